"""Lightning strategies that save through solosave (needs ``pip install 'solosave[lightning]'``).

Swap the strategy; nothing else in the training script changes::

    import solosave
    import solosave.lightning

    trainer = Trainer(strategy=solosave.lightning.ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1,
        options=solosave.CheckpointerOptions(files_per_rank=1)))     # optional: solosave's knobs

:class:`ModelParallelStrategy` (FSDP2 / tensor parallel) and :class:`FSDPStrategy` (FSDP1,
sharded state dicts) are Lightning's strategies with their checkpoint methods replaced:

* ``save_checkpoint`` is a solosave asynchronous save: it returns once the state is staged; the
  first save creates the prepared metadata file (one collective save), every later one (in this
  job and in later jobs at the same world size) reuses it with one 8-byte ``all_reduce`` in the
  background. The file is ``prepared-w<world size>-n<workers>.metadata`` in the checkpoint root
  (the first ``ModelCheckpoint``'s ``dirpath``, else the first checkpoint's parent), unless
  ``options`` name another (a relative path lies in the root). Lightning's own files
  (``meta.pt``: the loops, callbacks, hyperparameters) are written by rank 0 only after
  ``.metadata`` is published: Lightning takes a directory holding ``meta.pt`` as a finished
  checkpoint, so an unfinished or failed save is never taken for one. Each save is written
  beside its destination, in ``.<name>.solosave-<n>``, and only then put in its place by rank 0
  (an atomic exchange of the two names where Linux offers it): a save into a path that holds a
  checkpoint (``last.ckpt`` with ``save_last=True``) leaves the earlier one loadable there until
  the new one is complete, whatever kills the job meanwhile. A side directory that a killed job
  left behind is put in place at the next start if it was finished after its destination, else
  removed. With two tiers (``durable_root``) saves are written in place, as the copies follow
  the directory's name; the earlier checkpoint then stays loadable on the durable tier. No collective runs in the
  training thread: the path is not broadcast (ranks that disagree fail that save, on every
  rank) and the Trainer's barrier after each save is skipped (there is nothing to wait for).
* ``load_checkpoint`` is :func:`solosave.load` (each rank reads its own shards; resharding to
  another world size, as Lightning's own load does); a single-file checkpoint is loaded by
  Lightning's own code.
* ``remove_checkpoint`` (``ModelCheckpoint``'s top-k) waits (bounded) for a save of that path
  still in flight, writes none of its files, then deletes it (rank 0): ``meta.pt`` first, then
  ``.metadata``, then the rest. A link (``last.ckpt``) is removed, never its target.
* A failed save (logged when it is noticed) raises its :class:`~solosave.CheckpointError` on
  every rank at the next save, or at the end of ``fit`` (``teardown``), so ``fit`` fails with it.
  Nothing of it was published; the earlier checkpoints are untouched.

The workers start at ``setup`` (when ``fit`` runs with a ``ModelCheckpoint``), so the first save
does not wait for them; otherwise at the first save. ``teardown`` waits (bounded by the options'
``timeout``) for the save in flight and stops them. A save outside a run (``trainer.save_checkpoint``
after ``fit``) returns only once it is published, and stops the workers it started: no loop
would collect it and no ``teardown`` follows. :meth:`wait_for_checkpoint` (every rank)
waits for the save in flight, e.g. before reading it in the same job.

Who calls what (every rank, Lightning's order): ``setup`` (collective once: the workers' start)
-> per batch ``on_train_batch_start`` (collects a finished save; never blocks) ->
``save_checkpoint`` (no collective) / ``remove_checkpoint`` (bounded wait if that save is in
flight) -> ``teardown`` (bounded wait, then stops the workers). ``load_checkpoint`` is
collective (solosave's load).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from solosave._src.core.errors import SolosaveError
from solosave._src.load.load import load as solosave_load
from solosave._src.save.checkpointer import AsyncCheckpointer, SaveHandle
from solosave._src.save.options import CheckpointerOptions
from solosave._src.storage.local import replace_path
from solosave._src.storage.registry import backend_for
from solosave._src.tools.framework import PublishedSave, Publisher, options_in_root
from solosave._src.tools.retention import remove_checkpoint as remove_dcp_checkpoint
from solosave._src.write.writer import FileWriter

try:
    from lightning.fabric.utilities.load import _METADATA_FILENAME as META_FILE
    from lightning.pytorch.strategies import FSDPStrategy as _LightningFSDPStrategy
    from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
    from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
except ImportError as e:  # lightning missing, or a release without these names
    raise ImportError(f"solosave.lightning needs lightning 2.6 ({e}); install it with: "
                      "pip install 'solosave[lightning]'") from e

log = logging.getLogger("solosave")

#: The name of the Trainer's barrier after every ``save_checkpoint``; skipped: the save is asynchronous.
_SAVE_BARRIER = "Trainer.save_checkpoint"
#: A save to ``<dir>/<name>`` is written to ``<dir>/.<name>.solosave-<n>``, then put in place.
_BESIDE = ".solosave-"
_BESIDE_NAME = re.compile(r"\.(.+)\.solosave-(\d+)")


def _wrapped(model: torch.nn.Module | None) -> torch.nn.Module:
    """The strategy's wrapped model; Lightning sets it in ``setup``, before any checkpoint."""
    if model is None:
        raise RuntimeError("the strategy has no model yet: checkpoints are saved and loaded after "
                           "Trainer.fit/validate set the strategy up")
    return model


