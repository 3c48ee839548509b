"""Two hosts made here: network namespaces joined by a veth pair (iproute2, as root), two ranks
on each. The ranks' trainers and workers talk over the veth only (GLOO_SOCKET_IFNAME); the
checkpoint directory is shared, as a network file system would be."""

import filecmp
import json
import os
import shlex
import shutil
import subprocess
import sys
import uuid

import pytest
import torch

import solosave
from tests.support import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
pytestmark = pytest.mark.timeout(300)


def _sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = uuid.uuid4().hex[:6]
    ns = [f"ss{tag}a", f"ss{tag}b"]
    devs = [f"v{tag}a", f"v{tag}b"]
    addrs = ["10.78.0.1", "10.78.0.2"]
    try:
        for n in ns:
            _sh("ip", "netns", "add", n)
        _sh("ip", "link", "add", devs[0], "type", "veth", "peer", "name", devs[1])
        for n, d, a in zip(ns, devs, addrs):
            _sh("ip", "link", "set", d, "netns", n)
            _sh("ip", "-n", n, "addr", "add", f"{a}/24", "dev", d)
            _sh("ip", "-n", n, "link", "set", d, "up")
            _sh("ip", "-n", n, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {e}")
    yield list(zip(ns, devs, addrs))
    for n in ns:
        subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _job(hosts, root, phase, per_host=2, local_dirs=False, script="multihost_fns.py", extra=(), timeout=240):
    """Run ``script root phase *extra`` on every rank; ``[(returncode, stdout, stderr)]`` in rank
    order. ``local_dirs``: each host sees its own ``root/host<h>`` as ``root/fast`` (a bind
    mount in a mount namespace of its own): node-local fast tiers."""
    world = per_host * len(hosts)
    port = free_port()
    procs = []
    for h, (ns, dev, _) in enumerate(hosts):
        for local in range(per_host):
            env = dict(os.environ, RANK=str(h * per_host + local), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_host), MASTER_ADDR=hosts[0][2],
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=dev, OMP_NUM_THREADS="1",
                       SOLOSAVE_WORKER_ZYGOTE="",  # workers in the host's namespaces, not the zygote's
                       PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
            cmd = [sys.executable, os.path.join(HERE, script), str(root), phase, *extra]
            if local_dirs:
                own, fast = os.path.join(root, f"host{h}"), os.path.join(root, "fast")
                cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       f"mount --bind {shlex.quote(own)} {shlex.quote(fast)} && exec {shlex.join(cmd)}"]
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *cmd],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, o, e))
    return outs


def test_two_hosts_create_reuse_and_load_elsewhere(hosts, tmp_path, case_log):
    outs = _job(hosts, tmp_path, "ok")
    results = [json.loads(o.strip().splitlines()[-1]) for rc, o, e in outs if rc == 0]
    assert len(results) == 4, outs
    for r in results:
        assert r["c0"][:2] == ["create", True] and r["c1"] == ["reuse", True, ["all_reduce"]], r
    # the checkpoint of 4 ranks on 2 hosts loads in one process (another world size)
    from tests.multiproc import multihost_fns as M

    got = {"model": {"w": torch.zeros(64, 32)}, "step": 0, **{f"rank{r}": torch.zeros(4) for r in range(4)}}
    solosave.load(got, tmp_path / "ok1")
    assert torch.equal(got["model"]["w"], M.state(0, 1)["model"]["w"]) and got["step"] == 1
    assert all(got[f"rank{r}"].tolist() == [r * 100 + 1.0] * 4 for r in range(4))
    case_log("2 hosts x 2 ranks (network namespaces, veth, GLOO_SOCKET_IFNAME)",
             "create then reuse saves (one all_reduce) published on every rank; the checkpoint loads in "
             "one process (world size 1)")


@pytest.mark.slow  # 26 s; run by make test-slow (in CI)
def test_losing_a_host_mid_save_fails_the_others_promptly(hosts, tmp_path, case_log):
    outs = _job(hosts, tmp_path, "kill")
    survivors = [json.loads(o.strip().splitlines()[-1]) for rc, o, e in outs[:2]]
    assert [rc for rc, _, _ in outs[2:]] == [-9, -9], outs
    for r in survivors:
        assert r["c2"].startswith("CheckpointError"), r
        seconds = float(r["c2"].split(" after ")[1].split()[0])
        assert seconds < 20.0, r  # the loss was detected, not waited out (timeout 20 s)
    assert not (tmp_path / "kill2" / ".metadata").exists()
    assert (tmp_path / "kill1" / ".metadata").exists()
    case_log("2 hosts x 2 ranks; the second host's ranks SIGKILLed in the middle of a reuse save",
             f"survivors: {'; '.join(r['c2'] for r in survivors)}; nothing published; the previous "
             "checkpoint intact")


