import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import solosave
from solosave._src.formats.dcp import METADATA_VERSION
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.index.writer import PREFIX
from solosave._src.prepared.prepared import FORMAT_VERSION, MAGIC, Fingerprint, metadata_structure_hash
from solosave._src.save.options import CheckpointerOptions
from solosave._src.storage.local import LocalStorage
from tests.support import dcp_save_local


def write_v1_file(path, metadata, pickled):
    """A version-1 prepared file (solosave still reads it, converting on load), as solosave wrote
    them: the fingerprint of ``metadata`` at world size 1 with 1 worker, then ``pickled``, a
    protocol-2 pickle of a ``Metadata``."""
    fp = Fingerprint(1, 1, metadata_structure_hash(metadata), torch.__version__)
    head = json.dumps({**fp.fields(), "format_version": 1}, sort_keys=True).encode()
    LocalStorage().commit(str(path), b"".join((MAGIC, b"1\n", head, b"\n", pickled)))


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    dcp_save_local({"w": torch.randn(4, 4), "step": 3, "l": [1, 2]}, checkpoint_id=str(d))
    return d


def test_plain_dcp_metadata_accepted_from_dir_file_and_object(ckpt_dir):
    a = solosave.load_prepared_metadata(ckpt_dir)
    b = solosave.load_prepared_metadata(ckpt_dir / ".metadata")
    assert a.fingerprint.structure_hash == b.fingerprint.structure_hash
    assert a.fingerprint.world_size is None
    a.check_compatible(world_size=1, workers=1)
    assert [rel for rel, _ in a.rank_files(0)] == ["__0_0.distcp"]


def test_roundtrip_and_fingerprint_mismatch(ckpt_dir, tmp_path):
    md = solosave.load_prepared_metadata(ckpt_dir).metadata
    p = solosave.PreparedMetadata.from_metadata(md, world_size=2, workers=1)
    path = tmp_path / "prep.md"
    solosave.save_prepared_metadata(p, path)
    q = solosave.load_prepared_metadata(path)
    assert q.fingerprint == p.fingerprint
    q.check_compatible(2, 1)
    with pytest.raises(solosave.FingerprintMismatchError, match="world_size differs: prepared for 2 ranks, this run has 4"):
        q.check_compatible(4, 1)
    with pytest.raises(solosave.FingerprintMismatchError, match="workers differs"):
        q.check_compatible(2, 3)


def test_structure_tampering_detected_in_a_version_1_file(ckpt_dir, tmp_path):
    md = solosave.load_prepared_metadata(ckpt_dir).metadata
    path = tmp_path / "prep.md"
    md2 = pickle.loads(pickle.dumps(md))
    k = next(iter(md2.storage_data))
    md2.storage_data[k].length += 1
    write_v1_file(path, md, pickle.dumps(md2, protocol=2))
    with pytest.raises(solosave.FingerprintMismatchError, match="structure"):
        solosave.load_prepared_metadata(path).check_compatible(1, 1)


