"""The GPU device check (``make device-check``): one command, at most 8 minutes on one GPU, no
network, no installs. It runs from the source tree as it is (this script puts ``src`` on
``sys.path`` and on ``PYTHONPATH`` for the worker processes and the demo), on the torch already
installed there (the package's declared torch floor is not checked: nothing is installed).

    python3 -u tools/device_check.py [--only NAME,...] [--skip-demo] [--budget SECONDS]

One line per section as it goes (``PASS`` / ``FAIL`` / ``SKIP`` / ``TIMEOUT``, its seconds and
what it saw), then a summary; with ``$OUT`` set, the summary as JSON in
``$OUT/device_check.json``. Exit status 1 if a section failed or timed out, else 0 (sections
skipped for want of a GPU do not fail: on a CPU machine this is a dry run of the harness).

How it is bounded: the sections run in a child process; this process reads its lines and kills
it (its whole process group) when a section outlives its bound (its own, cut to what is left of
the budget, 480 s by default), then starts a new child for the sections left. A section that
would start after the budget is skipped, named. ``make device-check`` adds ``timeout 600``.

The sections (``SECTIONS``; each checks what the issue that asked for it names):

* ``environment``: Python, torch, the device, where solosave was imported from;
* ``stream_ordering``: the current stream busy (``torch.cuda._sleep``), then a fill, a save, a
  second fill: the staged bytes are the first fill's; again with the side stream delayed; in
  blocking and overlapped staging;
* ``pinning``: the staging buffer is registered and its views are pinned; staging bandwidth
  against a pinned ``copy_(non_blocking=True)`` of the same bytes (at least 0.8x);
* ``overlap_races``: a plain tensor changed before ``wait_staged()`` is a ``StagingRaceError``;
  a 1-rank DTensor with ``AdamW(foreach=True)`` stepped right after ``save()`` (the side stream
  delayed) still saves the values of the call;
* ``dtype_matrix``: transposed, bf16, fp8 (compared as bytes), empty, CPU and CUDA mixed,
  conjugate complex and negative-view tensors saved (blocking and overlapped) and loaded
  bit-exactly onto CUDA, non-contiguous targets included;
* ``double_registration``: the staging buffer registered a second time (which fails): a later
  kernel in the training thread does not raise; a control thread shows what the failed call
  would have done to the thread that made it;
* ``worker_context``: the worker's ``/proc/<pid>/maps`` and ``/proc/<pid>/fd`` name no
  ``/dev/nvidia*``, also after saves whose non-tensor values hold CUDA tensors;
* ``close_in_flight``: ``close(timeout=0.2)`` while the copies wait behind a busy stream: no
  crash, and the buffer is unmapped once the copies end;
* ``nccl_device_id``: W=1 with ``init_process_group("nccl", device_id=...)``, process and thread
  worker modes: create then reuse saves, bit-exact;
* ``figures``: the ``save()`` stall against a pinned device-to-host copy of the same bytes, and a
  step with overlapped staging against the compute alone;
* ``demo``: ``solosave train --device cuda`` (FSDP2, one rank, NCCL, overlapped staging), then a
  resume (last; ``--skip-demo``).

History: written on a machine without a GPU; dry-run there (every CUDA section skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)
os.environ["PYTHONPATH"] = os.pathsep.join([SRC] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

MIB = 1 << 20
BUDGET_S = 480.0
CHILD_START_S = 120.0  # torch's import and the first CUDA call, before the first section
SLEEP_CYCLES = int(3e8)  # torch.cuda._sleep: some 100-200 ms of a busy stream


class Skip(Exception):
    """A section that cannot run here (no GPU, too few GPUs, no solosave)."""


# =============================================================================================
# the sections (run in the child)
# =============================================================================================

def _cuda() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise Skip(f"no CUDA device (torch {torch.__version__})")
    return torch


_PG: dict = {}


def _group() -> None:
    """The child's W=1 process group: NCCL bound to device 0 (``device_id``), made once."""
    torch = _cuda()
    import torch.distributed as dist

    if not dist.is_initialized():
        torch.cuda.set_device(0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        _PG["backend"] = dist.get_backend()


def _delayed_side_runtime() -> Any:
    """The real runtime, except that each side stream first sleeps (the copies start late)."""
    import torch

    from solosave._src.staging.device import CudaRuntime

    class DelayedSide(CudaRuntime):
        @contextlib.contextmanager
        def use_stream(self, stream: Any) -> Any:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)
                yield

    return DelayedSide()


