"""Two hosts made here: network namespaces joined by a veth pair (iproute2, as root), two ranks
on each. The ranks' trainers and workers talk over the veth only (GLOO_SOCKET_IFNAME); the
checkpoint directory is shared, as a network file system would be."""

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
import torch

import solosave
from tests.support import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
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


def _job(hosts, root, phase, per_host=2):
    world = per_host * len(hosts)
    port = free_port()
    procs = []
    for h, (ns, dev, _) in enumerate(hosts):
        for local in range(per_host):
            env = dict(os.environ, RANK=str(h * per_host + local), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(local), MASTER_ADDR=hosts[0][2], MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME=dev, OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable,
                                           os.path.join(HERE, "multihost_fns.py"), str(root), phase],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=240)
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
