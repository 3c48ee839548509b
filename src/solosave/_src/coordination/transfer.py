"""Files from one rank to another over a channel: the peer copies of two tiers.

:func:`ring_pass` is one step of a ring: every rank of the channel calls it at once, sends its
list of files to ``send_to`` and receives the list of ``recv_from`` (either may be empty), full
duplex, one chunk each way at a time (point-to-point messages of :meth:`Channel.exchange`; the
only collective-free data path solosave has). Per pass, on every rank, in order:

1. the header's length (8 bytes), then the header: the names and sizes of the files sent, or the
   error that kept this rank from listing them;
2. the files' bytes in chunks of at most :data:`CHUNK`, step ``i`` sending this rank's chunk
   ``i`` and receiving the other's chunk ``i``. A file that cannot be read to the end is padded
   with zeros (the receiver must get the bytes the header announced) and reported;
3. a trailer (1 byte): whether every byte sent was the file's. A received file is committed
   (``commit()`` of the sink: it appears whole, see :func:`open_whole`)
   only after a good trailer and a clean write; otherwise it is abandoned (``close()``).

Memory: one chunk out and one in, whatever the files' sizes. Every message is bounded by the
channel's timeout; a failed or late message raises :class:`ChannelError` (the channel is then
broken, as after any failed collective).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import queue
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from solosave._src.coordination.channel import Channel
from solosave._src.core.errors import ChannelError, describe
from solosave._src.storage.base import Storage
from solosave._src.storage.local import RenamedDataFile

#: Bytes per message.
CHUNK = 8 << 20

#: The names a peer may send: a rank's data files and their checksum sidecars, the load index
#: and ``.metadata``; nothing with a directory part (a peer never names a path of this host).
#: The longest header accepted (names and sizes of a rank's files; far below this).
MAX_HEADER = 1 << 20
#: The most bytes a header may announce (256 TiB: no rank's files come near it); more breaks
#: the channel at once, before any receive is planned.
MAX_ANNOUNCED = 1 << 48

PEER_FILE = re.compile(r"^(__\d+_\d+\.distcp(\.crc32)?|\.solosave-index|\.metadata)$")


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A file to send: its name at the receiver, and the file ``path`` of ``storage`` that holds
    its bytes."""

    name: str
    storage: Storage
    path: str


@dataclass(slots=True)
class PassResult:
    """What one :func:`ring_pass` did on this rank."""

    received: list[str] = field(default_factory=list)
    sent_bytes: int = 0
    received_bytes: int = 0
    #: What went wrong on this rank's side (its reading, or its writing of what it received), or
    #: what the sending rank reported.
    error: str | None = None


def ring_pass(channel: Channel, send_to: int | None, recv_from: int | None, outgoing: Sequence[Outgoing],
              open_sink: Callable[[str, int], Any], stop: Callable[[], bool] | None = None,
              chunk: int = CHUNK, max_bytes: int | None = None) -> PassResult:
    """Send ``outgoing`` to ``send_to`` and receive from ``recv_from`` (see the module docstring).
    Either may be ``None``: this rank only receives (``outgoing`` then empty) or only sends, and
    its partner calls with the matching rank. ``open_sink(name, size)`` gives the object a
    received file is written to (``write``, ``commit``, ``close``, as a ``DataFile``); ``stop()``
    is checked between chunks; ``chunk``: bytes per message (the same on every rank);
    ``max_bytes``: the most this rank can receive (its free space): from a header announcing
    more, nothing is written (the bytes are received and dropped, so both ranks stay in step)
    and the pass reports the error. A header announcing more than :data:`MAX_ANNOUNCED` breaks
    the channel at once."""
    res = PassResult()
    if send_to is None and outgoing:
        raise ValueError("internal: files to send without a rank to send them to")
    files, error = _sizes(outgoing)
    header = json.dumps({"files": files, "error": error}).encode()
    out_header = header if send_to is not None else None
    got = channel.exchange(send_to, len(header).to_bytes(8, "little") if out_header else None, recv_from,
                           8 if recv_from is not None else 0)
    size = int.from_bytes(got or b"", "little")
    if size > MAX_HEADER:
        raise ChannelError(f"rank {recv_from} announced a header of {size} bytes (at most {MAX_HEADER})")
    data = channel.exchange(send_to, out_header, recv_from, size if recv_from is not None else 0)
    theirs = _read_header(data, recv_from) if recv_from is not None else {"files": [], "error": None}
    incoming = [(name, size) for name, size in theirs["files"]]
    total = sum(size for _, size in incoming)
    if total > MAX_ANNOUNCED:  # no checkpoint holds that much per rank: a crafted or corrupt header
        raise ChannelError(f"rank {recv_from} announced {total} bytes of files (at most {MAX_ANNOUNCED}); "
                           "nothing was received")
    out_chunks = _ChunkReader(outgoing, files, chunk)
    in_plan = _ChunkPlan([size for _, size in incoming], chunk)
    if max_bytes is not None and total > max_bytes:  # no room here: received and dropped, in step
        sinks: list[Any] = []
        write_error: str | None = (f"rank {recv_from} sends {total} bytes of files, more than this rank can hold "
                                   f"({max_bytes} bytes free); nothing was written")
    else:
        sinks, write_error = _open_sinks(incoming, open_sink)
    try:
        write_error = _move(channel, send_to, recv_from, out_chunks, in_plan, incoming, sinks, res, files, chunk,
                            stop, write_error)
    except BaseException:
        _abandon(sinks)  # a pass cut short leaves no temporary file and no open descriptor
        raise
    read_error = out_chunks.error or error
    trailer = channel.exchange(send_to, (b"+" if read_error is None else b"-") if send_to is not None else None,
                               recv_from, 1 if recv_from is not None else 0)
    if recv_from is None:
        trailer = b"+"
    if theirs["error"] is not None:
        res.error = f"rank {recv_from} could not send its files: {theirs['error']}"
    elif trailer != b"+":
        res.error = f"rank {recv_from} could not read all of the files it sent"
    res.error = res.error or write_error or read_error
    _finish(sinks, incoming, res, ok=trailer == b"+" and write_error is None and theirs["error"] is None)
    return res