def _staged(stager: Any, staged: Any) -> dict:
    from solosave._src.staging.buffer import BufferReader

    reader = BufferReader()
    try:
        stager.hand_to(reader)
        return {it.spec.fqn: reader.tensor(staged, it).clone() for it in staged.items if it.payload is None}
    finally:
        reader.release()


def sec_environment(out: dict) -> str:
    import torch

    out.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
               devices=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
    import solosave

    out["solosave"] = os.path.dirname(solosave.__file__)
    return (f"Python {out['python']}, torch {out['torch']} (CUDA {out['cuda']}), "
            f"{out.get('device', 'no GPU')} x{out['devices']}, solosave from {out['solosave']}")


def sec_stream_ordering(out: dict) -> str:
    torch = _cuda()
    from solosave._src.plan.local_plan import plan_local
    from solosave._src.staging.device import CudaRuntime
    from solosave._src.staging.staging import Stager

    x = torch.zeros(16 * MIB, device="cuda")
    bad = []
    for label, runtime in (("current stream busy", CudaRuntime()), ("side stream delayed", _delayed_side_runtime())):
        for overlap in (False, True):
            stager = Stager(runtime=runtime)
            try:
                torch.cuda.synchronize()
                torch.cuda._sleep(SLEEP_CYCLES)  # the fill below waits behind this
                x.fill_(1.0)
                plan = plan_local({"x": x})
                staged, staging = stager.stage(plan.specs, plan.values, overlap=overlap)
                if overlap:
                    staging.wait(60)  # wait_staged(): orders the current stream after the copies
                x.fill_(2.0)  # must not overtake the copy
                staging.synchronize(60)
                got = _staged(stager, staged)["x"]
                ok = bool((got == 1.0).all())
                out[f"{label}/{'overlap' if overlap else 'blocking'}"] = ok
                if not ok:
                    bad.append(f"{label}, {'overlap' if overlap else 'blocking'}: staged values "
                               f"{sorted(set(got[:: 1 << 20].tolist()))}, want 1.0")
            finally:
                stager.close()
    if bad:
        raise AssertionError("; ".join(bad))
    return "the staged bytes are the first fill's in all 4 cases (current busy / side delayed x blocking / overlap)"


def sec_pinning(out: dict) -> str:
    torch = _cuda()
    from solosave._src.plan.local_plan import plan_local
    from solosave._src.staging.staging import Stager

    sd = {f"t{i:02d}": torch.randn(16 * MIB, device="cuda") for i in range(16)}  # 1 GiB
    total = sum(t.numel() * t.element_size() for t in sd.values())
    plan = plan_local(sd)
    stager = Stager()
    try:
        staged, staging = stager.stage(plan.specs, plan.values)
        staging.synchronize(60)
        buf = stager._buffer
        views = stager._plan.views
        out["registered"] = bool(buf is not None and buf.pinned)
        out["views_pinned"] = all(v.is_pinned() for v in views)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _, staging = stager.stage(plan.specs, plan.values)
            staging.synchronize(60)
            times.append(time.perf_counter() - t0)
    finally:
        stager.close()
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    base = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pos = 0
        for t in sd.values():
            n = t.numel() * t.element_size()
            dst[pos:pos + n].view(t.dtype).copy_(t, non_blocking=True)
            pos += n
        torch.cuda.synchronize()
        base.append(time.perf_counter() - t0)
    out["staging_GBps"] = round(total / min(times) / 1e9, 2)
    out["pinned_copy_GBps"] = round(total / min(base) / 1e9, 2)
    out["ratio"] = round(min(base) / min(times), 2)
    if not (out["registered"] and out["views_pinned"]):
        raise AssertionError(f"buffer registered: {out['registered']}, views pinned: {out['views_pinned']}")
    if out["ratio"] < 0.8:
        raise AssertionError(f"staging {out['staging_GBps']} GB/s is below 0.8x the pinned copy's "
                             f"{out['pinned_copy_GBps']} GB/s")
    return (f"registered, views pinned; staging {out['staging_GBps']} GB/s vs pinned copy_ "
            f"{out['pinned_copy_GBps']} GB/s ({out['ratio']}x) over {total / 2**30:.0f} GiB")


