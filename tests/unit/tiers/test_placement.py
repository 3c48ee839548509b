"""Peer copies on any number of hosts: the placement rule, the options, and the plans of a
restore (tiers/placement.py, tiers/peer_repair.py), without processes."""

import argparse
import itertools
import os

import pytest

from solosave import CheckpointerOptions
from solosave._src.core.errors import OptionError
from solosave._src.save.options import add_option_flags, options_from_args, peer_layout, peer_ranks_per_host
from solosave._src.tiers.peer_repair import StepView, Transfer, _fetches, plan_repair, schedule
from solosave._src.tiers.placement import PeerLayout, PeerPlacement, owner_of


@pytest.mark.parametrize("hosts,copies", [(h, k) for h in (2, 3, 4, 5, 7, 8, 12, 16, 30, 64) for k in (1, 2, 3)
                                          if k < h])
def test_every_copy_on_another_host_and_each_round_a_permutation(hosts, copies):
    p = PeerPlacement(hosts, copies)
    for h in range(hosts):
        held = p.holders(h)
        assert len(set(held)) == copies and h not in held, (h, held)
    for j in range(1, copies + 1):  # round j: every host sends one stream and receives one
        assert sorted(p.holders(h)[j - 1] for h in range(hosts)) == list(range(hosts))
        assert all(p.holders(p.source_in_round(h, j))[j - 1] == h for h in range(hosts))
    assert sorted(len(p.sources(h)) for h in range(hosts)) == [copies] * hosts


def test_copies_go_to_other_failure_domains_when_there_are_enough():
    checked = 0
    for hosts in range(2, 65):
        for per_domain in (d for d in range(1, hosts + 1) if hosts % d == 0):
            for copies in range(1, min(hosts, 5)):
                p = PeerPlacement(hosts, copies, per_domain)
                if p.domains <= copies:
                    continue
                for h in range(hosts):
                    domains = {p.domain_of(x) for x in (h, *p.holders(h))}
                    assert len(domains) == copies + 1, (hosts, per_domain, copies, h, p.holders(h))
                checked += 1
    assert checked > 300
    # racks of 4 hosts, 16 hosts, one copy: never in the same rack
    p = PeerPlacement(16, 1, 4)
    assert all(p.domain_of(p.holders(h)[0]) != p.domain_of(h) for h in range(16))


def test_groups_make_fewer_sets_whose_loss_loses_files_than_one_ring():
    """Files are lost only when a host and its K holders are all lost: groups of K + 1 (cliques)
    leave hosts / (K + 1) such sets, a ring over all hosts one per host."""
    p = PeerPlacement(12, 2)
    fatal = {frozenset((h, *p.holders(h))) for h in range(12)}
    assert len(fatal) == 4 and all(len(s) == 3 for s in fatal)
    assert p.lost_files_of({0, 1, 2}) == [0, 1, 2]  # a whole clique
    assert p.lost_files_of({0, 1, 3}) == [] and p.lost_files_of({0, 3, 6, 9}) == []
    # any K hosts lost: nothing lost, for every K-subset
    for lost in itertools.combinations(range(12), 2):
        assert p.lost_files_of(set(lost)) == []


def test_what_cannot_be_placed_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="peer_copies=3 needs more than 3 hosts, but the job has 3"):
        PeerPlacement(3, 3)
    with pytest.raises(ValueError, match="hosts_per_domain=4 does not divide the 6 hosts"):
        PeerPlacement(6, 1, 4)
    with pytest.raises(ValueError, match="two hosts or more"):
        PeerPlacement(1, 1)
    with pytest.raises(ValueError, match="copies must be a whole number >= 1"):
        PeerPlacement(4, 0)