class _ChunkPlan:
    """Which file each received chunk belongs to, and its size, computed per step (memory: one
    count per file, whatever the sizes announced)."""

    def __init__(self, sizes: list[int], chunk: int) -> None:
        self.sizes, self.chunk = sizes, chunk
        self.ends = list(itertools.accumulate(-(-s // chunk) for s in sizes))  # chunks up to each file

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, step: int) -> tuple[int, int]:
        i = bisect.bisect_right(self.ends, step)
        first = self.ends[i - 1] if i else 0
        return i, min(self.chunk, self.sizes[i] - (step - first) * self.chunk)


def _move(channel: Channel, send_to: int | None, recv_from: int | None, out_chunks: Any, in_plan: _ChunkPlan,
          incoming: list[tuple[str, int]], sinks: list[Any], res: PassResult, files: list[tuple[str, int]],
          chunk: int, stop: Callable[[], bool] | None, write_error: str | None) -> str | None:
    """Step 2: the chunks both ways. Returns the first write error (the pass goes on after it,
    dropping what it receives, to stay in step). The next outgoing chunk is read, and the last
    received ones written, on threads of their own while a message is in flight (a few chunks
    each way in memory: one queued and one being read out, two queued and one being written in,
    plus the message's own copies): the file I/O overlaps the network instead of following it."""
    steps = max(len(in_plan), sum(-(-size // chunk) for _, size in files))
    with _Ahead(out_chunks) as ahead, _Behind(sinks, incoming, write_error) as behind:
        for step in range(steps):
            if stop is not None and stop():
                raise InterruptedError("the peer copy was stopped (the checkpointer is closing)")
            out = ahead.next()
            want = in_plan[step] if step < len(in_plan) else None
            data = channel.exchange(send_to if out else None, out, recv_from if want else None,
                                    want[1] if want else 0)
            res.sent_bytes += len(out or b"")
            if want is not None and data is not None:
                res.received_bytes += len(data)
                behind.write(want[0], data)
        return behind.finish()


class _Ahead:
    """The outgoing chunks, each read on a thread while the previous one is sent (one ahead)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._box: queue.Queue[bytes | None] = queue.Queue(maxsize=1)
        self._closed = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="solosave-peer-read", daemon=True)

    def __enter__(self) -> _Ahead:
        self._thread.start()
        return self

    def _run(self) -> None:
        for item in itertools.chain(self._chunks, [None]):
            while not self._closed.is_set():
                try:
                    self._box.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item is None or self._closed.is_set():
                return

    def next(self) -> bytes | None:
        """The next chunk; ``None`` once they are all sent."""
        if self._ended:
            return None
        while True:
            try:
                item = self._box.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("internal: the peer transfer's reading thread ended early") from None
        self._ended = item is None
        return item

    def __exit__(self, *exc: Any) -> None:
        self._closed.set()
        self._thread.join()


class _Behind:
    """Received chunks written to their sinks on a thread while the next one arrives (two
    queued at most). The first write error is kept and what follows is dropped, in step."""

    def __init__(self, sinks: list[Any], incoming: list[tuple[str, int]], error: str | None) -> None:
        self._sinks, self._incoming, self.error = sinks, incoming, error
        self._box: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=2)
        self._thread = threading.Thread(target=self._run, name="solosave-peer-write", daemon=True)
        self._done = False

    def __enter__(self) -> _Behind:
        self._thread.start()
        return self

    def _run(self) -> None:
        while (item := self._box.get()) is not None:
            i, data = item
            if self.error is None:
                try:
                    self._sinks[i].write(data)
                except Exception as e:  # noqa: BLE001 - reported; the pass goes on to stay in step
                    self.error = f"writing {self._incoming[i][0]} failed: {describe(e)}"

    def write(self, i: int, data: bytes) -> None:
        self._box.put((i, data))

    def finish(self) -> str | None:
        """Wait for every queued write; the first write error."""
        if not self._done:
            self._done = True
            self._box.put(None)
            self._thread.join()
        return self.error

    def __exit__(self, *exc: Any) -> None:
        self.finish()  # a pass cut short: the writes end before its sinks are abandoned


def open_whole(storage: Storage, path: str, open_data: Callable[[str], Any], fsync: bool = True) -> Any:
    """A sink for a received file that appears only whole: ``open_data(path)`` (a ``DataFile``)
    where its commit is atomic already (an object store), else a local file written under a
    temporary name and renamed into place at its commit
    (:class:`~solosave._src.storage.local.RenamedDataFile`)."""
    return RenamedDataFile(path, open_data, fsync) if storage.local_files else open_data(path)


def _sizes(outgoing: Sequence[Outgoing]) -> tuple[list[tuple[str, int]], str | None]:
    try:
        return [(o.name, o.storage.size(o.path)) for o in outgoing], None
    except Exception as e:  # noqa: BLE001 - sent as the header's error: the receiver knows at once
        return [], describe(e)


def _read_header(data: bytes | None, sender: int) -> dict:
    """The sender's header (JSON), checked: a peer that names anything but checkpoint files of
    this directory (a path, a negative size) breaks the channel, as a failed message does."""
    try:
        head = json.loads(data or b"")
        files, error = head["files"], head["error"]
        assert isinstance(files, list) and (error is None or isinstance(error, str))  # noqa: S101 - caught below
    except Exception as e:  # noqa: BLE001 - any malformed header breaks the channel
        raise ChannelError(f"rank {sender} sent a malformed header: {describe(e)}") from e
    for entry in files:
        name, size = entry if isinstance(entry, list) and len(entry) == 2 else (entry, None)
        if not isinstance(name, str) or not PEER_FILE.match(name) or not isinstance(size, int) or size < 0:
            raise ChannelError(f"rank {sender} sent a file entry that is not a checkpoint file: {name!r} ({size!r})")
    return head


class _ChunkReader:
    """The outgoing files as one stream of chunks, each file padded to its announced size."""

    def __init__(self, outgoing: Sequence[Outgoing], files: list[tuple[str, int]], chunk: int) -> None:
        self.error: str | None = None
        self.chunk = chunk
        self._it = self._gen(outgoing, files)

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        return next(self._it)

    def _gen(self, outgoing: Sequence[Outgoing], files: list[tuple[str, int]]) -> Iterator[bytes]:
        for o, (_, size) in zip(outgoing, files):
            yield from self._read(o, size)

    def _read(self, o: Outgoing, size: int) -> Iterator[bytes]:
        """The chunks of one file: each exactly the size the receiver expects (short reads are
        filled up; a file that ends early or fails is padded with zeros and reported)."""
        done = 0
        try:
            with o.storage.open_read(o.path) as f:
                while done < size:
                    want = min(self.chunk, size - done)
                    parts: list[bytes] = []
                    got = 0
                    while got < want:
                        data = f.read(want - got)
                        if not data:  # the error is set before the padded chunk is handed over
                            self.error = self.error or f"reading {o.path} failed: EOFError: {o.path} ended " \
                                                       f"after {done + got} of {size} bytes"
                            done += want
                            yield b"".join(parts) + bytes(want - got)
                            raise EOFError(f"{o.path} ended after {done - want + got} of {size} bytes")
                        parts.append(bytes(data))
                        got += len(data)
                    done += want
                    yield b"".join(parts)
        except Exception as e:  # noqa: BLE001 - padded below, reported in the trailer
            self.error = self.error or f"reading {o.path} failed: {describe(e)}"
        while done < size:
            n = min(self.chunk, size - done)
            done += n
            yield bytes(n)


def _abandon(sinks: list[Any]) -> None:
    for sink in sinks:
        with contextlib.suppress(Exception):
            sink.close()


def _open_sinks(incoming: list[tuple[str, int]], open_sink: Callable[[str, int], Any]) -> tuple[list[Any], str | None]:
    sinks: list[Any] = []
    for name, size in incoming:
        try:
            sinks.append(open_sink(name, size))
        except Exception as e:  # noqa: BLE001 - the bytes are still received (and dropped)
            _abandon(sinks)
            return [], f"opening {name} failed: {describe(e)}"
    return sinks, None


def _finish(sinks: list[Any], incoming: list[tuple[str, int]], res: PassResult, ok: bool) -> None:
    """Commit every received file (``ok``), else abandon them all."""
    for sink, (name, _) in zip(sinks, incoming):
        if not ok:
            with contextlib.suppress(Exception):
                sink.close()
            continue
        try:
            sink.commit()
            res.received.append(name)
        except Exception as e:  # noqa: BLE001 - reported; the others are still committed
            res.error = res.error or f"committing {name} failed: {describe(e)}"


__all__ = ["CHUNK", "PEER_FILE", "Outgoing", "PassResult", "open_whole", "ring_pass"]