def sec_overlap_races(out: dict, root: str) -> str:
    torch = _cuda()
    _group()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import solosave

    with solosave.AsyncCheckpointer(overlap_staging=True, persistent_worker=False, timeout=60) as ck:
        x = torch.arange(4 * MIB, dtype=torch.float32, device="cuda")
        h = ck.save({"x": x}, f"{root}/race-plain")
        x.add_(1.0)  # before wait_staged()
        try:
            h.wait_staged()
            out["plain"] = "no error"
        except solosave.StagingRaceError:
            out["plain"] = "StagingRaceError"
        with contextlib.suppress(solosave.CheckpointError):
            h.wait(60)
        mesh = init_device_mesh("cuda", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.randn(4096, 1024, device="cuda"), mesh, [Shard(0)]))
        opt = torch.optim.AdamW([p], lr=0.1, foreach=True)
        p.grad = distribute_tensor(torch.ones(4096, 1024, device="cuda"), mesh, [Shard(0)])
        opt.step()  # the optimizer's state exists; the step below is the one that races
        before = p.to_local().detach().clone()
        ck._res.session.stager.runtime = _delayed_side_runtime()  # test tool: copies start late
        h = ck.save({"p": p}, f"{root}/race-dtensor")
        opt.step()  # no wait_staged(): the optimizer's step pre-hook orders it after the copies
        h.wait(60)
    got = {"p": distribute_tensor(torch.zeros(4096, 1024, device="cuda"), mesh, [Shard(0)])}
    solosave.load(got, f"{root}/race-dtensor")
    out["dtensor_holds_the_call"] = bool(torch.equal(got["p"].to_local(), before))
    out["dtensor_stepped"] = not bool(torch.equal(p.to_local().detach(), before))
    if out["plain"] != "StagingRaceError" or not out["dtensor_holds_the_call"] or not out["dtensor_stepped"]:
        raise AssertionError(f"plain tensor: {out['plain']}; DTensor checkpoint holds the values of the "
                             f"call: {out['dtensor_holds_the_call']} (stepped: {out['dtensor_stepped']})")
    return ("plain tensor changed before wait_staged(): StagingRaceError; DTensor + AdamW(foreach) "
            "stepped right after save() with the copies delayed: the checkpoint holds the values of the call")


def _matrix_sd(torch: Any) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    z = torch.complex(torch.randn(64, device="cuda", generator=g), torch.randn(64, device="cuda", generator=g))
    sd = {"transposed": torch.randn(64, 32, device="cuda", generator=g).t(),
          "bf16": torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16),
          "empty": torch.empty(0, 5, device="cuda"),
          "host": torch.arange(100, dtype=torch.int64),
          "conj": z.conj(), "neg": torch.randn(33, device="cuda", generator=g)._neg_view(),
          "big": torch.randn(8 * MIB, device="cuda", generator=g)}
    if hasattr(torch, "float8_e4m3fn"):
        sd["fp8"] = torch.randn(4096, device="cuda", generator=g).to(torch.float8_e4m3fn)
    return sd


def _bytes(t: Any) -> Any:
    import torch

    t = t.resolve_conj().resolve_neg().contiguous().cpu()
    return t.view(torch.uint8) if t.numel() and t.dim() else t.reshape(-1).view(torch.uint8)


def sec_dtype_matrix(out: dict, root: str) -> str:
    torch = _cuda()
    _group()
    import solosave

    sd = _matrix_sd(torch)
    want = {k: _bytes(v) for k, v in sd.items()}
    bad = []
    for overlap in (False, True):
        with solosave.AsyncCheckpointer(overlap_staging=overlap, persistent_worker=False, timeout=60) as ck:
            h = ck.save(sd, f"{root}/matrix-{overlap}")
            h.wait_staged()
            h.wait(60)
        for strided in (False, True):
            tgt = {k: torch.empty_like(v.resolve_conj().resolve_neg(), device=v.device) for k, v in sd.items()}
            if strided:
                tgt["transposed"] = torch.empty(64, 32, device="cuda").t()
                tgt["big"] = torch.empty(8 * MIB, 2, device="cuda")[:, 0]  # strided: every other element
            solosave.load(tgt, f"{root}/matrix-{overlap}")
            for k in sd:
                if tgt[k].device != sd[k].device or not torch.equal(_bytes(tgt[k]), want[k]):
                    bad.append(f"{k} ({'overlap' if overlap else 'blocking'}, "
                               f"{'non-contiguous' if strided else 'contiguous'} target)")
    out["keys"] = sorted(sd)
    if bad:
        raise AssertionError("not bit-exact: " + ", ".join(bad))
    return f"{len(sd)} keys ({', '.join(sorted(sd))}) x blocking/overlap x contiguous/non-contiguous targets: bit-exact"


