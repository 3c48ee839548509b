"""Rank functions of tests/integrations/test_storage.py (module-level: the ranks and their workers import
them). The ranks reach the S3 server through the AWS variables the test passes as ``env``."""

from __future__ import annotations

import os
import time
import urllib.request

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import solosave
from solosave import FileWriter
from solosave._src.storage.upload import MIN_PART
from solosave.integrations import CheckpointManager, find_latest_checkpoint, published_checkpoints, read_latest_marker
from tests.support import assert_equal, zeros_like


def state(rank: int, seed: int) -> dict:
    """About 6.5 MiB per rank: the big tensor spans two 5 MiB upload parts."""
    g = torch.Generator().manual_seed(seed)
    return {"big": {f"r{rank}": torch.randn(1536, 1024, generator=g)},
            "w": torch.randn(64, 32, generator=g), "step": seed, "name": f"run-{seed}",
            "ids": torch.arange(100, dtype=torch.int64) + seed}


class FailingUploadWriter(FileWriter):
    """Fails the upload of rank 1's file of any checkpoint whose URL contains ``fail``, after
    one part went out (so there is a multipart upload to abort)."""

    def open(self, path: str):  # noqa: ANN201 - an ObjectUpload
        up = super().open(path)
        if "fail" in path and "/__1_" in path:
            add = up._add

            def failing(view):
                if up.tell() + view.nbytes > MIN_PART + (1 << 20):
                    raise ConnectionError("injected: the upload of this part failed")
                return add(view)

            up._add = failing
        return up


def _uploads_left(bucket: str, opts: dict) -> int:
    import fsspec

    return len(fsspec.filesystem("s3", **opts).call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []))


def _loads(sd: dict, url: str, opts: dict) -> bool:
    """Both loaders read ``url`` back as ``sd`` (solosave's and stock DCP's fsspec reader)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    a = zeros_like(sd)
    solosave.load(a, url, storage_options=opts)
    b = zeros_like(sd)
    dcp.load(b, storage_reader=FsspecReader(url, **opts))
    assert_equal(sd, a)
    assert_equal(sd, b)
    return True


def create_reuse_fail(rank: int, world: int, bucket: str, endpoint: str) -> dict:
    """W=2: a create save then reuse saves to s3://bucket, both loaders, overwrite, and an upload
    that fails on rank 1 (nothing published, every rank raises, the previous checkpoint loads).
    The endpoint reaches the ranks and their workers only through ``storage_options``."""
    os.environ.pop("AWS_ENDPOINT_URL", None)
    opts = {"client_kwargs": {"endpoint_url": endpoint}}
    root = f"s3://{bucket}/run"
    out: dict = {"modes": [], "collectives": []}
    writer = FailingUploadWriter(part_size=MIN_PART, upload_concurrency=2)
    with solosave.AsyncCheckpointer(writer=writer, prepared_metadata=f"{root}/prepared.metadata",
                                    create_prepared_metadata=True, timeout=120, storage_options=opts) as ckpt:
        for step in range(2):
            r = ckpt.save(state(rank, step), f"{root}/step_{step}").wait(120)
            out["modes"].append(r.mode)
            out["collectives"].append(r.collectives())
        out["loads"] = _loads(state(rank, 1), f"{root}/step_1", opts)
        try:
            ckpt.save(state(rank, 9), f"{root}/step_1")
        except solosave.CheckpointExistsError as e:
            out["exists"] = str(e)
        out["modes"].append(ckpt.save(state(rank, 11), f"{root}/step_1", overwrite=True).wait(120).mode)
        out["overwritten"] = _load_equal(state(rank, 11), f"{root}/step_1", opts)
        try:
            ckpt.save(state(rank, 3), f"{root}/step_fail").wait(120)
        except solosave.CheckpointError as e:
            out["failed"] = str(e)
        dist.barrier()
        out["fail_published"] = _exists(f"{root}/step_fail/.metadata", opts)
        out["uploads_left"] = _uploads_left(bucket, opts)
        out["previous_loads"] = _load_equal(state(rank, 11), f"{root}/step_1", opts)
        out["modes"].append(ckpt.save(state(rank, 4), f"{root}/step_4").wait(120).mode)
    out["after_loads"] = _load_equal(state(rank, 4), f"{root}/step_4", opts)
    out["prepared"] = solosave.load_prepared_metadata(f"{root}/prepared.metadata",
                                                      storage_options=opts).fingerprint.world_size
    return out


def _load_equal(sd: dict, url: str, opts: dict | None = None) -> bool:
    got = zeros_like(sd)
    solosave.load(got, url, storage_options=opts)
    assert_equal(sd, got)
    return True


def _exists(url: str, opts: dict) -> bool:
    import fsspec

    fs = fsspec.filesystem("s3", **opts)
    fs.invalidate_cache()
    return fs.exists(url)


def retention_and_stock_writer(rank: int, world: int, bucket: str) -> dict:
    """W=2: CheckpointManager on s3:// (latest marker, keep-last, newest published), and stock
    DCP's fsspec writer read back by solosave.load."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    root = f"s3://{bucket}/ckpts"
    ckpt = solosave.AsyncCheckpointer(persistent_worker=False, assume_constant_structure=True, checksums=True,
                                      timeout=120)
    manager = CheckpointManager(root, ckpt, keep_last=2, async_save=True)
    for step in (1, 2, 3, 4, 5):
        manager.save(step, state(rank, step))
        manager.poll()
    manager.finish()
    manager.wait_for_pruning(60)
    dist.barrier()
    out = {"published": [s for s, _ in published_checkpoints(root)],
           "latest": find_latest_checkpoint(root), "marker": read_latest_marker(root),
           "failures": len(manager.failures)}
    out["latest_loads"] = _loads(state(rank, 5), out["latest"][1], {})
    report = solosave.verify_checkpoint(out["latest"][1])
    out["verify"] = (report.ok, report.checksums, report.checksummed_records)
    sd = state(rank, 7)
    dcp.save(sd, storage_writer=FsspecWriter(f"s3://{bucket}/stock"))
    got = zeros_like(sd)
    solosave.load(got, f"s3://{bucket}/stock")
    assert_equal(sd, got)
    out["stock_loads"] = True
    return out


