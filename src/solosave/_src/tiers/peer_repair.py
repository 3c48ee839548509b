"""Restoring hosts' fast tiers from their peers (checkpoints saved with ``peer_copies``).

The peer copies (``tiers/peer_copy.py``) leave, on the fast tier of host ``h``, the files of its
own ranks and of the hosts it keeps copies of (``PeerPlacement.keeps``), the ``.metadata``, the
load index and the ``.solosave-peers`` sidecar (the layout). When hosts lost them (replaced
nodes, a wiped ``/dev/shm``), their ranks get them back over the network from whichever
surviving hosts hold them, before the restore chooses a tier; the durable tier is not read.
Who calls what (every rank of the process group, alone otherwise: nothing to do):

* :func:`restore_from_peers` (``integrations.find_restore_point(..., ranks_per_host=)`` with the
  steps under the save directory, ``solosave.load(..., ranks_per_host=)`` with the one
  checkpoint): every rank surveys the steps on its fast tier (:func:`survey`) -> **one**
  ``all_gather_object`` of the surveys (restore time only; never in a save) ->
  :func:`plan_repair`, the same on every rank: the newest step of which every rank's files are
  held, whole, by some host that has it published with the same ``save_id``, and for each host
  that misses part of what it should keep, a transfer of each missing rank's files from one of
  their holders (the least loaded so far: the transfers spread over the survivors) ->
  :func:`move_files`: the transfers in rounds in which every rank sends at most one stream and
  receives at most one -> one 8-byte ``all_reduce`` (every file written) -> the first rank of
  each repaired host writes the sidecar and publishes the load index and ``.metadata``,
  ``.metadata`` last -> one 8-byte ``all_reduce`` (so no rank looks before it is there).
* :func:`fetch_for_load` (``solosave.load`` of a fast copy with ``ranks_per_host``): the files
  this rank's load reads that its host does not hold (with more than K + 1 hosts, values kept by
  one rank, such as replicated tensors, sit on K + 1 hosts only) -> one ``all_gather_object`` of
  what each rank misses and what its host holds -> :func:`move_files` from the holders -> one
  8-byte ``all_reduce``. The load then reads its host's fast tier only.

With ``durable_root`` given, a step of which some rank's files are on no surviving host (more
than K hosts lost) is still repaired when the durable tier holds that step published, the same
checkpoint (its ``save_id``), with those files whole: only the files that no survivor holds are
read from the durable tier, by each host that keeps them; every other file comes from a peer.
The durable tier is surveyed (by the first rank, for the steps newer than what the peers alone
restore; one ``broadcast_object``) only when the peers alone cannot restore the newest step.
A step that neither the survivors nor the durable copy make whole is not repaired: the tier
choice that follows finds it incomplete and reads the durable copy, or an older step.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from solosave._src.coordination.channel import CollectiveCounter, DistChannel
from solosave._src.coordination.rendezvous import new_gloo_group
from solosave._src.coordination.transfer import PEER_FILE, Outgoing, open_whole, ring_pass
from solosave._src.core.errors import ChannelError, IndexUnusable, SolosaveError, describe
from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE
from solosave._src.formats.metadata_check import loads_metadata
from solosave._src.index.reader import LoadIndex
from solosave._src.storage.base import Storage
from solosave._src.storage.copy import stream_into
from solosave._src.storage.registry import storage_for
from solosave._src.tiers.peer_copy import PEERS_FILE, ranks_kept_here
from solosave._src.tiers.placement import PeerLayout, owner_of
from solosave._src.write.publish import commit_checkpoint, unpublish

log = logging.getLogger("solosave")

#: The files a host's first rank publishes after a repair, in this order.
_META = (INDEX_FILE, METADATA_FILE)


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


# -- what a host holds -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StepView:
    """What one rank finds of one step on its fast tier (gathered from every rank)."""

    name: str
    published: bool = False
    save_id: str | None = None
    #: Bytes of each rank's data files, for the ranks whose files are all here and whole.
    owners: dict[int, int] = field(default_factory=dict)
    #: The ``.solosave-peers`` sidecar (``PeerLayout.describe``), if any.
    layout: dict | None = None


def survey(directory: str, st: Storage) -> StepView:
    """This rank's :class:`StepView` of ``directory``. Never raises: what cannot be read is not held."""
    name = st.basename(directory)
    try:
        sizes = st.sizes(directory)
    except (OSError, ValueError):
        return StepView(name)
    if METADATA_FILE not in sizes:
        return StepView(name)
    files, ends, save_id = _listed_files(directory, st)
    if files is None:
        return StepView(name)
    owners: dict[int, int] = {}
    whole: dict[int, bool] = {}
    for i, f in enumerate(files):
        m = owner_of(f)
        if m is None:
            continue
        need = ends[i] if ends is not None else 0
        whole[m] = whole.get(m, True) and sizes.get(f, -1) >= need
        owners[m] = owners.get(m, 0) + max(sizes.get(f, 0), 0)
    layout = None
    if PEERS_FILE in sizes:
        try:
            layout = json.loads(st.read(st.join(directory, PEERS_FILE)))
            PeerLayout.from_description(layout)
        except (OSError, ValueError):
            layout = None
    return StepView(name, True, save_id, {o: b for o, b in owners.items() if whole[o]}, layout)