def test_unsafe_pickle_refused_and_not_executed(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.metadata"
    path.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(solosave.UnsafeMetadataError, match="posix.system|os.system"):
        solosave.load_prepared_metadata(path)
    assert not marker.exists()


@pytest.mark.parametrize("cut", [1, 20, 200])
def test_truncated_files_give_clear_errors(ckpt_dir, tmp_path, cut):
    data = (ckpt_dir / ".metadata").read_bytes()
    path = tmp_path / "trunc"
    path.write_bytes(data[:cut])
    with pytest.raises(solosave.PreparedMetadataError, match="truncated or corrupt"):
        solosave.load_prepared_metadata(path)


def test_missing_and_empty(tmp_path):
    with pytest.raises(solosave.PreparedMetadataError, match="no such file"):
        solosave.load_prepared_metadata(tmp_path / "nope")
    with pytest.raises(solosave.PreparedMetadataError, match="no .metadata"):
        solosave.load_prepared_metadata(tmp_path)
    (tmp_path / "e").write_bytes(b"")
    with pytest.raises(solosave.PreparedMetadataError, match="empty"):
        solosave.load_prepared_metadata(tmp_path / "e")


def test_template_render_is_read_by_stock_dcp(ckpt_dir, tmp_path):
    md = solosave.load_prepared_metadata(ckpt_dir).metadata
    tpl = MetadataTemplate(md)
    data = tpl.render("/some/where/step_9", "save-123")
    out = pickle.loads(data)
    assert out.storage_meta.checkpoint_id == "/some/where/step_9"
    assert out.storage_meta.save_id == "save-123"
    assert out.storage_data == md.storage_data and out.state_dict_metadata == md.state_dict_metadata
    assert pickle.loads(tpl.render("x" * 1000)).storage_meta.checkpoint_id == "x" * 1000
    # a copy of the checkpoint with the rendered .metadata loads through stock DCP
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(ckpt_dir, d)
    LocalStorage().commit(str(d / ".metadata"), tpl.render(str(d)))
    sd = {"w": torch.zeros(4, 4), "step": 0, "l": []}
    dcp.load(sd, checkpoint_id=str(d), no_dist=True)
    ref = {"w": torch.zeros(4, 4), "step": 0, "l": []}
    dcp.load(ref, checkpoint_id=str(ckpt_dir), no_dist=True)
    assert torch.equal(sd["w"], ref["w"]) and sd["step"] == 3 and sd["l"] == [1, 2]


def test_local_commit_leaves_no_temp(tmp_path):
    LocalStorage().commit(str(tmp_path / "f"), b"one")
    LocalStorage().commit(str(tmp_path / "f"), b"two")
    assert (tmp_path / "f").read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["f"]


@pytest.mark.parametrize("kw, needle", [
    ({"create_prepared_metadata": True}, "create_prepared_metadata needs prepared_metadata naming the file"),
    ({"workers": 0}, "files_per_rank must be"),
    ({"on_layout_drift": "ignore"}, "on_layout_drift"),
    ({"timeout": 0}, "timeout"),
])
def test_invalid_options(kw, needle):
    with pytest.raises(ValueError, match=needle):
        CheckpointerOptions(**kw)


def test_metadata_object_with_create_mode_rejected(ckpt_dir):
    md = solosave.load_prepared_metadata(ckpt_dir).metadata
    with pytest.raises(ValueError, match="needs a file path, not a Metadata"):
        CheckpointerOptions(prepared_metadata=md, create_prepared_metadata=True)


def test_checkpointer_needs_initialised_process_group():
    with pytest.raises(ValueError, match="not initialised"):
        solosave.AsyncCheckpointer()


@pytest.mark.parametrize("obj", [5, "short", list(range(3000)), {"a": [1.5] * 40}])
def test_bytes_padding_is_readable_or_refused(obj):
    import io

    from solosave._src.write.writer import bytes_slot, padded_payload

    buf = io.BytesIO()
    torch.save(obj, buf)
    raw = buf.getvalue()
    for length in (len(raw), bytes_slot(len(raw)), len(raw) * 2, len(raw) * 5, len(raw) + 65535):
        data = padded_payload(raw, length)
        if data is not None:
            assert len(data) == length
            assert torch.load(io.BytesIO(data), weights_only=False) == obj
    assert padded_payload(raw, bytes_slot(len(raw))) is not None  # the slot rule always pads
    assert padded_payload(raw, len(raw) - 1) is None


def test_prepared_adopts_the_coordinators_template_only_for_its_publication(ckpt_dir, tmp_path):
    from solosave._src.formats.safe_pickle import safe_loads
    from solosave._src.prepared.prepared import PreparedMetadata, load_prepared_metadata

    md = solosave.load_prepared_metadata(ckpt_dir).metadata
    tpl = MetadataTemplate(md)
    data = tpl.render(str(ckpt_dir), "save-abc")
    pm = PreparedMetadata.from_metadata(safe_loads(data, what="x"), 1, 1)
    other = PreparedMetadata.from_metadata(safe_loads(data, what="x"), 1, 1)
    assert not other.adopt_template("save-other", tpl)
    assert pm.adopt_template("save-abc", tpl)
    assert pm.template is tpl and not pm.adopt_template("save-abc", MetadataTemplate(md))
    out = pickle.loads(pm.template.render("/x/y", "s2"))
    assert out.state_dict_metadata == md.state_dict_metadata and out.storage_meta.checkpoint_id == "/x/y"
    assert other.template is not tpl  # built from its own metadata
    # the prepared file written from the published bytes loads as save_prepared_metadata's does
    path = tmp_path / "p.prepared"
    write_v1_file(path, pm.metadata, data)
    loaded = load_prepared_metadata(path)
    loaded.check_compatible(1, 1)
    assert loaded.metadata == pm.metadata and loaded.fingerprint == pm.fingerprint
    solosave_path = tmp_path / "q.prepared"
    from solosave._src.prepared.prepared import save_prepared_metadata

    save_prepared_metadata(pm, solosave_path)
    assert load_prepared_metadata(solosave_path).metadata == loaded.metadata


# -- format version 2: sections ----------------------------------------------------------------

def _sharded_prepared(world=8, tensors=3, workers=2):
    """A prepared metadata of ``tensors`` row-sharded tensors over ``world`` ranks (made from
    write results, as a create save makes it)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from solosave._src.formats.metadata_template import MetadataTemplate as Tpl
    from tests.unit.plan.oracle import prepared_from_results

    sdm, by_rank = {}, [[] for _ in range(world)]
    for t in range(tensors):
        fqn = f"model.t{t}"
        chunks = [ChunkStorageMetadata(torch.Size([r * 2, 0]), torch.Size([2, 3])) for r in range(world)]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2 * world, 3]), chunks)
        for r in range(world):
            by_rank[r].append(((fqn, (r * 2, 0)), f"__{r}_{t % workers}.distcp", 100 * (t // workers), 100))
    from tests.unit.plan.oracle import build_metadata

    md = build_metadata(sdm, [row for rows in by_rank for row in rows], {})
    blob = prepared_from_results(sdm, by_rank, Tpl(md), ("/ck", "sid-1"),
                                 {"world_size": world, "workers": workers, "torch_version": "x"})
    return blob, md


def test_sectioned_round_trip_and_per_rank_reads_touch_only_header_and_own_section(tmp_path):
    from solosave._src.coordination.protocol import ItemKind, ItemSpec
    from solosave._src.plan.local_plan import LocalPlan
    from solosave._src.prepared.sections import SectionReader
    from solosave._src.storage.sources import StorageSource

    blob, md = _sharded_prepared(world=64)
    path = tmp_path / "p.prepared"
    path.write_bytes(blob)
    pm = solosave.load_prepared_metadata(path)
    head = pm.bytes_read
    structure = pm._reader.header["structure"][1]
    # the magic and the first block (header), its length checked (2 bytes), the structure section
    assert head <= 4096 + 32 + 2 + structure
    pm.check_compatible(64, 2)
    assert pm.bytes_read == head  # the fingerprint and counts are in the header
    files = pm.rank_files(5)
    assert [rel for rel, _ in files] == ["__5_0.distcp", "__5_1.distcp"]
    assert [p.key for _, items in files for p in items] == [("model.t0", (10, 0)), ("model.t2", (10, 0)),
                                                            ("model.t1", (10, 0))]
    specs = [ItemSpec(f"model.t{t}", ItemKind.TENSOR, (10, 0), (2, 3), (128, 3), "float32", 24) for t in range(3)]
    reuse, staged = pm.plan_reuse(LocalPlan(specs, {}, {}), 5)
    assert not reuse.drift and {s.key for s in staged} == {s.key for s in specs}
    read = pm.bytes_read
    assert read < len(blob) / 10  # header + one table entry + own section + structure
    # the whole metadata still comes back (tools), and publishes what stock DCP reads
    assert pm.metadata.storage_data == md.storage_data
    assert pickle.loads(pm.template.render("/x", "s")).storage_meta.checkpoint_id == "/x"
    # a reader over a counting source reads nothing of other ranks' sections
    src = StorageSource(path)
    r = SectionReader(src)
    r.rank_layout(63)
    assert src.bytes_read < 4096 + 16 + 2 + structure + 2000
    # pickled for the worker: a reference, not the sections
    assert len(pickle.dumps(pm)) < 2000
    again = pickle.loads(pickle.dumps(pm))
    assert again.rank_files(5) == files and again.fingerprint == pm.fingerprint


def test_sectioned_reuse_plan_finds_items_written_by_other_ranks_in_the_directory(tmp_path):
    from solosave._src.coordination.protocol import ItemKind, ItemSpec
    from solosave._src.plan.local_plan import LocalPlan

    blob, _ = _sharded_prepared(world=16)
    from solosave._src.prepared.sections import SectionReader
    from solosave._src.storage.sources import BytesSource

    pm = solosave.PreparedMetadata(SectionReader(BytesSource(blob)))
    mine = ItemSpec("model.t0", ItemKind.TENSOR, (0, 0), (2, 3), (32, 3), "float32", 24)
    replica = ItemSpec("model.t1", ItemKind.TENSOR, (6, 0), (2, 3), (32, 3), "float32", 24, owner=False)
    moved = ItemSpec("model.t2", ItemKind.TENSOR, (1, 0), (2, 3), (32, 3), "float32", 24, owner=False)
    reuse, _ = pm.plan_reuse(LocalPlan([mine, replica], {}, {}), 0)
    assert reuse.drift == ("model.t2: prepared on this rank but not in its state dict",  # file __0_0
                           "model.t1: prepared on this rank but not in its state dict")  # file __0_1
    assert pm.spec_matches(replica) is None  # placed on rank 3: found through its bucket
    assert "resharded" in pm.spec_matches(moved)
    assert "a new item" in pm.spec_matches(ItemSpec("model.new", ItemKind.BYTES))


def test_a_dtensor_chunk_whose_owner_is_not_its_prepared_writer_is_a_drift():
    """A DTensor chunk is staged by its owner only: after a placement change, a rank that owns a
    chunk the layout puts elsewhere, or holds as a replica one its layout puts on it, must drift
    (it stages everything it owns then), or the fallback another rank's drift starts finds the
    chunk staged by no rank. A plain tensor (any holder may write it) placed elsewhere is no drift."""
    from solosave._src.coordination.protocol import ItemKind, ItemSpec
    from solosave._src.plan.local_plan import LocalPlan
    from solosave._src.prepared.sections import SectionReader
    from solosave._src.storage.sources import BytesSource

    blob, _ = _sharded_prepared(world=4)  # rank r writes the chunk at row 2r of model.t0..t2
    pm = solosave.PreparedMetadata(SectionReader(BytesSource(blob)))

    def chunk(t, row, owner=True, exclusive=True):
        return ItemSpec(f"model.t{t}", ItemKind.TENSOR, (row, 0), (2, 3), (8, 3), "float32", 24, owner, exclusive)

    reuse, staged = pm.plan_reuse(LocalPlan([chunk(0, 0), chunk(1, 0), chunk(2, 0)], {}, {}), 0)
    assert not reuse.drift and len(staged) == 3  # the steady state
    reuse, _ = pm.plan_reuse(LocalPlan([chunk(0, 0), chunk(1, 0, owner=False, exclusive=False), chunk(2, 0)],
                                       {}, {}), 0)
    assert reuse.drift == ("model.t1: chunk at [0, 0] is prepared on this rank, another replica owns it now",)
    moved = [chunk(0, 0), chunk(1, 0), chunk(2, 0), chunk(0, 2)]
    reuse, staged = pm.plan_reuse(LocalPlan(moved, {}, {}), 0)
    assert reuse.drift == ("model.t0: chunk at [2, 0] is this rank's now, prepared on another rank (resharded?)",)
    assert staged == moved  # a drifted rank stages every item it owns
    plain = [chunk(0, 0), chunk(1, 0), chunk(2, 0), chunk(0, 2, exclusive=False)]
    reuse, _ = pm.plan_reuse(LocalPlan(plain, {}, {}), 0)
    assert not reuse.drift


@pytest.mark.parametrize("where", ["header", "table", "section", "truncated"])
def test_v2_corrupt_or_truncated_sections_give_clear_errors(tmp_path, where):
    blob, _ = _sharded_prepared(world=8)
    data = bytearray(blob)
    body = blob.index(b"\n", len(b"SOLOSAVE-PREPARED\n2\n")) + 1
    if where == "header":
        data[body - 10] ^= 0xFF
    elif where == "table":
        data[body + 16 * 3 + 9] ^= 0xFF  # rank 3's length
    elif where == "section":
        data[-50] ^= 0xFF  # in the last directory bucket, or the last rank section
    else:
        data = data[: len(data) - 400]
    path = tmp_path / "bad"
    path.write_bytes(bytes(data))
    with pytest.raises(solosave.PreparedMetadataError, match="corrupt|truncated"):
        pm = solosave.load_prepared_metadata(path)
        for r in range(8):
            pm.rank_files(r)
        for t in range(3):
            for r in range(8):
                pm.placed((f"model.t{t}", (2 * r, 0)))


def test_v1_file_and_plain_metadata_convert_to_the_same_layout(ckpt_dir, tmp_path):
    md = solosave.load_prepared_metadata(ckpt_dir).metadata
    v1 = tmp_path / "v1.prepared"
    write_v1_file(v1, md, pickle.dumps(md, protocol=2))
    a = solosave.load_prepared_metadata(v1)
    b = solosave.load_prepared_metadata(ckpt_dir)
    a.check_compatible(1, 1)
    assert a.fingerprint.world_size == 1 and a.fingerprint.format_version == FORMAT_VERSION
    assert a.rank_files(0) == b.rank_files(0) and a.metadata == b.metadata
    # `solosave prepare` converts to version 4, read by sections
    out = tmp_path / "v4.prepared"
    solosave.save_prepared_metadata(a, out)
    assert out.read_bytes().startswith(b"SOLOSAVE-PREPARED\n4\n")
    c = solosave.load_prepared_metadata(out)
    assert c.rank_files(0) == a.rank_files(0) and c.fingerprint == a.fingerprint
    (tmp_path / "v9").write_bytes(b"SOLOSAVE-PREPARED\n9\n{}\n")
    with pytest.raises(solosave.FingerprintMismatchError, match="reads 1, 2, 3, 4"):
        solosave.load_prepared_metadata(tmp_path / "v9")


def test_version_2_files_are_still_read(tmp_path):
    """A prepared file written by solosave before version 3 (tests/unit/prepared/data/make_prepared_v2.py)
    opens by sections and gives the same layout, directory and metadata as version 4."""
    from pathlib import Path

    from tests.unit.prepared.data.make_prepared_v2 import metadata

    data_dir = Path(__file__).parent / "data"
    path = tmp_path / "old.prepared"
    path.write_bytes((data_dir / "prepared_v2.bin").read_bytes())
    old = solosave.load_prepared_metadata(path)
    assert old._reader.version == 2 and old.fingerprint.format_version == 2
    old.check_compatible(2, 2)
    want = metadata()
    assert old.metadata.storage_data == want.storage_data
    assert old.metadata.state_dict_metadata == want.state_dict_metadata
    new = solosave.PreparedMetadata.from_metadata(old.metadata, world_size=2, workers=2)
    assert new._reader.version == 4
    for r in range(2):
        assert old.layout(r) == new.layout(r)
    assert old.layout(1).files[0][1][0].key == ("w", (5, 0)) and old.layout(1).sizes[("w", (5, 0))] == (0, 4)
    assert old.layout(0).sizes[("step", ())] == () and ("extra", None) not in old.layout(1).sizes
    for key in [("w", (0, 0)), ("w", (5, 0)), ("cube", (0, 3, 0)), ("b", (0,)), ("step", ()), ("extra", None)]:
        assert old.placed(key) and new.placed(key), key
    assert not old.placed(("w", (1, 0))) and not new.placed(("w", (1, 0)))
    old_dir, old_blobs = _index_body_parts(old.index_body)
    new_dir, new_blobs = _index_body_parts(new.index_body)
    # the file was written under a torch whose Metadata has a version field; a torch without one
    # (2.8) builds the index without it
    assert old_dir.pop("version") == "1.0.0" and new_dir.pop("version") == METADATA_VERSION.get("version")
    # the data files' ends entered the index after version 2 (an index without them is still read)
    assert "file_ends" not in old_dir and len(new_dir.pop("file_ends")) == len(new_dir["files"])
    assert old_dir == new_dir and old_blobs == new_blobs


def _index_body_parts(body):
    """A load index body's directory (decoded) and the bytes after it."""
    n, _ = PREFIX.unpack_from(body)
    return json.loads(body[PREFIX.size:PREFIX.size + n]), body[PREFIX.size + n:]


def test_version_3_section_with_impossible_rows_is_refused():
    """A rank section whose checksum holds but whose rows name an fqn id or a number of dims
    that the file cannot have is refused as corrupt, not turned into wrong keys."""
    import struct

    from solosave._src.prepared.sections import _ENTRY, LayoutColumns, SectionReader, _crc, build_prepared
    from solosave._src.storage.sources import BytesSource

    structure = {"w": (0, "float32", (4, 2))}
    good = [0, 2, 0, 100, 0, 0, 4, 2]
    blob, header = build_prepared({"world_size": 1}, structure,
                                  LayoutColumns(torch.tensor([good]), [[("__0_0.distcp", 1)]]), None, None)
    reader = SectionReader(BytesSource(blob))
    assert reader.rank_layout(0).files[0][1][0].key == ("w", (0, 0))
    off, length, _ = reader._entry(0, "rank 0")
    at = reader.body + off + length - 8 * len(good)  # the row, at the end of the section
    for column, value in ((0, 7), (1, 5)):  # an fqn id beyond the structure, more dims than the width
        bad = bytearray(blob)
        bad[at + 8 * column:at + 8 * column + 8] = struct.pack("<q", value)
        section = bytes(bad[reader.body + off:reader.body + off + length])
        bad[reader.body:reader.body + _ENTRY.size] = _ENTRY.pack(off, length, _crc(reader.file_id, section))
        with pytest.raises(solosave.PreparedMetadataError, match="section of rank 0 is corrupt"):
            SectionReader(BytesSource(bytes(bad))).rank_layout(0)
    with pytest.raises(ValueError, match="hold 2 rows"):
        build_prepared({}, structure, LayoutColumns(torch.tensor([good]), [[("__0_0.distcp", 2)]]), None, None)
