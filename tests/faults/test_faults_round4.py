"""Round 4 of the attacks of the reliability issue: retention that could delete the only complete
copy on either tier, a crafted load index on S3, Lightning's top-k removal beside a save that fails
on one rank, torchtitan's keep_latest_k under a SIGKILL at a random moment. Rank functions:
``round4_fns.py``."""

from __future__ import annotations

import copy
import os
import resource
import time

import pytest

import solosave
from solosave._src.formats.dcp import INDEX_FILE
from tests import crafted
from tests.faults import round4_fns as r4
from tests.support import assert_equal, free_port, run_ranks, run_ranks_tolerant, zeros_like

pytestmark = pytest.mark.timeout(240)
TIMEOUT = 60.0


# -- 1. retention and two tiers --------------------------------------------------------------------
def test_retention_never_deletes_the_newest_complete_copy_of_either_tier(tmp_path, case_log):
    t0 = time.monotonic()
    out = run_ranks(r4.durable_copies_fail_while_retention_runs, 2, str(tmp_path), TIMEOUT, timeout=200)
    r = out[0]
    assert [(s, ok) for s, ok, _ in r["copies"]] == [(1, True), (2, True), (3, False), (4, False), (5, False)]
    # never a source deleted: each failed copy failed on the full disk (each tried again, in vain), or was
    # coalesced into a newer one while those tries ran
    assert all("No space left" in e or "coalesced" in e for _, ok, e in r["copies"] if not ok), r["copies"]
    for d in r["deletions"]:  # at every deletion, a newer complete copy stays on the same tier
        assert max(d[d["tier"]]) > d["step"], d
        assert d["tier"] == "durable" or d["step"] not in d["copying"], d
    assert r["fast"] == [5] and r["durable"] == [2] and not r["failures"]
    assert all(o["point"] == 5 and o["point_fast_lost"] == 2 for o in out)  # restored bit for bit both times
    case_log("two tiers, keep_last=1, durable_keep_last=1: the durable tier fills up (ENOSPC) from step 3 while "
             "both tiers' retention runs (W=2, 5 async saves)",
             f"{len(r['deletions'])} deletions, each with a newer complete copy on its tier and none of a checkpoint "
             f"whose copy was running; left: fast {r['fast']}, durable {r['durable']} (the newest complete durable "
             "copy kept); restore: step 5 from the fast tier, step 2 from the durable tier once the fast tier was "
             "lost, bit for bit", time.monotonic() - t0)


# ".//fast": the checkpointer's paths are normalized, save_dir was not (the fast tier deleted the
# sources of running copies at 0a3cae4)
@pytest.mark.parametrize("fast_name", ["fast", ".//fast"])
def test_fast_retention_spares_checkpoints_whose_durable_copy_is_running(tmp_path, fast_name, case_log):
    t0 = time.monotonic()
    out = run_ranks(r4.slow_copies_and_fast_retention, 2, str(tmp_path), fast_name, TIMEOUT, timeout=200)
    r = out[0]
    case_log(f"two tiers, keep_last=1, fast tier spelled {fast_name!r}: every durable copy slower than a save "
             "interval (W=2, 3 saves)", f"copies {[(s, ok) for s, ok, _ in r['copies']]}; left: fast {r['fast']}, "
             f"durable {r['durable']}", time.monotonic() - t0)
    # copy 2 ran, or (copy 1 still running when save 3 came: the copies fall behind) was coalesced into 3
    copies = {s: (ok, why) for s, ok, why in r["copies"]}
    assert sorted(copies) == [1, 2, 3] and copies[1][0] and copies[3][0], r["copies"]
    assert copies[2][0] or "coalesced" in copies[2][1], r["copies"]
    assert r["fast"] == [3] and r["durable"] == [s for s in (1, 2, 3) if copies[s][0]]  # each loaded bit for bit