def sec_double_registration(out: dict) -> str:
    torch = _cuda()
    from solosave._src.plan.local_plan import plan_local
    from solosave._src.staging.staging import Stager

    plan = plan_local({"x": torch.ones(MIB, device="cuda")})
    stager = Stager()
    try:
        _, staging = stager.stage(plan.specs, plan.values)
        staging.synchronize(60)
        buf = stager._buffer
        ptr, size = buf.base.data_ptr(), buf.size
        out["first_registration"] = buf.pinned
        buf.pinned = False  # a second registration through solosave's path (it fails)
        buf.pin(stager.runtime, 0)
        out["second_registration_pinned"] = buf.pinned
        buf.pinned = True  # it is registered (once): unregistered at close
        try:
            y = (torch.ones(1024, device="cuda") * 3).sum().item()
            out["kernel_in_training_thread"] = "ok" if y == 3072 else f"wrong result {y}"
        except RuntimeError as e:
            out["kernel_in_training_thread"] = f"raised: {str(e).splitlines()[0]}"
        control: dict = {}

        def bare_thread() -> None:  # the same failed call made directly: what it leaves to its thread
            torch.cuda.set_device(0)
            control["rc"] = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 1))
            try:
                (torch.ones(8, device="cuda") * 2).sum().item()
                control["kernel_after"] = "ok"
            except RuntimeError as e:
                control["kernel_after"] = f"raised: {str(e).splitlines()[0]}"

        t = threading.Thread(target=bare_thread)
        t.start()
        t.join(60)
        out["control"] = control
    finally:
        stager.close()
    if out["kernel_in_training_thread"] != "ok":
        raise AssertionError(f"after the failed second registration: {out['kernel_in_training_thread']}")
    return (f"second registration failed as expected; the training thread's next kernel ran; control thread: "
            f"cudaHostRegister code {control.get('rc')}, its next kernel {control.get('kernel_after')}")


def _nvidia_in(pid: int) -> list[str]:
    found = []
    with open(f"/proc/{pid}/maps") as f:
        found += sorted({line.split()[-1] for line in f if "/dev/nvidia" in line})
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/dev/nvidia"):
                found.append(target)
    return found


def sec_worker_context(out: dict, root: str) -> str:
    torch = _cuda()
    _group()
    import solosave
    from solosave._src.testing.introspect import worker_pid

    sd = {"w": torch.randn(MIB, device="cuda"), "ema": {"state": (torch.randn(16, device="cuda"), 0.999)}}
    with solosave.AsyncCheckpointer(persistent_worker=True, timeout=120, prepared_metadata=f"{root}/wc.md",
                                    create_prepared_metadata=True) as ck:
        modes = [ck.save(sd, f"{root}/wc{i}").wait(120).mode for i in range(3)]
        pid = worker_pid(ck)
        seen = _nvidia_in(pid)
        with open(f"/proc/{pid}/maps") as f:
            out["libcuda_mapped"] = any("libcuda" in line for line in f)
    out.update(modes=modes, nvidia=seen)
    if seen or modes != ["create", "reuse", "reuse"]:
        raise AssertionError(f"worker {pid} holds {seen or 'no /dev/nvidia*'}; modes {modes}")
    return (f"worker pid {pid}: no /dev/nvidia* in its maps or fds after 3 saves (modes {modes}) whose "
            f"non-tensor values hold CUDA tensors; libcuda mapped: {out['libcuda_mapped']}")


def _mapped_buffers() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if "/solosave_" in line})