def _listed_files(directory: str, st: Storage) -> tuple[list[str] | None, list[int] | None, str | None]:
    """The data files the checkpoint names (from its load index, with their ends, else from
    ``.metadata``) and its ``save_id``; ``(None, None, None)`` if neither can be read."""
    try:
        idx = LoadIndex.open(directory, st)
    except (IndexUnusable, OSError, ValueError):
        idx = None
    if idx is not None:
        try:
            ends = list(idx.file_ends) if idx.file_ends is not None else None
            return list(idx.files), ends, str(idx.header["save_id"])
        except (KeyError, ValueError, TypeError):
            pass
        finally:
            idx.close()
    where = st.join(directory, METADATA_FILE)
    try:
        md = loads_metadata(st.read(where), where)
    except (OSError, ValueError, SolosaveError):
        return None, None, None
    names = sorted({getattr(info, "relative_path", "") for info in (md.storage_data or {}).values()})
    save_id = getattr(md.storage_meta, "save_id", None)
    return [n for n in names if n], None, str(save_id) if save_id else None


# -- the plan, the same on every rank --------------------------------------------------------------
@dataclass(frozen=True)
class Transfer:
    """Files that rank ``src`` sends to rank ``dst``: rank ``owner``'s data files, or (``owner``
    ``None``) the load index and ``.metadata``, or the named ``files``."""

    src: int
    dst: int
    owner: int | None = None
    files: tuple[str, ...] = ()
    size: int = 0


@dataclass(frozen=True)
class RepairPlan:
    """:func:`plan_repair`'s answer: the step, its name, the transfers, and the hosts repaired."""

    step: int
    name: str
    layout: PeerLayout
    transfers: tuple[Transfer, ...]
    #: Hosts that receive files; of them, ``rebuilt``: those without the step published (their
    #: ``.metadata`` comes from a peer and is published last). The others keep theirs.
    repaired: frozenset[int]
    rebuilt: frozenset[int] = frozenset()
    #: ``(rank, owner)``: rank ``rank`` copies rank ``owner``'s data files from the durable copy
    #: (no surviving host holds them).
    from_durable: tuple[tuple[int, int], ...] = ()


