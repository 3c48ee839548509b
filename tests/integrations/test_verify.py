"""solosave verify / solosave.load on damaged checkpoints, and the checksum sidecars."""

import json
import os
import zlib

import pytest
import torch

import solosave
from solosave._src.formats.dcp import checksum_path
from solosave._src.save.writer import FileWriter, Record
from tests.multiproc import rank_fns
from tests.support import dcp_save_local, run_ranks


@pytest.fixture()
def ckpt(tmp_path):
    d = tmp_path / "ck"
    dcp_save_local({"a": torch.arange(1000.0), "b": torch.ones(64, 64), "step": 3}, checkpoint_id=str(d))
    return d


def test_clean_checkpoint_verifies(ckpt):
    rep = solosave.verify_checkpoint(ckpt)
    assert rep.ok and rep.items == 3 and rep.records == 3 and rep.checksums == "absent"
    assert rep.files == {"__0_0.distcp": os.path.getsize(ckpt / "__0_0.distcp")}


def test_truncated_data_file_caught_by_verify_and_load(ckpt):
    f = ckpt / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])
    rep = solosave.verify_checkpoint(ckpt)
    assert not rep.ok and any("truncated" in p for p in rep.problems)
    target = {"a": torch.zeros(1000), "b": torch.zeros(64, 64), "step": 0}
    with pytest.raises(solosave.CorruptCheckpointError, match="truncated") as ei:
        solosave.load(target, ckpt)
    assert ei.value.problems and torch.count_nonzero(target["a"]) == 0  # nothing half-loaded


def test_missing_data_file(ckpt):
    os.remove(ckpt / "__0_0.distcp")
    rep = solosave.verify_checkpoint(ckpt)
    assert any("missing" in p for p in rep.problems)


def test_verify_needs_a_published_checkpoint(tmp_path):
    with pytest.raises(solosave.PreparedMetadataError, match="no .metadata"):
        solosave.verify_checkpoint(tmp_path)


def test_error_pickles_with_its_problems():
    import pickle

    e = pickle.loads(pickle.dumps(solosave.CorruptCheckpointError("bad", ["x truncated"])))
    assert str(e) == "bad" and e.problems == ["x truncated"]


def test_writer_records_checksums_and_drops_stale_ones(tmp_path):
    recs = [Record(("t", (0,)), tensor=torch.arange(10.0)), Record(("s", None), payload=b"x" * 300)]
    results = FileWriter(fsync=False, checksums=True).write_file(str(tmp_path), "__0_0.distcp", recs)
    side = json.loads(open(checksum_path(str(tmp_path / "__0_0.distcp"))).read())
    data = (tmp_path / "__0_0.distcp").read_bytes()
    assert [(r["offset"], r["length"]) for r in side["records"]] == [(o, n) for _, _, o, n in results]
    assert all(zlib.crc32(data[r["offset"]:r["offset"] + r["length"]]) == r["crc32"] for r in side["records"])
    FileWriter(fsync=False).write_file(str(tmp_path), "__0_0.distcp", recs)
    assert not os.path.exists(checksum_path(str(tmp_path / "__0_0.distcp")))


def test_checksums_option_conflicts_with_plain_writer():
    with pytest.raises(ValueError, match="checksums=True"):
        solosave.AsyncCheckpointer(checksums=True, writer=FileWriter())


def test_load_errors_are_plain_exceptions(ckpt):
    """DCP wraps load errors in CheckpointException (a BaseException); solosave.load re-raises
    the underlying exception so that ``except Exception`` catches it."""
    with pytest.raises(Exception, match="missing_key"):
        solosave.load({"missing_key": torch.zeros(2)}, ckpt)


def test_writer_from_main_script_is_refused_for_the_worker_process():
    Main = type("MainWriter", (FileWriter,), {"__module__": "__main__"})
    with pytest.raises(ValueError, match="defined in the main script"):
        solosave.AsyncCheckpointer(writer=Main())


def test_a_metadata_of_another_layout_is_noticed(ckpt, tmp_path, case_log):
    # a prepared file (or any .metadata) of another layout copied over a checkpoint's own
    other = tmp_path / "other"
    dcp_save_local({"a": torch.arange(1000.0), "b": torch.ones(64, 64), "step": "x" * 3000},
             checkpoint_id=str(other))
    (ckpt / ".metadata").write_bytes((other / ".metadata").read_bytes())
    rep = solosave.verify_checkpoint(ckpt)
    assert not rep.ok and any(".metadata does not describe this file" in p for p in rep.problems), rep.problems
    case_log("a .metadata of another layout over a checkpoint's data files",
             "solosave verify reports that .metadata does not describe the data file")


def test_a_sidecar_that_is_json_but_not_an_object_is_a_problem_not_a_traceback(ckpt, capsys):
    from solosave.cli import main

    (ckpt / "__0_0.distcp.crc32").write_text("[1, 2, 3]")
    assert main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr()
    assert "unreadable checksum file (a JSON list, not an object)" in out.out and "Traceback" not in out.err


def _index_case(ckpt, how):
    """Give ``ckpt`` a load index as a solosave save writes it, then spoil it as ``how`` says."""
    import pickle
    import uuid

    from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE
    from solosave._src.formats.metadata_template import MetadataTemplate
    from solosave._src.index.writer import body_from_metadata, render

    md = pickle.loads((ckpt / METADATA_FILE).read_bytes())
    template, save_id = MetadataTemplate(md), str(uuid.uuid4())
    (ckpt / METADATA_FILE).write_bytes(template.render(str(ckpt), save_id))
    if how == "differs":  # this .metadata's save_id, another layout's rows
        for info in md.storage_data.values():
            info.offset += 1
    body = body_from_metadata(md)
    if how == "damaged":
        body = body[:-8] + bytes([body[-8] ^ 0xFF]) + body[-7:]
    (ckpt / INDEX_FILE).write_bytes(render(body, template, str(ckpt), save_id if how != "stale" else "other"))


@pytest.mark.parametrize("how,ok", [("matches", True), ("stale", True), ("differs", False), ("damaged", False)])
def test_verify_checks_the_load_index(ckpt, how, ok):
    rep = solosave.verify_checkpoint(ckpt)
    assert rep.index is None  # stock DCP's checkpoint: none
    _index_case(ckpt, how)
    rep = solosave.verify_checkpoint(ckpt)
    assert rep.index == how and rep.ok is ok, rep
    assert ok or any("load index" in p for p in rep.problems)


def test_checksums_with_a_tensor_written_through_torch_save(tmp_path):
    """A zero-element tensor has no frame and goes through ``torch.save`` between batches; with
    checksums its CRC32 was read back from a write-only file (EBADF: the save failed)."""
    out = run_ranks(rank_fns.checksummed_with_empty, 1, str(tmp_path))
    assert out == [(True, True, "verified", True, True, 7)]
