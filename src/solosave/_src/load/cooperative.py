"""Cooperative reads of a load: a byte range that several ranks need is read from storage by
one of them and delivered to the others over the process group, so the job reads each byte of
the checkpoint once (replicas: DDP, HSDP, FSDP2 with replicas, Megatron's DP groups; and
small records that a resharded load feeds to several ranks).

Who calls what. Every rank of the load's process group, once per load pass, calls exactly one
of :meth:`Cooperation.run` (it is about to read: its records by file), :meth:`Cooperation.stand_aside`
(it reads nothing in this pass, or reads through DCP's own path) or :meth:`Cooperation.abstain`
(it failed before reading). In order, on every rank:

1. the sketch (:mod:`solosave._src.coordination.sketch`): one ``all_reduce(SUM)`` of 4,099 int64
   counters over the keys of this rank's records of at least :data:`SHARE_MIN` bytes that it needs
   whole (:func:`_shareable`); a key is (file, offset, length, the checkpoint's location). A rank
   that failed before reading is counted in the last slot: then every rank reads its own records
   alone and nothing else happens here (the load's own agreement reports the failure; a rank
   that can still load from ``.metadata`` does). No bucket above one proves that no range is
   shared: the same. **That is the rule of "when it pays"**: only ranges of at least
   ``SHARE_MIN`` bytes that two or more ranks need whole are shared (a smaller one is read by
   each rank that needs it: it rides in a coalesced read anyway), and, for a checkpoint on local
   files (``scope="hosts"``), only when the job spans two or more hosts (the sketch says so too):
   ranks of one host that read the same file share its pages in the host's page cache, so the
   file is read from the disk once whatever they do, and delivering it over the process group
   only adds copies (docs/benchmarks.md, section 11). On an object store (``scope="all"``), every
   read is a request: ranges are shared between any ranks;
2. one ``all_gather_object`` of each rank's host name, unshared bytes and candidate keys (those
   in buckets of two or more), from which every rank computes the same plan
   (:func:`assign_readers`): for each range needed by two or more ranks, the reader is the
   needing rank with the fewest bytes so far on its host, then on itself (ranges by decreasing
   size), so that reads spread over hosts (their NICs) first, then over ranks;
3. rounds (:func:`plan_rounds`): in each, a rank reads or receives at most :data:`WINDOW` bytes
   (a range larger than that has a round to itself: then the reader and each receiver hold that
   whole range). In each round the readers read their ranges into buffers, the ranks agree that
   every read succeeded (``agree_ok``: one 8-byte ``all_reduce`` on gloo, an
   ``all_gather_object`` of one int on other backends), and only then every message of the
   round is posted at once (:meth:`~solosave._src.coordination.channel.Channel.transfers`:
   ``batch_isend_irecv``, NCCL through the GPU, gloo on CPU; each wait bounded by the channel's
   timeout) and every rank decodes each range it needs as it arrives. A read that failed fails
   the round on every rank before any message is posted: no rank waits in a transfer for a
   reader that gave up. A record that fails to decode (damaged bytes:
   :class:`~solosave.CorruptCheckpointError` naming the key) is raised after the last round, so
   that this rank still serves the others.

What remains of each rank's records (its unshared ones) is read by the caller as before.
"""

from __future__ import annotations

import pickle
import socket
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType

from solosave._src.coordination.channel import Channel
from solosave._src.coordination.sketch import Key, any_shared, candidates, failed_ranks, hosts_differ, sketch_of
from solosave._src.core.errors import FailedElsewhere
from solosave._src.load.whole_reads import WholeRead

__all__ = ["SHARE_MIN", "WINDOW", "CoopStats", "Cooperation", "assign_readers", "plan_rounds"]

#: Shortest range a load shares (smaller ones: each rank reads its own).
SHARE_MIN = 64 << 10
#: Bytes a rank reads or receives per round (its extra memory, unless one range is larger).
WINDOW = 256 << 20


