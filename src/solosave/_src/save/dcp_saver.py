"""DCP's save calls, backed by solosave: :class:`DcpSaver`, and ``solosave.save`` /
``solosave.async_save`` (the methods of :data:`default_saver`).

Switching from DCP is a change of import::

    fut = solosave.async_save(state_dict, checkpoint_id=f"ckpt/step_{step}")   # was dcp.async_save
    ...
    metadata = fut.result()                                                   # DCP's Metadata

Who calls what (every rank of ``process_group``, in the same order, as with DCP):

1. ``async_save(state_dict, checkpoint_id=..., process_group=...)`` - the first call for a
   process group makes its :class:`~solosave.AsyncCheckpointer` (a collective, once: the
   worker's set-up); every call waits (bounded) for the previous save of that group, then plans,
   stages and hands the save to the worker, with **no collective**, and returns a
   ``concurrent.futures.Future`` of the checkpoint's ``Metadata`` (DCP's return type; with
   ``overlap_staging``, DCP's ``AsyncSaveResponse``). A thread of this process completes it
   when the save is published (or fails: the same :class:`~solosave.CheckpointError` on every
   rank), then reads ``.metadata`` (one read per rank).
2. ``save(...)`` - the same, waited for: returns the ``Metadata`` once published.
3. :meth:`DcpSaver.close` - waits (bounded) for the saves in flight, stops the workers; the
   saver can be used again (new checkpointers). :data:`default_saver` is closed at exit.

Steady saves take solosave's reuse path by default (``assume_constant_structure=True``: the
first save of a group is collective, every later one needs one 8-byte ``all_reduce`` in the
worker; a changed layout falls back for that save). Like DCP's ``FileSystemWriter``, a save over
an existing checkpoint replaces it (its ``.metadata`` first). DCP arguments that solosave cannot
honour raise ``ValueError`` naming the solosave equivalent; none is ignored.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from solosave._src.core.errors import CheckpointError, describe
from solosave._src.formats.dcp import METADATA_FILE
from solosave._src.formats.metadata_check import loads_metadata
from solosave._src.save.checkpointer import AsyncCheckpointer, SaveHandle
from solosave._src.save.options import CheckpointerOptions
from solosave._src.save.result import SaveResult
from solosave._src.staging.staging import Staging
from solosave._src.storage.registry import storage_for
from solosave._src.write.writer import FileWriter

try:
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
except ImportError:  # pragma: no cover - a torch before AsyncSaveResponse
    AsyncSaveResponse = None  # type: ignore[assignment,misc]

#: What each DCP argument solosave cannot honour should be replaced by (``ValueError`` text).
_REFUSED = {
    "storage_writer": "pass checkpoint_id (a directory or an fsspec URL) instead; to control how the "
                      "files are written, subclass solosave.FileWriter and pass DcpSaver(writer=...)",
    "planner": "solosave plans as DCP's DefaultSavePlanner does (nested keys flattened, Stateful "
               "values saved as their state_dict()); drop planner=",
    "async_checkpointer_type": "solosave always writes in one persistent worker process per rank "
                               "(DcpSaver(worker='thread') for a thread); drop async_checkpointer_type=",
    "async_stager": "solosave stages into its own reusable host buffers; for copies that overlap the "
                    "next step use DcpSaver(overlap_staging=True)",
    "no_dist": "solosave needs torch.distributed; for one process call "
               "torch.distributed.init_process_group('gloo', rank=0, world_size=1, ...) first",
    "use_collectives": "solosave always writes DCP's global .metadata, and its steady saves need one "
                       "8-byte all_reduce (no gather); drop use_collectives=False",
}


def _refuse(**given: Any) -> None:
    """Raise for the first DCP argument solosave cannot honour (see :data:`_REFUSED`)."""
    for name, value in given.items():
        default = {"no_dist": False, "use_collectives": True}.get(name)
        if value is not default and value != default:
            raise ValueError(f"{name}={value!r} is not supported by solosave's DCP save: {_REFUSED[name]}")


@dataclass
class _Group:
    """One process group's checkpointer, and the thread completing its save in flight."""

    checkpointer: AsyncCheckpointer
    waiter: threading.Thread | None = None
    last_result: SaveResult | None = None
    #: The checkpointer's prepared metadata and its ``Metadata``, unpickled once per prepared file.
    metadata: tuple[Any, Metadata] | None = None


