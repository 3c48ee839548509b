"""solosave verify / solosave.load on damaged checkpoints, and the checksum sidecars."""

import json
import os
import zlib

import pytest
import torch

import solosave
from solosave._src.formats.checksum_sidecar import sidecar_limit
from solosave._src.formats.dcp import checksum_path
from solosave._src.write.writer import FileWriter, Record
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


def _record_checksums(ckpt):
    """Sidecars as a ``checksums=True`` save writes them, for a stock DCP checkpoint."""
    import pickle

    from solosave._src.formats.checksum_sidecar import CHECKSUM_FORMAT

    md = pickle.loads((ckpt / ".metadata").read_bytes())
    data = (ckpt / "__0_0.distcp").read_bytes()
    records = [{"offset": i.offset, "length": i.length, "crc32": zlib.crc32(data[i.offset:i.offset + i.length])}
               for i in md.storage_data.values()]
    (ckpt / "__0_0.distcp.crc32").write_text(json.dumps({"format": CHECKSUM_FORMAT, "records": records}))


@pytest.mark.parametrize("how", ["not an object", "not JSON", "truncated data"])
def test_the_checksum_summary_says_what_was_checked(ckpt, how, capsys, case_log):
    from solosave.cli import main

    _record_checksums(ckpt)
    rep = solosave.verify_checkpoint(ckpt)
    assert rep.ok and rep.checksums == "verified" and rep.checksum_summary() == "verified (3 of 3 records match)"
    if how == "not an object":
        (ckpt / "__0_0.distcp.crc32").write_text("[1, 2, 3]")
    elif how == "not JSON":
        (ckpt / "__0_0.distcp.crc32").write_bytes(b"\xff{not json")
    else:
        f = ckpt / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[:-100])
    rep = solosave.verify_checkpoint(ckpt)
    assert not rep.ok and rep.checksums == "failed", rep
    assert rep.checksummed_records + rep.checksum_unchecked == 3 and rep.checksum_unchecked >= 1
    assert main(["verify", str(ckpt)]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if "checksums:" in x)
    assert "verified" not in line and "could not be checked" in line, line
    case_log(f"solosave verify: checksum file {how}" if how != "truncated data" else
             "solosave verify: a data file with checksums, truncated",
             f"exit 1, the problem listed, and the summary line says so: '{line.strip()}'")


@pytest.mark.parametrize("how,why", [
    ("without its records", "no list of records"),
    ("padded past what 3 records need", f"longer than the {sidecar_limit(3)} bytes a checksum file of 3 record"),
    ("with a string for an offset", "record 0: offset is '0', not a non-negative integer"),
])
def test_a_damaged_checksum_file_is_reported_with_what_is_wrong(ckpt, how, why):
    """The sidecar is read by ``formats/checksum_sidecar.py``: at most a bounded number of bytes
    for the records ``.metadata`` gives its data file, every field checked."""
    _record_checksums(ckpt)
    side = ckpt / "__0_0.distcp.crc32"
    doc = json.loads(side.read_text())
    if how == "without its records":
        del doc["records"]
        side.write_text(json.dumps(doc))
    elif how == "with a string for an offset":
        doc["records"][0]["offset"] = str(doc["records"][0]["offset"])
        side.write_text(json.dumps(doc))
    else:
        side.write_text(json.dumps(doc) + " " * 5000)  # still JSON
    rep = solosave.verify_checkpoint(ckpt)
    assert not rep.ok and rep.checksums == "failed" and rep.checksum_unchecked == 3, rep
    problems = [p for p in rep.problems if "checksum" in p]
    assert len(problems) == 1 and problems[0].startswith("__0_0.distcp.crc32: unreadable checksum file ("), problems
    assert why in problems[0], problems


def _outside(ckpt, tmp_path, name):
    """Move ``ckpt/name`` out of the checkpoint and leave a symbolic link to it in its place."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    (ckpt / name).rename(elsewhere / name)
    (ckpt / name).symlink_to(elsewhere / name)


def test_a_data_file_that_links_outside_the_checkpoint_is_not_read(ckpt, tmp_path, capsys, case_log):
    from solosave.cli import main

    _outside(ckpt, tmp_path, "__0_0.distcp")
    target = {"a": torch.zeros(1000), "b": torch.zeros(64, 64), "step": 0}
    with pytest.raises(solosave.CorruptCheckpointError, match="symbolic link to a file outside the checkpoint"):
        solosave.load(target, ckpt)
    assert torch.count_nonzero(target["a"]) == 0  # nothing read through it
    rep = solosave.verify_checkpoint(ckpt)
    assert not rep.ok and any("symbolic link" in p for p in rep.problems), rep.problems
    assert main(["verify", str(ckpt)]) == 1 and "OK" not in capsys.readouterr().out.splitlines()
    with pytest.raises(solosave.CorruptCheckpointError, match="symbolic link"):
        solosave.export(ckpt, tmp_path / "export", format="torch")
    assert not [p for p in (tmp_path / "export").rglob("*") if p.is_file()]  # nothing exported
    case_log("a data file that is a symbolic link to a file outside the checkpoint",
             "solosave.load raises CorruptCheckpointError before reading it; export raises and writes "
             "nothing; verify reports it (exit 1)")


def test_links_inside_the_checkpoint_are_read_and_metadata_or_sidecars_outside_are_not(ckpt, tmp_path):
    from solosave._src.formats.dcp import CHECKSUM_SUFFIX

    target = {"a": torch.zeros(1000), "b": torch.zeros(64, 64), "step": 0}
    (ckpt / "__0_0.distcp").rename(ckpt / "data.bin")  # a link to a file inside: fine
    (ckpt / "__0_0.distcp").symlink_to("data.bin")
    solosave.load(target, ckpt)
    assert torch.equal(target["a"], torch.arange(1000.0))
    _record_checksums(ckpt)
    _outside(ckpt, tmp_path, "__0_0.distcp" + CHECKSUM_SUFFIX)
    rep = solosave.verify_checkpoint(ckpt)
    assert rep.checksums == "failed" and any("unreadable checksum file (a symbolic link" in p for p in rep.problems)
    _outside(ckpt, tmp_path, ".metadata")
    with pytest.raises(solosave.PreparedMetadataError, match="symbolic link to a file outside"):
        solosave.load(target, ckpt)
    with pytest.raises(solosave.PreparedMetadataError, match="symbolic link to a file outside"):
        solosave.verify_checkpoint(ckpt)


def test_an_index_whose_directory_length_is_damaged_is_reported_not_a_traceback(ckpt, capsys):
    """The directory length of the load index has no CRC of its own: its high bit flipped made
    ``solosave verify`` (and loads) raise ``MemoryError`` / ``OverflowError``."""
    from solosave._src.formats.dcp import INDEX_FILE
    from solosave.cli import main

    _index_case(ckpt, "matches")
    data = (ckpt / INDEX_FILE).read_bytes()
    body = data.index(b"\n", data.index(b"\n", len(b"SOLOSAVE-INDEX\n")) + 1) + 1
    (ckpt / INDEX_FILE).write_bytes(data[:body + 7] + bytes([data[body + 7] ^ 0x80]) + data[body + 8:])
    rep = solosave.verify_checkpoint(ckpt)
    assert rep.index == "damaged" and any("directory length" in p for p in rep.problems), rep
    assert main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr()
    assert "load index: damaged" in out.out and "Traceback" not in out.err
    target = {"a": torch.zeros(1000), "b": torch.zeros(64, 64), "step": 0}
    solosave.load(target, ckpt)
    assert torch.equal(target["a"], torch.arange(1000.0)) and target["step"] == 3
