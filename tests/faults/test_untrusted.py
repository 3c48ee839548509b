"""Untrusted input end to end: prepared files and load indexes damaged or crafted after real
saves, given to ``AsyncCheckpointer`` and ``solosave.load`` on 2 ranks. A refusal is one clear
error on every rank, within seconds, with nothing published and nothing written outside the
checkpoint; a damaged index never makes an intact checkpoint unloadable."""

import time

import pytest

from tests.faults import untrusted_fns as U
from tests.support import run_ranks

TIMEOUT = 20.0


@pytest.mark.timeout(300)
def test_crafted_prepared_files(tmp_path, case_log):
    t0 = time.monotonic()
    outs = run_ranks(U.crafted_prepared_files, 2, str(tmp_path), TIMEOUT, timeout=280)
    dt = time.monotonic() - t0
    for rank, o in enumerate(outs):
        assert o["outside_files"] == [], o["outside_files"]  # nothing written outside the checkpoint
        for name in ("name/relative", "name/absolute"):
            e = o[name]
            assert e["type"] == "PreparedMetadataError" and "not a data file name" in e["msg"], (rank, name, e)
            assert e["after_s"] < 10, e
        e = o["header/v4"]
        assert e["type"] == "PreparedMetadataError" and "checksum does not match" in e["msg"], (rank, e)
        first, second = o["template/fallback/2"], o["template/fallback/3"]
        assert first["type"] is None and first["published"] and first["mode"] == "reuse+fallback", first
        assert any("does not read back" in w for w in first["warnings"]), first
        assert second["type"] is None and second["mode"] == "reuse", second
        assert o["template/fallback/2/loads"] and o["template/fallback/3/loads"]
        assert o["template/fallback/refreshed"].startswith(b"SOLOSAVE-PREPARED\n4\n")
        for i in (2, 3):
            e = o[f"template/raise/{i}"]
            assert e["type"] == "LayoutDriftError" and "does not read back" in e["msg"], (rank, i, e)
            assert not o[f"template/raise/{i}/loads"]  # nothing published
    msg = outs[1]["name/relative"]["msg"]
    case_log("prepared file whose rank-0 section names data file '../pwned.bin' (or an absolute path), "
             "section CRC recomputed",
             f"every rank: PreparedMetadataError at construction within {max(o['name/relative']['after_s'] for o in outs)}"
             f" s ('{msg[:msg.index(':') + 1]} ... not a data file name'); nothing written outside the checkpoint", dt)
    case_log("version-4 prepared file with one digit of a template position changed (valid JSON)",
             "every rank: PreparedMetadataError at construction (the header's checksum does not match)", dt)
    case_log("version-3 prepared file (no header CRC) with one digit of a template position changed",
             "the first reuse save reads the template back, finds it unreadable and falls back: published, "
             "stock dcp.load reads it, the prepared file is refreshed (version 4) and the next save reuses it; "
             "with on_layout_drift='raise': LayoutDriftError on every rank, nothing published", dt)


@pytest.mark.timeout(300)
def test_a_damaged_load_index_never_makes_an_intact_checkpoint_unloadable(tmp_path, case_log):
    t0 = time.monotonic()
    outs = run_ranks(U.damaged_index_loads, 2, str(tmp_path), TIMEOUT, timeout=280)
    for rank, o in enumerate(outs):
        for name in ("rows", "directory length"):
            assert o[name] == {"type": None, "equal": True}, (rank, name, o[name])
    dt = time.monotonic() - t0
    case_log("2 ranks load a reuse save whose load index has one flipped bit in a row block",
             "solosave.load on every rank warns, falls back to .metadata and loads every value exactly", dt)
    case_log("2 ranks load a reuse save whose load index has the high bit of its directory length flipped "
             "(no CRC covers it)",
             "no MemoryError / OverflowError: the length is checked against the file; the load falls back to "
             ".metadata and loads every value exactly", dt)
