"""Rank functions for the multi-process tests (module-level: spawned processes import them)."""

from __future__ import annotations

import os
import pickle
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import solosave
from solosave._src.testing.introspect import worker_pid
from tests.support import assert_equal, dcp_save_local
from tests.support import fresh as _fresh
from tests.support import zeros_like as zeros_like_sd


def model_sd(rank: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(8, 16, generator=g), "b": torch.randn(16, generator=g),
                  "emb": torch.randn(32, 4, generator=g).to(torch.bfloat16)},
        "meta": {"step": 5 + seed, "name": "run-a", "lr": 0.25, "sched": [1, 2, 3]},
        "nested": [torch.arange(6, dtype=torch.int64), "tail"],
        f"rank{rank}_only": torch.full((3,), float(rank)),
    }


def _dtensor_sd(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5)  # same global shape at any ws
    return {"sharded": distribute_tensor(full, mesh, [Shard(0)]),
            "replicated": distribute_tensor(torch.arange(7.0), mesh, [Replicate()])}, full


# -- core ------------------------------------------------------------------------------------

def roundtrip_all_kinds(rank, ws, root, persistent):
    _fresh(root)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dsd, full = _dtensor_sd(rank, ws)
    sd = {"base": model_sd(rank), "dt": dsd, "m": msd, "o": osd, "rng": torch.get_rng_state()}
    with solosave.AsyncCheckpointer(persistent_worker=persistent) as ck:
        r = ck.save(sd, f"{root}/c1").wait(120)
    dist.barrier()
    # solosave.load into zeros
    tgt = zeros_like_sd({"base": model_sd(rank), "rng": torch.get_rng_state()})
    tdt, _ = _dtensor_sd(rank, ws)
    for v in tdt.values():
        v.to_local().zero_()
    tgt["dt"] = tdt
    solosave.load(tgt, f"{root}/c1")
    assert_equal(tgt["base"], sd["base"])
    assert torch.equal(tgt["rng"], sd["rng"])
    assert torch.equal(tgt["dt"]["sharded"].full_tensor(), full)
    assert torch.equal(tgt["dt"]["replicated"].to_local(), torch.arange(7.0))
    # optimizer + model through DCP's state_dict helpers
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    model2(torch.randn(3, 4)).sum().backward()
    opt2.step()
    m2, o2 = get_state_dict(model2, opt2)
    box = {"m": m2, "o": o2}
    dcp.load(box, checkpoint_id=f"{root}/c1")  # stock loader
    set_state_dict(model2, opt2, model_state_dict=box["m"], optim_state_dict=box["o"])
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert opt2.param_groups[0]["lr"] == 0.01
    s1 = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], s1)
    return r.bytes_written, r.mode


def reshard_save(rank, ws, root, seed):
    _fresh(root)
    dsd, full = _dtensor_sd(rank, ws)
    sd = {"dt": dsd, "plain": model_sd(0, seed)["model"]}
    with solosave.AsyncCheckpointer(workers=2) as ck:
        ck.save(sd, f"{root}/ck").wait(120)
    return sorted(os.listdir(f"{root}/ck"))


def reshard_load(rank, ws, root, seed):
    dsd, full = _dtensor_sd(rank, ws)
    for v in dsd.values():
        v.to_local().zero_()
    tgt = {"dt": dsd, "plain": zeros_like_sd(model_sd(0, seed)["model"])}
    solosave.load(tgt, f"{root}/ck")
    assert torch.equal(tgt["dt"]["sharded"].full_tensor(), full)
    assert_equal(tgt["plain"], model_sd(0, seed)["model"])
    # stock DCP with its own FileSystemReader
    dsd2, _ = _dtensor_sd(rank, ws)
    for v in dsd2.values():
        v.to_local().zero_()
    box = {"dt": dsd2}
    dcp.load(box, storage_reader=dcp.FileSystemReader(f"{root}/ck"))
    assert torch.equal(box["dt"]["sharded"].full_tensor(), full)
    return True