def plan_repair(views: Sequence[Mapping[int, StepView]], ranks_per_host: int,
                durable: Mapping[int, StepView] | None = None) -> RepairPlan | None:
    """The newest step that the hosts can restore from each other (see the module docstring):
    ``views[r]``, rank ``r``'s view of each step; ``durable``, the durable copy's view of some
    steps (files no survivor holds come from there). ``None`` when no step can be made whole."""
    W, L = len(views), ranks_per_host
    hosts = W // L
    for step in sorted({s for v in views for s in v}, reverse=True):
        host_view = [views[h * L].get(step) for h in range(hosts)]
        good = [v is not None and v.published and v.save_id is not None for v in host_view]
        ids = {v.save_id for v, ok in zip(host_view, good) if ok and v is not None}
        if len(ids) != 1:
            continue  # nowhere published, or two checkpoints under one name: not from peers
        layout = _layout_of([v for v, ok in zip(host_view, good) if ok and v is not None], W, L)
        if layout is None:
            continue
        plan = _transfers(step, host_view, good, layout, _same(durable, step, next(iter(ids))))
        if plan is not None:
            return plan
    return None


def _layout_of(published: Sequence[StepView], world: int, ranks_per_host: int) -> PeerLayout | None:
    """The step's layout from a sidecar that fits this job; ``None`` when the sidecars name
    another one (saved at another world size: not restorable from peers). Without any sidecar
    (saved before they were written): one copy."""
    described = [v.layout for v in published if v.layout is not None]
    for d in described:
        try:
            layout = PeerLayout.from_description(d)
        except ValueError:
            continue
        if layout.ranks_per_host == ranks_per_host and layout.placement.hosts * ranks_per_host == world:
            return layout
    if described:
        return None
    try:
        return PeerLayout.of(world, ranks_per_host, 1)
    except ValueError:
        return None


def _same(durable: Mapping[int, StepView] | None, step: int, save_id: str | None) -> StepView | None:
    """The durable copy's view of ``step`` if it is published and the same checkpoint."""
    v = None if durable is None else durable.get(step)
    return v if v is not None and v.published and v.save_id == save_id else None


def _transfers(step: int, host_view: Sequence[StepView | None], good: Sequence[bool],
               layout: PeerLayout, durable: StepView | None = None) -> RepairPlan | None:
    """The transfers that give every host what it should keep of ``step``, or ``None`` when
    some rank's files are held by no host and not whole in ``durable`` (the durable copy of the
    same checkpoint). A host holds a rank's files only if it has the step published and the
    layout says it keeps them (a stray file of another save is not a copy)."""
    L, p = layout.ranks_per_host, layout.placement
    W = p.hosts * L
    kept = [layout.kept_ranks(h) for h in range(p.hosts)]
    holders: dict[int, list[int]] = {o: [h for h, v in enumerate(host_view) if good[h] and v is not None
                                         and o in v.owners and o in kept[h]] for o in range(W)}
    nobody = {o for o, hs in holders.items() if not hs}
    if nobody and (durable is None or not nobody <= set(durable.owners)):
        return None
    sizes = {o: max(v.owners[o] for v in (host_view[h] for h in hs) if v is not None)
             for o, hs in holders.items() if hs}
    load = [0] * p.hosts
    out: list[Transfer] = []
    from_durable: list[tuple[int, int]] = []
    repaired, rebuilt = set(), set()
    for h in range(p.hosts):
        missing = sorted(o for o in kept[h] if h not in holders[o])
        if not missing and good[h]:
            continue
        repaired.add(h)
        for o in missing:
            if o in nobody:
                from_durable.append((layout.rank_on(h, o), o))
                continue
            src = min(holders[o], key=lambda s: (load[s], s))
            load[src] += sizes[o]
            out.append(Transfer(layout.rank_on(src, o), layout.rank_on(h, o), o, size=sizes[o]))
        if not good[h]:  # rebuilt whole: its .metadata too, from a host that keeps its own
            rebuilt.add(h)
            src = min((s for s in range(len(good)) if good[s]), key=lambda s: (load[s], s))
            out.append(Transfer(src * L, h * L, None, _META))
    name = next(v.name for v in host_view if v is not None)
    return RepairPlan(step, name, layout, tuple(out), frozenset(repaired), frozenset(rebuilt), tuple(from_durable))


