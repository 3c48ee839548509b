"""The GPU device check (``make device-check``): one script, a few minutes on one GPU, no network.

What it runs (every part prints one line; the exit status is 1 if any check failed):

1. W=1 with an NCCL training group: create then reuse saves of CUDA tensors that are changed in
   place right after ``save()`` returns; the checkpoints hold the values as of the call and load
   bit-exactly onto CUDA and onto CPU tensors.
2. W=2 ranks sharing the one GPU with a gloo training group (NCCL refuses two ranks on a device):
   the same, with the persistent workers.
   Both staging modes: blocking (the default) and ``overlap_staging`` (a matmul loop stands for the
   forward/backward, then ``wait_staged()``, then the in-place "optimizer step").
3. No worker process has a CUDA context (``nvidia-smi --query-compute-apps=pid``, asked while
   the workers are alive).
4. A table: ``save()`` stall against a plain device-to-host copy of the same bytes, and the time
   of a step (save + compute + wait_staged) against the compute alone, in both modes.

5. The demo (``solosave train --device cuda``, 2 ranks sharing the GPU, overlapped staging):
   create then reuse saves, then a resume from the last checkpoint.

Status: written without access to a GPU; never run. Run it
with ``.venv/bin/python tools/device_check.py`` on a machine with CUDA torch and one GPU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 1 << 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(n_tensors: int = 16, numel: int = MIB) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {f"w{i}": torch.randn(numel, device="cuda", generator=g) for i in range(n_tensors)}


def _compute(x: torch.Tensor, n: int = 20) -> None:
    for _ in range(n):
        x = torch.tanh(x @ x)


def _saves(ck, sd: dict, root: str, tag: str, out: dict, rank: int) -> list:
    """Four saves; tensors change in place after ``save()`` (blocking) or after
    ``wait_staged()`` (overlap); returns the expected values per save."""
    x = torch.randn(2048, 2048, device="cuda")
    expect, stalls, steps = [], [], []
    for i in range(4):
        for t in sd.values():
            t.add_(1.0)
        expect.append({k: v.cpu() for k, v in sd.items()})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = ck.save(sd, f"{root}/{tag}{i}")
        stalls.append(time.perf_counter() - t0)
        _compute(x)  # the next forward/backward
        h.wait_staged()
        for t in sd.values():  # the next optimizer step
            t.mul_(-3.0)
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
        out[f"{tag}mode{i}/{rank}"] = h.wait(300).mode
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _compute(x)
    torch.cuda.synchronize()
    out[f"{tag}compute/{rank}"] = time.perf_counter() - t0
    out[f"{tag}stall/{rank}"] = sorted(stalls[1:])[len(stalls[1:]) // 2]
    out[f"{tag}step/{rank}"] = sorted(steps[1:])[len(steps[1:]) // 2]
    return expect


def _rank(rank: int, world: int, port: int, backend: str, root: str, out: dict) -> None:
    import solosave
    from solosave._src.testing.introspect import worker_pid

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.cuda.set_device(0)
    sd = _state()
    expected = {}
    for tag, overlap in (("b", False), ("o", True)):
        with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep-{tag}.md", create_prepared_metadata=True,
                                        overlap_staging=overlap, timeout=300) as ck:
            expected[tag] = _saves(ck, sd, root, tag, out, rank)
            out[f"cuda_workers/{tag}/{rank}"] = sorted({worker_pid(ck)} & _cuda_pids())
    dist.barrier()
    for tag, expect in expected.items():
        for i, want in enumerate(expect):
            for device in ("cuda", "cpu"):
                tgt = {k: torch.zeros_like(v, device=device) for k, v in want.items()}
                solosave.load(tgt, f"{root}/{tag}{i}")
                out[f"exact/{tag}{i}/{device}/{rank}"] = all(torch.equal(tgt[k].cpu(), want[k]) for k in want)
    t0 = time.perf_counter()
    host = [v.to("cpu", non_blocking=False) for v in sd.values()]
    torch.cuda.synchronize()
    out[f"d2h/{rank}"] = time.perf_counter() - t0
    del host
    dist.destroy_process_group()


def _run(world: int, backend: str) -> dict:
    root = tempfile.mkdtemp(prefix=f"solosave-device-{backend}-")
    manager = mp.Manager()
    out = manager.dict()
    port = _port()
    mp.start_processes(_rank, args=(world, port, backend, root, out), nprocs=world, start_method="spawn")
    return dict(out)


def _cuda_pids() -> set[int]:
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30)
    return {int(x) for x in r.stdout.split() if x.strip().isdigit()}


def main() -> int:
    if not torch.cuda.is_available():
        print("device check: no CUDA device; nothing run")
        return 2
    failed = 0
    for world, backend in ((1, "nccl"), (2, "gloo")):
        res = _run(world, backend)
        exact = all(v for k, v in res.items() if k.startswith("exact/"))
        cuda_workers = sorted({p for k, v in res.items() if k.startswith("cuda_workers/") for p in v})
        d2h = max(v for k, v in res.items() if k.startswith("d2h/"))
        for tag, label in (("b", "blocking"), ("o", "overlap")):
            modes = [res[f"{tag}mode{i}/0"] for i in range(4)]
            ok = exact and modes == ["create", "reuse", "reuse", "reuse"] and not cuda_workers
            failed += not ok
            stall = max(v for k, v in res.items() if k.startswith(f"{tag}stall/"))
            step = max(v for k, v in res.items() if k.startswith(f"{tag}step/"))
            compute = max(v for k, v in res.items() if k.startswith(f"{tag}compute/"))
            print(f"W={world} {backend} {label:>8}: {'ok' if ok else 'FAILED'}  modes={modes}  bit-exact={exact}  "
                  f"workers with a CUDA context: {cuda_workers or 'none'}  stall {stall * 1e3:.1f} ms vs "
                  f"device-to-host copy {d2h * 1e3:.1f} ms ({stall / d2h:.2f}x)  step {step * 1e3:.1f} ms vs "
                  f"compute alone {compute * 1e3:.1f} ms ({step / compute:.2f}x)")
    failed += not _demo()
    return 1 if failed else 0


def _demo() -> bool:
    root = tempfile.mkdtemp(prefix="solosave-device-demo-")
    base = [sys.executable, "-m", "solosave", "train", "--nproc", "2", "--device", "cuda", "--no-progress",
            "--steps", "8", "--save", f"{root}/ckpt", "--save-interval", "4"]
    first = subprocess.run(base + ["--async-save", "--use-persistent-ckpt-worker", "--ckpt-metadata",
                                   f"{root}/prep.md", "--ckpt-metadata-create", "--ckpt-overlap-staging",
                                   "--json-log", f"{root}/log.jsonl"],
                           capture_output=True, text=True, timeout=240)
    resumed = subprocess.run(base[:-4] + ["--steps", "10", "--load", f"{root}/ckpt"],
                             capture_output=True, text=True, timeout=240)
    ok = first.returncode == 0 and resumed.returncode == 0 and '"reuse"' in open(f"{root}/log.jsonl").read()
    print(f"demo on CUDA: {'ok' if ok else 'FAILED'}  (rc {first.returncode}, resume rc {resumed.returncode})")
    if not ok:
        print(first.stdout[-2000:], first.stderr[-2000:], resumed.stderr[-2000:], sep="\n")
    return ok


if __name__ == "__main__":
    sys.exit(main())