def snapshot_and_worker_reuse(rank, ws, root):
    _fresh(root)
    sd = {"w": torch.zeros(256, 256), "s": 0}
    pids, storages = [], []
    with solosave.AsyncCheckpointer() as ck:
        for i in range(3):
            sd["w"].fill_(float(i))
            sd["s"] = i
            h = ck.save(sd, f"{root}/s{i}")
            sd["w"].fill_(-1.0)  # the next "optimizer step", before the save finished
            sd["s"] = -1
            h.wait(120)
            pids.append(worker_pid(ck))
        alive = [os.path.exists(f"/proc/{worker_pid(ck)}")]
    for i in range(3):
        tgt = {"w": torch.empty(256, 256), "s": 0}
        solosave.load(tgt, f"{root}/s{i}")
        assert bool((tgt["w"] == float(i)).all()) and tgt["s"] == i
        with open(f"{root}/s{i}/.metadata", "rb") as f:
            storages.append(pickle.load(f).storage_data)
    return pids, alive, storages[0] == storages[1] == storages[2]



def bad_input(rank, ws, root):
    _fresh(root)
    errors = {}
    with solosave.AsyncCheckpointer() as ck:
        ck.save({"w": torch.ones(2)}, f"{root}/done").wait(60)
        try:
            ck.save({"w": torch.ones(2)}, f"{root}/done")
        except solosave.CheckpointExistsError as e:
            errors["exists"] = str(e)
        try:
            ck.save({"w": torch.ones(2).to_sparse()}, f"{root}/x")
        except TypeError as e:
            errors["sparse"] = str(e)
        with open(f"{root}/afile_{rank}", "w") as f:
            f.write("x")
        try:
            ck.save({"w": torch.ones(2)}, f"{root}/afile_{rank}")
        except ValueError as e:
            errors["notdir"] = str(e)
        try:
            ck.save({"w": torch.ones(2)}, f"{root}/{'n' * 300}")
        except ValueError as e:
            errors["long"] = str(e)
        h = ck.save({"w": torch.full((2,), 3.0)}, f"{root}/done", overwrite=True)
        h.wait(60)
    tgt = {"w": torch.zeros(2)}
    solosave.load(tgt, f"{root}/done")
    errors["overwritten"] = tgt["w"].tolist()
    return errors


# -- counting --------------------------------------------------------------------------------

def count_saves(rank, ws, root, mode, saves):
    _fresh(root)
    kw = {}
    if mode == "reuse":
        kw = dict(prepared_metadata=f"{root}/prep.md", create_prepared_metadata=True)
    elif mode == "constant":
        kw = dict(assume_constant_structure=True)
    sd = model_sd(rank)
    log = os.environ["SOLOSAVE_TEST_COLLECTIVE_LOG"]
    per_save = []
    with solosave.AsyncCheckpointer(**kw) as ck:
        dist.barrier()
        for i in range(saves):
            sd["model"]["w"].add_(1)
            h = ck.save(sd, f"{root}/s{i}")
            r = h.wait(120)
            per_save.append({"mode": r.mode, "reported": r.collectives("all"),
                             "calling": r.collectives("calling_thread")})
            dist.barrier()  # (the test's own barrier; logged by the main process, excluded below)
            marker = os.path.join(log, f"mark.{rank}.{i}")
            open(marker, "w").close()
    return per_save


# -- reuse -----------------------------------------------------------------------------------

def create_then_reuse(rank, ws, root, workers):
    _fresh(root)
    dsd, _ = _dtensor_sd(rank, ws)
    sd = {"base": model_sd(rank), "dt": dsd}
    results = []
    with solosave.AsyncCheckpointer(workers=workers, prepared_metadata=f"{root}/prep.md",
                                    create_prepared_metadata=True) as ck:
        results.append(ck.save(sd, f"{root}/c0").wait(120))
        for i in range(1, 3):
            g = torch.Generator().manual_seed(100 + i)
            for t in sd["base"]["model"].values():  # re-randomize every parameter
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
            sd["dt"]["sharded"].to_local().copy_(torch.randn(sd["dt"]["sharded"].to_local().shape, generator=g))
            sd["base"]["meta"]["step"] = 1000 + i
            results.append(ck.save(sd, f"{root}/c{i}").wait(120))
    dist.barrier()
    expect = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd["base"]["model"].items()}
    tgt = {"base": zeros_like_sd(model_sd(rank))}
    solosave.load(tgt, f"{root}/c2")
    assert_equal(tgt["base"]["model"], expect)
    assert tgt["base"]["meta"]["step"] == 1002
    with open(f"{root}/c2/.metadata", "rb") as f:
        md2 = pickle.load(f)
    with open(f"{root}/c1/.metadata", "rb") as f:
        md1 = pickle.load(f)
    full = sd["dt"]["sharded"].full_tensor()
    return ([r.mode for r in results], [r.collectives("all") for r in results],
            str(md2.storage_meta.checkpoint_id), md1.storage_meta.save_id != md2.storage_meta.save_id,
            md1.storage_data == md2.storage_data, full.tolist())  # (tensors do not survive os._exit)