@dataclass
class CoopStats:
    """What the cooperation of one load pass did on this rank."""

    shared_ranges: int = 0       # ranges needed by two or more ranks (the whole job)
    bytes_read: int = 0          # this rank's reads of shared ranges from storage
    bytes_received: int = 0      # shared ranges delivered to this rank by their readers
    bytes_sent: int = 0
    files_opened: int = 0        # data files opened only for ranges read for the others
    opened: set[str] = field(default_factory=set)
    rounds: int = 0
    seconds_read: float = 0.0
    seconds_exchange: float = 0.0
    seconds_decode: float = 0.0


def assign_readers(needs: Sequence[tuple[str, Sequence[Key]]],
                   unshared: Sequence[int] = ()) -> dict[Key, tuple[int, tuple[int, ...]]]:
    """``needs[r]``: rank ``r``'s host and the keys it needs; ``unshared[r]``: the bytes rank
    ``r`` reads alone. Returns, for each key needed by two or more ranks, its reader and the
    ranks it is delivered to (the same on every rank: see the module docstring)."""
    who: dict[Key, list[int]] = defaultdict(list)
    for r, (_, keys) in enumerate(needs):
        for k in set(keys):
            who[k].append(r)
    rank_bytes = [unshared[r] if r < len(unshared) else 0 for r in range(len(needs))]
    for k, rs in who.items():
        if len(rs) == 1:  # a candidate no other rank needs: read alone
            rank_bytes[rs[0]] += k[2]
    host_bytes: dict[str, int] = defaultdict(int)
    for r, (host, _) in enumerate(needs):
        host_bytes[host] += rank_bytes[r]
    out: dict[Key, tuple[int, tuple[int, ...]]] = {}
    for k in sorted((k for k, rs in who.items() if len(rs) > 1), key=lambda k: (-k[2], k)):
        ranks = sorted(who[k])
        reader = min(ranks, key=lambda r: (host_bytes[needs[r][0]], rank_bytes[r], r))
        rank_bytes[reader] += k[2]
        host_bytes[needs[reader][0]] += k[2]
        out[k] = (reader, tuple(r for r in ranks if r != reader))
    return out


def plan_rounds(assignment: dict[Key, tuple[int, tuple[int, ...]]], window: int = WINDOW) -> list[list[Key]]:
    """The shared keys in rounds, in which each rank reads or receives at most ``window`` bytes
    (a larger key alone for its ranks): first fit, keys in (reader, file, offset) order."""
    rounds: list[list[Key]] = []
    load: list[dict[int, int]] = []
    for k in sorted(assignment, key=lambda k: (assignment[k][0], k)):
        reader, receivers = assignment[k]
        ranks = (reader, *receivers)
        i = next((j for j, used in enumerate(load)
                  if all(used.get(r, 0) == 0 or used[r] + k[2] <= window for r in ranks)), len(rounds))
        if i == len(rounds):
            rounds.append([])
            load.append({})
        rounds[i].append(k)
        for r in ranks:
            load[i][r] = load[i].get(r, 0) + k[2]
    return rounds


