"""What every framework adapter shares (torchtitan's manager, Lightning's strategies).

1. **Options.** A framework's configuration declares solosave's knobs by deriving them from the
   fields of :class:`~solosave.CheckpointerOptions` (:func:`option_fields`), so an option added
   there reaches every adapter; only :data:`ADAPTER_SET` are the adapter's own business (it maps
   its framework's notions onto them). :func:`prepared_file` places the prepared metadata file
   in the checkpoint root, one per topology by default.
2. **Publication.** :class:`Publisher` runs one save at a time through an
   :class:`~solosave.AsyncCheckpointer` and, once the save is published, has the coordinator
   write the framework's own files into the checkpoint (torchtitan: none; Lightning: ``meta.pt``,
   which Lightning takes as the sign of a finished checkpoint), then calls ``on_published``.

Who calls what (every rank, the training thread, in the same order on every rank)::

    publisher = Publisher(checkpointer, on_published=...)   # no collective
    publisher.save(step, state_dict, path, files={...})      # no collective; collects the previous save first
    publisher.poll()                                         # each step: never blocks, no collective
    publisher.collect(block=True, discard_files=...)         # bounded wait for the save in flight
    publisher.close(timeout)                                 # bounded: waits, then closes the checkpointer

A save's files are written by the coordinator (rank 0) only, after its own handle reports the save
published, each atomically; the other ranks never write them. A save whose files are
discarded (its checkpoint is being removed) gets none.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from solosave._src.core.errors import OptionError, SolosaveError
from solosave._src.save.checkpointer import SaveHandle
from solosave._src.save.options import CheckpointerOptions
from solosave._src.save.result import SaveResult
from solosave._src.storage.registry import backend_for, scheme_of, storage_for

log = logging.getLogger("solosave")

#: ``prepared_metadata`` of a framework config: one file per topology in the checkpoint root.
AUTO = "auto"
#: :class:`~solosave.CheckpointerOptions` fields an adapter sets from its framework's own
#: settings (where the prepared file lives, how staging overlaps the loop); every other field is
#: forwarded as the user set it.
ADAPTER_SET = frozenset({"prepared_metadata", "create_prepared_metadata", "assume_constant_structure",
                         "overlap_staging"})


# -- options ------------------------------------------------------------------------------------
def forwarded_fields() -> list[dataclasses.Field]:
    """The :class:`~solosave.CheckpointerOptions` fields a framework config declares as its own."""
    return [f for f in dataclasses.fields(CheckpointerOptions) if f.name not in ADAPTER_SET]


def option_fields(cls: type) -> type:
    """Class decorator, placed under ``@dataclass``: declare on ``cls`` one field per
    :func:`forwarded_fields` entry, with its type (a ``Literal`` of its choices, if it has
    some), default and metadata. A field ``cls`` declares itself under one of those names is
    an error (the option would then have two definitions)."""
    hints = typing.get_type_hints(CheckpointerOptions)
    own = dict(cls.__dict__.get("__annotations__", {}))
    for f in forwarded_fields():
        if f.name in own:
            raise TypeError(f"{cls.__qualname__} declares {f.name!r}, a CheckpointerOptions field that "
                            "option_fields() adds: drop the declaration")
        choices = f.metadata.get("choices")
        own[f.name] = Literal[choices] if choices else hints[f.name]
        setattr(cls, f.name, dataclasses.field(default=f.default, metadata=f.metadata))
    cls.__annotations__ = own
    return cls


def forwarded_values(config: Any) -> dict[str, Any]:
    """The values of ``config``'s forwarded option fields (as :func:`option_fields` declared them)."""
    return {f.name: getattr(config, f.name) for f in forwarded_fields()}


def prepared_file(prepared_metadata: str | os.PathLike | None, root: str | os.PathLike, world_size: int,
                  workers: int) -> str | None:
    """Where the prepared metadata file lives: :data:`AUTO` is ``<root>/prepared-w<world
    size>-n<workers>.metadata`` (one per topology, so a job at another world size makes its
    own); a relative path lies under ``root``; an absolute path or a URL is kept; ``None``
    stays ``None`` (no file)."""
    if prepared_metadata is None:
        return None
    pm = os.fspath(prepared_metadata)
    if pm == AUTO:
        pm = f"prepared-w{world_size}-n{workers}.metadata"
    return pm if scheme_of(pm) is not None or os.path.isabs(pm) else backend_for(root).join(root, pm)


def framework_options(values: Mapping[str, Any], *, prepared: str | None, overlap_staging: bool = False,
                      name_of: Callable[[str], str] = str) -> CheckpointerOptions:
    """The options of an adapter: ``values`` (forwarded fields, by name) plus the prepared file
    ``prepared``, created by the first save and reused by every later one (``None``: no file;
    the first save's metadata is kept in memory and reused). A bad value raises ``ValueError``
    whose message names each option through ``name_of`` (e.g. ``checkpoint.workers``)."""
    kw = {name: values[name] for name in (f.name for f in forwarded_fields()) if name in values}
    kw["overlap_staging"] = overlap_staging
    if prepared is None:
        kw["assume_constant_structure"] = True
    else:
        kw.update(prepared_metadata=prepared, create_prepared_metadata=True)
    try:
        return CheckpointerOptions(**kw)
    except OptionError as e:
        raise ValueError(e.render(name_of)) from e