def _host_files(root, h, name):
    d = root / f"host{h}" / name
    return sorted(os.listdir(d)) if d.is_dir() else []


@pytest.mark.slow  # 40-50 s of fresh interpreters in namespaces; run by make test-slow (in CI)
def test_peer_copies_restore_a_lost_hosts_fast_tier_bit_exactly(hosts, tmp_path, case_log):
    for d in ("fast", "host0", "host1"):
        (tmp_path / d).mkdir()
    outs = _job(hosts, tmp_path, "peer-save", local_dirs=True)
    saved = [json.loads(o.strip().splitlines()[-1]) for rc, o, e in outs if rc == 0]
    assert len(saved) == 4, outs
    for r in saved:
        assert r["ranks_per_host"] == 2, r
        assert [c[:3] for c in r["copies"]] == [[1, True, True], [2, True, False], [3, True, True]], r
        # step 2: rank 2 could not write rank 0's peer copy; every rank says so, naming rank 2
        assert r["copies"][1][3].startswith("peer copy") and "rank(s) [2]" in r["copies"][1][3], r
        assert "injected: no space left" in r["copies"][1][3], r
        # per copy: the peer stage's and the durable stage's status all_reduce, and the transfers
        assert all(c[4].count("all_reduce") == 2 and "send" in c[4] and "recv" in c[4] for c in r["copies"]), r
    assert len({r["copies"][1][3] for r in saved}) == 1
    data = [f"__{k}_0.distcp" for k in range(4)]
    for h in (0, 1):  # each host holds every rank's files and the .metadata; keep_last=2 pruned step 1
        assert set(data) | {".metadata"} <= set(_host_files(tmp_path, h, "iter_0000003")), h
        assert not [n for n in _host_files(tmp_path, h, "iter_0000003") if n.endswith(".incoming")], h
    # keep_last=2: each host pruned its own tier, keeping its two newest published steps; on host 1
    # step 2 was never published (its peer copy failed), so its part of step 2 went, step 1 stayed
    assert sorted(os.listdir(tmp_path / "host0")) == ["iter_0000002", "iter_0000003", "latest"]
    assert sorted(os.listdir(tmp_path / "host1")) == ["iter_0000001", "iter_0000003"]
    assert not os.listdir(tmp_path / "fast")  # the bind mounts never showed through
    before = {n: (tmp_path / "host1" / "iter_0000003" / n).read_bytes() for n in data + [".metadata"]}

    shutil.rmtree(tmp_path / "host0")  # host 0 lost its fast tier; the durable tier is gone too
    (tmp_path / "host0").mkdir()
    shutil.rmtree(tmp_path / "durable")
    outs = _job(hosts, tmp_path, "peer-restore", local_dirs=True)
    restored = [json.loads(o.strip().splitlines()[-1]) for rc, o, e in outs if rc == 0]
    assert len(restored) == 4, outs
    for r in restored:
        assert r["point"] == [3, str(tmp_path / "fast" / "iter_0000003")] and r["exact"], r
        assert r["load_path"] == str(tmp_path / "fast" / "iter_0000003") and r["load_exact"], r
    new0, old1 = tmp_path / "host0" / "iter_0000003", tmp_path / "host1" / "iter_0000003"
    assert set(data) | {".metadata"} <= set(os.listdir(new0))
    assert all(filecmp.cmp(new0 / n, old1 / n, shallow=False) for n in data + [".metadata"])
    assert all((old1 / n).read_bytes() == b for n, b in before.items())
    case_log("2 hosts x 2 ranks, a fast tier local to each host (bind mounts), two tiers with peer copies, "
             "keep_last 2; host 0's fast tier and the whole durable tier removed, then a restore",
             "each save's durable copy ok; the peer copies of steps 1 and 3 ok, step 2's failed on every rank "
             "naming rank 2 (an injected write error; host 1 left without step 2); each host held all 4 ranks' "
             "files of step 3; the "
             "restore brought host 0's files back from host 1 byte for byte and every rank loaded step 3 "
             "bit-exactly from the fast tier; again through solosave.load(ranks_per_host=2) after host 0 "
             "lost step 3 a second time")
