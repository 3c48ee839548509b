"""The peer copies of two tiers (``peer_copies``): each host's files also on K other hosts.

With node-local fast tiers (an NVMe or ``/dev/shm`` per host, the same path on every host), a
lost host takes its ranks' files with it. With ``peer_copies=K`` each rank's copier (the
background thread of :mod:`solosave._src.tiers.durable`, on the durable channel) runs this stage
first, for every save published on the fast tier, before the durable copy. Hosts are consecutive
blocks of ``L = ranks_per_host`` ranks; where each host's files go is
:class:`~solosave._src.tiers.placement.PeerPlacement` (K other hosts, in K different failure
domains when there are enough). Who calls what, in order (every rank):

1. the coordinator posts the digest of the checkpoint's ``.metadata`` and the ``.metadata`` and
   load index themselves on the job's store (keys, not collectives); every other rank compares
   it with the ``.metadata`` it sees and removes one of an earlier save of the same name (never
   an old ``.metadata`` beside new data); seeing the coordinator's own from another host means
   the tier is shared, and no file is sent (each receiver tells its sender, one byte per round);
2. every rank, rounds ``j = 1..K``: one :func:`~solosave._src.coordination.transfer.ring_pass`
   (its own files to the same local rank of its host's j-th holder, the files of the host whose
   j-th holder it is in, written next to its own under the same names, each renamed into place
   once whole). Each round is a permutation of the hosts: every rank sends one stream and
   receives one, with one chunk in memory each way;
3. every rank: **one** 8-byte ``all_reduce`` of the status word (ok / failed, this stage's
   identity), whatever K and the number of hosts; then the coordinator drops the store keys;
4. agreed ok: the first rank of each host writes the ``.solosave-peers`` sidecar (the layout, for
   a later repair) and, on every host but the coordinator's, publishes the load index and
   ``.metadata`` on its fast tier, ``.metadata`` last (a failure there is reported on that rank
   only); agreed failed: every rank all-gathers the errors (failure path only).

Each host then holds its own ranks' files, those of the hosts it keeps copies of, and the
``.metadata``; a lost host's files are on K others (:mod:`solosave._src.tiers.peer_repair`).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from solosave._src.coordination.channel import Channel
from solosave._src.coordination.protocol import Status, save_identity
from solosave._src.coordination.transfer import PEER_FILE, Outgoing, open_whole, ring_pass
from solosave._src.core.errors import describe
from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE
from solosave._src.storage.registry import storage_for
from solosave._src.tiers.placement import PeerLayout
from solosave._src.write.publish import commit_checkpoint, unpublish
from solosave._src.write.writer import FileWriter

#: The sidecar that records a checkpoint's peer layout on each host (``PeerLayout.describe``).
PEERS_FILE = ".solosave-peers"


def copy_to_peers(channel: Channel, seq: int, directory: str, files: tuple[str, ...], writer: FileWriter,
                  layout: PeerLayout, storage_options: Mapping[str, Any] | None = None,
                  stop: Callable[[], bool] | None = None) -> dict[int, str]:
    """Run the peer stage of save ``seq`` (published at ``directory``) on this rank; returns the
    failures (per rank; the same on every rank except a host's own ``.metadata`` publication).
    Raises ``ChannelError`` / ``OutOfStep`` (the channel broke); any other error of this rank is
    reported through the status word, in step with the others."""
    ch, L = channel, layout.ranks_per_host
    st = storage_for(directory, storage_options)
    key = f"peer-metadata/{seq}"
    publish, shared, error = _share_metadata(ch, st, directory, key, L)
    try:
        st.makedirs(directory)
    except OSError as e:
        error = error or f"creating {directory} failed: {describe(e)}"
    for round_ in range(1, layout.copies + 1):
        nxt, prv = layout.send_to(ch.rank, round_), layout.recv_from(ch.rank, round_)
        # the receiver tells its sender whether it sees the sender's files already (a shared tier)
        receiver_has_them = ch.exchange(prv, b"1" if shared else b"0", nxt, 1) == b"1"
        outgoing = ([] if shared or receiver_has_them
                    else [Outgoing(rel, st, st.join(directory, rel)) for rel in files])
        res = ring_pass(ch, nxt, prv, outgoing, _sink_for(st, directory, prv, writer), stop,
                        max_bytes=st.free_bytes(directory))
        error = error or res.error
    agreed = ch.agree(Status.OK if error is None else Status.FAILED, save_identity(seq, "peer:" + directory),
                      f"peer copy of save {seq}", error=error)
    if ch.is_coordinator:
        ch.drop_value(key)
        ch.drop_value(key + "/digest")
    if agreed.status is not Status.OK:
        return agreed.failures
    if ch.rank % L == 0 and not shared:
        try:
            st.commit(st.join(directory, PEERS_FILE), json.dumps(layout.describe()).encode(), fsync=writer.fsync)
            if publish is not None:
                commit_checkpoint(st, directory, publish[METADATA_FILE], publish.get(INDEX_FILE),
                                  fsync=writer.fsync)
        except OSError as e:
            return {ch.rank: f"publishing {METADATA_FILE} on this host's fast tier failed: {describe(e)}"}
    return {}


def ranks_kept_here(st: Any, directory: str, names: Iterable[str], rank: int, world: int) -> set[int] | None:
    """The ranks whose files the host of ``rank`` keeps under the layout of ``directory``'s
    ``.solosave-peers`` sidecar (``names``: the directory's listing). ``None``: no sidecar, an
    unreadable one, or one saved at another world size (hosts are not the same ranks then)."""
    if PEERS_FILE not in names:
        return None
    try:
        layout = PeerLayout.from_description(json.loads(st.read(st.join(directory, PEERS_FILE))))
        if layout.placement.hosts * layout.ranks_per_host != world:
            return None
        return layout.kept_ranks(layout.host_of(rank))
    except Exception:  # noqa: BLE001 - an odd sidecar: every file counts
        return None


def _sink_for(st: Any, directory: str, sender: int, writer: FileWriter) -> Callable[[str, int], Any]:
    """Where the files of rank ``sender`` go: beside this rank's own, each renamed into place
    once whole; a name that is not one of ``sender``'s data files is refused."""

    def sink(name: str, size: int) -> Any:
        if not name.startswith(f"__{sender}_"):
            raise ValueError(f"rank {sender} sent {name!r}, not one of its data files")
        return open_whole(st, st.join(directory, name), writer.open, writer.fsync)

    return sink


def _share_metadata(ch: Channel, st: Any, directory: str, key: str,
                    ranks_per_host: int) -> tuple[dict[str, bytes] | None, bool, str | None]:
    """Step 1: the coordinator posts its ``.metadata``'s digest and the files themselves; every
    other rank compares the digest with the ``.metadata`` it sees. Returns what this rank
    publishes after the stage (``None``: nothing; only the first rank of each host other than
    the coordinator's does), whether this rank sees the coordinator's ``.metadata`` from another
    host (a fast tier shared with it: the files are there already), and the error. With more
    than K + 1 hosts a host's ``.metadata`` names files that only other hosts hold: the
    checkpoint is whole across the hosts, and a lost host is rebuilt from them."""
    error: str | None = None
    if ch.is_coordinator:
        try:
            md = st.read(st.join(directory, METADATA_FILE))
            files: dict[str, bytes] | None = _published_files(st, directory, md)
        except OSError as e:
            md, files = b"", None
            error = f"reading the published {METADATA_FILE} of {directory} failed: {describe(e)}"
        ch.post_value(key + "/digest", hashlib.sha256(md).hexdigest().encode())
        ch.post_value(key, pickle.dumps(files, protocol=pickle.HIGHEST_PROTOCOL))
        return None, False, error
    digest = ch.read_value(key + "/digest", ch.timeout).decode()
    same, error = _stale_metadata_removed(st, directory, digest)
    other_host = ch.rank // ranks_per_host != ch.coordinator // ranks_per_host
    publish = None
    if other_host and ch.rank % ranks_per_host == 0 and not same and error is None:
        posted = pickle.loads(ch.read_value(key, ch.timeout))  # noqa: S301 - this job's coordinator, private store
        if posted is None or not all(PEER_FILE.match(n) for n in posted):
            error = "the coordinator could not post its .metadata"
        else:
            publish = posted
    # ranks on the coordinator's host see its .metadata on any tier: that tells nothing
    return publish, same and other_host, error


def _published_files(st: Any, directory: str, md: bytes) -> dict[str, bytes]:
    """The coordinator's ``.metadata`` and load index (if any), for the store."""
    out = {METADATA_FILE: md}
    try:
        out[INDEX_FILE] = st.read(st.join(directory, INDEX_FILE))
    except FileNotFoundError:
        pass
    return out


def _stale_metadata_removed(st: Any, directory: str, digest: str) -> tuple[bool, str | None]:
    """A rank other than the coordinator: whether the ``.metadata`` it sees is the coordinator's
    (by its digest), and the error. One of an earlier save of the same name is removed (every
    rank of the host does it before it writes: never an old ``.metadata`` beside new data)."""
    marker = st.join(directory, METADATA_FILE)
    try:
        here = st.read(marker)
    except FileNotFoundError:
        return False, None
    except OSError as e:
        return False, f"reading {marker} failed: {describe(e)}"
    if hashlib.sha256(here).hexdigest() == digest:
        return True, None
    try:
        unpublish(st, directory)
    except OSError as e:
        return False, f"removing the earlier save's {marker} failed: {describe(e)}"
    return False, None


__all__ = ["PEERS_FILE", "copy_to_peers", "ranks_kept_here"]
