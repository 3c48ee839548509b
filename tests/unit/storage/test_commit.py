"""The commit types: each backend replaces a small object with its own type (a rename on a file
system, one PUT on an object store), and a process that dies between staging and finishing
leaves the old object, or none, never a part of the new one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from solosave._src.storage.fsspec import MoveCommit, PutCommit
from solosave._src.storage.local import LocalDataFile, LocalStorage, RenameCommit
from solosave._src.storage.registry import storage_for

pytestmark = pytest.mark.timeout(60)


def _stores(tmp_path):
    """``(storage, destination path, readback)`` for each commit type."""
    fsspec = pytest.importorskip("fsspec")
    mem = f"memory://solosave-test-{uuid.uuid4().hex[:8]}/d/obj"
    url = f"file://{tmp_path}/moved/obj"
    os.makedirs(tmp_path / "moved")

    def read_mem():
        fs = fsspec.filesystem("memory")
        return fs.cat_file(mem) if fs.exists(mem) else None

    def read_file(p):
        return lambda: p.read_bytes() if p.exists() else None

    return [(LocalStorage(), str(tmp_path / "obj"), read_file(tmp_path / "obj")),
            (storage_for(mem), mem, read_mem),
            (storage_for(url), url, read_file(tmp_path / "moved" / "obj"))]


def test_each_backend_chooses_its_commit_type(tmp_path):
    types = [type(st.begin_commit(path, b"x")) for st, path, _ in _stores(tmp_path)]
    assert types == [RenameCommit, PutCommit, MoveCommit]
    assert LocalStorage.commit_type is RenameCommit


@pytest.mark.parametrize("existing", [True, False])
def test_a_crash_between_staging_and_finishing_leaves_the_old_object_or_none(tmp_path, existing):
    for st, path, readback in _stores(tmp_path):
        if existing:
            st.commit(path, b"old")
        staged = st.begin_commit(path, [b"new ", b"contents"])  # pieces, written in order
        # the process "dies" here: nothing ever finishes or discards the staged commit
        assert readback() == (b"old" if existing else None), type(staged).__name__
        del staged
        st.commit(path, [b"new ", b"contents"])  # the next save's commit works as before
        assert readback() == b"new contents"


def test_finish_publishes_discard_drops_and_the_first_one_wins(tmp_path):
    for st, path, readback in _stores(tmp_path):
        st.commit(path, b"old")
        dropped = st.begin_commit(path, b"dropped")
        dropped.discard()
        dropped.finish()  # too late: discarded
        assert readback() == b"old"
        done = st.begin_commit(path, b"new")
        done.finish()
        done.discard()  # too late: finished
        assert readback() == b"new" and done.done
    leftovers = sorted(n for n in os.listdir(tmp_path) if n.startswith("."))
    assert leftovers == [] and sorted(os.listdir(tmp_path / "moved")) == ["obj"]  # temporaries removed


def test_a_commit_is_written_aside_once_and_finished_after(tmp_path):
    c = RenameCommit(LocalStorage(), str(tmp_path / "f"))
    with pytest.raises(RuntimeError, match="finished before it was written aside"):
        c.finish()
    c.write_aside(b"a")
    with pytest.raises(RuntimeError, match="written aside twice"):
        c.write_aside(b"b")
    c.finish()
    assert (tmp_path / "f").read_bytes() == b"a"


def test_a_failed_write_aside_leaves_nothing(tmp_path):
    c = RenameCommit(LocalStorage(), str(tmp_path / "f"))
    with pytest.raises(TypeError):
        c.write_aside([b"ok", "not bytes"])
    assert os.listdir(tmp_path) == [] and c.done
    c.finish()  # nothing to publish: a no-op
    assert os.listdir(tmp_path) == []


_CHILD = r"""
import os, signal, sys
from solosave._src.storage.local import LocalStorage
staged = LocalStorage().begin_commit(sys.argv[1], b"new contents")
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("existing", [True, False])
def test_a_process_killed_after_staging_a_rename_leaves_the_old_file_or_none(tmp_path, existing):
    path = tmp_path / ".metadata"
    if existing:
        LocalStorage().commit(str(path), b"old")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], env=env, timeout=50, capture_output=True)
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert (path.read_bytes() if path.exists() else None) == (b"old" if existing else None)
    stray = [n for n in os.listdir(tmp_path) if n.startswith("..metadata.tmp.")]
    assert len(stray) == 1 and (tmp_path / stray[0]).read_bytes() == b"new contents"


def test_a_local_data_file_is_durable_at_commit_and_keeps_a_descriptor(tmp_path):
    f = LocalDataFile(str(tmp_path / "d"), fsync=True)
    f.write(b"abc")
    f.write_stable(memoryview(b"de"))
    assert f.tell() == 5 and f.fileno() >= 0  # the writer's writev batches use it
    f.commit()
    assert f.closed and (tmp_path / "d").read_bytes() == b"abcde"
    g = LocalDataFile(str(tmp_path / "e"), fsync=False)
    g.write(b"partial")
    g.close()  # abandoned: a file system keeps what was written (no .metadata names it)
    assert (tmp_path / "e").read_bytes() == b"partial"