class Cooperation:
    """One load pass's cooperation on this rank (see the module docstring); ``channel``: the
    load's process group; ``scope``: ``"all"`` (share ranges between any ranks) or ``"hosts"``
    (only when the job spans two or more hosts); ``host``: this rank's host (default: its host
    name)."""

    def __init__(self, channel: Channel, scope: str = "all", host: str | None = None, window: int = WINDOW,
                 share_min: int = SHARE_MIN) -> None:
        if scope not in ("all", "hosts"):
            raise ValueError(f"internal: cooperation scope {scope!r}")
        self.channel, self.scope, self.window, self.share_min = channel, scope, window, share_min
        self.host = host if host is not None else socket.gethostname()
        self.entered = False
        self.stats = CoopStats()
        self.tag_base = 0

    def stand_aside(self) -> None:
        """Take part without reading anything in this pass (every step of :meth:`run`, with no
        range of its own: the others' rounds need this rank's agreements)."""
        self.run({}, _nothing_to_fetch, _nothing_to_decode)

    def abstain(self) -> None:
        """Take part as a rank that failed before reading: every rank stops."""
        self._sketch(None)

    def run(self, files: dict[str, list[Any]], fetch: Callable[[str, int, torch.Tensor], bool],
            decode: Callable[[Any, torch.Tensor], None], whole_below: int = 0,
            metadata: Any = None, checkpoint: str = "") -> dict[str, list[Any]]:
        """``files``: this rank's records (``offset``, ``length``) by file. Reads and receives the
        shared ones, decoding each with ``decode(record, bytes)``; ``fetch(file, offset, into)``
        reads a range from storage (returns whether it opened a file); ``whole_below``: records
        shorter than this are read whole by the caller's read path even where a rank needs only
        part of one; ``metadata``: the load's (:func:`_shareable`); ``checkpoint``: its location
        (ranks share only ranges of the same checkpoint: it is part of every key). Returns the
        records left for this rank to read alone."""
        ident = zlib.crc32(checkpoint.encode())
        self.tag_base = (ident & 0x3FF) << 20  # + round << 12 + message: see _rounds
        mine: dict[Key, list[Any]] = defaultdict(list)
        for rel, records in files.items():
            for rec in records:
                if _shareable(rec, whole_below, metadata):
                    mine[(rel, int(rec.offset), int(rec.length), ident)].append(rec)
        big = [k for k in mine if k[2] >= self.share_min]
        summed = self._sketch(big)
        alone = sum(int(r.length) for records in files.values() for r in records) - sum(k[2] for k in mine)
        if failed_ranks(summed):  # the same sum on every rank: every rank reads alone
            return files
        if not any_shared(summed) or (self.scope == "hosts"
                                      and not hosts_differ(summed, self.channel.world_size)):
            return files
        maybe = candidates(big, summed)
        alone += sum(k[2] for k in mine) - sum(k[2] for k in maybe)
        gathered = self.channel.all_gather_object((self.host, alone, maybe))
        assignment = assign_readers([(host, keys) for host, _, keys in gathered], [n for _, n, _ in gathered])
        if not assignment:
            return files
        self.stats.shared_ranges = len(assignment)
        error = self._rounds(plan_rounds(assignment, self.window), assignment, mine, fetch, decode)
        if error is not None:
            raise error
        shared = set(assignment)
        return {rel: kept for rel, records in files.items()
                if (kept := [r for r in records if (rel, int(r.offset), int(r.length), ident) not in shared
                             or not _shareable(r, whole_below, metadata)])}

    # -- steps ------------------------------------------------------------------------------------
    def _sketch(self, keys: Sequence[Key] | None) -> list[int]:
        if self.entered:
            raise AssertionError("internal: a rank took part twice in one cooperative load")
        self.entered = True
        return self.channel.all_reduce_sum(sketch_of(keys, self.host))

    def _rounds(self, rounds: list[list[Key]], assignment: dict[Key, tuple[int, tuple[int, ...]]],
                mine: dict[Key, list[Any]], fetch: Callable[[str, int, torch.Tensor], bool],
                decode: Callable[[Any, torch.Tensor], None]) -> Exception | None:
        """Each round: this rank reads the ranges it reads for the others, the ranks agree that
        every read succeeded (a failed one fails the round on every rank before any message is
        posted), then every message of the round is posted at once and each range is decoded as
        it arrives. A decoding error is returned once this rank served every round."""
        me, st = self.channel.rank, self.stats
        late: Exception | None = None  # a decoding error: raised once this rank served every round
        for number, keys in enumerate(rounds):
            st.rounds += 1
            t0 = time.perf_counter()
            error: Exception | None = None
            held: list[tuple[Key, torch.Tensor]] = []
            try:
                for k in keys:
                    if assignment[k][0] == me:
                        buf = torch.empty(k[2], dtype=torch.uint8)
                        if fetch(k[0], k[1], buf):
                            st.opened.add(k[0])
                        st.bytes_read += k[2]
                        held.append((k, buf))
            except Exception as e:  # noqa: BLE001 - agreed below: every rank stops, none sends
                error = e
            t1 = time.perf_counter()
            st.seconds_read += t1 - t0
            failed = self.channel.agree_ok(None if error is None else _portable(error))
            if failed:
                if error is not None:
                    raise error
                rank, why = min(failed.items())
                raise FailedElsewhere(f"rank {rank} could not read its share of the cooperative load: {why}")
            # tags: 10 bits of the checkpoint, 8 of the round, 12 of the message (a rank sends at most
            # WINDOW / SHARE_MIN = 4096 messages to one rank in a round)
            moves = self.channel.transfers(self.tag_base + ((number & 0xFF) << 12))
            incoming = []
            for k in keys:
                if me in assignment[k][1]:
                    buf = torch.empty(k[2], dtype=torch.uint8)
                    incoming.append((k, buf, moves.recv(assignment[k][0], buf)))
            for k, buf in held:
                for dst in assignment[k][1]:
                    moves.send(dst, buf)
                    st.bytes_sent += k[2]
            moves.start()
            decoding = st.seconds_decode
            if late is None:
                late = self._decode(held, mine, decode)
            for k, buf, h in incoming:
                moves.wait_recv(h)
                st.bytes_received += k[2]
                if late is None:
                    late = self._decode([(k, buf)], mine, decode)
            moves.finish()
            st.seconds_exchange += time.perf_counter() - t1 - (st.seconds_decode - decoding)
        return late

    def _decode(self, ranges: list[tuple[Key, torch.Tensor]], mine: dict[Key, list[Any]],
                decode: Callable[[Any, torch.Tensor], None]) -> Exception | None:
        t0 = time.perf_counter()
        try:
            for k, buf in ranges:
                for rec in mine.get(k, ()):
                    decode(rec, buf)
        except Exception as e:  # noqa: BLE001 - returned: raised after the last round
            return e
        finally:
            self.stats.seconds_decode += time.perf_counter() - t0
        return None


