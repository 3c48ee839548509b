"""The shape every framework adapter shares (``_src/tools/framework.py``), in one process: option
fields derived from CheckpointerOptions, the prepared file's place, and the Publisher's rule that
a save's framework files appear only after its publication, on the coordinator only."""

from __future__ import annotations

import dataclasses
import os

import pytest

from solosave import CheckpointerOptions, CheckpointError
from solosave._src.tools import framework as fw


@dataclasses.dataclass(kw_only=True)
@fw.option_fields
class FrameworkConfig:
    folder: str = "ckpt"


def test_option_fields_are_derived_from_checkpointer_options():
    names = [f.name for f in dataclasses.fields(FrameworkConfig)]
    assert names == ["folder"] + [f.name for f in fw.forwarded_fields()]
    assert not fw.ADAPTER_SET & set(names)
    c = FrameworkConfig(files_per_rank=2, stage_replicas=True)
    o = fw.framework_options(fw.forwarded_values(c), prepared="/r/p.md", name_of=lambda n: f"cfg.{n}")
    assert (o.workers, o.stage_replicas, o.prepared_metadata, o.create_prepared_metadata) == (2, True, "/r/p.md", True)
    assert fw.framework_options({}, prepared=None).assume_constant_structure
    with pytest.raises(ValueError, match=r"^cfg\.files_per_rank must be >= 1"):
        fw.framework_options(fw.forwarded_values(FrameworkConfig(files_per_rank=0)), prepared=None,
                             name_of=lambda n: f"cfg.{n}")


def test_a_config_that_declares_an_option_itself_is_refused():
    with pytest.raises(TypeError, match="declares 'files_per_rank'"):
        @fw.option_fields
        class Twice:
            files_per_rank: int = 4


def test_prepared_file_lies_in_the_root():
    assert fw.prepared_file("auto", "/ck", 8, 2) == "/ck/prepared-w8-n2.metadata"
    assert fw.prepared_file("p.md", "/ck", 8, 1) == "/ck/p.md"
    assert fw.prepared_file("/abs/p.md", "/ck", 8, 1) == "/abs/p.md"
    assert fw.prepared_file("s3://b/p.md", "/ck", 8, 1) == "s3://b/p.md"
    assert fw.prepared_file(None, "/ck", 8, 1) is None
    o = fw.options_in_root(CheckpointerOptions(workers=2), "/ck", 4)
    assert (o.prepared_metadata, o.create_prepared_metadata) == ("/ck/prepared-w4-n2.metadata", True)
    assert fw.options_in_root(CheckpointerOptions(prepared_metadata="x.md"), "/ck", 4).prepared_metadata == "/ck/x.md"
    kept = CheckpointerOptions(assume_constant_structure=True)
    assert fw.options_in_root(kept, "/ck", 4) is kept


class Result:
    published = True


class Handle:
    def __init__(self, path, error=None, finished=True):
        self.path, self.error, self.finished = path, error, finished

    def done(self):
        return self.finished

    def wait(self, timeout=None):
        if self.error is not None:
            raise self.error
        return Result()


class Checkpointer:
    """Stands in for AsyncCheckpointer: each save 'publishes' by writing .metadata when waited for."""

    def __init__(self, rank=0, fail=()):
        self.rank, self.fail, self.closed = rank, set(fail), False

    def save(self, state_dict, path, overwrite=False):
        os.makedirs(path, exist_ok=True)
        if os.path.basename(path) in self.fail:
            return Handle(path, CheckpointError("boom", {1: "OSError: EIO"}))
        open(os.path.join(path, ".metadata"), "wb").close()
        return Handle(path, finished=False)

    def close(self):
        self.closed = True


def test_files_appear_only_after_publication_on_the_coordinator(tmp_path):
    published = []
    p = fw.Publisher(Checkpointer(), on_published=published.append)
    p.save(1, {}, str(tmp_path / "a"), files={"meta.pt": b"A"})
    assert not (tmp_path / "a" / "meta.pt").exists() and p.in_flight == str(tmp_path / "a")
    assert p.poll() == [] and not (tmp_path / "a" / "meta.pt").exists()  # not finished: nothing yet
    p.save(2, {}, str(tmp_path / "b"), files={"meta.pt": b"B"})  # collects a, waiting for it
    assert (tmp_path / "a" / "meta.pt").read_bytes() == b"A" and [d.step for d in published] == [1]
    p.collect(block=True, discard_files=True)  # b is being removed: no files for it
    assert not (tmp_path / "b" / "meta.pt").exists() and [d.step for d in published] == [1, 2]
    p.close()
    assert p.checkpointer.closed and p.in_flight is None

    other = fw.Publisher(Checkpointer(rank=1))
    other.save(1, {}, str(tmp_path / "c"), files={"meta.pt": b"C"})
    other.close()
    assert not (tmp_path / "c" / "meta.pt").exists()  # only the coordinator writes them


def test_a_failed_save_gets_no_files_and_is_kept(tmp_path):
    published = []
    p = fw.Publisher(Checkpointer(fail={"bad"}), on_published=published.append)
    p.save(3, {}, str(tmp_path / "bad"), files={"meta.pt": b"X"})
    done = p.close()
    assert [d.step for d in p.failures] == [3] and isinstance(done[0].error, CheckpointError)
    assert not (tmp_path / "bad" / "meta.pt").exists() and published == []


def test_a_file_that_cannot_be_written_fails_the_save(tmp_path):
    p = fw.Publisher(Checkpointer())
    p.save(4, {}, str(tmp_path / "d"), files={"sub/meta.pt": b"X"})  # its folder does not exist
    p.close()
    assert [d.step for d in p.failures] == [4]
    assert "was published but writing ['sub/meta.pt'] failed" in str(p.failures[0].error)
