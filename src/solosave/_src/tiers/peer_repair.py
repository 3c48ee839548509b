"""Restoring a host's fast tier from its peers (checkpoints saved with ``peer_copy``).

The peer copy (``tiers/peer_copy.py``) leaves, on the fast tier of host ``h`` (ranks ``h*L`` to
``h*L+L-1``), the files of its own ranks and of host ``h-1``, and the ``.metadata``. When a host
lost them (a replaced node, a wiped ``/dev/shm``), its ranks get them back from the two hosts
that hold them, over the network, before the restore chooses a tier; the durable tier is not
read. Who calls what (every rank of the process group, alone otherwise: nothing to do):

* :func:`restore_from_peers` (``integrations.find_restore_point(..., ranks_per_host=)`` with the
  steps under the save directory, ``solosave.load(..., ranks_per_host=)`` with the one
  checkpoint) runs the two below. :func:`repairable_step`: every rank lists the steps complete
  on its fast tier -> **one** ``all_gather_object`` of those
  lists (restore time only; never in a save) -> the newest step that every host either holds
  or can get back (both of its neighbour hosts hold it), the same on every rank.
* :func:`repair_from_peers` for that step, when some host misses it: two
  :func:`~solosave._src.coordination.transfer.ring_pass` es (to ``r-L``: the files of ``r-L``
  that this host keeps as its peer copies, and, from a host's first rank, the load index and
  ``.metadata``; to ``r+L``: this rank's own files), only hosts that hold the step sending and
  only hosts that miss it receiving -> one 8-byte ``all_reduce`` (every file written) -> the
  first rank of each repaired host publishes the load index and ``.metadata``, ``.metadata``
  last -> one 8-byte ``all_reduce`` (so no rank looks before it is there).

The restore then chooses a tier as without peers (``tiers/choice.py``): a repair that did not
complete leaves the step incomplete on that host, and the durable copy is read.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from solosave._src.coordination.channel import CollectiveCounter, DistChannel
from solosave._src.coordination.rendezvous import new_gloo_group
from solosave._src.coordination.transfer import PEER_FILE, Outgoing, open_whole, ring_pass
from solosave._src.core.errors import ChannelError, describe
from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE
from solosave._src.storage.registry import storage_for
from solosave._src.write.publish import commit_checkpoint, unpublish

log = logging.getLogger("solosave")


def peer_channel(process_group: Any, ranks_per_host: int, timeout: float = 600.0) -> DistChannel:
    """The channel of a restore from peers: ``process_group`` if it is a gloo group, else a gloo
    group over the same ranks (point-to-point messages of CPU bytes; created collectively, every
    rank of the job). Raises ``ValueError`` if the ranks do not form two hosts or more."""
    world = dist.get_world_size(process_group)
    if ranks_per_host < 1 or world % ranks_per_host or world // ranks_per_host < 2:
        raise ValueError(f"ranks_per_host={ranks_per_host} does not split the {world} ranks into two hosts or more "
                         "of the same size: pass the ranks per host the checkpoint was saved with")
    try:
        gloo = dist.get_backend(process_group) == "gloo"
    except Exception:  # noqa: BLE001 - unknown backend: a gloo group of its own
        gloo = False
    if gloo:
        return DistChannel(process_group, timeout=timeout)
    return DistChannel(new_gloo_group(process_group, CollectiveCounter(), timeout), timeout=timeout)


def repairable_step(complete: Mapping[int, str], ranks_per_host: int,
                    channel: DistChannel) -> tuple[int, str, list[bool]] | None:
    """``complete``: this rank's ``{step: name}`` complete on its fast tier. Returns the newest
    step every host holds or can get back from its neighbours, as ``(step, name, which ranks
    hold it)``, or ``None``; the same on every rank (see the module docstring)."""
    lists = channel.all_gather_object(sorted(complete.items()))
    return newest_restorable([dict(items) for items in lists], ranks_per_host)


def newest_restorable(held: Sequence[Mapping[int, str]], ranks_per_host: int) -> tuple[int, str, list[bool]] | None:
    """:func:`repairable_step`'s choice from every rank's ``{step: name}`` (``held[r]``, rank
    order): the newest step that every host holds, or can get back because both of its
    neighbour hosts hold it."""
    L = ranks_per_host
    hosts = len(held) // L
    for step in sorted({s for d in held for s in d}, reverse=True):
        host_has = [all(step in held[r] for r in range(h * L, h * L + L)) for h in range(hosts)]
        if all(has or (host_has[(h - 1) % hosts] and host_has[(h + 1) % hosts]) for h, has in enumerate(host_has)):
            name = next(d[step] for d in held if step in d)
            return step, name, [step in d for d in held]
    return None


def repair_from_peers(directory: str, holders: Sequence[bool], ranks_per_host: int, channel: DistChannel,
                      storage_options: Mapping[str, Any] | None = None) -> str | None:
    """Give every host that misses ``directory`` (``holders[r]``: rank ``r`` finds it complete)
    its files back from its neighbour hosts (see the module docstring). Returns this rank's
    error (``None``: nothing went wrong here); whether the step is complete everywhere is for
    the tier choice that follows to find out. A missing host's ``.metadata`` is removed first,
    and every file it receives is renamed into place once whole: a repair that fails leaves
    no file half-written and nothing published."""
    ch = channel
    W, L, r = ch.world_size, ranks_per_host, ch.rank
    missing = {k // L for k, ok in enumerate(holders) if not ok}
    if not missing:
        return None
    st = storage_for(directory, storage_options)
    directory = st.normalize(directory)
    here_missing = r // L in missing
    kept: dict[str, bytes] = {}
    error = None
    if here_missing:
        try:
            st.makedirs(directory)
            unpublish(st, directory)
        except OSError as e:
            error = f"preparing {directory} failed: {describe(e)}"

    def sink(name: str, size: int) -> Any:
        if not here_missing:
            raise ValueError(f"{name} was sent to a host that holds the checkpoint")
        if name in (METADATA_FILE, INDEX_FILE):
            return _Kept(kept, name)
        return open_whole(st, st.join(directory, name), st.open_data)

    nxt, prv = (r + L) % W, (r - L) % W
    for to, frm, rank_files, with_metadata in ((prv, nxt, prv, r % L == 0), (nxt, prv, r, False)):
        out: list[Outgoing] = []
        if not here_missing and to // L in missing:
            try:
                out = _files_of(st, directory, rank_files, with_metadata)
            except OSError as e:  # nothing sent; the pass still runs, in step
                error = error or f"listing {directory} failed: {describe(e)}"
        res = ring_pass(ch, to, frm, out, sink, max_bytes=st.free_bytes(directory))
        error = error or res.error
    ok = not ch.agree_ok(error)
    if ok and here_missing and r % L == 0:
        error = _publish(st, directory, kept)
    ch.agree_ok(error)
    return error


class _Kept:
    """A sink that keeps a small file (``.metadata``, the load index) to publish after the files."""

    def __init__(self, kept: dict[str, bytes], name: str) -> None:
        self._kept, self._name, self._buf = kept, name, io.BytesIO()

    def write(self, data: bytes) -> int:
        return self._buf.write(data)

    def commit(self) -> None:
        self._kept[self._name] = self._buf.getvalue()

    def close(self) -> None:
        self._buf = io.BytesIO()


def _files_of(st: Any, directory: str, rank: int, with_metadata: bool) -> list[Outgoing]:
    """Rank ``rank``'s data files (and sidecars) under ``directory`` on this host, and its load
    index and ``.metadata`` if asked for."""
    names = st.listdir(directory)
    out = [Outgoing(n, st, st.join(directory, n)) for n in sorted(names)
           if n.startswith(f"__{rank}_") and PEER_FILE.match(n)]
    if with_metadata:
        out += [Outgoing(n, st, st.join(directory, n)) for n in (INDEX_FILE, METADATA_FILE) if n in names]
    return out


def _publish(st: Any, directory: str, kept: Mapping[str, bytes]) -> str | None:
    if METADATA_FILE not in kept:
        return f"no {METADATA_FILE} reached this host for {directory}"
    try:
        commit_checkpoint(st, directory, kept[METADATA_FILE], kept.get(INDEX_FILE))
    except OSError as e:
        return f"publishing {METADATA_FILE} in {directory} failed: {describe(e)}"
    return None


def restore_from_peers(save_dir: str | os.PathLike, complete: Mapping[int, str], ranks_per_host: int,
                       process_group: Any = None, storage_options: Mapping[str, Any] | None = None) -> None:
    """Every rank: bring the newest step under ``save_dir`` that every host holds or can get
    back (``complete``: this rank's ``{step: name}`` complete on its fast tier) to the hosts
    that miss it: :func:`repairable_step`, then :func:`repair_from_peers`. Never raises for a
    repair that failed (logged, also an error between ranks): the tier choice that follows finds
    the step incomplete there and reads the durable copy, or fails in its own collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    channel = peer_channel(process_group, ranks_per_host)
    step = None
    try:
        found = repairable_step(complete, ranks_per_host, channel)
        if found is None:
            return
        step, name, holders = found
        st = storage_for(save_dir, storage_options)
        error = repair_from_peers(st.join(os.fspath(save_dir), name), holders, ranks_per_host, channel,
                                  storage_options)
    except ChannelError as e:
        error = f"between ranks: {e}"
    if error is not None:
        log.warning("solosave: restoring %s on this host's fast tier from its peers failed: %s",
                    "the newest step" if step is None else f"step {step}", error)


__all__ = ["newest_restorable", "peer_channel", "repair_from_peers", "repairable_step", "restore_from_peers"]
