import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import solosave
from solosave._options import CheckpointerOptions
from solosave._publish import MetadataTemplate, atomic_write


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    dcp.save({"w": torch.randn(4, 4), "step": 3, "l": [1, 2]}, checkpoint_id=str(d), no_dist=True)
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


def test_structure_tampering_detected(ckpt_dir, tmp_path):
    md = solosave.load_prepared_metadata(ckpt_dir).metadata
    p = solosave.PreparedMetadata.from_metadata(md, world_size=1, workers=1)
    path = tmp_path / "prep.md"
    solosave.save_prepared_metadata(p, path)
    md2 = pickle.loads(pickle.dumps(md))
    k = next(iter(md2.storage_data))
    md2.storage_data[k].length += 1
    raw = path.read_bytes()
    hdr = raw[: raw.index(b"}\n") + 2]
    path.write_bytes(hdr + pickle.dumps(md2, protocol=2))
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
    atomic_write(d / ".metadata", tpl.render(str(d)))
    sd = {"w": torch.zeros(4, 4), "step": 0, "l": []}
    dcp.load(sd, checkpoint_id=str(d), no_dist=True)
    ref = {"w": torch.zeros(4, 4), "step": 0, "l": []}
    dcp.load(ref, checkpoint_id=str(ckpt_dir), no_dist=True)
    assert torch.equal(sd["w"], ref["w"]) and sd["step"] == 3 and sd["l"] == [1, 2]


def test_atomic_write_leaves_no_temp(tmp_path):
    atomic_write(tmp_path / "f", b"one")
    atomic_write(tmp_path / "f", b"two")
    assert (tmp_path / "f").read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["f"]


@pytest.mark.parametrize("kw, needle", [
    ({"create_prepared_metadata": True}, "create_prepared_metadata needs prepared_metadata naming the file"),
    ({"workers": 0}, "workers must be"),
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

    from solosave._write import bytes_slot, padded_payload

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
    from solosave._prepared import (
        PreparedMetadata,
        load_prepared_metadata,
        prepared_fingerprint,
        write_prepared_file,
    )
    from solosave._safe_pickle import safe_loads

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
    write_prepared_file(path, prepared_fingerprint(pm.metadata, 1, 1), data)
    loaded = load_prepared_metadata(path)
    loaded.check_compatible(1, 1)
    assert loaded.metadata == pm.metadata and loaded.fingerprint == pm.fingerprint
    solosave_path = tmp_path / "q.prepared"
    from solosave._prepared import save_prepared_metadata

    save_prepared_metadata(pm, solosave_path)
    assert load_prepared_metadata(solosave_path).metadata == loaded.metadata