# -- 2. a crafted load index on S3 -------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_checkpoint():
    """An S3-compatible server on 127.0.0.1 (moto) and a 2-rank solosave checkpoint saved to it,
    with objects outside the checkpoint that a crafted index could try to make a load read."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (requirements-dev.txt)")
    pytest.importorskip("s3fs", reason="s3fs is not installed: pip install 'solosave[s3]'")
    import uuid

    import fsspec

    from solosave._src.testing.s3_server import s3_server

    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    with s3_server(port=free_port()) as (endpoint, env):
        os.environ.update(env)
        try:
            fs = fsspec.filesystem("s3")
            bucket = f"b-{uuid.uuid4().hex[:12]}"
            fs.mkdir(f"s3://{bucket}")
            url = f"s3://{bucket}/run/ck"
            run_ranks(r4.save_to_s3, 2, url, env=env, timeout=120)
            for outside in ("run/x", "x", "run/ck2/__0_0.distcp", "run/ck.bak/__0_0.distcp"):
                fs.pipe(f"s3://{bucket}/{outside}", b"not part of the checkpoint")
            yield fs, url, fs.cat_file(f"{url}/{INDEX_FILE}")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _crafted_indexes(data: bytes) -> dict[str, bytes]:
    """Load indexes an attacker who can write the index object makes (every checksum recomputed)."""
    header, directory, blobs = crafted.index_split(data)
    join = crafted.index_join

    def d(**kw):
        return {**copy.deepcopy(directory), **kw}

    def groups(g: int, field: int, value: int) -> dict:
        gs = copy.deepcopy(directory["groups"])
        gs[g][field] = value
        return d(groups=gs)

    g_w = directory["keys"]["w"][1]
    out = {f"data file named {name!r}": join(header, d(files=[name, *directory["files"][1:]]), blobs)
           for name in ("../x", "..", ".", "", "/etc/passwd", "../ck2/__0_0.distcp", "../../x", "sub/../x",
                        "%2e%2e/x", "x\0y")}
    out.update({
        "row of 'w' naming file 2**31": crafted.index_set_row(data, "w", file=2**31),
        "bytes entry naming file 7": join(header, d(keys={**directory["keys"], "name": ["b", 7, 0, 10]}), blobs),
        "2**40 chunks in a group": join(header, groups(g_w, 0, 2**40), blobs),
        "2**30 dimensions in a group": join(header, groups(g_w, 1, 2**30), blobs),
        "2**40 keys in a group": join(header, groups(g_w, 2, 2**40), blobs),
        "geometry at offset -5": join(header, groups(g_w, 3, -5), blobs),
        "geometry of 2**50 bytes": join(header, groups(g_w, 4, 2**50), blobs),
        "rows at offset 2**62": join(header, groups(g_w, 6, 2**62), blobs),
        "100,000 data files": join(header, d(files=[f"__{i}_0.distcp" for i in range(100_000)], file_ends=None),
                                   blobs),
        "file_ends of 2**62": join(header, d(file_ends=[2**62] * len(directory["files"])), blobs),
        "a 2 MiB directory": join(header, d(pad="x" * (2 << 20)), blobs),
        "directory length 2**63": data[:data.index(b"\n", len(crafted.INDEX_MAGIC)) + 1]
        + crafted.INDEX_PREFIX.pack(2**63, 0) + data[data.index(b"\n", len(crafted.INDEX_MAGIC)) + 13:],
        "truncated, body_length made to match": join(header, directory, blobs[:len(blobs) // 2]),
        "1 MiB appended": data + bytes(1 << 20),
        "1 MiB appended, body_length made to match": join(header, directory, blobs + bytes(1 << 20)),
        "empty": b"",
    })
    for cut in (5, len(crafted.INDEX_MAGIC) + 10, len(data) // 2, len(data) - 1):
        out[f"truncated to {cut} bytes"] = data[:cut]
    for key, value in (("metadata_length", -1), ("metadata_length", 2**62), ("metadata_length", 0),
                       ("save_id_at", -1), ("save_id_at", -100), ("save_id_at", 2**62),
                       ("save_id_at", header["metadata_length"] + 5), ("save_id_at", 1.5), ("body_length", -1),
                       ("body_length", 2**62), ("save_id", "x" * 100_000), ("save_id", 5)):
        out[f"header {key}={str(value)[:12]}"] = join({**header, key: value}, directory, blobs)
    return out


def _load_crafted(fs, url: str, data: bytes, monkeypatch) -> tuple[str, list[str], float]:
    """Write ``data`` as the checkpoint's load index and load it in this process (under an
    address-space limit of what the process uses plus 1 GiB): ``(outcome, paths read outside the
    checkpoint, seconds)``; outcome ``index`` / ``metadata`` (exact values through either) or the
    solosave exception; anything else raises."""
    from solosave._src.storage.fsspec import FsspecStorage

    fs.pipe(f"{url}/{INDEX_FILE}", data)
    seen: list[tuple[str, str]] = []
    for name in ("read", "read_range", "read_range_into", "open_read", "size", "sizes", "exists"):
        real = getattr(FsspecStorage, name)

        def spy(self, path, *a, _real=real, _name=name, **kw):
            seen.append((_name, str(path)))
            return _real(self, path, *a, **kw)

        monkeypatch.setattr(FsspecStorage, name, spy)
    got = zeros_like(r4.s3_full())
    t = time.monotonic()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + (1 << 30), hard))
    try:
        solosave.load(got, url)
        assert_equal(r4.s3_full(), got)
        outcome = "metadata" if ("read", f"{url}/.metadata") in seen else "index"
    except solosave.SolosaveError as e:
        outcome = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        monkeypatch.undo()
    outside = [p for _, p in seen if not (p == url or p.startswith(url + "/"))]
    return outcome, outside, time.monotonic() - t


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))


@pytest.mark.xdist_group("s3_round4")
def test_a_crafted_load_index_on_s3_is_never_trusted_past_its_checkpoint(s3_checkpoint, monkeypatch, case_log):
    fs, url, original = s3_checkpoint
    t0 = time.monotonic()
    outcome, outside, _ = _load_crafted(fs, url, original, monkeypatch)
    assert (outcome, outside) == ("index", []), (outcome, outside)  # the intact index is used
    seen: dict[str, int] = {}
    try:
        for name, data in _crafted_indexes(original).items():
            outcome, outside, seconds = _load_crafted(fs, url, data, monkeypatch)
            assert not outside, (name, outside)
            assert seconds < 10, (name, seconds)
            # a clear solosave error naming the checkpoint, or the exact values (the index set aside)
            assert outcome in ("index", "metadata") or url in outcome, (name, outcome)
            assert outcome == "metadata" or not name.startswith("data file named"), (name, outcome)
            key = outcome.split(":")[0]
            seen[key] = seen.get(key, 0) + 1
    finally:
        fs.pipe(f"{url}/{INDEX_FILE}", original)
    case_log("s3://: the load index object replaced by a crafted one (data files named '../x', '..', "
             "'/etc/passwd', another checkpoint's; huge counts, offsets and lengths in the directory and "
             "header; truncated, extended, empty), loaded by solosave.load",
             f"{sum(seen.values())} crafted indexes: {seen}; every value exact, nothing read outside the checkpoint, "
             "each load within 10 s and 1 GiB of address space", time.monotonic() - t0)


@pytest.mark.xdist_group("s3_round4")
def test_load_index_entries_that_disagree_with_the_checkpoint_fall_back_to_metadata(s3_checkpoint, monkeypatch,
                                                                                    case_log):
    fs, url, original = s3_checkpoint
    t0 = time.monotonic()
    header, directory, blobs = crafted.index_split(original)

    def sized(size):
        keys = copy.deepcopy(directory["keys"])
        keys["w"][4] = size
        return crafted.index_join(header, {**directory, "keys": keys}, blobs)

    cases = {"'w' declared [640, 32]": sized([640, 32]), "'w' declared [32, 64]": sized([32, 64]),
             "'w' declared [2**40, 2**40]": sized([2**40, 2**40]),
             "'w' at offset 10**12": crafted.index_set_row(original, "w", offset=10**12),
             "'w' of 2**62 bytes": crafted.index_set_row(original, "w", length=2**62),
             "'w' of 0 bytes": crafted.index_set_row(original, "w", length=0)}
    got: dict[str, str] = {}
    try:
        for name, data in cases.items():
            outcome, outside, seconds = _load_crafted(fs, url, data, monkeypatch)
            assert not outside and seconds < 10, (name, outside, seconds)
            got[name] = outcome[:160]
    finally:
        fs.pipe(f"{url}/{INDEX_FILE}", original)
    case_log("s3://: a crafted load index whose entries disagree with the intact .metadata (another size of a "
             "tensor; a record past the end of its file, or empty)", "; ".join(f"{k}: {v}" for k, v in got.items()),
             time.monotonic() - t0)
    assert all(v == "metadata" for v in got.values()), got


# -- 3. Lightning's top-k beside a save that fails on one rank ----------------------------------------
@pytest.fixture(scope="module")
def lightning_topk(tmp_path_factory):
    pytest.importorskip("lightning", reason="lightning not installed: pip install 'solosave[lightning]'")
    root = tmp_path_factory.mktemp("topk")
    t0 = time.monotonic()
    out = run_ranks(r4.lightning_topk_job, 2, str(root), timeout=200)
    return out, time.monotonic() - t0


@pytest.mark.xdist_group("lightning_round4")
def test_lightning_top_k_save_failing_on_one_rank_fails_every_rank_and_resumes(lightning_topk, case_log):
    out, seconds = lightning_topk
    for r in out:
        kind, message, step = r["error"]
        assert kind == "CheckpointError" and "rank(s) [1]" in message and "injected I/O error" in message, r["error"]
        assert step == 6 and r["error_after_s"] < TIMEOUT  # raised at the next save (last.ckpt's), same step
        assert not [n for n in r["left"] if ".solosave-" in n or n == "step=6.ckpt"], r["left"]
        assert {"last.ckpt", "step=4.ckpt"} <= set(r["finished"]), r["finished"]
        assert r["last"] == ("resumed", 4) and r["last_exact"], r  # last.ckpt holds step 4, bit for bit
        # "best" names the failed save: a clear error, never a load of an unfinished directory
        assert r["best"][0] == "FileNotFoundError" and "step=6.ckpt" in r["best"][1] or r["best_exact"], r["best"]
    assert out[0]["error"] == out[1]["error"]
    case_log("Lightning ModelCheckpoint(save_top_k=2, monitor='step', save_last=True): the top-k save of step 6 "
             "fails on rank 1 only (EIO) (W=2)",
             f"every rank: the same CheckpointError naming rank 1, at step 6, after "
             f"{max(r['error_after_s'] for r in out):.1f} s of fit; left finished: {out[0]['finished']}; "
             f"fit(ckpt_path='last') resumed step {out[0]['last'][1]} bit for bit; fit(ckpt_path='best') "
             f"-> {out[0]['best'][0]} (best_model_path {out[0]['best_path']!r})", seconds)


@pytest.mark.xdist_group("lightning_round4")
def test_lightning_top_k_keeps_a_good_checkpoint_until_the_one_replacing_it_is_published(lightning_topk):
    out, _ = lightning_topk
    for r in out:
        assert {"step=2.ckpt", "step=4.ckpt"} <= set(r["finished"]), r["finished"]


# -- 4. torchtitan's keep_latest_k and a SIGKILL at a random moment -----------------------------------
def test_titan_keep_latest_k_survives_a_sigkill_at_random_moments(tmp_path, case_log):
    pytest.importorskip("torchtitan", reason="torchtitan not installed: pip install 'solosave[torchtitan]'")
    t0 = time.monotonic()
    root = str(tmp_path)
    import json

    seeds = (11, 12, 13)
    for seed in seeds:
        res = run_ranks_tolerant(r4.titan_killed_job, 2, root, seed, timeout=90)
        assert res == {0: ("died", -9), 1: ("died", -9)}, res  # killed, not ended (a check failing raises)
    run_ranks(r4.titan_killed_job, 2, root, -1, timeout=90)
    rows = []
    for seed in (*seeds[1:], -1):  # what each killed job left, checked by the next job before it resumed
        c = [json.load(open(f"{root}/check-{seed}-{r}.json")) for r in range(2)]
        assert c[0] == c[1], c
        c = c[0]
        assert c["published"] and c["latest"] == c["published"][-1]  # a kill never leaves nothing
        assert c["exact"] == c["published"]  # every published one loads bit for bit
        assert c["partial_refused"] == c["partial"]  # an in-flight save's folder is never taken as complete
        assert c["seen_published"] is None or c["latest"] >= c["seen_published"]
        assert not c["bad_deletions"], c["bad_deletions"]  # retention never removed the newest published one
        # (how many are published at the kill depends on how far the pruning thread got: not checked)
        rows.append(f"published {c['published']}, partial {c['partial']}, newest seen published "
                    f"{c['seen_published']}")
    case_log("torchtitan SolosaveCheckpointManager(keep_latest_k=2, interval=1, async): the whole job SIGKILLed "
             f"at a random moment (seeds {seeds}), resumed from the newest published checkpoint each time (W=2)",
             "after each kill: " + "; ".join(rows) + "; every published one loaded bit for bit, every partial one "
             "refused, every deletion left a newer published checkpoint", time.monotonic() - t0)