def _shareable(rec: Any, whole_below: int, metadata: Any) -> bool:
    """Whether this rank's need of record ``rec`` is the whole record, so that the record can be
    shared: a record shorter than ``whole_below`` (the caller's read path reads it whole anyway),
    or one whose every item covers its whole saved chunk (``metadata``: the load's, for the chunk
    sizes; a read planned without DCP's planner is whole by construction). A rank that needs a
    part of a large record (resharding) reads that part alone, straight into its target: a chunk
    split between ranks is then read once without sharing, and replicas of a part read it each
    (sharing parts of records is not built)."""
    if rec.length < whole_below:
        return True
    for item in rec.items:
        if isinstance(item, WholeRead) or getattr(item, "type", None) == LoadItemType.BYTE_IO:
            continue  # a whole read; a non-tensor record is always read whole
        chunks = getattr((getattr(metadata, "state_dict_metadata", None) or {}).get(item.storage_index.fqn), "chunks",
                         None)
        chunk = next((c for c in chunks or () if tuple(c.offsets) == tuple(item.storage_index.offset or ())), None)
        if chunk is None or any(item.storage_offsets) or tuple(item.lengths) != tuple(chunk.sizes):
            return False
    return True


def _portable(error: Exception) -> Any:
    """``error`` if it survives pickling (it travels to the other ranks), else its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception that does not travel
        return RuntimeError(f"{type(error).__name__}: {error}")


def _nothing_to_fetch(rel: str, offset: int, into: torch.Tensor) -> bool:
    raise AssertionError("internal: a rank standing aside was given a range to read")


def _nothing_to_decode(rec: Any, data: torch.Tensor) -> None:
    raise AssertionError("internal: a rank standing aside was given a range to decode")
