"""The read path of :func:`solosave.load`: one pass per data file, few large reads in offset
order, tensor bytes placed straight into the target tensors.

Called by :meth:`solosave._src.load.load.SafeFileSystemReader.read_data` (every rank, once per load, on
the loading thread, after DCP's planning and after the byte ranges were checked) as
:func:`read_items`. Per data file, in file order, the records this rank needs are read:

* a tensor record of at least ``DIRECT_MIN`` bytes: two small reads (its head and tail) to
  decode it (:mod:`solosave._src.formats.record_reader`); its payload is read straight into the target tensor's
  memory when the target is a CPU tensor of the saved dtype and the requested chunk is
  contiguous in both (no intermediate copy): after the file's records are decoded, with one
  ``preadv`` per run of such chunks (the record headers between them go to a scratch buffer).
  Otherwise the chunk's bytes go through a reused scratch buffer (pinned for CUDA targets) and
  ``copy_`` (dtype conversion, resharding along an inner dimension, devices);
* every other record is coalesced with its neighbours into spans of up to ``SPAN_BYTES`` read
  with one ``preadv`` each into a reused buffer, then decoded from memory.

The items come from DCP's planner (``ReadItem``), except where the checkpoint has a load index
and the planner is DCP's default one: then every plain tensor the index shows saved whole, at
its shape, is a :class:`~solosave._src.load.whole_reads.WholeRead` (:mod:`solosave._src.load.whole_reads`), planned
without DCP's per-item objects, and DCP's planner plans the rest. Direct reads wait for the end
of their file if they are whole reads or the planner's ``commit_tensor`` does nothing (DCP's
default); otherwise each chunk is read and committed in turn, as DCP does. A write into a storage
that a waiting read also fills lets the waiting reads go first: aliased targets end as file
order leaves them, as with DCP.

Security is the same as before: tensor records are decoded without unpickling them
generically, a record in any other form is loaded as DCP loads it
(``torch.load(weights_only=True)``), BYTE_IO records go to ``planner.load_bytes`` (solosave's
planner: ``weights_only``), and the files were confined to the checkpoint directory by the
caller. Measured on this machine: docs/benchmarks.md (``python -m benchmarks --only load``).
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.planner import LoadItemType

from solosave._src.core.errors import CorruptCheckpointError, UnsafeMetadataError
from solosave._src.formats.record_reader import RecordCache, Region, TensorLayout, parse_tensor_record
from solosave._src.load.whole_reads import WholeRead, keeps_default

if TYPE_CHECKING:
    from solosave._src.load.cooperative import Cooperation

#: A tensor record at least this long is read on its own, its payload straight into the target.
#: Below it, copying from a coalesced span costs less than the record's own three reads.
DIRECT_MIN = 128 << 10
#: Largest coalesced read (one reused buffer of this size per load).
SPAN_BYTES = 16 << 20
#: Bytes between two records that a span still reads through instead of starting a new read.
GAP_MAX = 64 << 10
#: Largest scratch buffer that is pinned (for a CUDA target): torch's pinned-memory allocator
#: keeps every block it handed out cached for the rest of the process, so a larger record goes
#: through pageable memory (a slower copy) instead of leaving that much pinned memory behind.
PINNED_SCRATCH_MAX = 64 << 20
#: Bytes read from each end of a large record to decode it (its zip headers and ``data.pkl``).
PEEK = 4096
#: At most this many buffers, and about this many bytes, per ``preadv`` of direct chunks (Linux
#: takes up to 1024 buffers, and returns at most about 2 GiB, per call).
IOV_BATCH = 1024
BATCH_BYTES = 1 << 30


@dataclass
class ReadStats:
    """What one :func:`read_items` call did (kept on the reader as ``last_read_stats``)."""

    files: int = 0
    reads: int = 0            # preadv/pread calls
    bytes_read: int = 0
    direct: int = 0           # chunks read straight into their target
    copied: int = 0           # chunks copied from a span into their target (one memmove)
    converted: int = 0        # chunks through the scratch buffer and ``copy_``
    general: int = 0          # tensor records loaded with ``torch.load(weights_only=True)``
    byte_items: int = 0       # BYTE_IO items handed to ``planner.load_bytes``


@dataclass
class _Record:
    offset: int
    length: int
    is_tensor: bool
    items: list[Any] = field(default_factory=list)


def _records_by_file(items: Sequence[Any], storage_data: Mapping[Any, Any],
                     whole: Sequence[tuple[WholeRead, Any]] = ()) -> dict[str, list[_Record]]:
    """Each file's records (one per storage index, with the read items it serves, and one per
    whole read), by offset."""
    by_index: dict[Any, _Record] = {}
    files: dict[str, list[_Record]] = {}
    for read, info in whole:
        files.setdefault(info.relative_path, []).append(
            _Record(int(info.offset), int(info.length), True, [read]))
    for item in items:
        rec = by_index.get(item.storage_index)
        if rec is None:
            info = storage_data[item.storage_index]
            rec = by_index[item.storage_index] = _Record(int(info.offset), int(info.length),
                                                         item.type != LoadItemType.BYTE_IO)
            files.setdefault(info.relative_path, []).append(rec)
        rec.items.append(item)
    for recs in files.values():
        recs.sort(key=lambda r: r.offset)
    return files


def _pread_into(fd: int, address: int, n: int, offset: int, stats: ReadStats) -> None:
    """Read exactly ``n`` bytes at ``offset`` of ``fd`` into memory at ``address``."""
    done = 0
    while done < n:
        chunk = min(n - done, 1 << 30)
        got = os.preadv(fd, [(ctypes.c_char * chunk).from_address(address + done)], offset + done)
        stats.reads += 1
        if got <= 0:
            raise CorruptCheckpointError(f"a data file ended at byte {offset + done}, inside a record "
                                         "(it changed while being loaded)")
        done += got
    stats.bytes_read += n


@dataclass(slots=True)
class _Queued:
    """A chunk to read straight into its target: ``n`` bytes at ``offset`` of the file."""

    offset: int
    n: int
    target: torch.Tensor
    item: Any
    #: The file it is read from, where the reader is not one open file (``load/range_read.py``).
    path: str = ""


class _FileRecord:
    """A large record still on disk: its two ends in memory, the rest read on demand."""

    def __init__(self, fd: int, rec: _Record, stats: ReadStats) -> None:
        self.fd, self.offset, self.length, self.stats = fd, rec.offset, rec.length, stats
        n = min(PEEK, rec.length)
        self.head = memoryview(os.pread(fd, n, rec.offset))
        self.tail_at = rec.length - n
        self.tail = memoryview(os.pread(fd, n, rec.offset + self.tail_at))
        stats.reads += 2
        stats.bytes_read += 2 * n

    def get(self, off: int, n: int) -> Any:
        if off + n <= len(self.head):
            return self.head[off:off + n]
        if off >= self.tail_at:
            return self.tail[off - self.tail_at:off - self.tail_at + n]
        self.stats.reads += 1
        return os.pread(self.fd, n, self.offset + off)

    def place(self, address: int, start: int, n: int) -> None:
        _pread_into(self.fd, address, n, self.offset + start, self.stats)

    def whole(self) -> bytes:
        self.stats.reads += 1
        return os.pread(self.fd, self.length, self.offset)


class _SpanRecord:
    """A record inside a span already in memory (``view`` / ``address``: the span buffer)."""

    def __init__(self, view: memoryview, address: int, base: int, length: int) -> None:
        self.view, self.address, self.base, self.length = view, address, base, length

    def get(self, off: int, n: int) -> Any:
        return self.view[self.base + off:self.base + off + n]

    def place(self, address: int, start: int, n: int) -> None:
        ctypes.memmove(address, self.address + self.base + start, n)

    def whole(self) -> bytes:
        return bytes(self.view[self.base:self.base + self.length])


def _storage_of(t: torch.Tensor) -> int:
    """Where ``t``'s storage starts (-1: none to compare, e.g. a tensor subclass without one)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