def load_dt_at(rank, ws, root, ckpt):
    dsd, _ = _dtensor_sd(rank, ws)
    sd = {"dt": {"sharded": None}}
    # a fresh target at this world size with the saved global shape
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    with open(f"{root}/{ckpt}/.metadata", "rb") as f:
        size = pickle.load(f).state_dict_metadata["dt.sharded"].size
    sd = {"dt": {"sharded": distribute_tensor(torch.zeros(size), mesh, [Shard(0)])}}
    dcp.load(sd, checkpoint_id=f"{root}/{ckpt}")
    return sd["dt"]["sharded"].full_tensor().tolist()


def second_job(rank, ws, root):
    sd = model_sd(rank)
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md") as ck:
        r = ck.save(sd, f"{root}/job2").wait(120)
    tgt = zeros_like_sd(model_sd(rank))
    dist.barrier()
    solosave.load(tgt, f"{root}/job2")
    assert_equal(tgt["model"], sd["model"])
    return r.mode, r.collectives("all")


def drift(rank, ws, root, policy):
    _fresh(root)
    sd = model_sd(rank)
    out = {}
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md", create_prepared_metadata=True,
                                    on_layout_drift=policy) as ck:
        ck.save(sd, f"{root}/c0").wait(120)
        ck.save(sd, f"{root}/c1").wait(120)
        before = open(f"{root}/prep.md", "rb").read()
        sd["meta"]["sched"] = list(range(5000))  # a BYTES item outgrows its slot
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                r = ck.save(sd, f"{root}/c2").wait(120)
                out["mode"] = r.mode
                out["collectives"] = r.collectives("all")
            except solosave.LayoutDriftError as e:
                out["error"] = str(e)
                out["drifts"] = e.drifts
        out["warnings"] = [str(w.message) for w in caught if "layout drift" in str(w.message)]
        out["metadata"] = os.path.exists(f"{root}/c2/.metadata")
        dist.barrier()
        out["refreshed"] = open(f"{root}/prep.md", "rb").read() != before
        if policy == "fallback":
            r = ck.save(sd, f"{root}/c3").wait(120)
            out["after"] = (r.mode, r.collectives("all"))
    if out["metadata"]:
        tgt = zeros_like_sd(model_sd(rank))
        solosave.load(tgt, f"{root}/c2")
        assert tgt["meta"]["sched"] == list(range(5000))
    return out


def mismatched_world(rank, ws, root):
    try:
        solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md")
    except solosave.FingerprintMismatchError as e:
        return str(e)
    return None


def create_only(rank, ws, root):
    _fresh(root)
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md", create_prepared_metadata=True) as ck:
        return ck.save(model_sd(rank), f"{root}/c0").wait(120).mode



def load_reads_metadata_once(rank, ws, root):
    """Every rank loads one checkpoint; count who read .metadata from storage."""
    from solosave._src.load import load as _load

    sd = {"w": torch.arange(8.0), "step": 7}
    if rank == 0:
        dcp_save_local(sd, checkpoint_id=os.path.join(root, "ck"))
    dist.barrier()
    calls = []
    real = _load.read_metadata_bytes
    _load.read_metadata_bytes = lambda p, *a, **k: calls.append(p) or real(p, *a, **k)  # test-only counting
    try:
        target = {"w": torch.zeros(8), "step": 0}
        solosave.load(target, os.path.join(root, "ck"))
        errors = []
        for missing in ("ck_missing", "partial"):
            if missing == "partial" and rank == 0:
                os.makedirs(os.path.join(root, "partial"), exist_ok=True)
            dist.barrier()
            try:
                solosave.load({"w": torch.zeros(8)}, os.path.join(root, missing))
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
    finally:
        _load.read_metadata_bytes = real
    return {"reads": len(calls), "w": target["w"].tolist(), "step": target["step"], "errors": errors}


# -- overlapped staging ----------------------------------------------------------------------

