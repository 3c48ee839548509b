"""A save strategy for Megatron-core's ``dist_checkpointing`` backed by solosave (needs
``pip install 'solosave[megatron]'``: megatron-core 0.16 and psutil).

:class:`SolosaveSaveStrategy` writes the ``torch_dist`` format (DCP files, ``.metadata`` last
and atomically), so stock ``TorchDistLoadShardedStrategy`` loads what it wrote, at the same
parallelism or another. Its first save takes the collective path and, with
``create_prepared_metadata``, keeps the metadata in the prepared file you name; every later
save (of this job and of later jobs) plans locally, writes the prepared layout in solosave's
worker process and agrees on one 8-byte ``all_reduce`` there. A changed layout (a new key, a
resharded tensor) falls back to the collective path for that save and refreshes the file.

In a script that calls ``dist_checkpointing`` itself::

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from solosave.megatron import SolosaveSaveStrategy

    strategy = SolosaveSaveStrategy(prepared_metadata="prepared.metadata", create_prepared_metadata=True)
    queue = AsyncCallsQueue()
    request = dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=strategy,
                                      async_sharded_save=True, validate_access_integrity=False)
    queue.schedule_async_request(request)
    ...
    queue.maybe_finalize_async_calls(blocking=False)   # every iteration, every rank

Megatron-LM (``--ckpt-metadata FILE``, ``--ckpt-metadata-create``): :func:`add_arguments` as
the ``extra_args_provider`` of ``pretrain``, and :func:`strategy_from_args` as the
``save_strategy`` of the training loop's ``checkpointing_context``: docs/usage.md, "In
Megatron-LM", has the exact lines. :func:`register` makes the strategy a registered default
(``("solosave", 1)``).

Who calls what (every rank, in the trainer's order):

1. ``dist_checkpointing.save(..., sharded_strategy=strategy, async_sharded_save=True)`` calls
   :meth:`SolosaveSaveStrategy.async_save`, which plans and stages the main replicas (no
   collective, except once: the first save sets up solosave's worker), hands the save to the
   worker and returns an ``AsyncRequest``. A value this rank cannot save fails the save on
   every rank: each gets a request whose finalisation raises.
2. Megatron's ``AsyncCallsQueue.schedule_async_request`` runs the request's function (in its
   forked or persistent process, or here for a synchronous save): it waits, at most the
   strategy's ``timeout``, until solosave reports the save finished, and never raises.
3. ``maybe_finalize_async_calls`` finds every rank done (Megatron's own ``all_reduce``) and
   runs the finalisation on every rank: it returns once ``.metadata`` is published, or raises
   solosave's :class:`~solosave.CheckpointError` on every rank if any rank failed, before
   Megatron writes ``metadata.json``; then Megatron's ``all_reduce`` and ``barrier``.
4. :meth:`SolosaveSaveStrategy.close` (or exit) stops the worker.

Megatron's own collectives per save, beside the strategy's one ``all_reduce``: one
``all_gather_object`` of the sharding (and a check of the common state) unless
``validate_access_integrity=False``; one 4-byte ``all_reduce`` per poll of the queue; at
finalisation a 4-byte ``all_reduce(MAX)`` and a ``barrier``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from solosave._src.plan.local_plan import WholeValue
from solosave._src.save.checkpointer import AsyncCheckpointer, SaveHandle
from solosave._src.save.options import CheckpointerOptions, add_option_flags, options_from_args
from solosave._src.save.result import SaveResult
from solosave._src.write.writer import FileWriter

try:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.base import (
        AsyncSaveShardedStrategy,
        StrategyAction,
        register_default_strategy,
    )
except ImportError as e:  # megatron-core missing, or without a module it imports
    raise ImportError(f"solosave.megatron needs megatron-core 0.16 ({e}); install it with: "
                      "pip install 'solosave[megatron]'") from e

log = logging.getLogger("solosave")

#: The registry key :func:`register` uses: ``sharded_strategy=("solosave", 1)``.
BACKEND = ("solosave", 1)
#: The options that :func:`add_arguments` adds as flags (Megatron-LM has none of them; its
#: ``--dist-ckpt-workers`` and ``--ckpt-assume-constant-structure`` are read as they are).
MEGATRON_FLAGS = ("prepared_metadata", "create_prepared_metadata", "on_layout_drift", "timeout")


class SolosaveSaveStrategy(AsyncSaveShardedStrategy):
    """Megatron-core's ``torch_dist`` save, written by a :class:`~solosave.AsyncCheckpointer`.

    Args:
        process_group: the ranks that save together (default: the world group, as Megatron's
            ``torch_dist`` strategy uses).
        writer: a :class:`~solosave.FileWriter` (subclass) that writes the files.
        options: a :class:`~solosave.CheckpointerOptions`, or its fields as keywords
            (``prepared_metadata``, ``create_prepared_metadata``, ``workers``, ``timeout``, ...).

    The checkpointer, with its worker process, is made by the first save (a collective of every
    rank, once) and kept until :meth:`close`. Megatron's ``keep_only_main_replica`` behaviour is
    built in: only main replicas are saved. :attr:`last_result` is the
    :class:`~solosave.SaveResult` of the last finalised save (its collectives, timings, mode).
    """

    def __init__(self, process_group: Any = None, *, writer: FileWriter | None = None,
                 options: CheckpointerOptions | None = None, **option_fields: Any) -> None:
        super().__init__("torch_dist", 1)  # what metadata.json says: stock loading reads it
        if options is not None and option_fields:
            raise TypeError("pass either options=CheckpointerOptions(...) or its fields as keywords, not both")
        self.options = options if options is not None else CheckpointerOptions(**option_fields)
        self.process_group = process_group
        self.writer = writer
        self.last_result: SaveResult | None = None
        self._checkpointer: AsyncCheckpointer | None = None
        self._watcher: threading.Thread | None = None
        self._closed = False

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    @property
    def checkpointer(self) -> AsyncCheckpointer | None:
        """The checkpointer of this strategy (``None`` before the first save)."""
        return self._checkpointer

    def async_save(self, sharded_state_dict: Mapping[str, Any], checkpoint_dir: str | Path) -> AsyncRequest:
        """Start saving the main replicas of ``sharded_state_dict`` to ``checkpoint_dir``.

        Every rank calls it; returns once they are staged, with the request that Megatron's queue
        runs."""
        if self._closed:
            raise ValueError("this SolosaveSaveStrategy is closed; create a new one")
        self._join_watcher()  # the previous save's watcher is the only other user of the checkpointer
        state = dcp_state_dict(sharded_state_dict)
        if self._checkpointer is None:
            self._checkpointer = AsyncCheckpointer(self.process_group, writer=self.writer, options=self.options)
        try:
            handle = self._checkpointer.save(state, checkpoint_dir, overwrite=True)
        except Exception as e:  # noqa: BLE001 - raised from the finalisation, where every rank fails
            return _failed_request(e, self.options.timeout)
        reader, writer = multiprocessing.Pipe(duplex=False)
        self._watcher = threading.Thread(target=_watch, args=(handle, writer, self.options.timeout),
                                         name="solosave-megatron-watch", daemon=True)
        self._watcher.start()
        return AsyncRequest(wait_for_save, (reader, self.options.timeout), [lambda: self._finalize(handle)])

    def _finalize(self, handle: SaveHandle) -> None:
        """Megatron's finalisation, every rank: the save's result, or its error raised."""
        self._join_watcher()
        self.last_result = handle.wait(self.options.timeout)

    def _join_watcher(self) -> None:
        w = self._watcher
        if w is not None:
            w.join(self.options.timeout + 10.0)  # the watcher's own wait is bounded by timeout
            if w.is_alive():
                raise TimeoutError("solosave's previous Megatron save did not report within "
                                   f"{self.options.timeout:g} s; raise the strategy's timeout")
            self._watcher = None

    def close(self) -> None:
        """Wait (bounded) for the save in flight, stop the worker and free the staging memory."""
        if self._closed:
            return
        self._closed = True
        try:
            self._join_watcher()
        except TimeoutError as e:
            log.warning("solosave: %s", e)
        if self._checkpointer is not None:
            self._checkpointer.close()


def _failed_request(error: Exception, timeout: float) -> AsyncRequest:
    """The request of a save whose ``save()`` raised on this rank (a value it cannot save): the
    checkpointer has already failed that save on every rank, so every rank's Megatron queue
    polls, finalises and raises together (this rank its own error), instead of this rank
    raising alone and the others waiting for it in Megatron's next collective."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    writer.send_bytes(b"1")
    writer.close()

    def finalize() -> None:
        raise error

    return AsyncRequest(wait_for_save, (reader, timeout), [finalize])