def schedule(transfers: Iterable[Transfer]) -> list[list[Transfer]]:
    """The transfers in rounds in which each rank sends at most one and receives at most one
    (largest first; the same on every rank)."""
    rounds: list[list[Transfer]] = []
    busy: list[tuple[set[int], set[int]]] = []
    for t in sorted(transfers, key=lambda t: (-t.size, t.dst, t.src, t.owner if t.owner is not None else -1,
                                              t.files)):
        i = next((k for k, (senders, receivers) in enumerate(busy)
                  if t.src not in senders and t.dst not in receivers), len(rounds))
        if i == len(rounds):
            rounds.append([])
            busy.append((set(), set()))
        rounds[i].append(t)
        busy[i][0].add(t.src)
        busy[i][1].add(t.dst)
    return rounds


# -- moving the files ------------------------------------------------------------------------------
def move_files(channel: DistChannel, st: Storage, directory: str, transfers: Iterable[Transfer],
               kept: dict[str, bytes]) -> str | None:
    """Every rank: run the transfers in :func:`schedule`'s rounds (only the ranks of a transfer
    take part in it). Received data files are renamed into place once whole; the load index and
    ``.metadata`` are kept in ``kept`` (published by the caller). Returns this rank's first error."""
    ch, me = channel, channel.rank
    error = None
    for round_ in schedule(transfers):
        out = next((t for t in round_ if t.src == me), None)
        into = next((t for t in round_ if t.dst == me), None)
        if out is None and into is None:
            continue
        outgoing: list[Outgoing] = []
        if out is not None:
            try:
                outgoing = _outgoing(st, directory, out)
            except OSError as e:  # nothing sent; the pass still runs, in step
                error = error or f"listing {directory} failed: {describe(e)}"
        res = ring_pass(ch, None if out is None else out.dst, None if into is None else into.src, outgoing,
                        _sink(st, directory, into, kept), max_bytes=st.free_bytes(directory))
        error = error or res.error
    return error


def _outgoing(st: Storage, directory: str, t: Transfer) -> list[Outgoing]:
    """The files of transfer ``t`` here; ``FileNotFoundError`` when what the plan counted on is
    gone (reported, never sent as an empty set the receiver would take as complete)."""
    names = set(st.listdir(directory))
    if t.owner is None:
        wanted = [n for n in t.files if n in names]
        if METADATA_FILE in t.files and METADATA_FILE not in wanted or not wanted:
            raise FileNotFoundError(f"{directory}: {', '.join(n for n in t.files if n not in names)} gone")
    else:
        wanted = sorted(n for n in names if n.startswith(f"__{t.owner}_") and PEER_FILE.match(n))
        if not wanted:
            raise FileNotFoundError(f"{directory}: no data file of rank {t.owner} left to send")
    return [Outgoing(n, st, st.join(directory, n)) for n in wanted]


def _sink(st: Storage, directory: str, t: Transfer | None, kept: dict[str, bytes]) -> Any:
    def sink(name: str, size: int) -> Any:
        if t is None:
            raise ValueError(f"{name} was sent to a rank that expects nothing")
        if t.owner is None:
            if name not in t.files:
                raise ValueError(f"rank {t.src} sent {name!r}, not one of {list(t.files)}")
            if name in _META:
                return _Kept(kept, name)
        elif not name.startswith(f"__{t.owner}_"):
            raise ValueError(f"rank {t.src} sent {name!r}, not one of rank {t.owner}'s data files")
        return open_whole(st, st.join(directory, name), st.open_data)

    return sink


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