def options_in_root(options: CheckpointerOptions, root: str | os.PathLike, world_size: int) -> CheckpointerOptions:
    """A user's :class:`~solosave.CheckpointerOptions` placed in the checkpoint root ``root``:
    without a prepared file (and without ``assume_constant_structure``) the :data:`AUTO` file,
    created by the first save; a relative path lies under ``root``; anything else is kept."""
    pm = options.prepared_metadata
    if pm is None and not options.assume_constant_structure:
        auto = prepared_file(AUTO, root, world_size, options.files_per_rank)
        return dataclasses.replace(options, prepared_metadata=auto, create_prepared_metadata=True)
    if isinstance(pm, (str, os.PathLike)):
        prepared = prepared_file(pm, root, world_size, options.files_per_rank)
        return dataclasses.replace(options, prepared_metadata=prepared)
    return options


# -- publication --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PublishedSave:
    """A save that finished (successfully or not), as :meth:`Publisher.poll` reports it."""

    step: int
    path: str
    result: SaveResult | None
    error: BaseException | None


@dataclass(slots=True)
class _Pending:
    step: int
    handle: SaveHandle
    files: dict[str, bytes]
    discard_files: bool = False


class Publisher:
    """One save in flight through ``checkpointer`` (an :class:`~solosave.AsyncCheckpointer`, or
    an object with its ``save``/``close``/``rank``), and what follows each publication (see the
    module docstring). A failed save is logged and kept in :attr:`failures`; every finished one,
    in :attr:`done`. ``on_published(done)`` runs on the coordinator after the save's files are
    written; ``on_done(done)`` on every rank, for every finished save."""

    def __init__(self, checkpointer: Any, *, on_published: Callable[[PublishedSave], None] | None = None,
                 on_done: Callable[[PublishedSave], None] | None = None) -> None:
        self.checkpointer = checkpointer
        #: Keyword arguments of the fsspec filesystem of URL destinations (the checkpointer's).
        self.storage_options = getattr(getattr(checkpointer, "options", None), "storage_options", None)
        self.on_published = on_published
        self.on_done = on_done
        self.failures: list[PublishedSave] = []
        self.done: list[PublishedSave] = []
        self._pending: _Pending | None = None

    @property
    def is_coordinator(self) -> bool:
        return self.checkpointer.rank == 0

    @property
    def in_flight(self) -> str | None:
        """The directory of the save not yet collected (it may have finished), or ``None``."""
        return None if self._pending is None else self._pending.handle.path

    def save(self, step: int, state_dict: dict[str, Any], path: str, *, files: Mapping[str, bytes] | None = None,
             overwrite: bool = False) -> SaveHandle:
        """Collect the previous save (bounded), then start saving ``state_dict`` to ``path``
        (returns after staging). ``files``: name -> bytes, written into ``path`` by the
        coordinator once the save is published (only the coordinator's are used)."""
        self.collect(block=True)
        handle = self.checkpointer.save(state_dict, path, overwrite=overwrite)
        self._pending = _Pending(step, handle, dict(files or {}) if self.is_coordinator else {})
        return handle

    def poll(self) -> list[PublishedSave]:
        """Collect the save in flight if it has finished (non-blocking, no collective)."""
        return self.collect(block=False)

    def collect(self, block: bool, timeout: float | None = None, discard_files: bool = False) -> list[PublishedSave]:
        """Collect the save in flight: with ``block``, wait for it (at most ``timeout``, default
        the checkpointer's); otherwise only if it has finished. ``discard_files``: its files are
        not written (its checkpoint is about to be removed)."""
        p = self._pending
        if p is None:
            return []
        p.discard_files = p.discard_files or discard_files
        if not block and not _finished(p.handle):
            return []
        self._pending = None
        try:
            done = PublishedSave(p.step, p.handle.path, p.handle.wait(timeout), None)
        except SolosaveError as e:
            done = self._failed(p, e)
        if done.result is not None and done.result.published and self.is_coordinator:
            try:
                if p.files and not p.discard_files:
                    self._write_files(done.path, p.files)
            except OSError as e:  # published, but the framework will not take it as finished
                done = self._failed(p, SolosaveError(
                    f"{done.path}: .metadata was published but writing {sorted(p.files)} failed ({e}); "
                    "the framework does not take it as a finished checkpoint"))
            else:
                if self.on_published is not None:
                    self.on_published(done)
        self.done.append(done)
        if self.on_done is not None:
            self.on_done(done)
        return [done]

    def _failed(self, p: _Pending, error: BaseException) -> PublishedSave:
        done = PublishedSave(p.step, p.handle.path, None, error)
        self.failures.append(done)
        log.error("solosave: checkpoint of step %d (%s) failed: %s", p.step, p.handle.path, error)
        return done

    def _write_files(self, path: str, files: Mapping[str, bytes]) -> None:
        storage = storage_for(path, self.storage_options)
        for name, data in files.items():
            storage.commit(storage.join(path, name), data)

    def close(self, timeout: float | None = None) -> list[PublishedSave]:
        """Collect the save in flight (bounded by ``timeout``), then close the checkpointer."""
        try:
            return self.collect(block=True, timeout=timeout)
        finally:
            self.checkpointer.close()


def _finished(handle: SaveHandle) -> bool:
    """``handle.done()``, where a dead worker counts as finished (``wait()`` then reports it)."""
    try:
        return handle.done()
    except SolosaveError:
        return True


__all__ = ["ADAPTER_SET", "AUTO", "Publisher", "PublishedSave", "forwarded_fields", "forwarded_values",
           "framework_options", "option_fields", "options_in_root", "prepared_file"]