class DcpSaver:
    """DCP's ``save`` and ``async_save``, backed by solosave's checkpointers.

    One :class:`~solosave.AsyncCheckpointer` per process group, made at that group's first save
    and kept until :meth:`close`.

    Args:
        writer: a :class:`~solosave.FileWriter` (subclass) that writes the files.
        options: a :class:`~solosave.CheckpointerOptions`, or its fields as keywords. Default:
            ``assume_constant_structure=True`` (steady saves need one 8-byte ``all_reduce``);
            ``prepared_metadata`` / ``create_prepared_metadata`` keep the layout across jobs.
    """

    def __init__(self, *, writer: FileWriter | None = None, options: CheckpointerOptions | None = None,
                 **option_fields: Any) -> None:
        if options is not None and option_fields:
            raise TypeError("pass either options=CheckpointerOptions(...) or its fields as keywords, not both")
        self.options = options if options is not None else CheckpointerOptions(
            **{"assume_constant_structure": True, **option_fields})
        self.writer = writer
        self._groups: dict[Any, _Group] = {}
        self._lock = threading.Lock()

    def async_save(self, state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
                   storage_writer: Any = None, planner: Any = None, process_group: Any = None,
                   async_checkpointer_type: Any = None, async_stager: Any = None, no_dist: bool = False,
                   use_collectives: bool = True) -> Future | Any:
        """DCP's ``async_save``: start saving ``state_dict`` and return a future.

        Returns once ``state_dict`` is staged, with a future of the checkpoint's ``Metadata``
        (``AsyncSaveResponse`` with ``overlap_staging``)."""
        _refuse(storage_writer=storage_writer, planner=planner, async_checkpointer_type=async_checkpointer_type,
                async_stager=async_stager, no_dist=no_dist, use_collectives=use_collectives)
        group, handle = self._start(state_dict, checkpoint_id, process_group)
        published: Future = Future()
        staged: Future | None = None
        if self.options.overlap_staging and AsyncSaveResponse is not None:
            staged = Future()
        group.waiter = threading.Thread(target=self._complete, args=(group, handle, published, staged),
                                        name="solosave-dcp-save", daemon=True)
        group.waiter.start()
        if staged is not None:
            return AsyncSaveResponse(staging_completion=staged, upload_completion=published)
        return published

    def save(self, state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
             storage_writer: Any = None, planner: Any = None, process_group: Any = None, no_dist: bool = False,
             use_collectives: bool = True) -> Metadata:
        """DCP's ``save``: save ``state_dict`` and return the checkpoint's ``Metadata``.

        Returns once the checkpoint is published, or raises :class:`~solosave.CheckpointError`
        (the same on every rank)."""
        _refuse(storage_writer=storage_writer, planner=planner, no_dist=no_dist, use_collectives=use_collectives)
        group, handle = self._start(state_dict, checkpoint_id, process_group)
        group.last_result = result = handle.wait(self.options.timeout)
        return self._metadata(group, result)

    def last_result(self, process_group: Any = None) -> SaveResult | None:
        """The :class:`~solosave.SaveResult` of the group's last finished save.

        It holds the save's mode, collectives and timings; ``None`` before one."""
        group = self._groups.get(_key(process_group))
        return group.last_result if group is not None else None

    def checkpointer(self, process_group: Any = None) -> AsyncCheckpointer | None:
        """The checkpointer of ``process_group`` (``None`` before its first save)."""
        group = self._groups.get(_key(process_group))
        return group.checkpointer if group is not None else None

    def close(self) -> None:
        """Wait (bounded) for every save in flight, then stop the workers.

        The next save starts new ones. Every rank should call it. Never raises."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            if group.waiter is not None:
                group.waiter.join(self.options.timeout + 10.0)
            group.checkpointer.close()

    def __enter__(self) -> DcpSaver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _start(self, state_dict: dict[str, Any], checkpoint_id: Any, process_group: Any) -> tuple[_Group, SaveHandle]:
        if checkpoint_id is None:
            raise ValueError("checkpoint_id is required: the directory (or fsspec URL) to save to")
        key = _key(process_group)
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = _Group(AsyncCheckpointer(
                    process_group, writer=self.writer, options=self.options))
        if group.waiter is not None:  # the only other user of the checkpointer: let it finish
            group.waiter.join(self.options.timeout + 10.0)
            if group.waiter.is_alive():
                raise TimeoutError(f"the previous save did not finish within {self.options.timeout:g} s")
            group.waiter = None
        return group, group.checkpointer.save(state_dict, checkpoint_id, overwrite=True)

    def _complete(self, group: _Group, handle: SaveHandle, published: Future, staged: Future | None) -> None:
        """The waiter thread of one save (it alone waits on the checkpointer meanwhile)."""
        if staged is not None:
            try:
                staging = handle._staged
                if isinstance(staging, Staging):
                    staging.synchronize(self.options.timeout)
                staged.set_result(None)
            except BaseException as e:  # noqa: BLE001 - the staging's error, on its future
                staged.set_exception(e)
        try:
            group.last_result = result = handle.wait(self.options.timeout)
            published.set_result(self._metadata(group, result))
        except BaseException as e:  # noqa: BLE001 - the save's error, on its future
            published.set_exception(e)

    def _metadata(self, group: _Group, result: SaveResult) -> Metadata:
        """The ``Metadata`` this save published (what ``dcp.save`` returns), without reading
        the checkpoint back: another save to the same ``checkpoint_id`` may already have removed
        or replaced it. It is the prepared metadata the save was laid out by (the checkpointer
        keeps it after every save with ``assume_constant_structure`` or a prepared file), with
        this save's ``checkpoint_id`` and ``save_id``. Without prepared metadata (options that
        turn both off) the published ``.metadata`` is read, and refused if it is another save's."""
        prepared = group.checkpointer.prepared
        if prepared is not None:
            if group.metadata is None or group.metadata[0] is not prepared:
                group.metadata = (prepared, prepared.metadata)
            return dataclasses.replace(group.metadata[1], storage_meta=StorageMeta(
                checkpoint_id=result.path, save_id=result.save_id))
        storage = storage_for(result.path, self.options.storage_options)
        where = storage.join(result.path, METADATA_FILE)
        try:
            md = loads_metadata(storage.read(where), where)
        except (OSError, CheckpointError) as e:
            raise CheckpointError(f"the save to {result.path} was published, but its {METADATA_FILE} could not be "
                                  f"read back to return it ({describe(e)}); another save to the same checkpoint_id "
                                  "may have replaced it. Keep assume_constant_structure=True (DcpSaver's default) "
                                  "or pass prepared metadata: the Metadata is then returned without reading "
                                  "it") from e
        got = getattr(md.storage_meta, "save_id", None)
        if got != result.save_id:
            raise CheckpointError(f"the save to {result.path} was published, but its {METADATA_FILE} now belongs "
                                  f"to another save (save_id {got!r}, this one {result.save_id!r}); keep "
                                  "assume_constant_structure=True (DcpSaver's default) or pass prepared metadata")
        return md


