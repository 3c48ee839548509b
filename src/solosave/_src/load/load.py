"""Loading: DCP's load, with ``.metadata`` read once per process group and unpickled through
the allowlist, local planning, and solosave's own read path.

Who calls what (every rank of ``process_group``, when torch.distributed is initialised), for
a checkpoint with a load index (solosave's own, local): :func:`load` -> every rank opens the
index, builds the ``Metadata`` of its own shards from it and loads them (:func:`_load_local`)
-> one 8-byte ``all_reduce`` whose two bits say whether every rank loaded and whether every
rank had a usable index; only if a rank failed, an ``all_gather_object`` of the errors; only if
a rank had no usable index, the ``.metadata`` path below for the ranks that did not load. Before
its reads, each pass of a load with two or more ranks (unless ``cooperative=False``) runs the
steps of a cooperative load on every rank (:mod:`solosave._src.load.cooperative`: a 32 KiB
``all_reduce`` sketch; only where ranges are shared, an ``all_gather_object`` and, per round, an
agreement and point-to-point transfers); a rank that reads nothing in that pass takes part as
one that stands aside. For
any other checkpoint: :func:`load` -> the coordinator (group rank 0) reads ``.metadata`` from storage and broadcasts
its bytes (or the reason it could not) in one ``broadcast_object_list`` through
:class:`~solosave._src.coordination.channel.Channel` -> every rank unpickles them (allowlisted), so storage
sees one read of ``.metadata`` per load instead of one per rank (at W=4096 that file is about
114 MiB, see docs/benchmarks.md) -> every rank plans its reads alone and reads them
(:func:`_load_local`: DCP's planner and reader interfaces, the steps ``dcp.load`` runs with
``no_dist=True``; :class:`SafeFileSystemReader` reads through :mod:`solosave._src.load.read_path`) -> one
8-byte ``all_reduce`` (gloo) says whether any rank failed; if one did, an ``all_gather_object``
of each rank's error, so that every rank raises the same one.

Stock DCP's collective load gathers every rank's load plan to rank 0 and scatters it back
although its default global step returns the plans unchanged: with many small tensors that
pickling and moving is a large part of a load (docs/benchmarks.md, section 4). A
planner with a global step of its own still goes through ``dcp.load`` (:func:`_dcp_load`).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.futures import Future

from solosave._src.coordination.channel import DistChannel
from solosave._src.coordination.status import save_identity
from solosave._src.core.errors import (
    CorruptCheckpointError,
    FailedElsewhere,
    IndexUnusable,
    OutOfStep,
    PreparedMetadataError,
    UnsafeMetadataError,
)
from solosave._src.core.gc_pause import gc_paused
from solosave._src.formats.dcp import METADATA_FILE, check_ranges, local_file_problem
from solosave._src.formats.metadata_check import loads_metadata
from solosave._src.index.reader import LoadIndex, wanted_of
from solosave._src.load.cooperative import Cooperation
from solosave._src.load.range_read import read_items_by_ranges
from solosave._src.load.read_path import ReadStats, damaged_record, read_items
from solosave._src.load.result import LoadResult
from solosave._src.load.whole_reads import WholeRead, keeps_default, planning_the_rest, reads_in_place, whole_reads
from solosave._src.storage.base import Storage
from solosave._src.storage.dcp_filesystem import DcpFileSystem
from solosave._src.storage.registry import backend_for, storage_for
from solosave._src.tiers.choice import choose_copy
from solosave._src.tiers.paths import durable_copy_of
from solosave._src.tiers.peer_repair import fetch_for_load, restore_from_peers

log = logging.getLogger(__name__)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor records are unpickled with
    ``torch.load(weights_only=True)``: only torch's safe types, ``io.BytesIO`` (DCP's default
    planner saves a ``BytesIO`` value pickled whole) and the classes in ``safe_globals`` (the
    caller's own, trusted types) can be loaded; a crafted record that names anything else
    raises :class:`~solosave.UnsafeMetadataError` and executes nothing."""

    def __init__(self, safe_globals: Sequence[Any] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.safe_globals = [io.BytesIO, *safe_globals]

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            with torch.serialization.safe_globals(self.safe_globals):
                obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeMetadataError(
                f"refusing to load the record of {fqn!r}: {str(e).splitlines()[0]} Nothing was executed. If "
                "the checkpoint is yours and holds your own classes, pass them as "
                "solosave.load(..., safe_globals=[YourClass])") from None
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.load's many ways of meeting damaged bytes
            raise damaged_record(fqn, e) from None
        if self.flatten_state_dict:
            _set_at(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose ``read_metadata`` refuses pickles outside the allowlist and
    explains a missing or corrupt ``.metadata``, and whose ``read_data`` first checks that every
    byte range this rank will read lies inside its data file (a truncated or missing ``.distcp``
    raises :class:`~solosave.CorruptCheckpointError` instead of yielding garbage), then reads
    them in one pass per file (:mod:`solosave._src.load.read_path`)."""

    def read_data(self, plan: Any, planner: Any, whole: Sequence[tuple[WholeRead, Any]] = ()) -> Any:
        """DCP's interface; ``whole``: reads planned without DCP's planner (``(WholeRead,
        storage entry)``, :func:`_load_local` with a load index; needs ``fast_read``)."""
        needed = _needed(self.path, self.storage_data, plan)
        needed.update((MetadataIndex(read.fqn), info) for read, info in whole)
        problems = check_ranges(self.path, needed)
        if problems:
            _take_part(self.cooperation, failed=True)
            raise CorruptCheckpointError(
                f"checkpoint {os.fspath(self.path)} is damaged: {'; '.join(problems)}. Load an "
                "earlier checkpoint; `solosave verify` lists every problem.", problems)
        if not self.fast_read or any(getattr(info, "transform_descriptors", None) for info in needed.values()):
            if whole:
                raise AssertionError("internal: whole reads need the fast read path")
            _take_part(self.cooperation, failed=False)  # DCP's own path reads alone
            t0 = time.perf_counter()
            done = super().read_data(plan, planner)  # DCP's own path (stream transforms)
            self._count(_dcp_read_stats(needed), t0)
            return done
        t0 = time.perf_counter()
        self._count(read_items(self.path, plan.items, self.storage_data, planner, whole, self.cooperation), t0)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    #: Read with :func:`solosave._src.load.read_path.read_items` (one pass per file, payloads straight into
    #: the targets); ``False``: DCP's ``FileSystemReader.read_data`` (one ``torch.load`` per record).
    fast_read: bool = True
    #: What the last ``read_data`` did (``None`` before one).
    last_read_stats: ReadStats | None = None
    #: What every ``read_data`` of this reader did, with how long each took (the cooperative
    #: part included): one per load pass.
    reads: tuple[tuple[ReadStats, float], ...] = ()

    def _count(self, stats: ReadStats, t0: float) -> None:
        self.last_read_stats = stats
        self.reads = (*self.reads, (stats, time.perf_counter() - t0))
    #: Set by :func:`load` for one pass: ``read_data`` takes part in this cooperative load
    #: (:mod:`solosave._src.load.cooperative`; every rank of the load, once).
    cooperation: Cooperation | None = None

    #: ``.metadata`` parsed before DCP's load started (see :func:`load`); ``None``: read the
    #: file here (a reader used with stock ``dcp.load``).
    metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self.metadata
        if md is None:
            md = parse_metadata(read_metadata_bytes(self.path), self.path)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeStorageReader(SafeFileSystemReader):
    """:class:`SafeFileSystemReader` for a storage without
    :attr:`~solosave._src.storage.base.Storage.local_files` (a URL: ``s3://bucket/run/iter_0000100``):
    the same checks, through the backend (``storage_options``: keyword arguments of its client);
    the records are read with concurrent ranged reads straight into the targets
    (:mod:`solosave._src.load.range_read`), or, with ``fast_read = False`` or records that need
    DCP's stream transforms, by DCP's read path over
    :class:`~solosave._src.storage.dcp_filesystem.DcpFileSystem`."""

    def __init__(self, path: str, storage_options: Mapping[str, Any] | None = None,
                 storage: Storage | None = None) -> None:
        super().__init__(path)
        self.storage = storage if storage is not None else storage_for(path, storage_options)
        self.storage_options = storage_options
        # DCP's read path calls only FileSystemBase's methods on it, which DcpFileSystem implements
        self.fs = DcpFileSystem(self.storage)  # type: ignore[assignment]
        self.path = self.fs.init_path(path)

    def read_data(self, plan: Any, planner: Any, whole: Sequence[tuple[WholeRead, Any]] = ()) -> Any:
        needed = _needed(self.path, self.storage_data, plan)
        needed.update((MetadataIndex(read.fqn), info) for read, info in whole)
        try:
            problems = check_ranges(self.path, needed, size_of=self._sizes())
        except Exception:
            _take_part(self.cooperation, failed=True)
            raise
        if problems:
            _take_part(self.cooperation, failed=True)
            raise CorruptCheckpointError(
                f"checkpoint {self.path} is damaged: {'; '.join(problems)}. Load an earlier checkpoint; "
                "`solosave verify` lists every problem.", problems)
        if not self.fast_read or any(getattr(info, "transform_descriptors", None) for info in needed.values()):
            if whole:
                raise AssertionError("internal: whole reads need the fast read path")
            _take_part(self.cooperation, failed=False)  # DCP's own path reads alone
            t0 = time.perf_counter()
            done = FileSystemReader.read_data(self, plan, planner)
            self._count(_dcp_read_stats(needed), t0)
            return done
        t0 = time.perf_counter()
        self._count(read_items_by_ranges(self.storage, os.fspath(self.path), plan.items, self.storage_data,
                                         planner, whole, cooperation=self.cooperation), t0)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is None:
            self.metadata = parse_metadata(read_metadata_bytes(self.path, self.storage_options), self.path)
        return super().read_metadata(*args, **kwargs)

    def _sizes(self) -> Any:
        """``size_of(path)`` of :func:`check_ranges` from one listing of the checkpoint."""
        try:
            sizes = self.storage.sizes(os.fspath(self.path))
        except FileNotFoundError:
            sizes = {}

        def size_of(path: str) -> int:
            name = self.storage.basename(path)
            if name not in sizes:
                raise FileNotFoundError(path)
            return sizes[name]

        return size_of


def _needed(path: Any, storage_data: Mapping[Any, Any], plan: Any) -> dict[Any, Any]:
    """The storage entry of every item of ``plan``; a chunk that ``.metadata`` declares
    without an entry is a damaged checkpoint."""
    try:
        return {item.storage_index: storage_data[item.storage_index] for item in plan.items}
    except KeyError as e:
        raise CorruptCheckpointError(
            f"checkpoint {os.fspath(path)} is damaged: its {METADATA_FILE} declares {e.args[0]} but has no storage "
            "entry for it. Load an earlier checkpoint; `solosave verify` lists every problem.") from None


def _dcp_read_stats(needed: Mapping[Any, Any]) -> ReadStats:
    """What DCP's own read path reads for ``needed`` (each record's range, once)."""
    return ReadStats(files=len({info.relative_path for info in needed.values()}),
                     bytes_read=sum(int(info.length) for info in needed.values()))


def _take_part(coop: Cooperation | None, failed: bool) -> None:
    """A rank that does not read through ``coop`` in this pass still takes part in it, once
    (as a rank that failed, or one that reads alone): no other rank waits for it. A broken
    channel here is logged: the load's own agreement reports it."""
    if coop is None or coop.entered:
        return
    try:
        coop.abstain() if failed else coop.stand_aside()
    except FailedElsewhere:
        pass  # another rank's failure: the load's agreement reports it
    except Exception as e:  # noqa: BLE001 - the load already has its outcome; the agreement follows
        log.warning("solosave.load: taking part in the cooperative load failed on this rank: %s", e)


def _set_at(root: Any, path: Sequence[Any], value: Any) -> None:
    """Put ``value`` at the object path ``path`` of nested dicts and lists (DCP's flattening
    paths), creating containers on the way as DCP does."""
    node = root
    for key, nxt in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def parse_metadata(data: bytes, directory: str | os.PathLike) -> Metadata:
    """Unpickle ``.metadata`` bytes through the allowlist and check their shape
    (:func:`~solosave._src.formats.metadata_check.loads_metadata`); a clear
    :class:`~solosave.PreparedMetadataError` if they are not a DCP ``Metadata`` its loaders can use."""
    with gc_paused():  # tens of thousands of small objects, no cycles: see gc_paused
        return loads_metadata(data, os.path.join(os.fspath(directory), METADATA_FILE))


def read_metadata_bytes(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The bytes of ``<path>/.metadata`` (a local path or a URL): ``FileNotFoundError`` if there is
    no such directory, :class:`~solosave.PreparedMetadataError` if the checkpoint is not published."""
    st = storage_for(path, storage_options)
    directory = os.fspath(path)
    file = st.join(directory, METADATA_FILE)
    why = local_file_problem(directory, file)  # local files only: a URL is never found there
    if why is not None:
        raise PreparedMetadataError(f"{file}: {why}; refusing to read it (every file read must lie inside the "
                                    "checkpoint directory)")
    try:  # the file first: one request where listing a directory costs another
        return st.read(file)
    except (FileNotFoundError, NotADirectoryError):
        pass
    if not st.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    raise PreparedMetadataError(
        f"{directory}: no {METADATA_FILE}; this is not a published checkpoint (a failed or unfinished save "
        "leaves none). Load an earlier checkpoint.")


def _share_metadata(path: str | os.PathLike, process_group: Any,
                    storage_options: Mapping[str, Any] | None = None) -> bytes:
    """Group rank 0 reads ``.metadata``; every rank receives its bytes or raises rank 0's error."""
    ch = DistChannel(process_group)
    payload: tuple[str, Any] | None = None
    if ch.is_coordinator:
        try:
            payload = ("ok", read_metadata_bytes(path, storage_options))
        except Exception as e:  # noqa: BLE001 - every rank receives it (the others wait in the broadcast)
            payload = (type(e).__name__, str(e))
    kind, value = ch.broadcast_object(payload)
    if kind == "ok":
        return value
    if kind == "FileNotFoundError":
        raise FileNotFoundError(value)
    raise PreparedMetadataError(f"{value} (read by rank 0)")


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group: Any = None,
         planner: Any = None, read_metadata_once: bool = True, safe_globals: Sequence[Any] = (),
         storage_options: Mapping[str, Any] | None = None, use_index: bool = True,
         durable_root: str | os.PathLike | None = None, ranks_per_host: int = 0,
         cooperative: bool | None = None) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state_dict`` in place.

    Collective over ``process_group`` when torch.distributed is initialised; one process
    otherwise.

    Resharding works as in DCP: tensors and DTensors receive the chunks they cover, whatever the
    world size the checkpoint was saved at. ``read_metadata_once``: group rank 0 reads
    ``.metadata`` and broadcasts it (one storage read per load); ``False``: every rank reads it,
    as stock DCP does. Errors are the same on every rank and derive from ``Exception``: a
    missing or unpublished checkpoint, or an unsafe ``.metadata``, raises solosave's own error
    before DCP's load starts. Loading is safe against crafted checkpoints: ``.metadata`` is
    unpickled through an allowlist, non-tensor records with ``torch.load(weights_only=True)``
    (extend what they may hold with ``safe_globals``; a custom ``planner`` decides for itself),
    and every file read must lie inside the checkpoint directory. Top-level values with
    ``load_state_dict()`` (modules, optimizers) are loaded into, as DCP does.

    Each rank plans its reads alone (unless ``planner`` has a global step of its own) and reads
    each data file in one pass, tensor bytes straight into the target tensors
    (:mod:`solosave._src.load.read_path`). With ``use_index`` (the default), a checkpoint that
    solosave wrote is loaded through its load index (``.solosave-index``): each rank reads the
    entries its own shards need, not the whole ``.metadata``; a stale or damaged index is
    ignored with a warning. Collectives: the module docstring says which, in which order.

    ``path`` may be a URL (``s3://bucket/run/iter_0000100``; ``pip install 'solosave[s3]'``),
    with ``storage_options`` handed to its fsspec filesystem; its records are read by DCP's read
    path, with the same checks.

    ``durable_root`` (two tiers, ``CheckpointerOptions.durable_root``): ``path`` names the fast
    copy and ``<durable_root>/<name>`` the durable one; the fast copy is loaded when every rank
    finds it complete and the same checkpoint (its ``save_id``), else the durable one, on every
    rank (:mod:`solosave._src.tiers.choice`: one or two more 8-byte ``all_reduce``). A fast copy
    found damaged while loading (a truncated or unreadable file, on any rank) is followed by a
    load of the durable copy, on every rank.

    ``ranks_per_host`` (saved with ``peer_copies``, fast tiers local to each host): hosts that miss
    part of ``path`` get it back from the hosts that hold it, then the files this rank reads that
    its host does not keep come from those that do, or from the durable copy where no survivor
    holds them (:mod:`solosave._src.tiers.peer_repair`).

    ``cooperative``: each byte range of at least 64 KiB that several ranks need (replicas, or
    resharding) is read from storage by one of them and delivered to the others over
    ``process_group``, in rounds of at most 256 MiB per rank (:mod:`solosave._src.load.cooperative`).
    ``None`` (default): on for a URL; on local files only when the ranks span two or more hosts
    (ranks of one host share its page cache). ``True``: between any ranks; ``False``: off. Costs
    one 32 KiB ``all_reduce`` (then nothing else when nothing is shared), else an
    ``all_gather_object`` of the shared keys and one agreement per round.

    Returns a :class:`~solosave.LoadResult`: the path loaded from (a ``str``: with two tiers, the
    copy loaded), with what this rank read, received and sent, files opened, seconds per phase.
    """
    distributed = dist.is_available() and dist.is_initialized()
    peers = ranks_per_host if distributed else 0
    if peers:
        backend = backend_for(path)
        name = backend.basename(backend.normalize(path))
        restore_from_peers(backend.dirname(backend.normalize(path)), {0: name}, peers, process_group,
                           storage_options, durable_root)
    args = (process_group, planner, read_metadata_once, safe_globals, storage_options, use_index, distributed,
            cooperative)
    chosen = path if durable_root is None else choose_copy(path, durable_root, process_group, storage_options)
    durable = None if durable_root is None else durable_copy_of(path, durable_root)
    if peers and chosen != durable:
        _fetch_from_peers(state_dict, chosen, peers, process_group, storage_options)
    if durable is None:
        return _load(state_dict, path, *args)
    try:
        return _load(state_dict, chosen, *args)
    except OutOfStep:
        raise
    except Exception as e:  # noqa: BLE001 - every rank fails alike (the load agreed): every rank retries
        if chosen == durable:
            raise
        log.warning("solosave.load: the fast copy %s could not be read (%s); loading the durable copy %s",
                    chosen, e, durable)
        return _load(state_dict, durable, *args)


def _fetch_from_peers(state_dict: dict[str, Any], path: str | os.PathLike, ranks_per_host: int,
                      process_group: Any, storage_options: Mapping[str, Any] | None) -> None:
    """Peer copies on more hosts than copies + 1: bring the files this rank's load reads to its
    host from the hosts that hold them (:func:`~solosave._src.tiers.peer_repair.fetch_for_load`;
    every rank). A failure is logged: the load then finds the file missing and says so, or,
    with two tiers, reads the durable copy."""
    st = storage_for(path, storage_options)
    directory = st.normalize(path)
    error = fetch_for_load(directory, _files_read(state_dict, directory, st), ranks_per_host, process_group,
                           storage_options)
    if error is not None:
        log.warning("solosave.load: fetching the files of %s that this host does not hold failed: %s",
                    directory, error)


def _files_read(state_dict: dict[str, Any], directory: str, st: Storage) -> set[str]:
    """The data files this rank's load of ``state_dict`` reads (from the load index; every file
    the checkpoint names when the index cannot say)."""
    try:
        idx = LoadIndex.open(directory, st)
    except (IndexUnusable, OSError):
        idx = None
    if idx is None:  # every file .metadata names (unreadable: the load says why)
        try:
            md = parse_metadata(st.read(st.join(directory, METADATA_FILE)), directory)
        except Exception:  # noqa: BLE001 - reported by the load itself
            return set()
        return {info.relative_path for info in (md.storage_data or {}).values()}
    try:
        planner = DefaultLoadPlanner()
        sd = {k: v.state_dict() if _is_stateful(v) else v for k, v in state_dict.items()}
        planner.set_up_planner(sd, _EMPTY, False)  # flattens: the keys to look up
        md = idx.metadata_for(wanted_of(planner.state_dict))
        return {info.relative_path for info in md.storage_data.values()}
    except Exception:  # noqa: BLE001 - the load itself reports what is wrong with the index
        return set(idx.files)
    finally:
        idx.close()


def _load(state_dict: dict[str, Any], path: str | os.PathLike, process_group: Any, planner: Any,
          read_metadata_once: bool, safe_globals: Sequence[Any], storage_options: Mapping[str, Any] | None,
          use_index: bool, distributed: bool, cooperative: bool | None = None) -> LoadResult:
    """:func:`load` from ``path`` (its tier chosen); returns what this rank did."""
    t0 = time.perf_counter()
    storage = storage_for(path, storage_options)
    reader = (SafeFileSystemReader(path) if storage.local_files
              else SafeStorageReader(os.fspath(path), storage_options, storage=storage))  # DCP's read path
    if planner is None:
        planner = SafeLoadPlanner(safe_globals)
    local = not distributed or _plans_locally(planner)
    rank = dist.get_rank(process_group) if distributed else 0
    coops: list[Cooperation] = []

    def cooperation() -> Cooperation | None:  # one per pass, the same decision on every rank
        if cooperative is False or not distributed or not local or dist.get_world_size(process_group) < 2:
            return None
        scope = "all" if cooperative or not storage.local_files else "hosts"
        coops.append(Cooperation(DistChannel(process_group), scope))
        return coops[-1]

    def result() -> LoadResult:
        return _result(path, rank, reader, coops, time.perf_counter() - t0)

    loaded: bool | None = False
    if use_index and local and storage.load_index and _index_planner(planner):
        loaded = _via_index(state_dict, path, reader, planner, rank, process_group, distributed, storage,
                            cooperation())
        if loaded is None:
            return result()
    error: Exception | None = None
    if not local:
        reader.metadata = _metadata(path, distributed and read_metadata_once, process_group, storage_options)
        _dcp_load(state_dict, reader, planner, process_group)
        return result()
    coop = cooperation()
    try:
        if not loaded:
            reader.metadata = _metadata(path, distributed and read_metadata_once, process_group, storage_options)
            error = _local(state_dict, reader, planner, rank, None, coop)
        elif read_metadata_once:  # the broadcast is a collective: take part, parse nothing
            _share_metadata(path, process_group, storage_options)
    except Exception as e:  # noqa: BLE001 - every rank learns it below, then raises it
        error = e
    _take_part(coop, failed=error is not None)  # loaded already, or failed before reading
    if distributed:
        error = _agree(error, process_group)
    if error is not None:
        raise error
    return result()


def _result(path: str | os.PathLike, rank: int, reader: SafeFileSystemReader, coops: Sequence[Cooperation],
            seconds: float) -> LoadResult:
    """This rank's :class:`LoadResult` of a load from ``path``."""
    own = [stats for stats, _ in reader.reads]
    shared = [c.stats for c in coops]
    return LoadResult(
        os.fspath(path), rank=rank,
        bytes_read=sum(o.bytes_read for o in own) + sum(c.bytes_read for c in shared),
        bytes_received=sum(c.bytes_received for c in shared), bytes_sent=sum(c.bytes_sent for c in shared),
        files_opened=sum(o.files for o in own) + sum(c.files_opened for c in shared),
        shared_ranges=max((c.shared_ranges for c in shared), default=0), rounds=sum(c.rounds for c in shared),
        seconds={"total": seconds,
                 "read": max(0.0, sum(t for _, t in reader.reads) - sum(c.seconds_read + c.seconds_exchange
                                                                         + c.seconds_decode for c in shared)),
                 "shared_read": sum(c.seconds_read for c in shared),
                 "exchange": sum(c.seconds_exchange for c in shared),
                 "shared_decode": sum(c.seconds_decode for c in shared)})


def _via_index(state_dict: dict[str, Any], path: str | os.PathLike, reader: SafeFileSystemReader, planner: Any,
               rank: int, process_group: Any, distributed: bool, storage: Storage,
               coop: Cooperation | None = None) -> bool | None:
    """Load through this rank's load index, if it has a usable one, then agree: ``None`` when
    the load is complete on every rank; otherwise whether this rank loaded (some rank had no
    usable index: the ``.metadata`` path follows on every rank). Raises the agreed error."""
    error: Exception | None = None
    loaded = False
    idx = _open_index(reader.path if not storage.local_files else path, storage)
    if idx is not None:
        try:
            error, loaded = _local(state_dict, reader, planner, rank, idx, coop), True
        finally:
            idx.close()
        if isinstance(error, IndexUnusable):  # found while looking up this rank's entries: before any read
            log.warning("solosave.load: not using the load index: %s; reading the whole %s", error, METADATA_FILE)
            error, loaded = None, False
        elif error is not None and not isinstance(error, FailedElsewhere) and _index_disagrees(path, storage):
            # an index that disagrees with its own .metadata (a size, an offset) fails as if the
            # data were bad: .metadata settles it (where they agree, the error stands)
            log.warning("solosave.load: the load index of %s disagrees with its %s (%s); reading the whole %s",
                        os.fspath(path), METADATA_FILE, error, METADATA_FILE)
            error, loaded = None, False
    else:
        _take_part(coop, failed=False)  # no usable index here: this rank reads in the next pass
    if not distributed:
        if error is not None:
            raise error
        return None if loaded else False
    # One agreement for both questions: did every rank load, and did every rank have a usable
    # index? Bit 0: no error here; bit 1: loaded through the index.
    both = DistChannel(process_group).agree_flags(int(error is None) | int(loaded) << 1,
                                                  save_identity(0, backend_for(path).normalize(path)))
    if both is None:
        raise OutOfStep(f"solosave.load: the ranks are not all loading {os.fspath(path)} (call it on every rank "
                        "of the process group, with the same checkpoint)")
    if not both & 1:
        error = _agree(error, process_group, known_failed=True)
        raise error if error is not None else RuntimeError("internal: a rank failed to load and reported no error")
    return None if both & 2 else loaded


def _index_disagrees(path: str | os.PathLike, storage: Storage) -> bool:
    """After a load through the index failed (the failure path only): whether the load index's
    entries differ from ``.metadata``'s (both read again here, every key, every chunk). ``False``
    when they agree or either cannot be read (the error stands)."""
    try:
        directory = storage.normalize(path)
        whole = parse_metadata(storage.read(storage.join(directory, METADATA_FILE)), path)
        idx = LoadIndex.open(directory, storage)
    except Exception:  # noqa: BLE001 - nothing to settle it with: the index's error stands
        return False
    if idx is None:
        return False
    try:
        part = idx.metadata_for({k: None for k in whole.state_dict_metadata})
    except Exception:  # noqa: BLE001 - an index that cannot give the entries disagrees
        return True
    finally:
        idx.close()
    for key, full in whole.state_dict_metadata.items():
        md = part.state_dict_metadata.get(key)
        if md is None or type(full) is not type(md) or getattr(full, "size", None) != getattr(md, "size", None):
            return True
        if ({(tuple(c.offsets), tuple(c.sizes)) for c in getattr(full, "chunks", ())}
                != {(tuple(c.offsets), tuple(c.sizes)) for c in getattr(md, "chunks", ())}):
            return True
    stored, mine = whole.storage_data or {}, part.storage_data or {}
    return len(stored) != len(mine) or any(
        mine.get(k) is None or (mine[k].relative_path, mine[k].offset, mine[k].length)
        != (v.relative_path, v.offset, v.length) for k, v in stored.items())


def _metadata(path: str | os.PathLike, once: bool, process_group: Any,
              storage_options: Mapping[str, Any] | None) -> Metadata:
    """``.metadata``, read and parsed before DCP's load (DCP would swallow a reader's error into
    its own "metadata is None" AssertionError when it falls back to per-rank metadata); with
    ``once``, read by group rank 0 and broadcast (a collective)."""
    data = _share_metadata(path, process_group, storage_options) if once else read_metadata_bytes(path, storage_options)
    return parse_metadata(data, path)


def _local(state_dict: dict[str, Any], reader: SafeFileSystemReader, planner: Any, rank: int,
           idx: LoadIndex | None, coop: Cooperation | None = None) -> Exception | None:
    """:func:`_load_local`, its error returned (every rank learns it before any raises). With
    ``coop``, this rank takes part in that cooperative load once, whatever happens: through its
    read, or, where it failed before reading, as a failed rank (an unusable index: as one that
    reads nothing in this pass, since it will load from ``.metadata`` next)."""
    reader.cooperation = coop
    try:
        with gc_paused():
            _load_local(state_dict, reader, planner, rank, idx)
    except Exception as e:  # noqa: BLE001 - every rank learns it, then raises it
        _take_part(coop, failed=not isinstance(e, IndexUnusable))
        return e
    finally:
        reader.cooperation = None
    _take_part(coop, failed=False)
    return None


def _index_planner(planner: Any) -> bool:
    """Whether ``planner`` can plan from a partial ``Metadata`` (:mod:`solosave._src.index.writer`): DCP's
    default load planner's set-up, which only stores the metadata for ``create_local_plan``."""
    return keeps_default(planner, "set_up_planner")


def _open_index(path: str | os.PathLike, storage: Storage) -> LoadIndex | None:
    """This rank's open load index of ``path``, or ``None`` (none, or unusable: logged)."""
    try:
        return LoadIndex.open(path, storage)
    except IndexUnusable as e:
        log.warning("solosave.load: not using the load index: %s; reading the whole %s", e, METADATA_FILE)
    except OSError as e:
        log.warning("solosave.load: cannot read the load index of %s (%s); reading the whole %s",
                    os.fspath(path), e, METADATA_FILE)
    return None


def _plans_locally(planner: Any) -> bool:
    """Whether ``planner`` leaves the global step of a load to DCP's default, a pass-through
    (``create_default_global_load_plan`` returns the local plans unchanged): then each rank
    can plan alone, and the plans need not travel to rank 0 and back."""
    return keeps_default(planner, "create_global_plan", "finish_plan")


def _is_stateful(value: Any) -> bool:
    """DCP's ``Stateful`` test (both methods present), without its ``runtime_checkable``
    protocol check, which is slow enough per key to count in a load of many small tensors."""
    return (not isinstance(value, torch.Tensor) and hasattr(value, "state_dict")
            and hasattr(value, "load_state_dict"))


def _load_local(state_dict: dict[str, Any], reader: SafeFileSystemReader, planner: Any, rank: int,
                index: LoadIndex | None = None) -> None:
    """DCP's load steps on this rank alone, through the public planner and reader interfaces
    (what ``dcp.load`` runs with ``no_dist=True``): top-level ``Stateful`` values are loaded
    through their ``state_dict()``, then ``load_state_dict()``, as DCP does. With ``index``, the
    metadata is the part of the checkpoint's that this rank's (flattened) keys need."""
    keys = sorted(state_dict)
    stateful = {k for k in keys if _is_stateful(state_dict[k])}
    sd = {k: state_dict[k].state_dict() if k in stateful else state_dict[k] for k in keys}
    whole: list[tuple[WholeRead, Any]] = []
    if index is not None:
        planner.set_up_planner(sd, _EMPTY, rank == 0)  # flattens: the keys to look up
        if reader.fast_read and reads_in_place(planner):
            whole = whole_reads(planner.state_dict, index)
    with planning_the_rest(planner, whole):
        if index is not None:
            reader.metadata = index.metadata_for(wanted_of(planner.state_dict))
            planner.metadata = reader.metadata
            md = reader.read_metadata()
        else:
            md = reader.read_metadata()
            planner.set_up_planner(sd, md, rank == 0)
        reader.set_up_storage_reader(md, rank == 0)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
        plan = planner.finish_plan(plan)
        (reader.read_data(plan, planner, whole) if whole else reader.read_data(plan, planner)).wait()
    for k in keys:
        if k in stateful:
            state_dict[k].load_state_dict(sd[k])
        else:
            state_dict[k] = sd[k]


_EMPTY = Metadata(state_dict_metadata={})


_OURS = (CorruptCheckpointError, PreparedMetadataError, UnsafeMetadataError)


def _agree(error: Exception | None, process_group: Any, known_failed: bool = False) -> Exception | None:
    """Every rank returns the same error (``None``: every rank loaded): solosave's own errors
    first, then the lowest failing rank's. One 8-byte agreement says whether any rank failed
    (``DistChannel.all_and``; skipped when it is ``known_failed``); only then the errors travel
    in an ``all_gather_object``."""
    ch = DistChannel(process_group)
    mine: Exception | None = error
    if error is not None:
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:  # noqa: BLE001 - an exception that does not travel: send its text
            mine = RuntimeError(f"{type(error).__name__}: {error}")
    failed = sorted(ch.agree_ok(mine, known_failed).items())
    if not failed:
        return None
    rank, exc = min(failed, key=lambda f: (isinstance(f[1], FailedElsewhere), not isinstance(f[1], _OURS), f[0]))
    return error if rank == ch.rank else exc


def _dcp_load(state_dict: dict[str, Any], reader: SafeFileSystemReader, planner: Any, process_group: Any) -> None:
    """DCP's collective load, for a planner with its own global step; its errors unwrapped."""
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)
    except CheckpointException as e:
        # DCP wraps each rank's exception in a BaseException; re-raise the underlying one (ours
        # first: they are the same on every rank) so that ``except Exception`` sees it.
        inner = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        for exc in inner:
            if isinstance(exc, _OURS):
                raise exc from e
        for exc in inner:
            if isinstance(exc, Exception):
                raise exc from e
        raise
