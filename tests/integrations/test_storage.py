"""URL destinations (issue 16): saves, loads, the prepared file, the manager and the CLI on
``s3://`` against a real S3-compatible server started here (moto's server mode, 127.0.0.1),
with the same commit guarantees as local paths; bad URLs fail clearly, on every rank, in bounded
time. Skipped, with the reason, when moto or s3fs is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from solosave._src.save.session import normalize_directory
from solosave._src.storage.fsspec import FsspecStorage
from solosave._src.storage.local import check_local_path
from solosave._src.storage.registry import scheme_of, storage_for
from solosave._src.storage.upload import MIN_PART, S3Upload, _Body
from solosave._src.testing.s3_server import s3_server
from solosave.cli import main as cli
from tests.integrations import storage_fns
from tests.support import dcp_save_local, free_port, run_ranks

# One S3 server per module (the s3 fixture): its tests share one worker under pytest-xdist
# (make test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("s3_server")


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto.server", reason="moto[server] is not installed (requirements-dev.txt)")
    pytest.importorskip("s3fs", reason="s3fs is not installed: pip install 'solosave[s3]'")
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    with s3_server(port=free_port()) as (endpoint, env):
        os.environ.update(env)
        try:
            yield endpoint, env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _bucket(env_s3) -> str:
    import fsspec

    name = f"b-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(f"s3://{name}")
    return name


# -- no server needed ---------------------------------------------------------------------------
def test_urls_are_told_from_local_paths_and_never_mangled():
    assert scheme_of("s3://b/run/step_1") == "s3" and scheme_of("memory://x") == "memory"
    assert scheme_of("runs/s3:/b") is None and scheme_of("/tmp/x") is None and scheme_of("C:\\x") is None
    assert FsspecStorage.normalize("s3://b/run//") == "s3://b/run" and FsspecStorage.join("s3://b/run/", "x") == "s3://b/run/x"
    assert normalize_directory("s3://b/run/step_1/") == "s3://b/run/step_1"  # not ./s3:/b/...
    with pytest.raises(ValueError, match="collapsed by pathlib"):
        check_local_path(os.fspath(__import__("pathlib").Path("s3://bucket/run")))


def test_unknown_protocol_names_the_fix():
    pytest.importorskip("fsspec")
    with pytest.raises(ValueError, match=r"unknown storage protocol 'nosuchproto'.*solosave\[s3\]"):
        storage_for("nosuchproto://b/x")


def test_a_missing_backend_names_the_extra(monkeypatch):
    fsspec = pytest.importorskip("fsspec")

    def missing(protocol):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(ImportError, match=r"s3://b/x needs the fsspec backend of s3://.*pip install 'solosave\[s3\]'"):
        storage_for("s3://b/x")


def test_part_bodies_read_across_views_without_joining():
    views = [memoryview(b"abc"), memoryview(bytearray(b"defgh")), memoryview(b""), memoryview(b"ij")]
    body = _Body(views)
    assert len(body) == 10 and body.read(4) == b"abcd" and body.read() == b"efghij" and body.read() == b""
    body.seek(2)
    assert body.read(5) == b"cdefg" and body.tell() == 7
    body.seek(-1, os.SEEK_END)
    assert body.read() == b"j"


# -- against the server -------------------------------------------------------------------------
def test_uploads_complete_whole_or_leave_nothing(s3):
    import fsspec

    fs = fsspec.filesystem("s3")
    bucket = _bucket(s3)
    data = torch.arange((2 * MIN_PART + 12345) // 4, dtype=torch.int32)
    view = memoryview(data.numpy()).cast("B")
    up = S3Upload(fs, f"s3://{bucket}/f", MIN_PART, 2)
    up.write(b"head")
    up.write_stable(view)
    up.write(bytearray(b"tail"))
    assert not fs.exists(f"s3://{bucket}/f")  # parts are out, the object is not there yet
    up.commit()
    assert fs.cat_file(f"s3://{bucket}/f") == b"head" + bytes(view) + b"tail" and up._next == 4
    up = S3Upload(fs, f"s3://{bucket}/g", MIN_PART, 2)
    up.write_stable(view)
    up.close()  # abandoned: aborted, nothing visible, no upload left
    fs.invalidate_cache()
    assert not fs.exists(f"s3://{bucket}/g")
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")
    small = S3Upload(fs, f"s3://{bucket}/small", MIN_PART, 2)
    small.write(b"x" * 100)
    small.commit()  # one PUT
    assert fs.cat_file(f"s3://{bucket}/small") == b"x" * 100 and small._upload_id is None


def test_single_object_commits_and_listing(s3):
    bucket = _bucket(s3)
    st = storage_for(f"s3://{bucket}/d")
    st.commit(f"s3://{bucket}/d/iter_0000001/.metadata", b"one")
    st.commit(f"s3://{bucket}/d/iter_0000001/.metadata", b"two")
    assert st.read(f"s3://{bucket}/d/iter_0000001/.metadata") == b"two"
    assert st.read_range(f"s3://{bucket}/d/iter_0000001/.metadata", 1, 5) == b"wo"
    assert st.read_range(f"s3://{bucket}/d/iter_0000001/.metadata", 3, 5) == b""  # S3 refuses the range itself
    assert st.listdir(f"s3://{bucket}/d") == ["iter_0000001"] and st.isdir(f"s3://{bucket}/d/iter_0000001")
    st.remove(f"s3://{bucket}/d/iter_0000001/.metadata")
    st.remove(f"s3://{bucket}/d/iter_0000001/.metadata")  # idempotent
    assert not st.exists(f"s3://{bucket}/d/iter_0000001/.metadata")
    with pytest.raises(FileNotFoundError, match="does not exist; create it"):
        storage_for(f"s3://{bucket}-nope/x").check_container(f"s3://{bucket}-nope/x")


@pytest.mark.timeout(180)
def test_create_then_reuse_saves_load_and_a_failed_upload_publishes_nothing(s3, case_log):
    t0 = time.monotonic()
    bucket = _bucket(s3)
    env = {k: v for k, v in s3[1].items() if k != "AWS_ENDPOINT_URL"}  # the endpoint: storage_options only
    out = run_ranks(storage_fns.create_reuse_fail, 2, bucket, s3[0], env=env, timeout=160)
    for r in out:
        assert r["modes"] == ["create", "reuse", "reuse", "reuse"]
        assert r["collectives"][1] == {"all_reduce": {"count": 1, "bytes": 8}}
        assert r["loads"] and r["overwritten"] and r["previous_loads"] and r["after_loads"]
        assert "already holds a complete checkpoint" in r["exists"]
        assert "rank 1" in r["failed"] and "injected: the upload of this part failed" in r["failed"]
        assert r["fail_published"] is False and r["uploads_left"] == 0
        assert r["prepared"] == 2
    assert out[0]["failed"] == out[1]["failed"]
    case_log("s3://: an upload fails on rank 1 in a reuse save (W=2)",
             "no .metadata published, no multipart upload left, both ranks raise the same "
             "CheckpointError naming rank 1; the previous checkpoint loads; the next save reuses",
             time.monotonic() - t0)


@pytest.mark.timeout(150)
def test_retention_latest_and_stock_dcp_writer(s3):
    bucket = _bucket(s3)
    out = run_ranks(storage_fns.retention_and_stock_writer, 2, bucket, env=s3[1], timeout=130)
    for r in out:
        assert r["published"] == [4, 5] and r["failures"] == 0
        assert r["latest"] == (5, f"s3://{bucket}/ckpts/iter_0000005") and r["marker"] == "iter_0000005"
        assert r["latest_loads"] and r["stock_loads"]
        assert r["verify"] == (True, "verified", 6)  # every record, from CRC32 sidecars on the store


@pytest.mark.timeout(150)
def test_bad_destinations_fail_clearly_on_every_rank_in_bounded_time(s3, case_log):
    t0 = time.monotonic()
    endpoint, env = s3
    bucket = _bucket(s3)
    out = run_ranks(storage_fns.bad_input, 2, bucket, endpoint, f"http://127.0.0.1:{free_port()}",
                    env=env, timeout=130)
    want = {"protocol": ("ValueError", "pip install 'solosave[s3]'"),
            "bucket": ("FileNotFoundError", "does not exist; create it"),
            "endpoint": ("ConnectionError", "cannot reach the storage"),
            "load_endpoint": ("PreparedMetadataError", "cannot reach the storage"),
            "load_missing": ("FileNotFoundError", "does not exist"),
            "load_protocol": ("ValueError", "unknown storage protocol"),
            "credentials": ("PermissionError", "access denied")}
    for case, (kind, needle) in want.items():
        for r in out:
            got_kind, message, seconds = r[case]
            assert got_kind == kind and needle in message, (case, r[case])
            assert seconds < 30, (case, seconds)
        assert out[0][case][:2] == out[1][case][:2], case
    case_log("s3://: unknown protocol, missing bucket, wrong credentials, unreachable endpoint (W=2)",
             "every rank raises the same error naming the fix, each within "
             f"{max(r[c][2] for r in out for c in want):.1f} s", time.monotonic() - t0)


def test_cli_inspect_verify_prepare_on_urls(s3, capsys):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    bucket = _bucket(s3)
    url = f"s3://{bucket}/ck"
    dcp_save_local({"w": torch.ones(3, 2), "step": 4}, storage_writer=FsspecWriter(url))
    assert cli(["inspect", url, "--json"]) == 0
    assert {i["key"] for i in json.loads(capsys.readouterr().out)["items"]} == {"w", "step"}
    assert cli(["verify", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert cli(["prepare", "--from", url, "--out", f"s3://{bucket}/p.md", "--world-size", "1"]) == 0
    capsys.readouterr()
    assert cli(["inspect", f"s3://{bucket}/p.md", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fingerprint"]["world_size"] == 1
    assert cli(["verify", url, "--prepared", f"s3://{bucket}/p.md"]) == 0
    capsys.readouterr()
    for args, needle in ((["inspect", f"s3://{bucket}/nothing"], "no such file"),
                         (["verify", "nosuchproto://x/y"], "unknown storage protocol")):
        assert cli(args) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_saves_to_and_resumes_from_a_url(s3):
    """``solosave train --save s3://... --load s3://...`` (2 ranks):
    create-then-reuse saves, ``latest``, keep-last, then a resume from the newest published one."""
    import fsspec

    bucket = _bucket(s3)
    common = ["--nproc", "2", "--no-progress", "--layers", "1", "--d-model", "64", "--heads", "2",
              "--vocab", "128", "--seq-len", "32", "--batch-size", "4", "--save-interval", "4",
              "--async-save", "--use-persistent-ckpt-worker", "--keep-last", "1",
              "--ckpt-metadata", f"s3://{bucket}/prepared.metadata", "--ckpt-metadata-create"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def train(*args):
        r = subprocess.run([sys.executable, "-m", "solosave", "train", *common, *args],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    out = train("--steps", "8", "--save", f"s3://{bucket}/ckpt")
    assert "mode=create" in out and "mode=reuse" in out and f"verified s3://{bucket}/ckpt/iter_0000008: ok" in out
    out = train("--steps", "12", "--save", f"s3://{bucket}/ckpt", "--load", f"s3://{bucket}/ckpt")
    assert f"resumed from s3://{bucket}/ckpt/iter_0000008 (step 8)" in out
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert fs.cat_file(f"s3://{bucket}/ckpt/latest").strip() == b"iter_0000012"
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"s3://{bucket}/ckpt")) == ["iter_0000012", "latest"]


@pytest.mark.timeout(200)
def test_two_tiers_with_the_durable_tier_on_s3(s3, tmp_path):
    bucket = _bucket(s3)
    out = run_ranks(storage_fns.durable_on_s3, 2, bucket, str(tmp_path / "fast"), env=s3[1], timeout=180)
    durable = f"s3://{bucket}/durable"
    for r in out:
        assert r["copies"] == [(1, True, None), (2, True, None)]
        assert r["latest"] == "iter_0000002" and r["fast_left"] == ["iter_0000002", "latest"]
        assert r["objects"] == [".metadata", ".solosave-index", "__0_0.distcp", "__1_0.distcp"]
        assert r["loaded_from"] == f"{durable}/iter_0000002" and r["ranged"]
        assert r["verify"] == (True, "matches")  # the re-pointed index, read by ranges
        assert r["point"] == (2, f"{durable}/iter_0000002")


@pytest.mark.timeout(300)
def test_a_replicated_load_from_a_url_reads_each_byte_once(s3, tmp_path, case_log):
    import s3fs
    from torch.distributed.checkpoint import FileSystemReader

    from tests.multiproc import coop_fns

    local = str(tmp_path / "ck")
    run_ranks(coop_fns.save, 2, local, timeout=100)
    bucket = f"coop-{uuid.uuid4().hex[:8]}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(bucket)
    for name in os.listdir(local):
        fs.put_file(os.path.join(local, name), f"{bucket}/ck/{name}")
    unique = sum(int(i.length) for i in FileSystemReader(local).read_metadata().storage_data.values())
    out = run_ranks(coop_fns.load, 4, f"s3://{bucket}/ck", 2, None, local, env=s3[1], timeout=240)
    for o in out:
        assert o["ok"] and o["same_as_stock"], o
        assert o["result"]["shared_ranges"] == 6, o["result"]
    assert sum(o["result"]["bytes_read"] for o in out) == unique
    assert sum(o["result"]["bytes_received"] for o in out) == unique
    case_log("a checkpoint on S3 loaded at W=4 as 2 replicas x 2 shards (cooperative by default on a URL)",
             f"the ranks read {unique} bytes in all, the checkpoint's bytes once (1.00x); bit-exact")