def test_the_options_and_their_flags(monkeypatch):
    parser = argparse.ArgumentParser()
    add_option_flags(parser)
    args = parser.parse_args(["--ckpt-durable-root", "/d", "--ckpt-peer-copies", "2", "--ckpt-ranks-per-host", "2",
                              "--ckpt-hosts-per-domain", "2"])
    o = options_from_args(args)
    layout = peer_layout(o, 16)
    assert layout is not None and layout.describe() == {"ranks_per_host": 2, "hosts": 8, "copies": 2,
                                                        "hosts_per_domain": 2}
    assert PeerLayout.from_description(layout.describe()) == layout
    assert peer_ranks_per_host(CheckpointerOptions(), 8) == 0 and peer_layout(CheckpointerOptions(), 8) is None
    one = CheckpointerOptions(durable_root="/d", peer_copy=True, ranks_per_host=1)  # peer_copy=True: K = 1
    assert peer_layout(one, 5).copies == 1 and peer_layout(one, 5).placement.hosts == 5  # any number of hosts
    with pytest.raises(OptionError, match="peer_copies needs durable_root"):
        CheckpointerOptions(peer_copies=1)
    with pytest.raises(OptionError, match="peer_copies must be a whole number >= 0"):
        CheckpointerOptions(durable_root="/d", peer_copies=-1)
    with pytest.raises(OptionError, match="hosts_per_domain must be a whole number >= 1"):
        CheckpointerOptions(hosts_per_domain=0)
    with pytest.raises(ValueError, match="peer_copies=2 needs more than 2 hosts, but the job has 2"):
        peer_layout(o, 4)
    with pytest.raises(ValueError, match="at least two hosts of 2 rank"):
        peer_layout(o, 3)
    env = CheckpointerOptions(durable_root="/d", peer_copies=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert peer_ranks_per_host(env, 6) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="pass ranks_per_host .* or launch with torchrun"):
        peer_ranks_per_host(env, 4)


