"""The read path of :func:`solosave.load` for storage that is not local files (a URL: S3, ...):
concurrent ranged reads, each copied once, from the response, into the target tensors.

Called by :meth:`solosave._src.load.load.SafeStorageReader.read_data` (every rank, once per load,
on the loading thread, after DCP's planning and after the byte ranges were checked) as
:func:`read_items_by_ranges`. It decodes records exactly as the local read path does
(:mod:`solosave._src.load.read_path`: its ``_Loader``, the same checks, the same security), but
each read is a :meth:`~solosave._src.storage.base.Storage.read_range` or
:meth:`~solosave._src.storage.base.Storage.read_range_into` (one ranged GET on an object store),
and the reads run ``CONCURRENCY`` at a time on a thread pool.

On an object store every request costs a round trip whatever its size (and the S3 test server
even reads the whole object per request), so the records are read in few large requests:

1. per file, the records this rank needs, coalesced into spans of whole records (a span ends
   once it holds ``SPAN_BYTES``, or at a gap of more than ``GAP_MAX``), fetched concurrently
   with at most ``CONCURRENCY`` spans and ``SPAN_BUDGET`` bytes in flight or in memory, and
   decoded in file order as they arrive: each payload is copied from the response straight into
   its target (the one copy a client that returns bytes allows), or through ``copy_`` where it
   needs converting;
2. a tensor record of at least ``HUGE_BYTES`` is not held in memory: its head and tail (``PEEK``
   bytes each, to decode it) are fetched first, then its payload in parts of ``PART_BYTES``,
   read concurrently straight into the target's memory at their offsets
   (:meth:`~solosave._src.storage.base.Storage.read_range_into`), then committed in file order.

Memory beyond the targets: ``SPAN_BUDGET`` (or one span, if larger) and the parts in flight.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.autograd.graph import increment_version

from solosave._src.core.errors import CorruptCheckpointError
from solosave._src.load.read_path import (
    GAP_MAX,
    PEEK,
    ReadStats,
    _FileRecord,
    _Loader,
    _Record,
    _records_by_file,
    _SpanRecord,
)
from solosave._src.load.whole_reads import WholeRead
from solosave._src.storage.base import Storage

if TYPE_CHECKING:
    from solosave._src.load.cooperative import Cooperation

#: Ranged reads in flight at once.
CONCURRENCY = 16
#: A span of whole records ends once it holds this many bytes (one request each).
SPAN_BYTES = 16 << 20
#: Bytes of spans fetched ahead or held at once (one span at least).
SPAN_BUDGET = 256 << 20
#: A tensor record at least this long is read straight into its target, in parts.
HUGE_BYTES = 128 << 20
#: Largest part of such a read.
PART_BYTES = 16 << 20


def _extent(records: list[_Record]) -> int:
    """Bytes from the first record of a span to the end of its last."""
    return max(r.offset + r.length for r in records) - records[0].offset


def _view(address: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(address)).cast("B")


class _RangeRecord(_FileRecord):
    """A huge record of a file of the storage: its two ends fetched ahead, the rest read on
    demand with a ranged read."""

    def __init__(self, loader: _RangeLoader, path: str, rec: _Record, head: bytes, tail: bytes) -> None:
        self.loader, self.path, self.stats = loader, path, loader.stats
        self.offset, self.length = rec.offset, rec.length
        self.head, self.tail = memoryview(head), memoryview(tail)
        self.tail_at = rec.length - len(tail)

    def get(self, off: int, n: int) -> Any:
        if off + n <= len(self.head):
            return self.head[off:off + n]
        if off >= self.tail_at:
            return self.tail[off - self.tail_at:off - self.tail_at + n]
        return self.loader.read(self.path, self.offset + off, n)

    def place(self, address: int, start: int, n: int) -> None:
        self.loader.read_into(self.path, self.offset + start, _view(address, n))

    def whole(self) -> bytes:
        return self.loader.read(self.path, self.offset, self.length)


class _Span:
    """The bytes of a span as the storage returned them, kept as they are (no copy): its records
    are decoded from ``view`` and copied out from ``address``."""

    def __init__(self, start: int, data: bytes) -> None:
        self.start, self.data = start, data
        self.view = memoryview(data)
        self.address = int(np.frombuffer(data, np.uint8).ctypes.data) if data else 0


class _RangeLoader(_Loader):
    """:class:`~solosave._src.load.read_path._Loader` over a storage's ranged reads (see the
    module docstring); ``pool`` runs the reads."""

    def __init__(self, planner: Any, storage: Storage, directory: str, pool: ThreadPoolExecutor) -> None:
        super().__init__(planner)
        self.storage, self.directory, self.pool = storage, directory, pool
        self._path = ""
        self._lock = threading.Lock()  # the stats, counted from the pool's threads

    def _count(self, n: int) -> None:
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += n

    # -- reads (any thread) -----------------------------------------------------------------------
    def read(self, path: str, offset: int, n: int) -> bytes:
        data = self.storage.read_range(path, offset, n)
        if len(data) != n:
            raise CorruptCheckpointError(f"{path} ended at byte {offset + len(data)}, inside a record (it "
                                         "changed while being loaded)")
        self._count(n)
        return data

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        got = self.storage.read_range_into(path, offset, out)
        if got != len(out):
            raise CorruptCheckpointError(f"{path} ended at byte {offset + got}, inside a record (it changed "
                                         "while being loaded)")
        self._count(got)

    # -- the load ---------------------------------------------------------------------------------
    def load(self, files: dict[str, list[_Record]]) -> None:
        paths = {rel: self.storage.join(self.directory, rel) for rel in files}
        ends: dict[int, Future] = {}  # id(record) -> the head and tail of a huge record, every file at once
        for rel, records in files.items():
            for rec in records:
                if rec.is_tensor and rec.length >= HUGE_BYTES:
                    ends[id(rec)] = self.pool.submit(self._ends, paths[rel], rec)
        for rel in sorted(files):
            self.stats.files += 1
            self._path = paths[rel]
            self._file(paths[rel], files[rel], ends)
        self._read_queued(-1)

    def _ends(self, path: str, rec: _Record) -> tuple[bytes, bytes]:
        n = min(PEEK, rec.length)
        return self.read(path, rec.offset, n), self.read(path, rec.offset + rec.length - n, n)

    def _file(self, path: str, records: list[_Record], ends: dict[int, Future]) -> None:
        """One file: its spans (fetched ahead, ``CONCURRENCY`` at most) and huge records,
        decoded in file order."""
        plan: list[tuple[str, Any]] = []  # ("span", [records]) or ("huge", record), in file order
        span: list[_Record] = []
        end = 0
        for rec in records:
            if id(rec) in ends:
                if span:
                    plan.append(("span", span))
                    span = []
                plan.append(("huge", rec))
                continue
            if span and (rec.offset > end + GAP_MAX or end - span[0].offset >= SPAN_BYTES):
                plan.append(("span", span))
                span = []
            if not span:
                end = rec.offset
            span.append(rec)
            end = max(end, rec.offset + rec.length)
        if span:
            plan.append(("span", span))
        spans = deque(i for i, (kind, _) in enumerate(plan) if kind == "span")
        ahead: dict[int, tuple[int, Future]] = {}  # span index -> (its bytes, its fetch)
        for i, (kind, part) in enumerate(plan):
            while spans and len(ahead) < CONCURRENCY and (
                    not ahead or sum(n for n, _ in ahead.values()) + _extent(plan[spans[0]][1]) <= SPAN_BUDGET):
                j = spans.popleft()
                ahead[j] = (_extent(plan[j][1]), self.pool.submit(self._fetch_span, path, plan[j][1]))
            if kind == "huge":
                head, tail = ends.pop(id(part)).result()
                self._record(part, _RangeRecord(self, path, part, head, tail))
                continue
            got: _Span = ahead.pop(i)[1].result()
            for rec in part:
                self._record(rec, _SpanRecord(got.view, got.address, rec.offset - got.start, rec.length))

    def _fetch_span(self, path: str, records: list[_Record]) -> _Span:
        return _Span(records[0].offset, self.read(path, records[0].offset, _extent(records)))

    def _read_queued(self, fd: int) -> None:
        """The queued chunks of huge records, in parts read concurrently straight into their
        targets; then committed in file order. (``fd``: the local path's; not used here.)"""
        queue, self._queued = self._queued, []
        self._queued_storages.clear()
        if not queue:
            return
        parts = []
        for q in queue:
            address = q.target.data_ptr()
            for at in range(0, q.n, PART_BYTES):
                n = min(PART_BYTES, q.n - at)
                parts.append(self.pool.submit(self.read_into, q.path, q.offset + at, _view(address + at, n)))
        errors = []
        for f in parts:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - the first is raised once no read writes any more
                errors.append(e)
        if errors:
            raise errors[0]
        for q in queue:
            increment_version(q.target)  # written behind autograd's back, as copy_ would have noted
            self.stats.direct += 1
            self._commit(q.item, q.target)

    def _queue(self, q: Any) -> None:
        q.path = self._path  # the file it is read from (the local path reads its open file)
        super()._queue(q)


class _StorageRanges:
    """The ``fetch`` of a cooperative load on a storage: a range in concurrent parts of
    ``PART_BYTES``, straight into the buffer."""

    def __init__(self, storage: Storage, directory: str, pool: ThreadPoolExecutor) -> None:
        self.storage, self.directory, self.pool = storage, directory, pool
        self._seen: set[str] = set()

    def __call__(self, rel: str, offset: int, into: Any) -> bool:
        path = self.storage.join(self.directory, rel)
        address, n = into.data_ptr(), into.numel()
        parts = [self.pool.submit(self._part, path, offset + at, _view(address + at, min(PART_BYTES, n - at)))
                 for at in range(0, n, PART_BYTES)]
        errors = [e for f in parts if (e := f.exception()) is not None]  # every part done: none writes on
        if errors:
            raise errors[0]
        opened = rel not in self._seen
        self._seen.add(rel)
        return opened

    def _part(self, path: str, offset: int, out: memoryview) -> None:
        got = self.storage.read_range_into(path, offset, out)
        if got != len(out):
            raise CorruptCheckpointError(f"{path} ended at byte {offset + got}, inside a record (it changed "
                                         "while being loaded)")


def read_items_by_ranges(storage: Storage, directory: str, items: Sequence[Any], storage_data: Mapping[Any, Any],
                         planner: Any, whole: Sequence[tuple[WholeRead, Any]] = (),
                         concurrency: int = CONCURRENCY, cooperation: Cooperation | None = None) -> ReadStats:
    """Load every DCP ``ReadItem`` of ``items`` and every ``(WholeRead, storage entry)`` of
    ``whole`` from the data files of ``directory`` on ``storage`` (see the module docstring).
    With ``cooperation``, ranges that several ranks need first, as in
    :func:`~solosave._src.load.read_path.read_items`."""
    with ThreadPoolExecutor(max(concurrency, 1), thread_name_prefix="solosave-read") as pool:
        loader = _RangeLoader(planner, storage, directory, pool)
        files = _records_by_file(items, storage_data, whole)
        try:
            if cooperation is not None:
                files = cooperation.run(files, _StorageRanges(storage, directory, pool), loader.decode_in_memory,
                                        whole_below=HUGE_BYTES, metadata=getattr(planner, "metadata", None),
                                        checkpoint=directory)
                cooperation.stats.files_opened = len(cooperation.stats.opened - set(files))  # not counted below
            loader.load(files)
        except BaseException:
            loader._queued = []  # nothing more is read into the targets
            raise
    return loader.stats


__all__ = ["CONCURRENCY", "HUGE_BYTES", "PART_BYTES", "SPAN_BYTES", "read_items_by_ranges"]
