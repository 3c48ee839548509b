"""Helpers for your own training loop: Megatron-style flags and a checkpoint directory manager.

Which ranks call what, in which order::

    parser = argparse.ArgumentParser()
    solosave.integrations.add_checkpoint_args(parser)       # any process, no torch.distributed
    args = parser.parse_args()
    validate_checkpoint_args(args)                           # raises ValueError on bad combinations
    dist.init_process_group(...)
    resume = find_latest_checkpoint(args.load)               # every rank (reads the filesystem)
    ckpt = checkpointer_from_args(args, resumed_from=resume) # every rank: collective once (setup)
    manager = CheckpointManager(args.save, ckpt, keep_last=args.keep_last,
                                keep_every=args.keep_every, async_save=args.async_save)
    for step in ...:
        manager.poll()                                       # every step: never blocks, no collective
        if step % args.save_interval == 0:
            manager.save(step, state_dict)                   # every rank, same steps
    manager.finish()                                         # every rank: waits (bounded), closes

A checkpoint of step ``s`` lives in ``<save>/iter_{s:07d}``. It counts as *published* once its
``.metadata`` exists: solosave writes that file last and atomically. Only then does the
coordinator (rank 0) move ``<save>/latest`` (atomically) and prune old checkpoints
(``keep_last``, sparing ``keep_every`` archival ones), on a background thread
(:mod:`solosave._src.tools.retention`), never the newest published one and never one newer than it.

Two tiers (the checkpointer's ``durable_root``): ``<save>`` is the fast tier and every published
checkpoint is also copied, in the background, to ``<durable_root>/iter_{s:07d}``. Each tier has
its own ``latest`` (the durable one moves when a copy is published there) and its own retention:
the fast tier keeps the ``keep_last`` newest and every checkpoint whose copy is still running;
the durable tier keeps the ``durable_keep_last`` newest (all by default) and the ``keep_every``
archival ones. :func:`find_restore_point` (every rank, collective) picks the newest checkpoint
and the tier to restore it from.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from solosave._src.core.errors import OptionError, SolosaveError
from solosave._src.formats.dcp import METADATA_FILE
from solosave._src.load.load import load
from solosave._src.prepared.prepared import PreparedMetadata, load_prepared_metadata
from solosave._src.save.checkpointer import AsyncCheckpointer, SaveHandle
from solosave._src.save.options import CheckpointerOptions, add_option_flags, option, options_from_args
from solosave._src.save.result import DurableResult
from solosave._src.storage.registry import backend_for, storage_for
from solosave._src.tiers.choice import choose_restore_point
from solosave._src.tiers.peer_repair import restore_from_peers
from solosave._src.tools.framework import AUTO, PublishedSave, Publisher
from solosave._src.tools.preemption import PreemptionGuard, StopOutcome
from solosave._src.tools.retention import Pruner, remove_checkpoint

log = logging.getLogger("solosave")

LATEST_FILE = "latest"
StorageOptions = Mapping[str, Any] | None  # keyword arguments of the fsspec filesystem of a URL
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
PRUNE_WAIT_S = 300.0  # finish(): how long it waits for deletions still running, unless told


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """The flags of a training run's checkpointing that are not checkpointer options (those are
    :class:`~solosave.CheckpointerOptions`); declared once, here, with their flags."""

    save: str | None = option(None, flag="--save", metavar="DIR", help=(
        "directory for checkpoints (iter_XXXXXXX sub-directories); none: no saves"))
    save_interval: int | None = option(None, flag="--save-interval", metavar="K", help=(
        "save every K steps (and at the last step)"))
    load: str | None = option(None, flag="--load", metavar="DIR", help=(
        "resume from the newest published checkpoint under DIR (partial ones are ignored)"))
    async_save: bool = option(False, flag="--async-save", help=(
        "return to training right after staging; the worker writes in the background"))
    keep_last: int | None = option(None, flag="--keep-last", metavar="N", help=(
        "keep only the N newest published checkpoints (never deletes the newest good one)"))
    keep_every: int | None = option(None, flag="--keep-every", metavar="N", help=(
        "also keep, forever, every published checkpoint whose step is a multiple of N (archival: "
        "--keep-last never deletes them); with --ckpt-durable-root, on the durable tier"))
    durable_keep_last: int | None = option(None, flag="--durable-keep-last", metavar="N", help=(
        "with --ckpt-durable-root: keep only the N newest checkpoints on the durable tier (besides "
        "the --keep-every ones); default: keep every one there"))

    def __post_init__(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise OptionError(f"{{save_interval}} must be >= 1, got {self.save_interval}")
        if self.save_interval is not None and not self.save:
            raise OptionError("{save_interval} needs {save} DIR (where the checkpoints go)")
        if self.keep_last is not None and self.keep_last < 1:
            raise OptionError(f"{{keep_last}} must be >= 1 (the newest good checkpoint is always "
                              f"kept), got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise OptionError(f"{{keep_every}} must be >= 1 (steps that are multiples of it are kept), "
                              f"got {self.keep_every}")
        if self.durable_keep_last is not None and self.durable_keep_last < 1:
            raise OptionError(f"{{durable_keep_last}} must be >= 1 (the newest durable checkpoint is always "
                              f"kept), got {self.durable_keep_last}")


def add_checkpoint_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the checkpointing flags (named as in Megatron-LM) to ``parser``, in their own group.

    One flag per field of :class:`RunOptions` and of :class:`~solosave.CheckpointerOptions`."""
    g = parser.add_argument_group("checkpointing (solosave)")
    add_option_flags(g, RunOptions)
    add_option_flags(g, CheckpointerOptions)
    return parser