def pin_scratch(device_type: str, n: int, cuda_available: Any) -> bool:
    """Whether ``n`` bytes bound for a tensor on ``device_type`` go through pinned memory
    (``cuda_available``: a callable, asked only when the answer depends on it)."""
    return device_type == "cuda" and n <= PINNED_SCRATCH_MAX and bool(cuda_available())


def _plain_cpu(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether bytes of ``dtype`` can be written straight into ``target``'s memory."""
    return (type(target) is torch.Tensor and target.device.type == "cpu" and target.dtype == dtype
            and target.layout == torch.strided and target.is_contiguous() and not target.is_conj()
            and not target.is_neg() and not target.is_quantized)


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.size(dim):
            t = t.narrow(dim, o, n)
    return t


class _Loader:
    """Decodes records into the planner's targets; owns the reused buffers of one load."""

    def __init__(self, planner: Any) -> None:
        self.planner = planner
        self.stats = ReadStats()
        self.cache = RecordCache()
        self._span: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._regions: dict[int, tuple[TensorLayout, Region]] = {}
        self._queued: list[_Queued] = []
        self._queued_storages: set[int] = set()
        #: DCP's commit does nothing: a filled target needs no commit at once, its read may wait
        #: (``_read_queued``); else each chunk is read, then committed, in turn.
        self._defer = keeps_default(planner, "commit_tensor")
        self._fd = -1
        self._gap = memoryview(bytearray(GAP_MAX))

    def _buffer(self, which: str, n: int, pinned: bool = False) -> torch.Tensor:
        buf = getattr(self, which)
        if buf is None or buf.numel() < n or (pinned and not buf.is_pinned()):
            buf = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=pinned)
            setattr(self, which, buf)
        return buf

    def file(self, fd: int, records: list[_Record]) -> None:
        """Read and decode ``records`` (sorted by offset) of the open data file ``fd``."""
        self.stats.files += 1
        self._fd = fd
        span: list[_Record] = []
        end = 0
        for rec in records:
            if rec.is_tensor and rec.length >= DIRECT_MIN:
                self._flush(fd, span, end)
                span = []
                self._record(rec, _FileRecord(fd, rec, self.stats))
                continue
            if span and (rec.offset > end + GAP_MAX or rec.offset + rec.length - span[0].offset > SPAN_BYTES):
                self._flush(fd, span, end)
                span = []
            if not span:
                end = rec.offset
            span.append(rec)
            end = max(end, rec.offset + rec.length)
        self._flush(fd, span, end)
        self._read_queued(fd)

    def _queue(self, q: _Queued) -> None:
        self._queued.append(q)
        self._queued_storages.add(_storage_of(q.target))

    def _before_write(self, target: torch.Tensor) -> None:
        """A write that is not queued comes after the queued reads into the same storage (they
        are earlier in the file): what aliased targets end with is what file order gives."""
        if self._queued and _storage_of(target) in self._queued_storages:
            self._read_queued(self._fd)

    def _read_queued(self, fd: int) -> None:
        """Read the direct chunks queued for file ``fd``, in offset order, with one ``preadv``
        per run of chunks less than ``GAP_MAX`` apart (the bytes between them, record headers,
        go to a scratch buffer), then commit them. Reading them after the file's records are
        decoded keeps the decoding's Python work out of the caches the copies sweep (the
        measurements: docs/benchmarks.md, section 4)."""
        queue = sorted(self._queued, key=lambda q: q.offset)
        self._queued = []
        self._queued_storages.clear()
        i = 0
        while i < len(queue):
            j, start, pos = i, queue[i].offset, queue[i].offset
            iov: list[Any] = []  # memoryviews of the gap buffer and ctypes arrays over the targets
            while j < len(queue) and len(iov) < IOV_BATCH - 1 and pos - start < BATCH_BYTES:
                q = queue[j]
                gap = q.offset - pos
                if gap < 0 or gap > GAP_MAX:
                    break
                if gap:
                    iov.append(self._gap[:gap])
                iov.append((ctypes.c_char * q.n).from_address(q.target.data_ptr()))
                pos = q.offset + q.n
                j += 1
            got = os.preadv(fd, iov, start)
            self.stats.reads += 1
            if got == pos - start:
                self.stats.bytes_read += got
            else:  # a short read: chunk by chunk (raises where the file ends too early)
                for q in queue[i:j]:
                    _pread_into(fd, q.target.data_ptr(), q.n, q.offset, self.stats)
            i = j
        for q in queue:
            increment_version(q.target)  # written behind autograd's back, as copy_ would have noted
            self.stats.direct += 1
            self._commit(q.item, q.target)

    def _flush(self, fd: int, span: list[_Record], end: int) -> None:
        if not span:
            return
        start = span[0].offset
        buf = self._buffer("_span", end - start)
        address = buf.data_ptr()
        _pread_into(fd, address, end - start, start, self.stats)
        view = memoryview((ctypes.c_char * (end - start)).from_address(address)).cast("B")
        for rec in span:
            self._record(rec, _SpanRecord(view, address, rec.offset - start, rec.length))

    def decode_in_memory(self, rec: _Record, data: torch.Tensor) -> None:
        """Decode ``rec`` from ``data``, its bytes (a cooperative load delivered or read them)."""
        address = data.data_ptr()
        view = memoryview((ctypes.c_char * rec.length).from_address(address)).cast("B")
        self._record(rec, _SpanRecord(view, address, 0, rec.length))

    def _record(self, rec: _Record, src: _FileRecord | _SpanRecord) -> None:
        if not rec.is_tensor:
            data = src.whole()
            for item in rec.items:
                self.stats.byte_items += 1
                self.planner.load_bytes(item, io.BytesIO(data))
            return
        layout = parse_tensor_record(src.get, rec.length, self.cache)
        if layout is None:
            self._general(rec, src.whole())
            return
        for item in rec.items:
            self._tensor(item, layout, src)

    def _target(self, item: Any, size: Sequence[int]) -> torch.Tensor:
        target = item.target if type(item) is WholeRead else self.planner.resolve_tensor(item).detach()
        if tuple(target.size()) != tuple(size):
            raise ValueError(f"the chunk of {item.storage_index.fqn!r} at {list(item.storage_offsets)} has "
                             f"size {list(size)} in the checkpoint but {list(target.size())} in the state dict")
        return target

    def _whole_region(self, read: WholeRead, layout: TensorLayout) -> Region:
        """All of the saved tensor, which must have the shape the index gave ``read``."""
        if layout.size != tuple(read.target.shape):
            raise CorruptCheckpointError(
                f"the record of {read.fqn!r} holds a tensor of size {list(layout.size)}, but the checkpoint's "
                f"load index says {list(read.target.shape)}: the checkpoint is damaged. Load an earlier "
                "checkpoint; `solosave verify` lists every problem.")
        got = self._regions.get(id(layout))  # the layout is kept in the value: its id stays its own
        if got is None:
            got = self._regions[id(layout)] = (layout, layout.region((0,) * len(layout.size), layout.size))
        return got[1]

    def _tensor(self, item: Any, layout: TensorLayout, src: _FileRecord | _SpanRecord) -> None:
        if type(item) is WholeRead:
            region = self._whole_region(item, layout)
        else:
            try:
                region = layout.region(item.storage_offsets, item.lengths)
            except ValueError as e:  # the record holds another tensor than .metadata says
                raise CorruptCheckpointError(f"the record of {item.storage_index.fqn!r} is damaged: {e}. Load an "
                                             "earlier checkpoint; `solosave verify` lists every problem.") from None
        target = self._target(item, region.size)
        n = region.hi - region.lo
        if region.numel and region.contiguous and _plain_cpu(target, layout.dtype):
            if isinstance(src, _FileRecord) and (self._defer or type(item) is WholeRead):
                self._queue(_Queued(src.offset + layout.payload_start + region.lo, n, target, item))
                return
            self._before_write(target)
            src.place(target.data_ptr(), layout.payload_start + region.lo, n)
            increment_version(target)  # written behind autograd's back, as copy_ would have noted
            if isinstance(src, _FileRecord):
                self.stats.direct += 1
            else:
                self.stats.copied += 1
        elif region.numel:
            raw = self._buffer("_scratch", n, pin_scratch(target.device.type, n, torch.cuda.is_available))
            src.place(raw.data_ptr(), layout.payload_start + region.lo, n)
            self._before_write(target)
            target.copy_(raw[:n].view(layout.dtype).as_strided(region.size, region.stride))
            self.stats.converted += 1
        self._commit(item, target)

    def _commit(self, item: Any, target: torch.Tensor) -> None:
        if type(item) is not WholeRead:  # DCP's default planner's commit does nothing
            self.planner.commit_tensor(item, target)

    def _general(self, rec: _Record, data: bytes) -> None:
        """A record in another form: load it as DCP does (``weights_only``), then narrow."""
        self.stats.general += 1
        fqn = rec.items[0].storage_index.fqn
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeMetadataError(f"refusing to load the tensor record of {fqn!r}: "
                                      f"{str(e).splitlines()[0]} Nothing was executed.") from None
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.load's many ways of meeting damaged bytes
            raise damaged_record(fqn, e) from None
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"the record of {fqn!r} holds a {type(tensor).__name__}, not a tensor")
        for item in rec.items:
            try:
                chunk = _narrow(tensor, item.storage_offsets, item.lengths)
            except (RuntimeError, IndexError, ValueError) as e:
                raise CorruptCheckpointError(
                    f"the record of {fqn!r} is damaged: it holds a tensor of size {list(tensor.shape)}, which has no "
                    f"chunk at {list(item.storage_offsets)} of size {list(item.lengths)} ({e})") from None
            target = self._target(item, chunk.size())
            self._before_write(target)
            target.copy_(chunk)
            self._commit(item, target)