def _key(process_group: Any) -> Any:
    """One checkpointer for the default group however it is named."""
    if process_group is None or (dist.is_available() and dist.is_initialized() and process_group is dist.group.WORLD):
        return None
    return process_group


#: The :class:`DcpSaver` behind ``solosave.save`` and ``solosave.async_save``, with the default
#: options; closed at exit. ``default_saver.close()`` frees its workers sooner.
default_saver = DcpSaver()
atexit.register(default_saver.close)


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
               storage_writer: Any = None, planner: Any = None, process_group: Any = None,
               async_checkpointer_type: Any = None, async_stager: Any = None, no_dist: bool = False,
               use_collectives: bool = True) -> Future | Any:
    """Start saving ``state_dict`` as ``torch.distributed.checkpoint.async_save`` does, by solosave.

    It is :meth:`DcpSaver.async_save` of :data:`default_saver`."""
    return default_saver.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                    planner=planner, process_group=process_group,
                                    async_checkpointer_type=async_checkpointer_type, async_stager=async_stager,
                                    no_dist=no_dist, use_collectives=use_collectives)


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None, storage_writer: Any = None,
         planner: Any = None, process_group: Any = None, no_dist: bool = False,
         use_collectives: bool = True) -> Metadata:
    """Save ``state_dict`` as ``torch.distributed.checkpoint.save`` does, by solosave.

    It is :meth:`DcpSaver.save` of :data:`default_saver`."""
    return default_saver.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                              planner=planner, process_group=process_group, no_dist=no_dist,
                              use_collectives=use_collectives)