def overlap_staging(rank, ws, root):
    """Overlapped staging: values as of save() after wait_staged(); a change before the copy
    is done (rank 1, the copy held back by a gate) fails that save on every rank; the next works."""
    import threading

    from solosave._src.staging import staging as _stage

    _fresh(root)
    w = f"w{rank}"  # held by one rank: plain tensors held by several are replicas
    sd = {w: torch.arange(4096.0) + rank, "b": torch.ones(3, dtype=torch.bfloat16), "step": 0}
    out = {"modes": []}
    with solosave.AsyncCheckpointer(overlap_staging=True, assume_constant_structure=True, timeout=60) as ck:
        for i in range(3):
            sd["step"] = i
            h = ck.save(sd, f"{root}/s{i}")
            h.wait_staged()
            expect = {w: sd[w].clone(), "b": sd["b"].clone(), "step": i}
            sd[w].add_(1)  # the optimizer step, after wait_staged()
            sd["b"].mul_(2)
            out["modes"].append(h.wait().mode)
            got = zeros_like_sd(expect)
            solosave.load(got, f"{root}/s{i}")
            assert_equal(got, expect)
        gate, real = threading.Event(), _stage._copy_pieces
        if rank == 1:
            _stage._copy_pieces = lambda *args: (gate.wait(30), real(*args))
        h = ck.save(sd, f"{root}/race")
        if rank == 1:
            sd[w].add_(1)  # before wait_staged() and before the copy
            gate.set()
            try:
                h.wait_staged()
            except solosave.StagingRaceError as e:
                out["race"] = str(e)
            _stage._copy_pieces = real
        try:
            h.wait()
        except solosave.CheckpointError as e:
            out["failed"] = str(e)
        out["published"] = os.path.exists(f"{root}/race/.metadata")
        h = ck.save(sd, f"{root}/after")
        h.wait_staged()
        out["after"] = h.wait().mode
    return out


def checksummed_with_empty(rank, ws, root):
    """``checksums=True`` with a zero-element tensor (written through ``torch.save``, not a
    frame): the save publishes, verify checks every record's CRC32, and it loads back."""
    sd = {"w": torch.arange(6.0) + rank, "empty": torch.empty(0), "b": torch.ones(2, 3), "step": 7}
    path = os.path.join(root, "ck")
    with solosave.AsyncCheckpointer(checksums=True) as ckpt:
        result = ckpt.save(sd, path).wait(timeout=60)
    report = solosave.verify_checkpoint(path)
    back = {"w": torch.zeros(6), "empty": torch.empty(0), "b": torch.zeros(2, 3), "step": 0}
    solosave.load(back, path)
    return (result.published, report.ok, report.checksums, torch.equal(back["w"], sd["w"]),
            torch.equal(back["b"], sd["b"]), back["step"])