# -- the protocols ---------------------------------------------------------------------------------
def repair_from_peers(plan: RepairPlan, directory: str, channel: DistChannel, st: Storage,
                      durable_dir: str | None = None, durable_st: Storage | None = None) -> str | None:
    """Every rank: carry out ``plan`` for ``directory`` (see the module docstring); the files of
    ``plan.from_durable`` are copied from ``durable_dir`` (on ``durable_st``). Returns this
    rank's error (``None``: nothing went wrong here); whether the step is complete everywhere is
    for the tier choice that follows to find out. A repaired host's ``.metadata`` is removed
    first, and every file it receives is renamed into place once whole: a repair that fails
    leaves no file half-written and nothing published."""
    ch, L = channel, plan.layout.ranks_per_host
    here = ch.rank // L in plan.rebuilt
    error = None
    if here:
        try:
            st.makedirs(directory)
            unpublish(st, directory)
        except OSError as e:
            error = f"preparing {directory} failed: {describe(e)}"
    kept: dict[str, bytes] = {}
    error = move_files(ch, st, directory, plan.transfers, kept) or error
    owners = [o for r, o in plan.from_durable if r == ch.rank]
    if owners and error is None:
        error = _copy_from_durable(durable_st, durable_dir, st, directory, owners)
    ok = not ch.agree_ok(error)
    if ok and here and ch.rank % L == 0:
        error = _publish(st, directory, kept, plan.layout)
    ch.agree_ok(error)
    return error


def _copy_from_durable(src: Storage | None, source: str | None, st: Storage, directory: str,
                       owners: Sequence[int]) -> str | None:
    """Copy ranks ``owners``' data files from the durable copy ``source`` into ``directory``,
    each renamed into place once whole. Returns the error, if any."""
    if src is None or source is None:
        return f"the plan reads the durable tier, which this rank was not given ({directory})"
    try:
        # the data files and their checksum sidecars, as a peer would send them
        names = sorted(n for n in src.listdir(source)
                       if PEER_FILE.match(n) and owner_of(n.removesuffix(".crc32")) in owners)
        found = {owner_of(n) for n in names if not n.endswith(".crc32")}
        if found != set(owners):
            return f"{source} holds no data file of rank(s) {sorted(set(owners) - found)}"
        for n in names:
            out = open_whole(st, st.join(directory, n), st.open_data)
            try:
                stream_into(src, src.join(source, n), out)
            except BaseException:
                out.close()
                raise
            out.commit()
            out.close()
    except Exception as e:  # noqa: BLE001 - reported, and agreed on by every rank
        return f"copying rank(s) {list(owners)}' files from the durable copy {source} failed: {describe(e)}"
    return None


def _publish(st: Storage, directory: str, kept: Mapping[str, bytes], layout: PeerLayout) -> str | None:
    try:
        st.commit(st.join(directory, PEERS_FILE), json.dumps(layout.describe()).encode())
        if METADATA_FILE in kept:
            commit_checkpoint(st, directory, kept[METADATA_FILE], kept.get(INDEX_FILE))
        elif not st.exists(st.join(directory, METADATA_FILE)):
            return f"no {METADATA_FILE} reached this host for {directory}"
    except OSError as e:
        return f"publishing {METADATA_FILE} in {directory} failed: {describe(e)}"
    return None


