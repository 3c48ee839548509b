"""Peer copies on three and four hosts made here: network namespaces joined by a bridge (in a
namespace of its own, as a switch), each host with its own fast tier (a bind mount of
``root/host<h>`` on ``root/fast`` in a mount namespace of its own). Hosts are wiped, the
durable tier is taken away, and the job restores bit for bit from the surviving copies."""

import filecmp
import json
import os
import shutil
import subprocess
import uuid

import pytest

from solosave._src.tiers.placement import PeerPlacement
from tests.multiproc.test_multihost import _job as launch

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]  # fresh interpreters in namespaces: make test-slow


def _sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def network():
    """``make(n)``: n hosts (namespace, device, address) on one switch; all removed at the end."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs root, iproute2 and unshare to make network and mount namespaces")
    tag = uuid.uuid4().hex[:6]
    made: list[str] = []

    def make(n):
        switch = f"sw{tag}"
        try:
            _sh("ip", "netns", "add", switch)
            made.append(switch)
            _sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", switch, "link", "set", "br0", "up")
            hosts = []
            for h in range(n):
                ns, dev, port = f"h{tag}{h}", f"v{tag}{h}", f"p{tag}{h}"
                _sh("ip", "netns", "add", ns)
                made.append(ns)
                _sh("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "link", "set", port, "netns", switch)
                _sh("ip", "-n", switch, "link", "set", port, "master", "br0")
                _sh("ip", "-n", switch, "link", "set", port, "up")
                addr = f"10.79.0.{h + 1}"
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                hosts.append((ns, dev, addr))
            return hosts
        except (subprocess.CalledProcessError, OSError) as e:
            pytest.skip(f"cannot make network namespaces here: {e}")

    yield make
    for ns in reversed(made):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _job(hosts, root, phase, copies, per_host):
    """Every rank's JSON line (the launch is the two-host test's, node-local fast tiers)."""
    outs = launch(hosts, root, phase, per_host, local_dirs=True, script="peer_hosts_fns.py",
                  extra=(str(copies), str(per_host)), timeout=300)
    results = [json.loads(o.strip().splitlines()[-1]) for rc, o, e in outs if rc == 0 and o.strip()]
    assert len(results) == per_host * len(hosts), outs
    return results


def _files(root, h, name="iter_0000002"):
    d = root / f"host{h}" / name
    return sorted(os.listdir(d)) if d.is_dir() else []


@pytest.mark.parametrize("hosts_n,per_host,copies,lost",
                         [(4, 1, 1, (2,)), (4, 1, 2, (0, 3)), (3, 2, 1, (1,)), (4, 1, 2, (0, 1, 2))],
                         ids=["4x1-K1-lose-host2", "4x1-K2-lose-hosts0and3", "3x2-K1-lose-host1",
                              "4x1-K2-lose-three-hosts"])
def test_peer_copies_on_many_hosts_restore_lost_hosts_with_nothing_from_the_durable_tier(
        network, tmp_path, case_log, hosts_n, per_host, copies, lost):
    """Up to K hosts lost: the durable tier is removed before the restore. More than K: the
    durable copy keeps only the files no survivor holds (and its .metadata); every other data
    file is removed from it, so a restore that read any of them could not end bit-exact."""
    hosts = network(hosts_n)
    for d in ["fast", *(f"host{h}" for h in range(hosts_n))]:
        (tmp_path / d).mkdir()
    saved = _job(hosts, tmp_path, "save", copies, per_host)
    placement = PeerPlacement(hosts_n, copies)
    L = per_host
    for r in saved:
        assert r["layout"] == {"ranks_per_host": L, "hosts": hosts_n, "copies": copies, "hosts_per_domain": 1}, r
        assert [c[:3] for c in r["copies"]] == [[1, True, True], [2, True, True]], r
        # per save: one all_reduce for the peer stage (whatever K and the hosts), one for the durable copy
        assert all(c[4] == ["all_reduce", "all_reduce"] for c in r["copies"]), r
    for h in range(hosts_n):  # each host: its own ranks' files, those it keeps copies of, .metadata
        kept = {f"__{o}_0.distcp" for k in placement.keeps(h) for o in range(k * L, k * L + L)}
        here = set(_files(tmp_path, h))
        assert kept | {".metadata", ".solosave-index", ".solosave-peers"} <= here, (h, here)
        others = {n for n in here if n.endswith(".distcp")} - kept
        assert not others, (h, others)  # nothing else: K copies, not a copy everywhere
    before = {h: {n: (tmp_path / f"host{h}" / "iter_0000002" / n).read_bytes() for n in _files(tmp_path, h)
                  if n.endswith(".distcp")} for h in range(hosts_n)}

    for h in lost:  # the lost hosts' fast tiers, and the whole durable tier: nothing to read there
        shutil.rmtree(tmp_path / f"host{h}")
        (tmp_path / f"host{h}").mkdir()
    survivors = [h for h in range(hosts_n) if h not in lost]
    held = {n for h in survivors for n in before[h]}
    nobody = sorted({n for h in lost for n in before[h]} - held)
    assert bool(nobody) == (len(lost) > copies), nobody
    if nobody:  # more than K lost: the durable copy keeps exactly the files nobody else holds
        for step_dir in (tmp_path / "durable").glob("iter_*"):
            for f in step_dir.iterdir():
                if f.name.endswith(".distcp") and f.name not in nobody:
                    f.unlink()
    else:
        shutil.rmtree(tmp_path / "durable")
    restored = _job(hosts, tmp_path, "restore", copies, per_host)
    for r in restored:
        assert r["point"] == [2, str(tmp_path / "fast" / "iter_0000002")] and r["exact"], r
    for h in lost:  # rebuilt byte for byte: every file it kept, and the .metadata, published last
        for n, data in before[h].items():
            assert (tmp_path / f"host{h}" / "iter_0000002" / n).read_bytes() == data, (h, n)
        assert ".metadata" in _files(tmp_path, h)
        survivor = next(s for s in range(hosts_n) if s not in lost)
        assert filecmp.cmp(tmp_path / f"host{h}" / "iter_0000002" / ".metadata",
                           tmp_path / f"host{survivor}" / "iter_0000002" / ".metadata", shallow=False)
    assert not any(n.endswith(".incoming") or ".tmp" in n for h in range(hosts_n) for n in _files(tmp_path, h))
    if nobody:
        case_log(f"{hosts_n} hosts x {per_host} rank(s) (network and mount namespaces), peer_copies={copies}; "
                 f"host(s) {list(lost)} lost their fast tier (more than K); the durable copy kept only the files "
                 f"no survivor held ({', '.join(nobody)}), then a restore",
                 "the restore rebuilt the lost hosts byte for byte, the files no survivor held from the durable "
                 "copy and every other from the survivors; every rank loaded step 2 bit-exactly from the fast tier")
        return
    case_log(f"{hosts_n} hosts x {per_host} rank(s) (network and mount namespaces), peer_copies={copies}; "
             f"host(s) {list(lost)} lost their fast tier and the durable tier was removed, then a restore",
             f"each save's peer stage ok with one all_reduce; each host held its own and {copies} other host(s)' "
             "files only; the restore rebuilt the lost hosts byte for byte from the survivors and every rank "
             "loaded step 2 bit-exactly with no durable tier present")