class _SolosaveCheckpointing:
    """The checkpoint methods both strategies share; a mixin placed before Lightning's strategy.

    ``_model_key`` is the key Lightning's own strategy saves the model's state under."""

    _model_key: str

    def _init_checkpointing(self, options: CheckpointerOptions | None, writer: FileWriter | None) -> None:
        if options is not None and not isinstance(options, CheckpointerOptions):
            raise TypeError(f"options must be a solosave.CheckpointerOptions, got {type(options).__name__}")
        if writer is not None and not isinstance(writer, FileWriter):
            raise TypeError(f"writer must be a solosave.FileWriter, got {type(writer).__name__}")
        if options is not None and (options.peer_copy or options.peer_copies):
            raise ValueError("the Lightning strategies do not take peer copies (peer_copy / peer_copies): Lightning "
                             "saves last.ckpt again and again, and peer copies refuse to save over a checkpoint; "
                             "use durable_root alone, or CheckpointManager in your own loop")
        self._options = options if options is not None else CheckpointerOptions()
        self._writer = writer
        self._publisher: Publisher | None = None
        self._finished: list[PublishedSave] = []
        #: The saves not yet collected: where each is written (beside) -> its destination.
        self._beside: dict[str, str] = {}
        self._discarded: set[str] = set()  # saves (beside) whose checkpoint was removed in flight
        #: Removals asked for while a save was in flight (its path -> the checkpoints to remove
        #: once it is published; kept if it fails).
        self._held_removals: dict[str, list[str]] = {}
        self._saves_started = 0
        self._raised = 0  # failures of self._publisher already raised
        self._staging: SaveHandle | None = None
        self._interrupted = False

    # -- the workers ---------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        self._interrupted = False
        callback = getattr(trainer, "checkpoint_callback", None)
        root = getattr(callback, "dirpath", None)
        if self._publisher is None and trainer.state.fn == TrainerFn.FITTING and root:
            self._start(os.fspath(root))

    def _start(self, root: str) -> Publisher:
        """Every rank, collective once: the checkpointer and its workers; the prepared file in ``root``."""
        options = options_in_root(self._options, root, self.world_size)  # type: ignore[attr-defined]
        if self.is_global_zero:  # type: ignore[attr-defined]
            # before the checkpointer's set-up, which every rank joins: no save of this job runs yet
            _recover_beside(Path(root))
        self._publisher = Publisher(AsyncCheckpointer(options=options, writer=self._writer),
                                    on_published=self._put_in_place, on_done=self._collected)
        self._raised = 0
        return self._publisher

    @property
    def checkpointer(self) -> AsyncCheckpointer | None:
        """The running :class:`~solosave.AsyncCheckpointer` (``None`` before the workers start)."""
        return None if self._publisher is None else self._publisher.checkpointer

    @property
    def saves(self) -> list[PublishedSave]:
        """Every finished save of this strategy (step, path, :class:`~solosave.SaveResult` or
        error), oldest first."""
        return list(self._finished)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._publisher is not None:
            self._publisher.poll()

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """With ``overlap_staging``: the last save's copies overlap this step's forward/backward
        (the closure) and are waited for before the optimizer changes the tensors."""
        handle, self._staging = self._staging, None
        if handle is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

        def closure_then_wait() -> Any:
            out = closure()
            try:
                handle.wait_staged()
            except SolosaveError as e:  # that save fails on every rank; raised at the next save
                log.error("solosave: staging of the save of %s failed: %s", handle.path, e)
            return out

        return super().optimizer_step(optimizer, closure_then_wait, model, **kwargs)  # type: ignore[misc]

    # -- saving ----------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: Any = None) -> None:
        """Every rank: start an asynchronous save of ``checkpoint`` into the directory
        ``filepath`` (see the module docstring). Raises the error of an earlier failed save
        instead of starting this one."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported: "
                            "pass solosave.CheckpointerOptions(storage_options=...) as the strategy's options")
        path = _local_path(filepath)
        publisher = self._publisher or self._start(os.fspath(path.parent))
        publisher.collect(block=True)  # the previous save: its error is raised now, on every rank
        self._raise_failure()
        state = {self._model_key: checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        self._check_state(state)
        self._saves_started += 1  # the same count on every rank: every rank makes every save
        files = {META_FILE: _serialized(checkpoint)} if self.is_global_zero else None  # type: ignore[attr-defined]
        target = os.fspath(path)
        o = publisher.checkpointer.options
        if o.durable_root:
            # copies follow each save under its directory's name: written in place, as before
            # (the earlier checkpoint stays loadable on the durable tier while this one is saved)
            self._clear_destination(path)
        else:
            target = os.fspath(path.with_name(f".{path.name}{_BESIDE}{self._saves_started}"))
            self._beside[target] = os.fspath(path)
        handle = publisher.save(int(checkpoint.get("global_step", 0)), state, target, files=files, overwrite=True)
        self._staging = handle if publisher.checkpointer.options.overlap_staging else None
        if not self._in_a_run():  # no loop will collect it and no teardown will follow: finish it now
            error = self._drain()
            if error is not None:
                raise error

    def _in_a_run(self) -> bool:
        """Inside ``fit``/``validate``/...: the Trainer is running (and will tear the strategy down)."""
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        return trainer is not None and trainer.state.status == TrainerStatus.RUNNING

    def _check_state(self, state: dict[str, Any]) -> None:
        """A strategy refuses a state its checkpoints cannot hold (before anything is written)."""

    def _clear_destination(self, path: Path) -> None:
        """A save written in place (two tiers): a file or link at ``path`` is removed (every rank
        tries: the first one wins), and an earlier checkpoint there stops counting as finished
        (rank 0 removes its ``meta.pt``; the save removes its ``.metadata``)."""
        if path.is_symlink() or path.is_file():
            try:
                path.unlink()
            except (FileNotFoundError, IsADirectoryError):  # another rank got there first
                pass
        if self.is_global_zero and path.is_dir():  # type: ignore[attr-defined]
            (path / META_FILE).unlink(missing_ok=True)

    def _put_in_place(self, done: PublishedSave) -> None:
        """Rank 0, once the save written beside its destination is published and holds its
        ``meta.pt``: it takes the destination's place (or, removed in flight, is deleted). A file
        system error is logged, never raised (it would be raised on rank 0 alone): the save then
        stays beside its destination, published, and the next start puts it in place."""
        final = self._beside.get(done.path)
        if final is None:
            return
        try:
            if done.path in self._discarded:
                _remove(Path(done.path))
            else:
                replace_path(done.path, final, _remove)
        except OSError as e:
            log.error("solosave: the checkpoint published at %s could not be put in place at %s: %s",
                      done.path, final, e)

    def _collected(self, done: PublishedSave) -> None:
        """Every rank, every finished save: recorded under its destination's name; rank 0 removes
        what a failed one left beside it (nothing was published there; an error is logged)."""
        final = self._beside.pop(done.path, done.path)
        removed = done.path in self._discarded
        self._discarded.discard(done.path)
        for held in self._held_removals.pop(done.path, []):  # removals that waited for this save
            if removed:
                log.warning("solosave: keeping %s: the save meant to displace it (%s) was removed", held, final)
            elif done.error is None and self.is_global_zero:  # type: ignore[attr-defined]
                self._remove_now(held)
            elif done.error is not None:
                log.warning("solosave: keeping %s: the save meant to displace it (%s) failed", held, final)
        if done.error is not None and self.is_global_zero and final != done.path:  # type: ignore[attr-defined]
            try:
                _remove(Path(done.path))
            except OSError as e:
                log.warning("solosave: could not remove the failed save at %s: %s", done.path, e)
        self._finished.append(dataclasses.replace(done, path=final))

    def barrier(self, name: str | None = None) -> None:
        if name == _SAVE_BARRIER:
            return  # the save goes on in the background: there is nothing to wait for
        super().barrier(name)  # type: ignore[misc]

    def wait_for_checkpoint(self, timeout: float | None = None) -> None:
        """Every rank: wait (at most ``timeout``, default the options' ``timeout``) for the save
        in flight; on rank 0 its ``meta.pt`` is then written. Raises that save's error."""
        if self._publisher is not None:
            self._publisher.collect(block=True, timeout=timeout)
            self._raise_failure()

    def _raise_failure(self) -> None:
        """Raise the newest failed save not raised yet (the same on every rank: every rank
        collects the same saves at the same calls)."""
        p = self._publisher
        if p is None or len(p.failures) <= self._raised:
            return
        self._raised = len(p.failures)
        error = p.failures[-1].error
        raise error if error is not None else SolosaveError("a checkpoint save failed")

    # -- removing --------------------------------------------------------------------------------
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        """Every rank (as ``ModelCheckpoint`` calls it): a save of ``filepath`` still in flight
        is waited for (bounded) and gets no ``meta.pt``; then rank 0 deletes the checkpoint (a
        link only as a link). While another save is in flight (the one that displaces this
        checkpoint from the top k), the deletion waits for it to be published, and does not
        happen if it fails. A failed deletion is logged, never raised: it would raise on rank
        0 alone."""
        target = os.path.abspath(os.fspath(filepath))
        p = self._publisher
        flight = None if p is None else p.in_flight
        if p is not None and flight is not None and os.path.abspath(self._beside.get(flight, flight)) == target:
            self._discarded.add(flight)
            p.collect(block=True, discard_files=True)
        elif p is not None and flight is not None:
            # top-k removes the checkpoint a new save displaces while that save is in flight: the
            # removal waits for the new one to be published (if it fails, the old one stays)
            self._held_removals.setdefault(flight, []).append(target)
            return
        if self.is_global_zero:  # type: ignore[attr-defined]
            self._remove_now(target)

    def _remove_now(self, target: str) -> None:
        """Rank 0: delete a checkpoint; a failure is logged (raising would raise on rank 0 alone)."""
        try:
            _remove(Path(target))
        except OSError as e:
            log.warning("solosave: could not remove checkpoint %s: %s", target, e)

    # -- loading ---------------------------------------------------------------------------------
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank, collective: a finished directory checkpoint (holding ``meta.pt``) through
        :func:`solosave.load`, resharded to this world size; a single file by Lightning's own
        code. A directory without ``meta.pt`` is refused: its save failed or never finished."""
        path = _local_path(checkpoint_path)
        if self._publisher is not None and self._publisher.collect(block=True):  # it may be the one saved
            # rank 0 put it in place while collecting it: no rank looks at the path before that
            super().barrier("solosave: load_checkpoint")  # type: ignore[misc]
        if not path.exists():
            raise FileNotFoundError(f"{path}: no checkpoint there (a save is put there only once it is published "
                                    "and finished); load an earlier checkpoint")
        if not path.is_dir():
            return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        if not (path / META_FILE).is_file():
            raise ValueError(f"{path} is not a finished checkpoint: it holds no {META_FILE} (a save that failed "
                             "or has not finished leaves none); load an earlier checkpoint")
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model  # type: ignore[attr-defined]
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING  # type: ignore[attr-defined]
        optimizers = list(self.optimizers) if fitting else []  # type: ignore[attr-defined]
        # Every template before the one (collective) load. An optimizer's template may create
        # its state by a step at zero learning rate: made first, that step never sees loaded values.
        state: dict[str, Any] = {f"optimizer_{i}": get_optimizer_state_dict(module, opt)
                                 for i, opt in enumerate(optimizers)}
        state[self._model_key] = get_model_state_dict(module)
        solosave_load(state, os.fspath(path))
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        strict = self.lightning_module.strict_loading  # type: ignore[attr-defined]
        set_model_state_dict(module, state[self._model_key], options=StateDictOptions(strict=strict))
        for i, opt in enumerate(optimizers):
            set_optimizer_state_dict(module, opt, optim_state_dict=state[f"optimizer_{i}"])
        return torch.load(path / META_FILE, weights_only=weights_only)

    # -- the end ---------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        self._interrupted = True
        super().on_exception(exception)  # type: ignore[misc]

    def teardown(self) -> None:
        """Every rank: wait (bounded) for the save in flight, stop the workers, then raise a
        failed save's error not raised yet (logged instead when ``fit`` already failed)."""
        try:
            error = self._drain()
        finally:
            super().teardown()  # type: ignore[misc]
        if error is not None and not self._interrupted:
            raise error
        if error is not None:
            log.error("solosave: a checkpoint save failed while training stopped: %s", error)

    def _drain(self) -> BaseException | None:
        """Every rank: wait (bounded) for the save in flight, stop the workers; returns the
        error of a failed save not raised yet."""
        p, self._publisher, self._staging = self._publisher, None, None
        if p is None:
            return None
        p.close(self._options.timeout)
        fresh = p.failures[self._raised:]
        return fresh[-1].error if fresh else None

    def __getstate__(self) -> dict:
        state = super().__getstate__()  # type: ignore[misc]
        state.update(_publisher=None, _staging=None)  # the workers stay with this process
        return state


class ModelParallelStrategy(_SolosaveCheckpointing, _LightningModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose checkpoints are solosave's asynchronous saves.

    It covers FSDP2 and tensor parallelism (see the module docstring); it takes Lightning's
    arguments plus ``options`` (a :class:`~solosave.CheckpointerOptions`) and ``writer`` (a
    :class:`~solosave.FileWriter`). Checkpoints are distributed (``save_distributed_checkpoint``);
    the state dicts are taken without a copy to CPU (solosave's staging makes the one copy)."""

    _model_key = "state_dict"

    def __init__(self, *args: Any, options: CheckpointerOptions | None = None, writer: FileWriter | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise ValueError("solosave.lightning.ModelParallelStrategy writes distributed checkpoints; for a "
                             "single-file checkpoint (save_distributed_checkpoint=False) use Lightning's own "
                             "ModelParallelStrategy")
        self._init_checkpointing(options, writer)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(_wrapped(self.model))

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(_wrapped(self.model), getattr(optimizer, "_optimizer", optimizer))


class FSDPStrategy(_SolosaveCheckpointing, _LightningFSDPStrategy):
    """Lightning's ``FSDPStrategy`` whose checkpoints are solosave's asynchronous saves.

    It uses sharded state dicts (``state_dict_type="sharded"``, the only kind it takes), and its
    checkpoints are saved by solosave (see the module docstring); it takes Lightning's arguments
    plus ``options`` and ``writer``.

    Its state dicts hold DTensors: unless you pass a ``device_mesh`` (or a ``process_group``),
    the strategy wraps the model with a one-dimensional mesh over every rank (:attr:`device_mesh`;
    the sharding is the same). A model you wrap yourself in ``configure_model`` needs
    ``FullyShardedDataParallel(..., device_mesh=strategy.device_mesh)``: FSDP's older
    ``ShardedTensor`` state dicts are refused at the first save, with that hint."""

    _model_key = "model"

    def __init__(self, *args: Any, state_dict_type: str = "sharded", options: CheckpointerOptions | None = None,
                 writer: FileWriter | None = None, **kwargs: Any) -> None:
        if state_dict_type != "sharded":
            raise ValueError(f"solosave.lightning.FSDPStrategy saves sharded checkpoints, got state_dict_type="
                             f"{state_dict_type!r}; drop it, or use Lightning's own FSDPStrategy for 'full'")
        # Lightning's positional arguments stop before state_dict_type: it cannot come twice
        super().__init__(*args, state_dict_type="sharded", **kwargs)  # type: ignore[misc]
        self._init_checkpointing(options, writer)

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.kwargs.get("device_mesh") is None and self.kwargs.get("process_group") is None:
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type, (self.world_size,))

    @property
    def device_mesh(self) -> Any:
        """The mesh the strategy wraps the model with (set up with the process group)."""
        return self.kwargs.get("device_mesh")

    def _sharded_context(self) -> Any:
        from torch.distributed.fsdp import (
            FullyShardedDataParallel,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )

        return FullyShardedDataParallel.state_dict_type(
            _wrapped(self.model), StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=False),
            ShardedOptimStateDictConfig(offload_to_cpu=False))

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._sharded_context():
            return _wrapped(self.model).state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with self._sharded_context():
            return FullyShardedDataParallel.optim_state_dict(_wrapped(self.model),
                                                             getattr(optimizer, "_optimizer", optimizer))

    def _check_state(self, state: dict[str, Any]) -> None:
        sharded = [k for k, v in state[self._model_key].items() if type(v).__name__ == "ShardedTensor"]
        if sharded:
            raise TypeError(f"state_dict[{sharded[0]!r}] is a ShardedTensor, which solosave does not save: wrap "
                            "the model with FullyShardedDataParallel(..., device_mesh=strategy.device_mesh) so "
                            "that its sharded state dict holds DTensors")


def _local_path(filepath: str | os.PathLike) -> Path:
    if not backend_for(filepath).local_files:
        raise ValueError(f"checkpoint path {os.fspath(filepath)!r}: solosave.lightning saves to local (or "
                         "mounted) paths only, as Lightning's sharded checkpoints do")
    return Path(filepath)


def _serialized(checkpoint: Mapping[str, Any]) -> bytes:
    """Lightning's ``meta.pt`` (the checkpoint without the model and optimizer states), taken now."""
    buf = io.BytesIO()
    torch.save(dict(checkpoint), buf)
    return buf.getvalue()


def _recover_beside(root: Path) -> None:
    """Rank 0, before any save of this job: the side directories a killed job left in ``root``.

    One that holds a checkpoint finished after its destination's (``meta.pt`` is written after
    publication) takes its place; any other is removed. Errors are logged: rank 0 alone runs this."""
    try:
        names = sorted(os.listdir(root), key=_beside_number)
    except FileNotFoundError:
        return
    for name in names:
        m = _BESIDE_NAME.fullmatch(name)
        if m is None or not (root / name).is_dir():
            continue
        side, final = root / name, root / m.group(1)
        # a job killed right after the exchange leaves the earlier checkpoint at the side name:
        # only one published after what the destination holds is newer
        try:
            if _finished_at(side) > _finished_at(final):
                log.warning("solosave: %s was published but not yet put in place when the job ended: now at %s",
                            side, final)
                replace_path(side, final, _remove)
            else:
                _remove(side)
        except OSError as e:
            log.error("solosave: could not clear %s left by an earlier job: %s", side, e)


def _finished_at(path: Path) -> float:
    """When the checkpoint at ``path`` was finished (its ``meta.pt``, written after publication),
    or -1 if it holds no finished one."""
    try:
        if not (path / ".metadata").is_file():
            return -1.0
        return (path / META_FILE).stat().st_mtime
    except OSError:
        return -1.0


def _beside_number(name: str) -> int:
    m = _BESIDE_NAME.fullmatch(name)
    return int(m.group(2)) if m else -1


def _remove(path: Path) -> None:
    """Delete a checkpoint: a link or file as such; a directory ``meta.pt`` first (it stops being
    a finished checkpoint), then ``.metadata``, then the rest. Gone already: nothing to do."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        (path / META_FILE).unlink(missing_ok=True)
        remove_dcp_checkpoint(os.fspath(path))


__all__ = ["FSDPStrategy", "ModelParallelStrategy"]