def test_rank_to_rank_pairs_keep_the_local_rank():
    layout = PeerLayout.of(6, 2, 1)  # 3 hosts of 2 ranks
    assert [layout.send_to(r, 1) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [layout.recv_from(r, 1) for r in range(6)] == [4, 5, 0, 1, 2, 3]
    assert owner_of("__12_3.distcp") == 12 and owner_of("__1_0.distcp.crc32") is None and owner_of(".metadata") is None


# -- the plan of a restore, the same on every rank ----------------------------------------------------
def _views(layout, held_hosts, step=5, save_id="s", lost=()):
    """Every rank's view of ``step`` after a save with ``layout``, hosts in ``lost`` empty."""
    L, p = layout.ranks_per_host, layout.placement
    views = []
    for r in range(p.hosts * L):
        h = r // L
        if h in lost:
            views.append({})
            continue
        owners = {o: 100 for k in p.keeps(h) for o in range(k * L, k * L + L)}
        views.append({step: StepView(f"iter_{step:07d}", True, save_id, owners, layout.describe())})
    return views


def test_a_restore_with_no_host_lost_moves_nothing():
    layout = PeerLayout.of(8, 2, 1)
    plan = plan_repair(_views(layout, None), 2)
    assert plan is not None and plan.step == 5 and plan.transfers == () and not plan.repaired


@pytest.mark.parametrize("hosts,copies", [(4, 1), (4, 2), (5, 2), (7, 3), (3, 2)])
def test_any_k_lost_hosts_are_rebuilt_from_the_survivors(hosts, copies):
    L = 2
    layout = PeerLayout.of(hosts * L, L, copies)
    for lost in itertools.combinations(range(hosts), copies):
        plan = plan_repair(_views(layout, None, lost=set(lost)), L)
        assert plan is not None and plan.repaired == frozenset(lost), lost
        for h in lost:  # every file it keeps, from a survivor that holds it, and the .metadata
            got = {t.owner for t in plan.transfers if t.dst // L == h and t.owner is not None}
            assert got == {o for k in layout.placement.keeps(h) for o in range(k * L, k * L + L)}
            assert any(t.owner is None and t.dst == h * L for t in plan.transfers)
        for t in plan.transfers:
            assert t.src // L not in lost and t.src % L == t.dst % L
        rounds = schedule(plan.transfers)
        for r in rounds:
            assert len({t.src for t in r}) == len(r) and len({t.dst for t in r}) == len(r)
        assert sum(len(r) for r in rounds) == len(plan.transfers)


def test_the_transfers_spread_over_the_holders():
    layout = PeerLayout.of(8, 1, 3)  # 8 hosts of one rank, 3 copies: a lost host's files are on 3 others
    plan = plan_repair(_views(layout, None, lost={0}), 1)
    sources = [t.src for t in plan.transfers if t.owner is not None]
    assert len(sources) == 4 and len(set(sources)) >= 3, plan.transfers


def test_more_hosts_lost_than_copies_falls_back_or_takes_an_older_step():
    layout = PeerLayout.of(4, 1, 1)
    lost = set(layout.placement.groups[0])  # a whole group: its files are on no survivor
    assert plan_repair(_views(layout, None, lost=lost), 1) is None
    views = _views(layout, None, lost=lost)
    for r, v in enumerate(_views(layout, None, step=4)):  # an older step every host still holds
        views[r].update(v)
    plan = plan_repair(views, 1)
    assert plan is not None and plan.step == 4 and plan.transfers == ()


@pytest.mark.parametrize("hosts,copies", [(4, 1), (4, 2), (5, 2), (6, 1)])
def test_more_hosts_lost_than_copies_read_only_the_files_nobody_holds_from_the_durable_copy(hosts, copies):
    L = 2
    layout = PeerLayout.of(hosts * L, L, copies)
    every = {o: 100 for o in range(hosts * L)}
    durable = {5: StepView("iter_0000005", True, "s", every)}
    for lost in itertools.combinations(range(hosts), copies + 1):
        views = _views(layout, None, lost=set(lost))
        held = {o for h in range(hosts) if h not in lost for k in layout.placement.keeps(h)
                for o in range(k * L, k * L + L)}
        plan = plan_repair(views, L, durable)
        assert plan is not None and plan.step == 5 and plan.repaired == frozenset(lost), lost
        for h in lost:  # every file it keeps: from a survivor where one holds it, else from the durable copy
            keeps = {o for k in layout.placement.keeps(h) for o in range(k * L, k * L + L)}
            peers = {t.owner for t in plan.transfers if t.dst // L == h and t.owner is not None}
            durable_here = {o for r, o in plan.from_durable if r // L == h}
            assert peers == keeps & held and durable_here == keeps - held, (lost, h)
            assert all(r % L == o % L for r, o in plan.from_durable)
        assert {o for _, o in plan.from_durable} == set(range(hosts * L)) - held
        if held == set(range(hosts * L)):
            assert plan.from_durable == ()


def test_the_durable_copy_is_used_only_when_it_is_the_same_checkpoint_and_whole():
    layout = PeerLayout.of(4, 1, 1)
    lost = set(layout.placement.groups[0])
    nobody = {o for h in lost for o in [h]}
    views = _views(layout, None, lost=lost)
    assert plan_repair(views, 1, {5: StepView("iter_0000005", True, "another job", {o: 1 for o in range(4)})}) is None
    assert plan_repair(views, 1, {5: StepView("iter_0000005", False, "s", {})}) is None
    partial = {o: 1 for o in range(4) if o != min(nobody)}  # a file nobody else holds is not whole there
    assert plan_repair(views, 1, {5: StepView("iter_0000005", True, "s", partial)}) is None
    assert plan_repair(views, 1, {4: StepView("iter_0000004", True, "s", {o: 1 for o in range(4)})}) is None
    plan = plan_repair(views, 1, {5: StepView("iter_0000005", True, "s", {o: 1 for o in range(4)})})
    assert plan is not None and {o for _, o in plan.from_durable} == nobody


def test_two_checkpoints_under_one_name_are_never_mixed():
    layout = PeerLayout.of(4, 1, 1)
    views = _views(layout, None, lost={1})
    views[2] = {5: StepView("iter_0000005", True, "another job", views[2][5].owners, layout.describe())}
    assert plan_repair(views, 1) is None


def test_a_load_fetches_each_missing_file_once_per_host_from_the_least_loaded_holder():
    # 3 hosts of 2 ranks; both ranks of host 0 need __4_0 (kept by host 2 only); rank 1 needs __2_0
    gathered = [(["__4_0.distcp"], {"__0_0.distcp": 10}), (["__4_0.distcp", "__2_0.distcp"], None),
                ([], {"__2_0.distcp": 10, "__4_0.distcp": 30}), ([], None),
                ([], {"__4_0.distcp": 30, "__2_0.distcp": 10}), ([], None)]
    got = _fetches(gathered, 2)
    assert sorted((t.files, t.dst) for t in got) == [(("__2_0.distcp",), 1), (("__4_0.distcp",), 0)]
    assert {t.src // 2 for t in got} == {1, 2}  # spread: one from each holder
    assert all(isinstance(t, Transfer) and t.src % 2 == t.dst % 2 for t in got)


def test_a_host_missing_only_some_files_keeps_its_metadata():
    """Review finding: a published host that misses one copy gets that copy only; it is not
    unpublished, and a wholly lost host's .metadata comes from a published host."""
    layout = PeerLayout.of(4, 1, 1)
    views = _views(layout, None, lost={3})
    partial = layout.placement.keeps(1)[1]  # host 1 lost the copy it keeps
    v = views[1][5]
    views[1] = {5: StepView(v.name, True, v.save_id, {o: b for o, b in v.owners.items() if o != partial}, v.layout)}
    plan = plan_repair(views, 1)
    assert plan.repaired == {1, 3} and plan.rebuilt == {3}
    assert [t.owner for t in plan.transfers if t.dst == 1] == [partial]  # that copy, and no .metadata
    meta = [t for t in plan.transfers if t.owner is None]
    assert len(meta) == 1 and meta[0].dst == 3 and meta[0].src != 3


def test_stray_files_and_other_layouts_are_not_copies():
    layout = PeerLayout.of(4, 1, 1)
    views = _views(layout, None, lost={0})
    # host 2 also has a stray file of rank 0 (another save's): not one of the files it keeps
    stray = next(h for h in range(1, 4) if 0 not in {o for k in layout.placement.keeps(h) for o in (k,)})
    v = views[stray][5]
    views[stray] = {5: StepView(v.name, True, v.save_id, {**v.owners, 0: 100}, v.layout)}
    plan = plan_repair(views, 1)
    holder = layout.placement.holders(0)[0]
    assert {t.src for t in plan.transfers if t.owner == 0} == {holder}
    # sidecars of another world size: not restorable from peers (no made-up layout)
    other = PeerLayout.of(8, 2, 1).describe()
    views = [{s: StepView(x.name, x.published, x.save_id, x.owners, other) for s, x in v.items()}
             for v in _views(layout, None, lost={0})]
    assert plan_repair(views, 1) is None


def test_complete_here_at_another_world_size_checks_every_file(tmp_path):
    """Review finding: a rank beyond the saved hosts raised KeyError inside the tier choice."""
    import json

    from solosave._src.formats.dcp import METADATA_FILE
    from solosave._src.storage.registry import storage_for
    from solosave._src.tiers.peer_copy import PEERS_FILE, ranks_kept_here

    (tmp_path / PEERS_FILE).write_text(json.dumps(PeerLayout.of(4, 2, 1).describe()))
    (tmp_path / METADATA_FILE).write_bytes(b"x")
    st, names = storage_for(str(tmp_path)), {PEERS_FILE, METADATA_FILE}
    assert ranks_kept_here(st, str(tmp_path), names, 1, 4) == {0, 1, 2, 3}  # 2 hosts, K=1: everything
    assert ranks_kept_here(st, str(tmp_path), names, 6, 8) is None  # restored at 8 ranks: every file
    assert ranks_kept_here(st, str(tmp_path), names, 0, 2) is None


def test_files_from_the_durable_copy_come_with_their_checksum_sidecars(tmp_path):
    from solosave._src.storage.local import LocalStorage
    from solosave._src.tiers.peer_repair import _copy_from_durable

    durable, fast = tmp_path / "durable", tmp_path / "fast"
    durable.mkdir()
    fast.mkdir()
    for name, data in {"__0_0.distcp": b"zero", "__0_0.distcp.crc32": b"crc", "__1_0.distcp": b"one"}.items():
        (durable / name).write_bytes(data)
    st = LocalStorage()
    assert _copy_from_durable(st, str(durable), st, str(fast), [0]) is None
    assert sorted(os.listdir(fast)) == ["__0_0.distcp", "__0_0.distcp.crc32"]
    assert (fast / "__0_0.distcp").read_bytes() == b"zero"
    assert "holds no data file of rank(s) [2]" in _copy_from_durable(st, str(durable), st, str(fast), [2])