def validate_checkpoint_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the flag and the fix for a bad value or combination."""
    if args.prepared_metadata == AUTO:
        if args.create_prepared_metadata:
            raise ValueError("--ckpt-metadata auto already creates the prepared metadata when it finds "
                             "none to reuse; drop --ckpt-metadata-create")
        if not args.save:
            raise ValueError("--ckpt-metadata auto keeps its prepared file under --save DIR; add --save")
    options_from_args(args, RunOptions)
    _checkpointer_options(args, None)


def auto_prepared_path(save_dir: str | os.PathLike, world_size: int, workers: int) -> str:
    """Where ``--ckpt-metadata auto`` keeps its prepared file when it has none to reuse.

    The path is ``<save>/prepared-w<world size>-n<workers>.metadata``, one per topology (as
    torchtitan's manager names its own), so a resume at another world size or
    ``--dist-ckpt-workers`` creates a file of its own instead of meeting one it cannot use."""
    return backend_for(save_dir).join(save_dir, f"prepared-w{world_size}-n{workers}.metadata")


def _checkpointer_options(args: argparse.Namespace, prepared: PreparedMetadata | None,
                          world_size: int = 1) -> CheckpointerOptions:
    """The options the flags describe; ``--ckpt-metadata auto`` becomes ``prepared`` (the
    resumed checkpoint's metadata, when it fits this run) or the prepared file of this run's
    topology (``world_size`` ranks), created by the first save if it does not exist."""
    if args.prepared_metadata != AUTO:
        return options_from_args(args, CheckpointerOptions)
    if prepared is not None:
        return options_from_args(args, CheckpointerOptions, prepared_metadata=prepared)
    return options_from_args(args, CheckpointerOptions, create_prepared_metadata=True,
                             prepared_metadata=auto_prepared_path(args.save, world_size, args.files_per_rank))


# -- the checkpoint directory ------------------------------------------------------------------
def checkpoint_dir(save_dir: str | os.PathLike, step: int) -> str:
    """``<save_dir>/iter_{step:07d}`` (``save_dir`` a local path or a URL)."""
    return backend_for(save_dir).join(save_dir, f"iter_{step:07d}")


def _iter_names(save_dir: str | os.PathLike, storage_options: StorageOptions) -> list[str]:
    """The names in ``save_dir`` that look like checkpoints (none if it does not exist)."""
    storage = storage_for(save_dir, storage_options)
    path = os.fspath(save_dir)
    try:
        names = storage.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [n for n in names if _ITER_RE.match(n)]


def published_checkpoints(save_dir: str | os.PathLike, storage_options: StorageOptions = None) -> list[tuple[int, str]]:
    """List ``(step, path)`` of every published checkpoint under ``save_dir``, oldest first.

    ``save_dir`` is a local path or a URL (``storage_options``: keyword arguments of its fsspec
    filesystem); a checkpoint counts when it has a published ``.metadata``. Partial checkpoints
    (no ``.metadata``) are left out."""
    if not save_dir:
        return []
    storage = storage_for(save_dir, storage_options)
    out = []
    for name in _iter_names(save_dir, storage_options):
        path = storage.join(save_dir, name)
        if storage.isfile(storage.join(path, METADATA_FILE)):
            out.append((int(_ITER_RE.match(name).group(1)), path))  # type: ignore[union-attr]
    return sorted(out)


def find_latest_checkpoint(save_dir: str | os.PathLike | None,
                           storage_options: StorageOptions = None) -> tuple[int, str] | None:
    """The newest published checkpoint under ``save_dir`` as ``(step, path)``, or ``None``.

    The directory listing decides, not the ``latest`` marker: a marker that is missing or points
    at a removed checkpoint does not hide a newer published one."""
    found = published_checkpoints(save_dir, storage_options) if save_dir else []
    return found[-1] if found else None


def find_restore_point(save_dir: str | os.PathLike | None, durable_root: str | os.PathLike | None = None, *,
                       process_group: Any = None, storage_options: StorageOptions = None,
                       ranks_per_host: int = 0) -> tuple[int, str] | None:
    """The checkpoint to resume from, as ``(step, path)``, or ``None``.

    It is the newest step published on either tier, from the fast tier (``save_dir``) when every
    rank finds it complete there, else from ``durable_root``; every rank gets the same answer.
    Every rank of ``process_group`` calls it (one 8-byte ``all_reduce`` per step examined and one
    of the chosen copy's ``save_id``, normally two; :mod:`solosave._src.tiers.choice`). Without
    ``durable_root``: :func:`find_latest_checkpoint` (no collective).

    ``ranks_per_host`` (checkpoints saved with ``peer_copies``; the checkpointer's
    ``peer_ranks_per_host``): first, the hosts whose fast tier misses part of the newest step
    that the hosts hold between them get those files from whichever hosts hold them
    (:mod:`solosave._src.tiers.peer_repair`: one ``all_gather_object`` of what each rank holds,
    then the transfers, only when a host misses something). Files that no surviving host holds
    (more than ``peer_copies`` hosts lost) are copied from the durable copy of the same step,
    and only those (one ``broadcast_object`` more, of the first rank's look at the durable tier)."""
    if not durable_root:
        return find_latest_checkpoint(save_dir, storage_options)
    if ranks_per_host and save_dir:
        storage = storage_for(save_dir, storage_options)
        here = {step: storage.basename(path) for step, path in published_checkpoints(save_dir, storage_options)}
        restore_from_peers(save_dir, here, ranks_per_host, process_group, storage_options, durable_root)
    fast = dict(published_checkpoints(save_dir, storage_options)) if save_dir else {}
    durable = dict(published_checkpoints(durable_root, storage_options))
    candidates = [(step, fast.get(step), durable.get(step)) for step in set(fast) | set(durable)]
    return choose_restore_point(candidates, process_group, storage_options)


def prunable_checkpoints(save_dir: str | os.PathLike, keep_last: int | None, keep_every: int | None = None,
                         below: int | None = None, storage_options: StorageOptions = None,
                         spare: Collection[str] = ()) -> list[str]:
    """The checkpoint directories that retention deletes now, oldest first.

    They are every one (published or partial) older than the newest published one, except the
    ``keep_last`` newest published ones and the published ones whose step is a multiple of
    ``keep_every``. ``below``: consider only steps below it (the manager passes the step it last
    published, so a save it started since is never touched); ``spare``: paths never deleted now
    (checkpoints whose durable copy still reads them). Nothing without ``keep_last``."""
    published = published_checkpoints(save_dir, storage_options)
    if keep_last is None or not published:
        return []
    limit = published[-1][0] if below is None else min(published[-1][0], below)
    keep = {s for s, _ in published[-keep_last:]}
    keep |= {s for s, _ in published if keep_every and s % keep_every == 0}
    out = []
    backend = backend_for(save_dir)
    spared = {backend.normalize(p) for p in spare}  # "./ckpt" and "ckpt" are one directory
    for name in _iter_names(save_dir, storage_options):
        step = int(_ITER_RE.match(name).group(1))  # type: ignore[union-attr]
        path = backend.join(save_dir, name)
        if step < limit and step not in keep and backend.normalize(path) not in spared:
            out.append((step, path))
    return [path for _, path in sorted(out)]


def prepared_for_resume(resumed_from: str, world_size: int, workers: int,
                        storage_options: StorageOptions = None) -> PreparedMetadata | None:
    """The ``.metadata`` of ``resumed_from`` as prepared metadata, if it fits this run.

    For ``--ckpt-metadata auto``; ``None`` (with a log line saying why) otherwise."""
    try:
        prepared = load_prepared_metadata(resumed_from, storage_options=storage_options)
        prepared.check_compatible(world_size, workers)
    except (SolosaveError, OSError) as e:  # a mismatched or unreadable file: create one instead
        log.warning("solosave: --ckpt-metadata auto: not reusing %s: %s", resumed_from, e)
        return None
    return prepared


def checkpointer_from_args(args: argparse.Namespace, process_group: Any = None,
                           resumed_from: str | None = None, **overrides: Any) -> AsyncCheckpointer:
    """Build the :class:`~solosave.AsyncCheckpointer` the flags describe.

    Every rank calls it; collective once, for the worker's setup. ``resumed_from``: the
    checkpoint this run resumed from, used by ``--ckpt-metadata auto``. ``overrides`` replace
    options (``CheckpointerOptions`` fields)."""
    import torch.distributed as dist

    validate_checkpoint_args(args)
    prepared = None
    world_size = dist.get_world_size(process_group)
    if args.prepared_metadata == AUTO and resumed_from is not None:
        prepared = prepared_for_resume(resumed_from, world_size, args.files_per_rank,
                                       getattr(args, "storage_options", None))
    options = _checkpointer_options(args, prepared, world_size)
    if overrides:
        options = dataclasses.replace(options, **overrides)
    return AsyncCheckpointer(process_group, options=options)


@dataclass(frozen=True, slots=True)
class DurableSave:
    """A durable copy that ended (two tiers).

    It holds the step, and its ``DurableResult`` (``ok``, ``error``, ``path`` on the durable
    tier, ...)."""

    step: int
    result: DurableResult


class CheckpointManager:
    """Runs saves into ``<save_dir>/iter_XXXXXXX``, moves ``latest`` and prunes old checkpoints.

    Every rank constructs one and calls :meth:`save` at the same steps; :meth:`poll` (never
    blocks, no collective) collects finished saves; :meth:`finish` waits for the last one. Only
    the coordinator (``checkpointer.rank == 0``) writes ``latest`` and deletes directories, and
    only after its own result says the checkpoint was published. A failed save is reported (and
    kept in :attr:`failures`); training goes on, the previous checkpoint stays the newest.
    A step whose directory already holds a published checkpoint raises
    :class:`~solosave.CheckpointExistsError` from :meth:`save` unless ``overwrite``.
    ``on_done`` is called on every rank with each :class:`PublishedSave`. The saves themselves
    run through a :class:`~solosave._src.tools.framework.Publisher`, as the Lightning
    strategies' do.

    Retention (:func:`prunable_checkpoints`): ``keep_last`` newest published checkpoints are
    kept, plus, forever, the published ones whose step is a multiple of ``keep_every``. The
    deletions run on a background thread of the coordinator (they never block :meth:`save` or
    :meth:`poll`); one that fails is logged and skipped. ``remover(path)`` deletes one
    checkpoint directory (default: ``.metadata`` first, then the rest).

    Two tiers (the checkpointer's ``durable_root``; see the module docstring): :meth:`poll` also
    collects the durable copies that ended (:attr:`durable_done`, failures also in
    :attr:`durable_failures` and logged; ``on_durable`` is called on every rank with each
    :class:`DurableSave`); the coordinator moves ``<durable_root>/latest`` after each copy
    published there and prunes the durable tier (``durable_keep_last``, ``keep_every``) on a
    second thread; the fast tier keeps the ``keep_last`` newest (``keep_every`` does not apply
    there) and never deletes a checkpoint whose copy is still running. :meth:`finish` waits for
    the copies too (bounded). With peer copies (the checkpointer's ``peer_copy``; fast tiers
    local to each host) the first rank of every host prunes its own host's fast tier, and
    :meth:`restore` first brings a lost host's files back from its peers.
    """

    def __init__(self, save_dir: str | os.PathLike, checkpointer: AsyncCheckpointer, *,
                 keep_last: int | None = None, keep_every: int | None = None, async_save: bool = True,
                 overwrite: bool = False, on_done: Callable[[PublishedSave], None] | None = None,
                 remover: Callable[[str], None] = remove_checkpoint, durable_keep_last: int | None = None,
                 on_durable: Callable[[DurableSave], None] | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be >= 1, got {keep_every}")
        if durable_keep_last is not None and durable_keep_last < 1:
            raise ValueError(f"durable_keep_last must be >= 1, got {durable_keep_last}")
        self.save_dir = os.fspath(save_dir)
        self.on_done = on_done
        self._publisher = Publisher(checkpointer, on_published=self._on_published, on_done=self._on_done)
        #: Keyword arguments of the fsspec filesystem of a URL ``save_dir`` (the checkpointer's).
        self.storage_options = self._publisher.storage_options
        if remover is remove_checkpoint and self.storage_options:
            remover = functools.partial(remove_checkpoint, storage_options=self.storage_options)
        self.checkpointer = checkpointer
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.overwrite = overwrite
        #: Every finished save, and the failed ones among them (each was logged).
        self.done: list[PublishedSave] = self._publisher.done
        #: The step of the last :meth:`save` call (``None`` before the first).
        self.last_saved_step: int | None = None
        self.failures: list[PublishedSave] = self._publisher.failures
        self._published_step: int | None = None  # read by the pruner's thread
        #: Two tiers: the durable root (the checkpointer's), the copies not yet ended and the
        #: fast paths they read (a frozenset, replaced whole: read by the pruner's thread).
        self.durable_root: str | None = getattr(getattr(checkpointer, "options", None), "durable_root", None)
        self.durable_keep_last = durable_keep_last
        self.on_durable = on_durable
        self.durable_done: list[DurableSave] = []
        self.durable_failures: list[DurableSave] = []
        self._copies: list[tuple[int, str, Any]] = []  # (step, fast path, DurableCopy)
        self._copying: frozenset[str] = frozenset()
        self._durable_step: int | None = None
        #: Peer copies: the ranks per host (0: none). Each host's fast tier is its own then, so the
        #: first rank of every host prunes its host's, not the coordinator alone.
        self._ranks_per_host: int = getattr(checkpointer, "peer_ranks_per_host", 0)
        rank = getattr(checkpointer, "rank", 0)
        self._prunes_fast_tier = self.is_coordinator or bool(self._ranks_per_host and rank % self._ranks_per_host == 0)
        fast_every = None if self.durable_root else keep_every  # archival copies live on the durable tier
        self._pruner = Pruner(lambda: prunable_checkpoints(self.save_dir, self.keep_last, fast_every,
                                                           below=self._published_step,
                                                           storage_options=self.storage_options,
                                                           spare=self._copying), remover)
        self._durable_pruner = None if not self.durable_root else Pruner(
            lambda: prunable_checkpoints(self.durable_root, self.durable_keep_last, self.keep_every,  # type: ignore[arg-type]
                                         below=self._durable_step, storage_options=self.storage_options), remover)

    @property
    def is_coordinator(self) -> bool:
        return self._publisher.is_coordinator

    def restore(self, state_dict: dict[str, Any], **load_options: Any) -> tuple[int, str] | None:
        """Load the newest checkpoint into ``state_dict`` (every rank; collective).

        With two tiers it loads from the fast copy when every rank finds it complete, else from
        the durable copy (:func:`find_restore_point`). Returns ``(step, path loaded from)``, or
        ``None`` (nothing to restore; ``state_dict`` untouched). ``load_options``: keywords of
        ``solosave.load``."""
        group = getattr(self.checkpointer, "process_group", None)
        point = find_restore_point(self.save_dir, self.durable_root, process_group=group,
                                   storage_options=self.storage_options, ranks_per_host=self._ranks_per_host)
        if point is None:
            return None
        b = backend_for(point[1])
        on_fast_tier = b.dirname(b.normalize(point[1])) == b.normalize(self.save_dir)
        peers = {"ranks_per_host": self._ranks_per_host, "durable_root": self.durable_root} if (
            on_fast_tier and self._ranks_per_host) else {}  # a fast copy that fails to load: the durable one
        loaded = load(state_dict, point[1], process_group=group, storage_options=self.storage_options,
                      **{**peers, **load_options})
        return point[0], loaded

    def save(self, step: int, state_dict: dict[str, Any]) -> SaveHandle:
        """Save ``state_dict`` as step ``step``.

        With ``async_save`` it returns after staging; otherwise it waits for publication. A
        previous save still in flight is finished first."""
        handle = self._publisher.save(step, state_dict, checkpoint_dir(self.save_dir, step), overwrite=self.overwrite)
        self.last_saved_step = step
        if not self.async_save:
            self._publisher.collect(block=True)
        return handle

    def wait(self, timeout: float | None = None) -> list[PublishedSave]:
        """Wait for the save in flight to end, published or failed.

        Bounded by ``timeout`` (default the checkpointer's); the checkpointer stays open.
        Returns the saves that ended."""
        return self._publisher.collect(block=True, timeout=timeout)

    def poll(self) -> list[PublishedSave]:
        """Collect the save in flight if it has finished, and the durable copies that ended.

        Non-blocking, no collective."""
        done = self._publisher.poll()
        self._collect_durable(block=False)
        return done

    def wait_for_pruning(self, timeout: float | None = None) -> bool:
        """Wait until no deletion of old checkpoints is due or running, on either tier.

        Returns at once on other ranks; ``False`` if ``timeout`` ran out first."""
        if not self._pruner.wait(timeout):
            return False
        return self._durable_pruner is None or self._durable_pruner.wait(timeout)

    def wait_for_copies(self, timeout: float | None = None) -> list[DurableSave]:
        """Wait for every durable copy still running and return the ones that ended now.

        Two tiers: each copy is waited for at most ``timeout`` (default the checkpointer's)."""
        return self._collect_durable(block=True, timeout=timeout)

    def finish(self, timeout: float | None = None) -> list[PublishedSave]:
        """Wait (bounded) for the work still running, then close the checkpointer.

        Waits for the save in flight (bounded), for the durable copies still running (bounded),
        then for the deletions still running (bounded by ``timeout``, else :data:`PRUNE_WAIT_S`;
        past it they go on in the background, and a warning says so), and closes the
        checkpointer."""
        try:
            done = self._publisher.collect(block=True, timeout=timeout)
            try:
                self._collect_durable(block=True, timeout=timeout)
            except SolosaveError as e:  # a copy that did not end in time: close() abandons it
                log.warning("solosave: %s; the checkpointer's close() abandons it", e)
            return done
        finally:
            limit = PRUNE_WAIT_S if timeout is None else timeout
            for pruner in (self._pruner, self._durable_pruner):
                if pruner is not None and not pruner.close(limit):
                    log.warning("solosave: old checkpoints still being deleted after %.1f s; left to a "
                                "background thread (a half-deleted one is never published)", limit)
            self.checkpointer.close()

    def _on_published(self, done: PublishedSave) -> None:
        """The coordinator, once ``done`` is published: its durable copy (if any) is tracked
        first (the copy reads the fast checkpoint, which pruning then spares), ``latest`` moves,
        pruning is asked for."""
        self._track_copy(done)
        self._mark_latest(self.save_dir, done.path)
        self._published_step = done.step
        if self.keep_last is not None:
            self._pruner.request()

    def _on_done(self, done: PublishedSave) -> None:
        """Every rank, for every finished save: its durable copy is tracked, then ``on_done``.
        A host's first rank that prunes its own tier (peer copies) learns the step published
        now, below which alone it deletes (as the coordinator does)."""
        self._track_copy(done)
        if self._prunes_fast_tier and not self.is_coordinator and done.error is None and done.result is not None:
            self._published_step = done.step
        if self.on_done is not None:
            self.on_done(done)

    def _track_copy(self, done: PublishedSave) -> None:
        """Track the durable copy of ``done`` (two tiers; idempotent: the coordinator's
        :meth:`_on_published` and every rank's :meth:`_on_done` both call it)."""
        copy = getattr(done.result, "durable", None)
        if copy is None or any(c is copy for _, _, c in self._copies):
            return
        self._copies.append((done.step, done.path, copy))
        self._copying = frozenset(p for _, p, _ in self._copies)

    def _collect_durable(self, block: bool, timeout: float | None = None) -> list[DurableSave]:
        """The durable copies that ended, in save order (``block``: wait for each, bounded)."""
        out: list[DurableSave] = []
        while self._copies:
            step, _, copy = self._copies[0]
            if not block and not copy.done():
                break
            result = copy.wait(timeout)
            self._copies.pop(0)
            self._copying = frozenset(p for _, p, _ in self._copies)
            ended = DurableSave(step, result)
            out.append(ended)
            self.durable_done.append(ended)
            if result.superseded:  # coalesced: a newer checkpoint's copy replaced it (not a failure)
                log.info("solosave: checkpoint of step %d not copied to the durable tier: %s", step, result.error)
            elif not result.ok:
                self.durable_failures.append(ended)
                log.error("solosave: checkpoint of step %d stays on the fast tier only: %s", step, result.error)
            elif self.is_coordinator:
                self._mark_latest(self.durable_root, result.path)  # type: ignore[arg-type]
                self._durable_step = step
                if self._durable_pruner is not None:
                    self._durable_pruner.request()
            if self._prunes_fast_tier and self.keep_last is not None:
                self._pruner.request()  # the fast copy it read may go now
            if self.on_durable is not None:
                self.on_durable(ended)
        # copies that ended behind one still running (coalesced ones, while the store stalls) no
        # longer read their fast checkpoint: retention may take it (reports stay in save order)
        copying = frozenset(p for _, p, c in self._copies if not c.done())
        if copying != self._copying:
            self._copying = copying
            if self._prunes_fast_tier and self.keep_last is not None:
                self._pruner.request()
        return out

    def _mark_latest(self, root: str, path: str) -> None:
        """Replace ``<root>/latest`` at once (a rename locally, one object write on an object store)."""
        storage = storage_for(root, self.storage_options)
        storage.commit(storage.join(root, LATEST_FILE), (storage.basename(path) + "\n").encode())


def read_latest_marker(save_dir: str | os.PathLike, storage_options: StorageOptions = None) -> str | None:
    """The checkpoint name in ``<save_dir>/latest``, or ``None``."""
    try:
        storage = storage_for(save_dir, storage_options)
        data = storage.read(storage.join(save_dir, LATEST_FILE))
    except FileNotFoundError:
        return None
    return data.decode().strip() or None


__all__ = [
    "AUTO", "LATEST_FILE", "CheckpointManager", "DurableSave", "PreemptionGuard", "PublishedSave", "StopOutcome",
    "add_checkpoint_args",
    "auto_prepared_path", "checkpoint_dir", "checkpointer_from_args", "find_latest_checkpoint",
    "find_restore_point", "prepared_for_resume",
    "prunable_checkpoints", "published_checkpoints", "read_latest_marker", "validate_checkpoint_args",
]