def _timed(fn) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def _save_once(url: str, **options) -> None:
    with solosave.AsyncCheckpointer(persistent_worker=False, timeout=60, **options) as ckpt:
        ckpt.save(state(dist.get_rank(), 0), url).wait(60)


def bad_input(rank: int, world: int, bucket: str, endpoint: str, dead: str) -> dict:
    """W=2: each bad destination fails on every rank with the same clear error, in bounded time."""
    fast = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}}
    cases = {
        "protocol": lambda: _save_once("nosuchproto://b/x"),
        "bucket": lambda: _save_once(f"s3://{bucket}-missing/x"),
        "endpoint": lambda: _save_once(f"s3://{bucket}/x", storage_options={
            **fast, "client_kwargs": {"endpoint_url": dead}}),
        "load_endpoint": lambda: solosave.load({"w": torch.zeros(1)}, f"s3://{bucket}/x", storage_options={
            **fast, "client_kwargs": {"endpoint_url": dead}}),
        "load_missing": lambda: solosave.load({"w": torch.zeros(1)}, f"s3://{bucket}/nothing-here"),
        "load_protocol": lambda: solosave.load({"w": torch.zeros(1)}, "nosuchproto://b/x"),
    }
    out = {name: _timed(fn) for name, fn in cases.items()}
    # wrong credentials: the server checks them from now on (rank 0 switches it), then stops
    if rank == 0:
        _auth(endpoint, "0")
    dist.barrier()
    try:
        out["credentials"] = _timed(lambda: _save_once(f"s3://{bucket}/x", storage_options={
            "key": "wrong", "secret": "wrong"}))
    finally:
        dist.barrier()
        if rank == 0:
            _auth(endpoint, "inf")
    return out


def _auth(endpoint: str, count: str) -> None:
    """moto's switch: check credentials after ``count`` more requests ("inf": never)."""
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
                                 headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(req, timeout=10).close()  # noqa: S310 - the test's own server


def durable_on_s3(rank: int, world: int, bucket: str, fast: str) -> dict:
    """W=2, two tiers: the fast tier a local directory, the durable one s3://bucket/durable; the
    copies are concurrent multipart uploads (5 MiB parts), published with the load index; a load
    from the durable tier reads the index by ranges; with the fast tier gone every rank restores
    from the durable copy."""
    import shutil

    from solosave._src.load.load import SafeStorageReader
    from solosave.integrations import CheckpointManager, find_restore_point

    durable = f"s3://{bucket}/durable"
    writer = FileWriter(part_size=MIN_PART, upload_concurrency=2)
    ck = solosave.AsyncCheckpointer(writer=writer, assume_constant_structure=True, durable_root=durable, timeout=120)
    manager = CheckpointManager(fast, ck, keep_last=1)
    for step in (1, 2):
        manager.save(step, state(rank, step))
    manager.finish()
    dist.barrier()  # rank 0 writes the markers and prunes: the other rank looks once it has finished
    out = {"copies": [(d.step, d.result.ok, d.result.error) for d in manager.durable_done],
           "latest": read_latest_marker(durable), "fast_left": sorted(os.listdir(fast))}
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    out["objects"] = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{durable}/iter_0000002"))
    sd = zeros_like(state(rank, 2))
    reader_stats = {}
    real = SafeStorageReader.read_data

    def spy(self, plan, planner, whole=()):
        fut = real(self, plan, planner, whole)
        reader_stats["stats"] = self.last_read_stats
        return fut

    SafeStorageReader.read_data = spy
    try:
        out["loaded_from"] = solosave.load(sd, f"{durable}/iter_0000002")
    finally:
        SafeStorageReader.read_data = real
    assert_equal(state(rank, 2), sd)
    out["ranged"] = reader_stats["stats"] is not None and reader_stats["stats"].bytes_read > 0
    report = solosave.verify_checkpoint(f"{durable}/iter_0000002")
    out["verify"] = (report.ok, report.index)
    if rank == 0:
        shutil.rmtree(fast)
    dist.barrier()
    out["point"] = find_restore_point(fast, durable)
    return out
