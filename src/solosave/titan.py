"""A torchtitan checkpoint manager backed by solosave (needs ``pip install 'solosave[torchtitan]'``).

torchtitan 0.3 builds its checkpointer from the trainer's ``checkpoint`` config: whatever
``BaseCheckpointManager.Config`` subclass that field holds, its ``build()`` constructs the owning
manager. Select solosave's in your ``config_registry`` function::

    from solosave.titan import SolosaveCheckpointManager

    def my_config() -> Trainer.Config:
        return Trainer.Config(
            ...,
            checkpoint=SolosaveCheckpointManager.Config(
                enable=True, folder="checkpoint", interval=500, keep_latest_k=3,
                async_mode="async",            # or "disabled" (each save waits for publication)
                prepared_metadata="auto",      # first save creates it, every later one reuses it
                last_save_model_only=False,    # torchtitan's default True: a model-only export
            ),
        )

and every field can still be overridden from the command line (``--checkpoint.interval 100``,
``--checkpoint.files_per_rank 2``, ...). How torchtitan's fields map onto solosave:

* ``folder`` (under the trainer's ``dump_folder``): checkpoints go to ``<folder>/iter_XXXXXXX``
  through :class:`solosave.integrations.CheckpointManager`: ``<folder>/latest`` moves, and old
  checkpoints are pruned, only after publication. Local (or mounted) filesystems only.
* ``interval``, ``enable_first_step_checkpoint``, ``load_only``: when to save, as in torchtitan.
* ``keep_latest_k``: ``keep_last`` (0 keeps all); the newest published checkpoint is never deleted.
* ``load_step``: -1 loads the newest *published* checkpoint (partial ones are ignored), else that
  step (``FileNotFoundError`` if it is not published); step 0 loads the model only, as torchtitan
  does. ``initial_load_path`` (DCP format) and ``exclude_from_loading`` work as in torchtitan.
* ``async_mode``: ``"async"`` returns to training right after staging (solosave pins its
  staging buffer by itself for CUDA tensors); ``"async_with_pinned_mem"`` also overlaps the
  copies with the next forward/backward (solosave's ``overlap_staging``; torchtitan's trainer
  calls ``maybe_wait_for_staging()`` before the optimizer step); ``"disabled"`` waits for
  each save's publication. A failed asynchronous save is logged and kept in :attr:`failures`;
  training goes on from the previous checkpoint; a failed last-step save raises.
* ``last_save_model_only``: the last step's save holds the model only, in ``export_dtype``, written
  synchronously by stock ``torch.distributed.checkpoint.save`` (a one-off structure must not
  replace the prepared metadata). As with torchtitan's own manager, it is then the newest
  checkpoint: a later job that should resume full state needs an explicit ``load_step``.
* ``prepared_metadata`` (default ``"auto"``: ``prepared-w<W>-n<workers>.metadata`` in ``folder``,
  created by the first save and reused by every later one; a relative path lies in ``folder``;
  ``None``: no file, the first save of each job is collective) maps onto solosave's
  ``prepared_metadata``/``create_prepared_metadata``/``assume_constant_structure``.
* every other field of :class:`solosave.CheckpointerOptions` (``files_per_rank``,
  ``worker``, ``on_layout_drift``, ``timeout``, ``checksums``, ``staging_dir``,
  ``stage_replicas``, ...) is a field of the config too, with the same name, default and
  meaning, derived from ``CheckpointerOptions`` itself (so a new option appears here at once)
  and validated there. ``workers`` and ``persistent_worker``, their names in solosave 0.1, stay
  accepted as aliases.

Not supported (refused by the config): Hugging Face safetensors loads and exports
(``initial_load_in_hf``, ``last_save_in_hf``) and remote (fsspec) folders; use torchtitan's own
``CheckpointManager`` for those.

Who calls what (every rank, in the trainer's order): ``build()`` (collective once: the
checkpointer's setup) -> ``load(step)`` (collective: DCP's load) -> per step
``maybe_wait_for_staging()`` and ``save(step, last_step)`` (no collective in
the training thread unless it is a model-only last save) -> ``close()`` (waits, bounded).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from solosave._src.core.errors import SolosaveError
from solosave._src.formats.dcp import METADATA_FILE
from solosave._src.load.load import load as solosave_load
from solosave._src.save.checkpointer import AsyncCheckpointer, SaveHandle
from solosave._src.save.options import CheckpointerOptions
from solosave._src.tools.framework import (
    AUTO,
    PublishedSave,
    forwarded_values,
    framework_options,
    option_fields,
    prepared_file,
)

from .integrations import CheckpointManager, checkpoint_dir, find_latest_checkpoint

try:
    from torchtitan.components.checkpointer import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
except ImportError as e:  # torchtitan missing, or installed without a dependency it imports
    if sys.version_info < (3, 11):  # torchtitan 0.3 needs 3.11: [torchtitan] installs nothing on 3.10
        raise ImportError(f"solosave.titan needs torchtitan 0.3, which needs Python 3.11 or newer (this is "
                          f"{sys.version_info.major}.{sys.version_info.minor}); use Python 3.11+, then "
                          "pip install 'solosave[torchtitan]'") from e
    raise ImportError(f"solosave.titan needs torchtitan 0.3 ({e}); install it with: "
                      "pip install 'solosave[torchtitan]'") from e

log = logging.getLogger("solosave")

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


class SolosaveCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpointer contract, saving through a :class:`~solosave.AsyncCheckpointer`.

    Constructed by ``config.build(dataloader=..., model_parts=..., optimizers=...,
    lr_schedulers=..., states=..., sd_adapter=..., base_folder=...)`` as torchtitan's trainer
    does; the checkpoint holds ``states`` plus the model (flattened, as torchtitan saves it), the
    optimizers, the LR schedulers and the dataloader.
    """

    @dataclass(kw_only=True, slots=True)
    @option_fields  # + every CheckpointerOptions field but the four mapped here (workers, timeout, ...)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
        """'async': training resumes right after staging; 'async_with_pinned_mem': also
        overlaps the staging copies with the next forward/backward (overlap_staging);
        'disabled': each save waits until it is published."""

        prepared_metadata: str | None = AUTO
        """Prepared metadata file, relative to the checkpoint folder: the first save creates it
        (collectively, once), every later save of this and later jobs reuses it (one 8-byte
        all_reduce). 'auto': prepared-w<world size>-n<workers>.metadata, one per topology.
        None: no file; each job's first save is collective, the later ones reuse it in memory."""

        workers: int | None = None
        """Old name of files_per_rank (solosave 0.1); set, it replaces files_per_rank."""

        persistent_worker: bool | None = None
        """Old name: True for worker='process', False for worker='thread' (solosave 0.1)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.workers is not None:
                # both fields are declared by option_fields, which mypy does not see
                self.files_per_rank = self.workers  # type: ignore[misc]
            if self.persistent_worker is not None:
                self.worker = "process" if self.persistent_worker else "thread"  # type: ignore[misc]
            mode = str(self.async_mode).lower()  # a TOML file or a flag may give "Async"
            if mode not in ASYNC_MODES:
                raise ValueError(f"checkpoint.async_mode must be one of {ASYNC_MODES}, got {self.async_mode!r}")
            self.async_mode = cast(Any, mode)
            for name in ("initial_load_in_hf", "last_save_in_hf"):
                if getattr(self, name):
                    raise ValueError(f"checkpoint.{name}: SolosaveCheckpointManager does not read or write "
                                     "Hugging Face safetensors; use torchtitan's CheckpointManager for that")
            if filesystem.is_remote(self.folder):
                raise ValueError(f"checkpoint.folder {self.folder!r}: SolosaveCheckpointManager writes to "
                                 "local (or mounted) filesystems only")
            checkpointer_options(self, None)  # solosave validates its own fields

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any = None,
                 base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.config = config
        self.save_future: SaveHandle | None = None
        self._staging: SaveHandle | None = None
        self.folder = os.path.join(base_folder, config.folder) if base_folder else config.folder
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        self.sd_adapter = sd_adapter
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._closed = False
        self.manager: CheckpointManager | None = None
        if config.load_only:
            return
        if dist.get_rank() == 0:
            os.makedirs(self.folder, exist_ok=True)
        prepared = prepared_metadata_path(config, self.folder, dist.get_world_size())
        checkpointer = AsyncCheckpointer(options=checkpointer_options(config, prepared))
        self.manager = CheckpointManager(
            self.folder, checkpointer, keep_last=config.keep_latest_k or None,
            async_save=config.async_mode != "disabled", overwrite=True)

    def __del__(self) -> None:
        self.close()

    # -- results ---------------------------------------------------------------------------
    @property
    def results(self) -> list[PublishedSave]:
        """Every finished save of this manager (step, path, ``SaveResult`` or error), in order."""
        return list(self.manager.done) if self.manager is not None else []

    @property
    def failures(self) -> list[PublishedSave]:
        """The saves that failed (each was logged; nothing of them was published)."""
        return list(self.manager.failures) if self.manager is not None else []

    # -- saving ----------------------------------------------------------------------------
    def _should_save(self, step: int, last_step: bool) -> bool:
        if step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or step % self.config.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        manager = self.manager
        if manager is None:  # load_only
            return False
        if not self._should_save(curr_step, last_step):
            if manager.poll():  # collects a finished save (latest, pruning); never blocks
                self.save_future = None
            return False
        self.maybe_wait_for_saving()
        if last_step and self.config.last_save_model_only:
            self._export_model(curr_step)
            return True
        handle = manager.save(curr_step, self._states_to_save())
        self._staging = handle
        self.save_future = handle if manager.async_save else None
        if last_step:
            self.maybe_wait_for_saving()
            failed = [d for d in manager.failures if d.step == curr_step]
            if failed:
                error = failed[-1].error
                raise error if error is not None else SolosaveError(f"the save of step {curr_step} failed")
        return True

    def _states_to_save(self) -> dict[str, Any]:
        """torchtitan's checkpoint layout: the model's tensors flattened at the top level beside
        the other states (their ``state_dict()`` is taken by ``save``); empty states are left out."""
        out = {k: v for k, v in self.states.items() if k != MODEL and v is not None}
        out.update(self.states[MODEL].state_dict())
        return out

    def _export_model(self, step: int) -> None:
        """The model only, cast to ``export_dtype``, saved synchronously by stock DCP into the
        step's directory (the run's prepared metadata stays that of the full state)."""
        sd = {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in self.states[MODEL].state_dict().items()}
        path = checkpoint_dir(self.folder, step)
        log.info("solosave: saving a model-only checkpoint in %s at the last step to %s", self.export_dtype, path)
        dcp.save(sd, checkpoint_id=path)

    def _wait_for_saving(self) -> None:
        handle, self.save_future = self.save_future, None
        if handle is None or self.manager is None:
            return
        try:
            handle.wait()
        except SolosaveError:
            pass  # recorded (and logged) by the manager's poll below
        self.manager.poll()

    def _maybe_wait_for_staging(self) -> None:
        """With ``async_with_pinned_mem`` (solosave's ``overlap_staging``): the last save's copies
        overlap the forward/backward, and this (called by torchtitan's trainer before
        ``optimizers.step()``) waits for them (``SaveHandle.wait_staged``). With ``async``,
        ``save`` returned after staging (CUDA: the current stream waits for the copies), so
        there is nothing to wait for. A staging race is logged; that save fails."""
        handle, self._staging = self._staging, None
        if handle is None:
            return
        try:
            handle.wait_staged()
        except SolosaveError as e:
            log.error("solosave: staging of the save of %s failed: %s", handle.path, e)

    # -- loading ---------------------------------------------------------------------------
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        model_only = False
        if step == -1:
            found = find_latest_checkpoint(self.folder)
            if found is None:
                if not self.config.initial_load_path:
                    log.info("solosave: no checkpoint in %s; a fresh start", self.folder)
                    return False
                path, model_only = self.config.initial_load_path, self.config.initial_load_model_only
            else:
                step, path = found
        else:
            path = checkpoint_dir(self.folder, step)
            if not os.path.isfile(os.path.join(path, METADATA_FILE)):
                raise FileNotFoundError(f"checkpoint.load_step={step}: {path} holds no published checkpoint")
        model_only = model_only or step == 0
        log.info("solosave: loading %s%s", path, " (model only)" if model_only else "")
        states = self._states_to_load(model_only)
        solosave_load(states, path)
        self.states[MODEL].load_state_dict(states)  # model tensors were loaded in place; refresh the cache
        return True

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return dict(self.states[MODEL].state_dict())
        unknown = [k for k in self.config.exclude_from_loading if k not in self.states]
        if unknown:
            raise ValueError(f"checkpoint.exclude_from_loading names {unknown}, not in the states "
                             f"{sorted(self.states)}")
        out = {k: v for k, v in self.states.items()
               if k != MODEL and v is not None and k not in self.config.exclude_from_loading}
        out.update(self.states[MODEL].state_dict())
        return out

    # -- closing ---------------------------------------------------------------------------
    def _close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.save_future = None
        if self.manager is not None:
            self.manager.finish(self.config.timeout)


def prepared_metadata_path(config: SolosaveCheckpointManager.Config, folder: str, world_size: int) -> str | None:
    """The prepared metadata file that ``config`` names for a run of ``world_size`` ranks.

    ``None``: keep it in memory only."""
    return prepared_file(config.prepared_metadata, folder, world_size, config.files_per_rank)


def checkpointer_options(config: SolosaveCheckpointManager.Config, prepared: str | None) -> CheckpointerOptions:
    """The :class:`~solosave.CheckpointerOptions` of ``config`` with the prepared file ``prepared``.

    ``prepared`` ``None``: in memory. A bad value raises ``ValueError`` naming the
    ``checkpoint.`` field."""
    return framework_options(forwarded_values(config), prepared=prepared,
                             overlap_staging=config.async_mode == "async_with_pinned_mem",
                             name_of=lambda name: f"checkpoint.{name}")


__all__ = ["AUTO", "SolosaveCheckpointManager", "checkpointer_options", "prepared_metadata_path"]
