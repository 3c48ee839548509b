"""The reuse publish: a .metadata rendered from MetadataTemplate is what stock DCP reads."""

import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from solosave._src.coordination.protocol import ItemKind, ItemSpec
from solosave._src.formats.dcp import METADATA_FILE
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.storage.registry import storage_for
from solosave._src.write.publish import begin_publication, commit_checkpoint
from tests.support import dcp_save_local
from tests.unit.plan.oracle import build_metadata, build_state_dict_metadata


def publish_metadata(directory, data, storage_options=None):
    """``.metadata`` alone (no load index) through the one publication function."""
    assert commit_checkpoint(storage_for(directory, storage_options), os.fspath(directory), data) is None


def stage_metadata(directory, data, storage_options=None):
    return begin_publication(storage_for(directory, storage_options), os.fspath(directory), data)


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


class _Recording:
    """A local storage that records, in order, which published file became visible when (and
    can fail the commit of one of them)."""

    def __init__(self, fail=None):
        from solosave._src.storage.local import LocalStorage

        outer = self
        self.events, self.fail = [], fail

        class Rec(LocalStorage):
            def begin_commit(self, path, data, fsync=True):
                if os.path.basename(path) == outer.fail:
                    raise OSError(28, "No space left on device")
                staged = super().begin_commit(path, data, fsync)
                finish = staged.finish

                def recorded():
                    finish()
                    outer.events.append(("commit", os.path.basename(path), os.path.exists(path)))

                staged.finish = recorded
                return staged

            def remove(self, path):
                super().remove(path)
                outer.events.append(("remove", os.path.basename(path), os.path.exists(path)))

        self.storage = Rec()


def test_commit_checkpoint_writes_the_index_then_metadata_last(tmp_path):
    """The invariant every publishing path goes through (engine, collective fallback, durable
    copy, peer copy, peer repair: tests/unit/test_invariants.py finds no other writer): the load
    index is visible before ``.metadata``, and ``.metadata`` is the last thing written."""
    from solosave._src.formats.dcp import INDEX_FILE

    rec = _Recording()
    (tmp_path / METADATA_FILE).write_bytes(b"old")
    from solosave._src.write.publish import unpublish

    unpublish(rec.storage, os.fspath(tmp_path))
    assert not (tmp_path / METADATA_FILE).exists()
    (tmp_path / "__0_0.distcp").write_bytes(b"new data")  # the data, written after the old .metadata went
    assert commit_checkpoint(rec.storage, os.fspath(tmp_path), [b"new ", b"md"], b"index") is None
    names = [e[1] for e in rec.events if e[0] == "commit"]
    assert names == [INDEX_FILE, METADATA_FILE]
    assert (tmp_path / METADATA_FILE).read_bytes() == b"new md" and (tmp_path / INDEX_FILE).read_bytes() == b"index"
    assert rec.events[0] == ("remove", METADATA_FILE, False)


def test_an_index_that_fails_is_a_warning_and_metadata_that_fails_publishes_nothing(tmp_path):
    from solosave._src.formats.dcp import INDEX_FILE

    rec = _Recording(fail=INDEX_FILE)
    warning = commit_checkpoint(rec.storage, os.fspath(tmp_path), b"md", lambda: b"index")
    assert warning is not None and "load index" in warning and "No space left" in warning
    assert (tmp_path / METADATA_FILE).read_bytes() == b"md"
    rec = _Recording(fail=METADATA_FILE)
    d = tmp_path / "second"
    d.mkdir()
    import pytest
    with pytest.raises(OSError, match="No space left"):
        commit_checkpoint(rec.storage, os.fspath(d), b"md", b"index")
    assert not (d / METADATA_FILE).exists() and _tmp_files(d) == []