def sec_close_in_flight(out: dict, root: str) -> str:
    torch = _cuda()
    _group()
    import solosave

    sd = {f"t{i}": torch.randn(16 * MIB, device="cuda") for i in range(8)}  # 512 MiB
    results = {}
    for overlap in (False, True):
        ck = solosave.AsyncCheckpointer(overlap_staging=overlap, timeout=60)
        ck.save(sd, f"{root}/close-warm-{overlap}").wait(120)
        torch.cuda._sleep(SLEEP_CYCLES * 3)  # the copies queue behind this
        h = ck.save(sd, f"{root}/close-{overlap}")
        t0 = time.monotonic()
        ck.close(timeout=0.2)
        close_s = time.monotonic() - t0
        torch.cuda.synchronize()
        deadline = time.monotonic() + 30
        while _mapped_buffers() and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            h.wait(1)
            state = "published"
        except solosave.CheckpointError:
            state = "abandoned"
        results["overlap" if overlap else "blocking"] = (round(close_s, 2), state, _mapped_buffers())
    out["results"] = {k: list(v) for k, v in results.items()}
    left = {k: v[2] for k, v in results.items() if v[2]}
    if left:
        raise AssertionError(f"staging buffers still mapped after the copies ended: {left}")
    return "; ".join(f"{k}: close() {v[0]} s, save {v[1]}, buffer unmapped after the copies"
                     for k, v in results.items())


def sec_nccl_device_id(out: dict, root: str) -> str:
    torch = _cuda()
    _group()
    import solosave

    sd = {"w": torch.randn(4 * MIB, device="cuda"), "step": 0}
    res = {}
    for persistent in (True, False):
        tag = "process" if persistent else "thread"
        with solosave.AsyncCheckpointer(persistent_worker=persistent, timeout=120,
                                        prepared_metadata=f"{root}/n-{tag}.md", create_prepared_metadata=True) as ck:
            modes = []
            for i in range(3):
                sd["w"].add_(1.0)
                sd["step"] = i
                want = sd["w"].clone()
                modes.append(ck.save(sd, f"{root}/n-{tag}{i}").wait(120).mode)
        got = {"w": torch.zeros_like(want), "step": -1}
        solosave.load(got, f"{root}/n-{tag}2")
        res[tag] = (modes, bool(torch.equal(got["w"], want)) and got["step"] == 2)
    out.update(backend=_PG.get("backend"), results={k: list(v) for k, v in res.items()})
    bad = {k: v for k, v in res.items() if v[0] != ["create", "reuse", "reuse"] or not v[1]}
    if bad:
        raise AssertionError(f"{bad}")
    return f"{_PG.get('backend')} W=1 bound to cuda:0: process and thread modes, create/reuse/reuse, bit-exact"


def _compute(x: Any, n: int = 20) -> Any:
    import torch

    for _ in range(n):
        x = torch.tanh(x @ x)
    return x