def _watch(handle: SaveHandle, writer: Any, timeout: float) -> None:
    """Trainer thread of one save: wait for its outcome (bounded), then tell the request's
    function (:func:`wait_for_save`) that it may return. The outcome itself is read by the
    finalisation, on every rank."""
    try:
        handle.wait(timeout)
    except Exception:  # noqa: BLE001,S110 - reported by the finalisation, which waits again
        pass
    finally:
        try:
            writer.send_bytes(b"1")
        except OSError:  # the request's function already gave up and closed its end
            pass
        writer.close()


def wait_for_save(reader: Any, timeout: float) -> None:
    """Return when solosave has finished the save, at most ``timeout`` seconds later.

    The function of the ``AsyncRequest`` (Megatron's async caller runs it in its forked or
    persistent process, or in the trainer for a synchronous save). Never raises: a failed save
    raises in the finalisation instead, on every rank, and an error here would kill Megatron's
    persistent worker and leave its queue waiting."""
    try:
        if reader.poll(timeout):
            reader.recv_bytes()
    except (EOFError, OSError):  # the trainer is gone: nothing more to wait for
        pass
    finally:
        reader.close()


# -- the state dict solosave saves ---------------------------------------------------------------

class MegatronShards:
    """The main-replica shards of one Megatron ``ShardedTensor`` key held by this rank.

    They form a DCP checkpointable object (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``): each shard is a chunk of the global tensor at its
    ``global_offset``, with the prepended axes (``prepend_axis_num``) as leading dimensions of
    size 1, the chunks Megatron's own ``torch_dist`` strategy writes."""

    def __init__(self, key: str, shards: list[Any]) -> None:
        self.key = key
        self.global_size = torch.Size(shards[0].global_shape)
        self.chunks: list[tuple[torch.Size, torch.Tensor]] = []
        for sh in shards:
            if getattr(sh, "flattened_range", None) is not None:
                raise TypeError(f"sharded tensor {key!r} has a flattened_range (the layout of "
                                "megatron-core before 0.14), which solosave does not save; use "
                                "Megatron's own torch_dist strategy for it")
            if sh.data is None:
                raise TypeError(f"sharded tensor {key!r} has no data to save")
            if tuple(sh.global_shape) != tuple(self.global_size):
                raise TypeError(f"sharded tensor {key!r}: shards of global shapes {list(self.global_size)} "
                                f"and {list(sh.global_shape)} on one rank")
            self.chunks.append((torch.Size(sh.global_offset), _with_prepended_axes(key, sh)))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, off, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.global_size))
                for i, (off, t) in enumerate(self.chunks)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.chunks) and self.chunks[index.index][0] == index.offset:
            return self.chunks[index.index][1]
        for off, t in self.chunks:
            if off == index.offset:
                return t
        raise ValueError(f"no shard of {self.key!r} at {index.offset} on this rank")


