"""The reuse publish: a .metadata rendered from MetadataTemplate is what stock DCP reads."""

import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from solosave._src.coordination.protocol import ItemKind, ItemSpec
from solosave._src.formats.dcp import METADATA_FILE
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.write.publish import publish_metadata, stage_metadata
from tests.support import dcp_save_local
from tests.unit.plan.oracle import build_metadata, build_state_dict_metadata


def _checkpoint(tmp_path):
    """A stock DCP checkpoint of two tensors; its Metadata rebuilt by solosave's layout code."""
    d = tmp_path / "ck"
    sd = {"a": torch.arange(8, dtype=torch.float32), "b": torch.ones(2, 3)}
    dcp_save_local(sd, checkpoint_id=str(d))
    stock = FileSystemReader(str(d)).read_metadata()
    specs = [ItemSpec(k, ItemKind.TENSOR, (0,) * v.dim(), tuple(v.shape), tuple(v.shape), "float32", v.numel() * 4)
             for k, v in sd.items()]
    results = [((idx.fqn, tuple(idx.offset)), info.relative_path, info.offset, info.length)
               for idx, info in stock.storage_data.items()]
    md = build_metadata(build_state_dict_metadata(specs), results, stock.planner_data)
    return d, sd, stock, md


def test_rendered_metadata_is_read_by_stock_dcp_with_storage_meta(tmp_path):
    d, sd, stock, md = _checkpoint(tmp_path)
    tpl = MetadataTemplate(md)
    publish_metadata(d, tpl.render(os.fspath(d), "save-42"))
    read = FileSystemReader(str(d)).read_metadata()
    assert read.storage_meta.checkpoint_id == os.fspath(d)
    assert read.storage_meta.save_id == "save-42"
    assert read.storage_data == stock.storage_data
    assert read.state_dict_metadata == stock.state_dict_metadata
    assert read.planner_data == stock.planner_data
    out = {"a": torch.zeros(8), "b": torch.zeros(2, 3)}
    dcp.load(out, checkpoint_id=str(d), no_dist=True)
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"], sd["b"])


def test_render_changes_only_storage_meta_and_is_linear(tmp_path):
    _, _, _, md = _checkpoint(tmp_path)
    tpl = MetadataTemplate(md)
    one = tpl.render("/ckpt/step_1", "s1")
    two = tpl.render("/ckpt/step_0000002", "s2")
    assert len(two) - len(one) == len("/ckpt/step_0000002") - len("/ckpt/step_1")
    a, b = pickle.loads(one), pickle.loads(two)
    assert a.storage_data == b.storage_data and a.state_dict_metadata == b.state_dict_metadata
    assert (a.storage_meta.checkpoint_id, b.storage_meta.checkpoint_id) == ("/ckpt/step_1", "/ckpt/step_0000002")
    assert tpl.nbytes - 200 < len(one) < tpl.nbytes + 200


def test_publish_is_atomic_and_replaces(tmp_path):
    _, _, _, md = _checkpoint(tmp_path)
    tpl = MetadataTemplate(md)
    publish_metadata(tmp_path, tpl.render("x"))
    publish_metadata(tmp_path, tpl.render("y"))
    assert pickle.loads((tmp_path / METADATA_FILE).read_bytes()).storage_meta.checkpoint_id == "y"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".") and "tmp" in n]


def test_publish_writes_rendered_pieces_in_order(tmp_path):
    """The engine publishes ``render_parts`` (the 100 MiB pickle at W=4096 is not joined in
    memory first): the file holds exactly what ``render`` gives, locally and through fsspec."""
    d, _, _, md = _checkpoint(tmp_path)
    tpl = MetadataTemplate(md)
    parts = tpl.render_parts(os.fspath(d), "save-7")
    assert len(parts) == 5 and b"".join(parts) == tpl.render(os.fspath(d), "save-7")
    publish_metadata(d, parts)
    assert (d / METADATA_FILE).read_bytes() == tpl.render(os.fspath(d), "save-7")
    assert FileSystemReader(str(d)).read_metadata().storage_meta.save_id == "save-7"
    url = (tmp_path / "remote").as_uri()
    publish_metadata(url, tpl.render_parts(url, "save-8"), storage_options={"auto_mkdir": True})
    assert (tmp_path / "remote" / METADATA_FILE).read_bytes() == tpl.render(url, "save-8")


def _tmp_files(d):
    return sorted(n for n in os.listdir(d) if n.startswith(".") and "tmp" in n)


def test_staged_metadata_is_invisible_until_finished_and_discard_leaves_nothing(tmp_path):
    """A reuse save's coordinator stages ``.metadata`` while its data is written: the bytes sit
    in a temporary file, ``.metadata`` appears only at ``finish()``; ``discard()`` (any outcome
    but published) removes the temporary file; each is idempotent and the first one wins."""
    d, _, _, md = _checkpoint(tmp_path)
    tpl = MetadataTemplate(md)
    (d / METADATA_FILE).unlink()  # a checkpoint being saved: unpublished
    staged = stage_metadata(d, tpl.render_parts(os.fspath(d), "s1"))
    assert not (d / METADATA_FILE).exists() and len(_tmp_files(d)) == 1
    staged.finish()
    staged.discard()  # too late: published
    assert _tmp_files(d) == [] and FileSystemReader(str(d)).read_metadata().storage_meta.save_id == "s1"
    dropped = stage_metadata(d, tpl.render_parts(os.fspath(d), "s2"))
    dropped.discard()
    dropped.finish()  # too late: discarded
    assert _tmp_files(d) == [] and FileSystemReader(str(d)).read_metadata().storage_meta.save_id == "s1"
    url = (tmp_path / "remote").as_uri()  # through fsspec: nothing is written before finish()
    (tmp_path / "remote").mkdir()
    remote = stage_metadata(url, tpl.render_parts(url, "s3"), storage_options={"auto_mkdir": True})
    assert os.listdir(tmp_path / "remote") == []
    remote.finish()
    assert (tmp_path / "remote" / METADATA_FILE).read_bytes() == tpl.render(url, "s3")