def sec_figures(out: dict, root: str) -> str:
    torch = _cuda()
    _group()
    import solosave

    sd = {f"t{i:02d}": torch.randn(4 * MIB, device="cuda") for i in range(64)}  # 1 GiB
    total = sum(t.numel() * t.element_size() for t in sd.values())
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pos = 0
    for t in sd.values():
        n = t.numel() * t.element_size()
        dst[pos:pos + n].view(t.dtype).copy_(t, non_blocking=True)
        pos += n
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t0
    x = torch.randn(4096, 4096, device="cuda")
    _compute(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _compute(x)
    torch.cuda.synchronize()
    compute = time.perf_counter() - t0
    figures = {}
    for overlap in (False, True):
        stalls, steps = [], []
        with solosave.AsyncCheckpointer(overlap_staging=overlap, timeout=120, prepared_metadata=f"{root}/f{overlap}.md",
                                        create_prepared_metadata=True) as ck:
            for i in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = ck.save(sd, f"{root}/f{overlap}{i}")
                stalls.append(time.perf_counter() - t0)
                _compute(x)  # the next forward/backward
                h.wait_staged()
                torch.cuda.synchronize()
                steps.append(time.perf_counter() - t0)
                h.wait(120)
        mode = "overlap" if overlap else "blocking"
        figures[mode] = {"stall_ms": round(sorted(stalls[1:])[1] * 1e3, 1),
                         "step_ms": round(sorted(steps[1:])[1] * 1e3, 1)}
    out.update(d2h_ms=round(d2h * 1e3, 1), compute_ms=round(compute * 1e3, 1), figures=figures, bytes=total)
    per_mode = [f"{m}: save() stall {f['stall_ms']} ms ({f['stall_ms'] / (d2h * 1e3):.2f}x the copy), "
                f"step {f['step_ms']} ms ({f['step_ms'] / (compute * 1e3):.2f}x compute)" for m, f in figures.items()]
    return (f"pinned D2H copy of {total / 2**30:.0f} GiB {d2h * 1e3:.1f} ms; compute alone {compute * 1e3:.1f} ms; "
            + "; ".join(per_mode))


def sec_demo(out: dict, root: str) -> str:
    _cuda()
    base = [sys.executable, "-m", "solosave", "train", "--nproc", "1", "--device", "cuda", "--parallel", "fsdp",
            "--no-progress", "--save", f"{root}/demo/ckpt", "--save-interval", "4"]
    first = subprocess.run(base + ["--steps", "8", "--async-save", "--use-persistent-ckpt-worker",
                                   "--ckpt-metadata", f"{root}/demo/prep.md", "--ckpt-metadata-create",
                                   "--ckpt-overlap-staging", "--json-log", f"{root}/demo/log.jsonl"],
                           capture_output=True, text=True, timeout=150)
    resumed = subprocess.run(base + ["--steps", "10", "--load", f"{root}/demo/ckpt"],
                             capture_output=True, text=True, timeout=150)
    log = open(f"{root}/demo/log.jsonl").read() if os.path.exists(f"{root}/demo/log.jsonl") else ""
    out.update(rc=first.returncode, resume_rc=resumed.returncode, reuse='"reuse"' in log)
    if first.returncode or resumed.returncode or not out["reuse"]:
        raise AssertionError(f"rc {first.returncode}, resume rc {resumed.returncode}, reuse saves: {out['reuse']}\n"
                             f"{first.stdout[-1500:]}{first.stderr[-1500:]}{resumed.stderr[-1500:]}")
    return "FSDP2 on CUDA, NCCL, overlapped staging: create then reuse saves published; resumed from the last"


#: name -> (bound in seconds, function, takes the scratch directory)
SECTIONS: dict[str, tuple[float, Callable[..., str], bool]] = {
    "environment": (60, sec_environment, False),
    "stream_ordering": (60, sec_stream_ordering, False),
    "pinning": (90, sec_pinning, False),
    "overlap_races": (90, sec_overlap_races, True),
    "dtype_matrix": (90, sec_dtype_matrix, True),
    "double_registration": (45, sec_double_registration, False),
    "worker_context": (90, sec_worker_context, True),
    "close_in_flight": (90, sec_close_in_flight, True),
    "nccl_device_id": (120, sec_nccl_device_id, True),
    "figures": (120, sec_figures, True),
    "demo": (200, sec_demo, True),
}


def child(names: list[str], root: str) -> None:
    """Run ``names`` in order, one ``@@begin`` / ``@@end <json>`` pair of lines per section."""
    for name in names:
        _, fn, needs_root = SECTIONS[name]
        print(f"@@begin {name}", flush=True)
        out: dict = {}
        t0 = time.monotonic()
        try:
            detail = fn(out, root) if needs_root else fn(out)
            status = "PASS"
        except Skip as e:
            status, detail = "SKIP", str(e)
        except BaseException as e:  # noqa: BLE001 - reported as the section's failure
            status = "FAIL"
            detail = f"{type(e).__name__}: {e}"
            out["traceback"] = traceback.format_exc()[-3000:]
        rec = {"name": name, "status": status, "seconds": round(time.monotonic() - t0, 1), "detail": detail,
               "data": out}
        print("@@end " + json.dumps(rec, default=str), flush=True)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no late teardown of NCCL or gloo at interpreter exit


# =============================================================================================
# the parent: bounds, lines, summary
# =============================================================================================

def _start_child(names: list[str], root: str) -> subprocess.Popen:
    cmd = [sys.executable, "-u", os.path.abspath(__file__), "--child", ",".join(names), "--root", root]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


class _Child:
    """A child running the sections left, its output read in whole lines without blocking
    (raw reads: a buffered reader would hide lines from ``select``)."""

    def __init__(self, names: list[str], root: str) -> None:
        self.p = _start_child(names, root)
        self.ended = False
        self._buf = b""

    def lines(self, timeout: float) -> list[str]:
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not ready:
            return []
        data = os.read(self.p.stdout.fileno(), 1 << 16)
        if not data:
            self.ended, rest, self._buf = True, self._buf, b""
            return [rest.decode(errors="replace")] if rest else []
        *full, self._buf = (self._buf + data).split(b"\n")
        return [line.decode(errors="replace") for line in full]


def _kill(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(10)


def _report(rec: dict) -> None:
    print(f"{rec['status']:<7} {rec['name']:<20} {rec['seconds']:>6.1f} s  {rec['detail']}", flush=True)
    tb = rec.get("data", {}).get("traceback")
    if tb and rec["status"] == "FAIL":
        print("        " + tb.rstrip().replace("\n", "\n        "), flush=True)


def _record(results: list[dict], todo: list[str], name: str, status: str, seconds: float, detail: str) -> None:
    rec = {"name": name, "status": status, "seconds": round(seconds, 1), "detail": detail}
    _report(rec)
    results.append(rec)
    todo.remove(name)


def run(names: list[str], budget: float, root: str) -> list[dict]:
    """Run the sections in children, each bounded, the whole within ``budget`` seconds."""
    t_start = time.monotonic()
    results: list[dict] = []
    todo = list(names)
    while todo:
        if time.monotonic() - t_start > budget:
            for name in list(todo):
                _record(results, todo, name, "SKIP", 0.0, f"no time left in the {budget:.0f} s budget")
            break
        child = _Child(todo, root)
        current, since, bound = None, time.monotonic(), CHILD_START_S
        while True:
            if current is None and time.monotonic() - t_start > budget:
                _kill(child.p)  # between two sections: the rest is skipped (above)
                break
            left = bound - (time.monotonic() - since)
            if left <= 0:
                _kill(child.p)
                _record(results, todo, current or todo[0], "TIMEOUT", time.monotonic() - since,
                        f"still running after its bound of {bound:.0f} s; the child was killed")
                break
            for line in child.lines(min(left, 1.0)):
                if line.startswith("@@begin "):
                    current, since = line.split(" ", 1)[1], time.monotonic()
                    # its own bound, cut to what is left of the whole budget
                    bound = min(SECTIONS[current][0], max(budget - (since - t_start), 1.0))
                elif line.startswith("@@end "):
                    rec = json.loads(line.split(" ", 1)[1])
                    _report(rec)
                    results.append(rec)
                    todo.remove(rec["name"])
                    current, since, bound = None, time.monotonic(), CHILD_START_S
                else:
                    print(f"        | {line}", flush=True)
            if child.ended:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.p.wait(10)
                if current is not None or (todo and child.p.returncode):
                    _record(results, todo, current or todo[0], "FAIL", time.monotonic() - since,
                            f"the child process died (exit status {child.p.returncode})")
                break
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated section names (default: all)")
    ap.add_argument("--skip-demo", action="store_true", help="leave out the demo (the last section)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check (default 480)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child(args.child.split(","), args.root)
        return 0
    names = [n for n in (args.only.split(",") if args.only else SECTIONS) if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    if args.skip_demo:
        names = [n for n in names if n != "demo"]
    print(f"solosave device check: {len(names)} section(s), budget {args.budget:.0f} s, source {SRC}", flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="solosave-device-check-") as root:
        results = run(names, args.budget, root)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "TIMEOUT", "SKIP")}
    total = time.monotonic() - t0
    print(f"device check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['TIMEOUT']} timed out, "
          f"{counts['SKIP']} skipped in {total:.0f} s", flush=True)
    if os.environ.get("OUT"):
        summary = {"python": platform.python_version(), "argv": sys.argv, "total_s": round(total, 1),
                   "counts": counts, "sections": results}
        with open(os.path.join(os.environ["OUT"], "device_check.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 1 if counts["FAIL"] or counts["TIMEOUT"] else 0


if __name__ == "__main__":
    sys.exit(main())
