"""Checkpointer options: declared once, here, for the API, the command-line flags and validation.

Each knob is a field of :class:`CheckpointerOptions` whose :func:`option` metadata names its
Megatron-style flag and help text; ``solosave.integrations.add_checkpoint_args`` generates the
flags from these fields and :func:`options_from_args` builds the options back, so a knob is
declared (and validated) in exactly one place. ``__post_init__`` raises :class:`OptionError`
(a ``ValueError``) naming the option; from the command line the flag is named instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from solosave._src.core.errors import OptionError
from solosave._src.prepared.prepared import PreparedMetadata
from solosave._src.tiers.placement import PeerLayout

DRIFT_POLICIES = ("fallback", "raise")
#: Where each rank's saves are written: a spawned process reused by every save, or a thread.
WORKER_KINDS = ("process", "thread")
#: The longest ``timeout`` accepted, in seconds (about 31 years). torch turns a timeout into a
#: deadline in int64 nanoseconds and gloo refuses a negative one, so a much larger value, or
#: ``inf``, would fail deep inside the set-up on some ranks only and leave the others waiting
#: in its broadcast.
MAX_TIMEOUT_S = 1e9


def option(default: Any, *, flag: str, help: str, metavar: str | None = None,  # noqa: A002 - argparse's name
           cli_default: Any = dataclasses.MISSING, choices: tuple | None = None,
           parse: Any = None, const: Any = None) -> Any:
    """A dataclass field with its command-line flag. ``cli_default``: the flag's default when it
    differs from the API's (Megatron's flags are opt-in); ``parse``: turns the flag's text into
    the value (default: by the field's type); ``const``: the flag takes no value and sets this
    one (Megatron's ``--use-persistent-ckpt-worker`` sets ``worker="process"``)."""
    return field(default=default, metadata={"flag": flag, "help": help, "metavar": metavar, "const": const,
                                            "cli_default": cli_default, "choices": choices, "parse": parse})


def json_object(text: str) -> dict:
    """A flag's JSON object (``--ckpt-storage-options '{"anon": false}'``)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class _OptionFields:
    """The fields of :class:`CheckpointerOptions` (which adds the old names)."""

    files_per_rank: int = option(1, flag="--dist-ckpt-workers", metavar="N", help=(
        "files (writer threads) per rank: __{rank}_{0..N-1}.distcp (default 1); more helps when "
        "one writer thread cannot saturate the storage"))
    worker: str = option("process", flag="--use-persistent-ckpt-worker", cli_default="thread", const="process",
                         choices=WORKER_KINDS, help=(
        "write in one spawned worker process per rank, reused by every save (the API's default, "
        "worker='process'); without the flag a background thread of the trainer writes "
        "(worker='thread')"))
    prepared_metadata: str | os.PathLike | Metadata | PreparedMetadata | None = option(
        None, flag="--ckpt-metadata", metavar="FILE|auto", help=(
            "prepared metadata to reuse: every save then needs one 8-byte all_reduce. 'auto' (flag "
            "only): the .metadata of the checkpoint resumed from, if it fits this run, else "
            "<save>/prepared-w<world size>-n<workers>.metadata (one per topology), created by the "
            "first save if it does not exist"))
    create_prepared_metadata: bool = option(False, flag="--ckpt-metadata-create", help=(
        "create the prepared metadata file at the first save if it does not exist (collective "
        "path once), then reuse it"))
    assume_constant_structure: bool = option(False, flag="--ckpt-assume-constant-structure", help=(
        "without a prepared file: the first save's metadata is kept in memory and every later "
        "save reuses it (one all_reduce); a changed layout falls back as in reuse mode"))
    on_layout_drift: str = option("fallback", flag="--ckpt-on-layout-drift", choices=DRIFT_POLICIES, help=(
        "a reuse save whose layout no longer matches: 'fallback' (default) saves it collectively "
        "and refreshes the prepared metadata; 'raise' fails it"))
    timeout: float = option(600.0, flag="--ckpt-timeout", metavar="SECONDS", help=(
        "bound of every checkpoint wait: the worker's start, a save's completion, each collective "
        "(default 600, at most 1e9)"))
    checksums: bool = option(False, flag="--ckpt-checksums", help=(
        "record a CRC32 of every record next to each data file, for `solosave verify` (one CRC "
        "pass in the background)"))
    staging_dir: str | None = option(None, flag="--ckpt-staging-dir", metavar="DIR", help=(
        "stage in memory-mapped files in DIR instead of /dev/shm (also $SOLOSAVE_STAGING_DIR); "
        "solosave falls back to the temporary directory by itself when /dev/shm is too small"))
    stage_replicas: bool = option(False, flag="--ckpt-stage-replicas", help=(
        "reuse mode: stage every replicated tensor this rank holds, not only those the prepared "
        "layout has it write, so a drift fallback can reassign any of them in the same save (a "
        "replicated tensor that vanished from its writer still gets saved). Costs up to "
        "world-size times the stall under DDP; without it that one save fails and the next heals"))
    overlap_staging: bool = option(False, flag="--ckpt-overlap-staging", help=(
        "save() returns before the tensors are copied: the copies overlap the next forward/"
        "backward (a side CUDA stream, or a thread for CPU tensors), and the training loop must "
        "call handle.wait_staged() before optimizer.step(); a tensor changed in place before "
        "that fails the save (StagingRaceError). Default: copies done (CPU) or stream-ordered "
        "(CUDA) when save() returns"))
    storage_options: dict[str, Any] | None = option(None, flag="--ckpt-storage-options", metavar="JSON",
                                                    parse=json_object, help=(
        "URL destinations (s3://bucket/path; pip install 'solosave[s3]'): keyword arguments of the fsspec "
        "filesystem, e.g. '{\"client_kwargs\": {\"endpoint_url\": \"http://host:9000\"}}'; by default "
        "the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) apply"))
    durable_root: str | None = option(None, flag="--ckpt-durable-root", metavar="DIR|URL", help=(
        "two tiers: a save to .../NAME is published as usual (the fast tier), then each rank's worker "
        "copies its files to DURABLE/NAME in the background and the coordinator publishes "
        "DURABLE/NAME/.metadata once every rank's copy succeeded (a path or a URL; "
        "storage_options apply to URLs); the training loop never waits for the copy"))
    durable_every_save: bool = option(False, flag="--ckpt-durable-every-save", help=(
        "two tiers: copy every save to the durable tier, in order, even when the copies fall "
        "behind (a save then waits, before it writes, while two copies are pending). Default: "
        "copies that fall behind are coalesced, the latest wins, and no save ever waits for them"))
    durable_retries: int = option(2, flag="--ckpt-durable-retries", metavar="N", help=(
        "two tiers: a durable copy that failed on some rank is tried again, on every rank, up to N "
        "more times, after 1 s, 2 s, 4 s, ... (default 2; 0: never)"))
    peer_copy: bool = option(False, flag="--ckpt-peer-copy", help=(
        "one peer copy: the same as peer_copies=1"))
    peer_copies: int = option(0, flag="--ckpt-peer-copies", metavar="K", help=(
        "two tiers with a fast tier local to each host (the same path on every host): before its "
        "durable copy, each rank's worker also sends its files to the same local rank of K other "
        "hosts (in K other failure domains when hosts_per_domain leaves enough), which keep them "
        "beside their own, and every host gets the .metadata; hosts whose fast tiers are lost (up "
        "to K, any of them) are rebuilt from the others (CheckpointManager.restore, find_restore_point "
        "or solosave.load with ranks_per_host), without reading the durable tier. 0: none. Needs "
        "durable_root and K < the number of hosts"))
    ranks_per_host: int | None = option(None, flag="--ckpt-ranks-per-host", metavar="N", help=(
        "peer copies: ranks per host, hosts being consecutive blocks of ranks (default: "
        "$LOCAL_WORLD_SIZE, which torchrun sets)"))
    hosts_per_domain: int | None = option(None, flag="--ckpt-hosts-per-domain", metavar="N", help=(
        "peer copies: hosts per failure domain (rack, switch), domains being consecutive blocks of "
        "hosts; the copies of a file then go to other domains than its own and each other's where "
        "there are more than K domains. Default: each host its own domain"))

    def __post_init__(self) -> None:
        _check_storage_options(self)
        _check_durable_root(self)
        _check_peer_copy(self)
        r = self.durable_retries
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r <= 10:
            raise OptionError(f"{{durable_retries}} must be a whole number from 0 to 10, got {r!r}")
        n = self.files_per_rank
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise OptionError(f"{{files_per_rank}} must be >= 1 (an int: files per rank), got {n!r}")
        if self.worker not in WORKER_KINDS:
            raise OptionError(f"{{worker}} must be one of {WORKER_KINDS}, got {self.worker!r}")
        if self.on_layout_drift not in DRIFT_POLICIES:
            raise OptionError(f"{{on_layout_drift}} must be one of {DRIFT_POLICIES}, got {self.on_layout_drift!r}")
        if not (isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool)
                and 0 < self.timeout <= MAX_TIMEOUT_S):
            raise OptionError("{timeout} must be a positive number of seconds, at most 1e9 "
                              f"(about 31 years: every wait needs a finite bound), got {self.timeout!r}")
        pm = self.prepared_metadata
        if pm is not None and not isinstance(pm, (str, os.PathLike, Metadata, PreparedMetadata)):
            raise TypeError("prepared_metadata must be a path, a torch.distributed.checkpoint "
                            f"Metadata or a solosave.PreparedMetadata, got {type(pm).__name__}")
        if self.create_prepared_metadata:
            if pm is None:
                raise OptionError("{create_prepared_metadata} needs {prepared_metadata} naming the file to "
                                  "create (e.g. prepared.metadata)")
            if isinstance(pm, (Metadata, PreparedMetadata)):
                raise OptionError("{create_prepared_metadata} needs a file path, not a Metadata object: "
                                  "pass the path to create, or drop {create_prepared_metadata} to reuse "
                                  "the object as it is")

    @property
    def prepared_path(self) -> str | None:
        """The prepared file named by ``prepared_metadata``, if it is a path."""
        pm = self.prepared_metadata
        return os.fspath(pm) if isinstance(pm, (str, os.PathLike)) else None

    @property
    def creates_prepared(self) -> bool:
        """The first collective save's metadata becomes the prepared metadata."""
        return self.create_prepared_metadata or self.assume_constant_structure


class CheckpointerOptions(_OptionFields):
    """Options of :class:`~solosave.AsyncCheckpointer`; every field says when to change it.

    Keyword arguments only. Two names of solosave 0.1 stay accepted as aliases: ``workers=N``
    for ``files_per_rank=N`` and ``persistent_worker=True/False`` for ``worker="process"`` /
    ``"thread"`` (also readable as properties); passing an alias and its new name at once is
    an error."""

    __slots__ = ()

    def __init__(self, *, workers: int | None = None, persistent_worker: bool | None = None,
                 **fields: Any) -> None:
        if workers is not None:
            if "files_per_rank" in fields:
                raise OptionError("{workers} is the old name of {files_per_rank}: pass one of them")
            fields["files_per_rank"] = workers
        if persistent_worker is not None:
            if "worker" in fields:
                raise OptionError("{persistent_worker} is the old name of {worker}: pass one of them")
            fields["worker"] = "process" if persistent_worker else "thread"
        super().__init__(**fields)

    @property
    def workers(self) -> int:
        """Old name of :attr:`files_per_rank`."""
        return self.files_per_rank

    @property
    def persistent_worker(self) -> bool:
        """Old name: whether :attr:`worker` is ``"process"``."""
        return self.worker == "process"


def _check_storage_options(options: _OptionFields) -> None:
    """``storage_options`` is a mapping with string keys that pickles (it travels to the worker);
    kept as a plain dict of its own."""
    so = options.storage_options
    if so is None:
        return
    if not isinstance(so, Mapping) or not all(isinstance(k, str) for k in so):
        raise OptionError(f"{{storage_options}} must be a mapping with string keys (keyword arguments of "
                          f"the fsspec filesystem), got {type(so).__name__}")
    try:
        pickle.dumps(dict(so))
    except Exception as e:  # noqa: BLE001 - any failure: it cannot reach the worker
        raise OptionError(f"{{storage_options}} must be picklable (it travels to the worker process): {e}") from e
    object.__setattr__(options, "storage_options", dict(so))


def _check_durable_root(options: _OptionFields) -> None:
    """``durable_root`` is a path or a URL (kept as the string every rank derives alike)."""
    root = options.durable_root
    if root is None:
        return
    if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
        raise OptionError(f"{{durable_root}} must be a directory path or a URL (s3://bucket/run), got {root!r}")
    object.__setattr__(options, "durable_root", os.fspath(root))


def _check_peer_copy(options: _OptionFields) -> None:
    """Peer copies ride on the durable copies' channel; their counts are whole numbers."""
    for name in ("ranks_per_host", "hosts_per_domain"):
        n = getattr(options, name)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise OptionError(f"{{{name}}} must be a whole number >= 1, got {n!r}")
    k = options.peer_copies
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise OptionError(f"{{peer_copies}} must be a whole number >= 0 (copies of each host's files), got {k!r}")
    if (options.peer_copy or k) and not options.durable_root:
        raise OptionError("{peer_copies} needs {durable_root}: the peer copies run in the background copy of two "
                          "tiers, before the copy to the durable tier; set both")


def peer_copy_count(options: _OptionFields) -> int:
    """K: the copies of each host's files (``peer_copies``, or 1 for ``peer_copy``; 0: none)."""
    return options.peer_copies or (1 if options.peer_copy else 0)


def peer_layout(options: _OptionFields, world_size: int) -> PeerLayout | None:
    """Where the peer copies go (``None``: no peer copy). Raises ``ValueError`` naming the fix
    when they cannot be made: no host size known, uneven hosts or domains, K >= the hosts."""
    k = peer_copy_count(options)
    if not k:
        return None
    n = options.ranks_per_host
    if n is None:
        env = os.environ.get("LOCAL_WORLD_SIZE", "")
        if not env.isdigit() or int(env) < 1:
            raise ValueError("peer copies need the number of ranks per host: pass ranks_per_host "
                             "(--ckpt-ranks-per-host) or launch with torchrun, which sets LOCAL_WORLD_SIZE")
        n = int(env)
    if world_size % n or world_size // n < 2:
        raise ValueError(f"peer copies need at least two hosts of {n} rank(s) each (ranks_per_host={n}), but the "
                         f"world has {world_size} rank(s): drop peer_copies on a single host, or fix ranks_per_host")
    return PeerLayout.of(world_size, n, k, options.hosts_per_domain or 1)


def peer_ranks_per_host(options: _OptionFields, world_size: int) -> int:
    """The ranks per host of the peer copies (0: no peer copy); raises as :func:`peer_layout`."""
    layout = peer_layout(options, world_size)
    return 0 if layout is None else layout.ranks_per_host


def add_option_flags(group: Any, cls: type = CheckpointerOptions, only: tuple[str, ...] | None = None) -> None:
    """Add one flag per field of ``cls`` (an options dataclass declared with :func:`option`), or
    per field named in ``only``."""
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        meta = f.metadata
        default = f.default if meta["cli_default"] is dataclasses.MISSING else meta["cli_default"]
        if f.type in (bool, "bool"):
            group.add_argument(meta["flag"], dest=f.name, action="store_true", default=default, help=meta["help"])
            continue
        if meta.get("const") is not None:
            group.add_argument(meta["flag"], dest=f.name, action="store_const", const=meta["const"],
                               default=default, help=meta["help"])
            continue
        kind = meta.get("parse") or {"int": int, "float": float}.get(str(f.type).split("|")[0].strip())
        group.add_argument(meta["flag"], dest=f.name, type=kind, default=default, metavar=meta["metavar"],
                           choices=meta["choices"], help=meta["help"])


def flag_of(name: str, cls: type) -> str:
    """The flag of field ``name`` of the options dataclass ``cls`` (the name if it has none)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata["flag"]
    return name


def options_from_args(args: argparse.Namespace, cls: type = CheckpointerOptions, **overrides: Any) -> Any:
    """Build ``cls`` from parsed flags; a bad value raises ``ValueError`` naming the flag."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kw.update(overrides)
    try:
        return cls(**kw)
    except OptionError as e:
        raise ValueError(e.render(lambda name: flag_of(name, cls))) from e