def damaged_record(fqn: str, e: BaseException) -> CorruptCheckpointError:
    """The error of a record that ``torch.load(weights_only=True)`` could not read (anything but
    a refused global): the bytes are damaged, whatever torch's own words for it."""
    first = (str(e).splitlines() or [""])[0][:200]
    return CorruptCheckpointError(
        f"the record of {fqn!r} is damaged: torch.load cannot read it ({type(e).__name__}: {first}). Load an "
        "earlier checkpoint; `solosave verify` lists every problem.", [f"{fqn}: {type(e).__name__}: {first}"])


class LocalRanges:
    """The ``fetch`` of a cooperative load (:meth:`~solosave._src.load.cooperative.Cooperation.run`)
    on local files: a range read straight into the buffer; one descriptor per file, kept open
    until :meth:`close`."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        self._fds: dict[str, int] = {}

    def __call__(self, rel: str, offset: int, into: torch.Tensor) -> bool:
        opened = rel not in self._fds
        if opened:
            self._fds[rel] = os.open(os.path.join(self.directory, rel), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        _pread_into(self._fds[rel], into.data_ptr(), into.numel(), offset, ReadStats())
        return opened

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def read_items(directory: str | os.PathLike, items: Sequence[Any], storage_data: Mapping[Any, Any],
               planner: Any, whole: Sequence[tuple[WholeRead, Any]] = (), cooperation: Cooperation | None = None
               ) -> ReadStats:
    """Load every DCP ``ReadItem`` of ``items`` from the data files of ``directory`` into
    ``planner``'s targets, and every ``(WholeRead, storage entry)`` of ``whole`` into its own
    target, in one pass per file (see the module docstring); returns what was done. With
    ``cooperation`` (every rank of the load, :mod:`solosave._src.load.cooperative`), the ranges
    that several ranks need are read by one of them and delivered to the others first."""
    loader = _Loader(planner)
    files = _records_by_file(items, storage_data, whole)
    if cooperation is not None:
        fetch = LocalRanges(directory)
        try:
            files = cooperation.run(files, fetch, loader.decode_in_memory, whole_below=DIRECT_MIN,
                                    metadata=getattr(planner, "metadata", None),
                                    checkpoint=os.path.abspath(os.fspath(directory)))
            cooperation.stats.files_opened = len(cooperation.stats.opened - set(files))  # not counted below
        finally:
            fetch.close()
    for rel, records in sorted(files.items()):
        fd = os.open(os.path.join(os.fspath(directory), rel), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            loader.file(fd, records)
        finally:
            os.close(fd)
    return loader.stats