def _with_prepended_axes(key: str, sh: Any) -> torch.Tensor:
    """``sh.data`` with its ``prepend_axis_num`` prepended axes as leading dimensions of size 1
    (Megatron's own ``torch_dist`` strategy leaves the data so viewed: then it is taken as it is)."""
    data = sh.data.detach()
    dims = len(sh.global_offset)
    if data.dim() == dims - sh.prepend_axis_num:
        return data.reshape((1,) * sh.prepend_axis_num + tuple(data.shape))
    if data.dim() == dims and all(n == 1 for n in data.shape[:sh.prepend_axis_num]):
        return data
    raise TypeError(f"sharded tensor {key!r}: data of shape {list(data.shape)} does not fit its global offset "
                    f"{list(sh.global_offset)} with {sh.prepend_axis_num} prepended axes")


def dcp_state_dict(sharded_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The flat state dict solosave saves for Megatron's sharded state dict.

    ``sharded_state_dict`` is as Megatron's ``torch_dist`` strategy builds it. The flat state dict
    holds the main replicas only; the shards of a ``ShardedTensor`` key as one
    :class:`MegatronShards`; the ``ShardedObject`` s of a unique key as one record holding the
    list of their data (a :class:`~solosave._src.plan.local_plan.WholeValue`: ``torch.save`` of
    that list, as Megatron's planner writes it; its loader reads the list back)."""
    tensors: dict[str, list[Any]] = {}
    objects: dict[str, list[Any]] = {}
    for sh in nested_values(dict(sharded_state_dict)):
        if isinstance(sh, ShardedTensor):
            group, key = tensors, sh.key
        elif isinstance(sh, ShardedObject):
            group, key = objects, sh.unique_key
        else:
            raise TypeError(f"the sharded state dict holds a {type(sh).__name__}; Megatron's save hands a "
                            "sharded strategy only ShardedTensors and ShardedObjects")
        if is_main_replica(sh.replica_id):
            group.setdefault(key, []).append(sh)
    clash = set(tensors) & set(objects)
    if clash:
        raise TypeError(f"key {sorted(clash)[0]!r} names both a sharded tensor and a sharded object")
    out: dict[str, Any] = {key: MegatronShards(key, shards) for key, shards in tensors.items()}
    out.update((key, WholeValue([o.data for o in objs])) for key, objs in objects.items())
    return out


# -- selecting it ---------------------------------------------------------------------------------

def register(strategy: SolosaveSaveStrategy) -> tuple[str, int]:
    """Register ``strategy`` as Megatron-core's default save strategy and return its key.

    The key is the backend :data:`BACKEND`, ``("solosave", 1)``: ``dist_checkpointing.save(...,
    sharded_strategy=("solosave", 1))`` then saves through it.

    Not under ``("torch_dist", 1)``: megatron-core 0.16's ``get_default_strategy`` registers its
    own ``torch_dist`` strategies again on every lookup, so such a registration would not last.
    The checkpoints still say ``torch_dist`` in their ``metadata.json``, so Megatron loads them
    with its stock strategy."""
    if not isinstance(strategy, SolosaveSaveStrategy):
        raise TypeError(f"register() takes a SolosaveSaveStrategy, got {type(strategy).__name__}")
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND[0], BACKEND[1], strategy)
    return BACKEND


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: add solosave's flags to ``parser``.

    It adds ``--ckpt-metadata FILE``, ``--ckpt-metadata-create``, ``--ckpt-on-layout-drift`` and
    ``--ckpt-timeout``, in their own group."""
    add_option_flags(parser.add_argument_group("solosave"), CheckpointerOptions, only=MEGATRON_FLAGS)
    return parser


def strategy_from_args(args: argparse.Namespace, process_group: Any = None) -> SolosaveSaveStrategy:
    """Build the :class:`SolosaveSaveStrategy` Megatron-LM's parsed ``args`` describe.

    It reads the flags of :func:`add_arguments`, plus Megatron-LM's own ``--dist-ckpt-workers``
    (files per rank) and ``--ckpt-assume-constant-structure`` when present. A bad value raises
    ``ValueError`` naming the flag."""
    extra = {}
    if getattr(args, "dist_ckpt_workers", None) is not None:
        extra["files_per_rank"] = args.dist_ckpt_workers
    if getattr(args, "ckpt_assume_constant_structure", False):
        extra["assume_constant_structure"] = True
    fields = {f.name for f in dataclasses.fields(CheckpointerOptions)} - set(MEGATRON_FLAGS)
    own = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in fields})
    return SolosaveSaveStrategy(process_group, options=options_from_args(own, CheckpointerOptions, **extra))


__all__ = [
    "BACKEND", "MEGATRON_FLAGS", "MegatronShards", "SolosaveSaveStrategy", "add_arguments", "dcp_state_dict",
    "register", "strategy_from_args", "wait_for_save",
]