def structure_of_dtensors(rank, ws):
    """The structure cache over DTensors: a hit plans nothing and hands staging each shard's own
    tensor (the bytes ``to_local()`` shows, without its autograd view); another placement or
    another local shape is a miss."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from solosave._src.plan.local_plan import local_shard
    from solosave._src.plan.structure import StructureCache

    dsd, full = _dtensor_sd(rank, ws)
    sd = {"model": dsd, "step": 3}
    sc = StructureCache()
    first = sc.plan(sd)
    again = sc.plan(sd)
    out = {"hit": sc.hits == 1 and again.specs is first.specs}
    shards = {k: again.values[k] for k in ("model.sharded", "model.replicated")}
    out["same_bytes"] = all(torch.equal(v, dsd[k.split(".")[1]].to_local()) for k, v in shards.items())
    out["same_storage"] = all(v.data_ptr() == dsd[k.split(".")[1]].to_local().data_ptr() for k, v in shards.items())
    out["not_dtensor"] = all(type(v) is torch.Tensor for v in shards.values())
    mesh = init_device_mesh("cpu", (ws,))
    sc.plan({"model": {**dsd, "sharded": distribute_tensor(full, mesh, [Replicate()])}, "step": 3})
    out["placement_miss"] = sc.hits == 1
    sc.plan(sd)
    sc.plan({"model": {**dsd, "sharded": distribute_tensor(full[:12], mesh, [Shard(0)])}, "step": 3})
    out["shape_miss"] = sc.hits == 1
    sc.plan(sd)  # a dtype of the same shapes, local and global: only the DTensor's spec tells it
    sc.plan({"model": {**dsd, "sharded": distribute_tensor(full.double(), mesh, [Shard(0)])}, "step": 3})
    out["dtype_miss"] = sc.hits == 1
    sc.plan(sd)
    again_dsd, _ = _dtensor_sd(rank, ws)  # new DTensors, new spec objects, the same structure
    sc.plan({"model": again_dsd, "step": 3})
    out["equal_spec_hit"] = sc.hits == 2

    class Opaque:  # a DTensor-like without _local_tensor: to_local() is asked
        def to_local(self):
            return full

    out["fallback"] = local_shard(Opaque()) is full
    return out


def dtensor_foreach_step_during_overlapped_staging(rank, ws, root):
    """D1: DTensor state (FSDP2-style shards) with overlapped staging whose CPU copy starts late.

    (a) ``optimizer.step()`` of ``SGD(foreach=True)`` right after ``save()``, without
    ``wait_staged()``: its in-place update moves no version counter of a DTensor, so nothing
    could notice it; the checkpoint must still hold the values of the call. (b) a plain in-place
    ``add_`` on the DTensor before ``wait_staged()`` is a staging race."""
    import threading
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from solosave._src.staging import staging as _stage

    _fresh(root)
    mesh = init_device_mesh("cpu", (ws,))
    p = torch.nn.Parameter(distribute_tensor(torch.arange(64.0 * ws), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.ones(64 * ws), mesh, [Shard(0)])
    opt = torch.optim.SGD([p], lr=1.0, foreach=True)
    real = _stage._copy_pieces
    started = threading.Event()

    def late_copy(*args, **kwargs):  # the copy starts after the step would have run
        started.set()
        time.sleep(0.5)
        return real(*args, **kwargs)

    out = {}
    _stage._copy_pieces = late_copy
    try:
        with solosave.AsyncCheckpointer(overlap_staging=True, persistent_worker=False, timeout=60) as ck:
            before = p.to_local().detach().clone()
            h = ck.save({"p": p}, f"{root}/a")
            opt.step()
            out["stepped"] = not torch.equal(p.to_local().detach(), before)
            h.wait()
            got = {"p": distribute_tensor(torch.zeros(64 * ws), mesh, [Shard(0)])}
            solosave.load(got, f"{root}/a")
            out["a_holds_the_call"] = torch.equal(got["p"].to_local(), before)
            h = ck.save({"p": p}, f"{root}/b")
            with torch.no_grad():
                p.add_(1.0)  # not an optimizer: the version counter of the DTensor shows it
            try:
                h.wait_staged()
                out["b_race"] = None
            except solosave.StagingRaceError as e:
                out["b_race"] = str(e)
            try:
                h.wait()
                out["b_published"] = True
            except solosave.CheckpointError:
                out["b_published"] = os.path.exists(f"{root}/b/.metadata")
    finally:
        _stage._copy_pieces = real
    return out


def thread_mode_subgroup_under_a_bound_device(rank, ws, root):
    """A checkpointer in thread mode on a strict subgroup while the default group says it is
    bound to a device (as ``init_process_group(device_id=...)`` makes it under NCCL): refused at
    once with a clear error, before any collective (torch's new_group would have the ranks
    outside the subgroup wait in an NCCL split that nobody joins)."""
    sub = dist.new_group([0])
    world = dist.group.WORLD
    world.bound_device_id = torch.device("cuda", 0)  # a label only: nothing runs on it here
    try:
        if rank != 0:
            return None
        try:
            solosave.AsyncCheckpointer(process_group=sub, persistent_worker=False, timeout=10)
        except ValueError as e:
            return str(e)
        return "no error"
    finally:
        world.bound_device_id = None



def submit_fails(rank: int, ws: int, root: str, persistent: bool) -> dict:
    """The worker's hand-over fails inside ``save()`` (a transport that raises: test-only, on
    this one checkpointer): ``save()`` raises it, and neither a later ``save()`` nor ``close()``
    waits for the job the worker never got."""
    import time

    ck = solosave.AsyncCheckpointer(persistent_worker=persistent, timeout=120)
    transport = ck._res.transport
    real = transport.submit

    def broken(job):
        raise RuntimeError("hand-over refused")

    transport.submit = broken
    raised = None
    try:
        ck.save({"w": torch.ones(4)}, f"{root}/a")
    except RuntimeError as e:
        raised = str(e)
    transport.submit = real
    t0 = time.monotonic()
    mode = ck.save({"w": torch.ones(4)}, f"{root}/b").wait(60).mode
    t1 = time.monotonic()
    ck.close()
    return {"raised": raised, "next_save_mode": mode, "next_save_s": t1 - t0, "close_s": time.monotonic() - t1}