def restore_from_peers(save_dir: str | os.PathLike, steps: Mapping[int, str], ranks_per_host: int,
                       process_group: Any = None, storage_options: Mapping[str, Any] | None = None,
                       durable_root: str | os.PathLike | None = None) -> None:
    """Every rank: bring the newest step under ``save_dir`` that the hosts hold between them
    (``steps``: this rank's ``{step: name}`` of the steps it lists on its fast tier) to the
    hosts that miss part of it (see the module docstring); with ``durable_root``, the files that
    no survivor holds come from the durable copy under it. A repair that failed is logged, not
    raised: the tier choice that follows finds the step incomplete there and reads the durable
    copy. A broken channel (a peer gone or late) raises ``ChannelError``: the process group
    cannot be trusted for the choice's own collectives after it."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    channel = peer_channel(process_group, ranks_per_host)
    st = storage_for(save_dir, storage_options)
    mine = {s: survey(st.join(os.fspath(save_dir), n), st) for s, n in steps.items()}
    views = channel.all_gather_object(mine)
    plan = plan_repair(views, ranks_per_host)
    newer = {s: v.name for view in views for s, v in view.items() if plan is None or s > plan.step}
    dst = None
    if durable_root is not None and newer:  # the peers alone cannot restore the newest step
        dst = storage_for(durable_root, storage_options)
        root = os.fspath(durable_root)
        found = None
        if channel.is_coordinator:
            found = {s: survey(dst.join(root, n), dst) for s, n in newer.items()}
        plan = plan_repair(views, ranks_per_host, channel.broadcast_object(found)) or plan
    if plan is None or not (plan.transfers or plan.from_durable):
        return
    durable_dir = None if dst is None else dst.join(os.fspath(durable_root), plan.name)  # type: ignore[arg-type]
    try:
        error = repair_from_peers(plan, st.normalize(st.join(os.fspath(save_dir), plan.name)), channel, st,
                                  durable_dir, dst)
    except ChannelError as e:
        raise ChannelError(f"restoring step {plan.step} from the peers failed between ranks: {e}") from e
    if error is not None:
        log.warning("solosave: restoring step %s on this host's fast tier from its peers failed: %s", plan.step,
                    error)


def fetch_for_load(directory: str, needed: Iterable[str], ranks_per_host: int, process_group: Any = None,
                   storage_options: Mapping[str, Any] | None = None) -> str | None:
    """Every rank: bring to this rank's host the data files of ``directory`` that its load reads
    (``needed``) and the host does not hold, from hosts that do (see the module docstring).
    Returns this rank's error; a file no host holds is left missing (the load then fails and,
    with two tiers, reads the durable copy). Only the files a host keeps under the checkpoint's
    layout count as held there. A broken channel raises ``ChannelError``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    channel = peer_channel(process_group, ranks_per_host)
    st = storage_for(directory, storage_options)
    try:
        sizes = st.sizes(directory)
    except (OSError, ValueError):
        sizes = {}
    missing = sorted(n for n in set(needed) if n not in sizes and PEER_FILE.match(n))
    kept = ranks_kept_here(st, directory, sizes, channel.rank, channel.world_size)
    held = {n: s for n, s in sizes.items() if (o := owner_of(n)) is not None and (kept is None or o in kept)}
    gathered = channel.all_gather_object((missing, held if channel.rank % ranks_per_host == 0 else None))
    transfers = _fetches(gathered, ranks_per_host)
    if not transfers:
        return None
    error = move_files(channel, st, directory, transfers, {})
    channel.agree_ok(error)
    return error


def _fetches(gathered: Sequence[tuple[list[str], dict[str, int] | None]], ranks_per_host: int) -> list[Transfer]:
    """The transfers of :func:`fetch_for_load`: each file a host misses, once per host, to the
    lowest of its ranks that needs it, from the least loaded host that holds it."""
    L = ranks_per_host
    hosts = len(gathered) // L
    held = [gathered[h * L][1] or {} for h in range(hosts)]
    load = [0] * hosts
    out: list[Transfer] = []
    for h in range(hosts):
        wanted: dict[str, int] = {}
        for r in range(h * L, h * L + L):
            for n in gathered[r][0]:
                wanted.setdefault(n, r)
        for n, dst in sorted(wanted.items()):
            sources = [s for s in range(hosts) if s != h and n in held[s]]
            if not sources:
                continue
            src = min(sources, key=lambda s: (load[s], s))
            load[src] += held[src][n]
            out.append(Transfer(src * L + dst % L, dst, None, (n,), held[src][n]))
    return out


__all__ = ["RepairPlan", "StepView", "Transfer", "fetch_for_load", "move_files", "peer_channel", "plan_repair",
           "repair_from_peers", "restore_from_peers", "schedule", "survey"]
