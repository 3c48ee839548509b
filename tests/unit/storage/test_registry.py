"""The storage registry: the backend is chosen once from the path's scheme, optional backends are
imported only when used (and say what to install), and a registered backend serves every call
site (saves, loads, prepared files, retention) through the protocol alone."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

import solosave
from solosave._src.coordination.protocol import EngineSettings
from solosave._src.engine.engine import Engine
from solosave._src.formats.dcp import METADATA_FILE
from solosave._src.load.load import read_metadata_bytes
from solosave._src.save.options import CheckpointerOptions
from solosave._src.save.session import SaveSession, normalize_directory
from solosave._src.storage.fsspec import FsspecStorage
from solosave._src.storage.local import LocalStorage
from solosave._src.storage.registry import (
    ANY_URL,
    PLAIN,
    REGISTRY,
    StorageRegistry,
    backend_for,
    scheme_of,
    storage_for,
)
from solosave._src.testing.introspect import job_for
from solosave._src.testing.local_channel import local_channels
from solosave._src.tools.retention import remove_checkpoint
from solosave._src.write.writer import FileWriter

pytestmark = pytest.mark.timeout(60)

FAKE = "tests.unit.storage.dict_storage"


def test_the_scheme_picks_the_backend():
    assert scheme_of("s3://b/x") == "s3" and scheme_of("GS://b") == "gs"
    assert scheme_of("runs/x") is None and scheme_of("s3:/b/x") is None and scheme_of(pathlib.Path("/x")) is None
    assert backend_for("/tmp/ck") is LocalStorage and backend_for(pathlib.Path("ck")) is LocalStorage
    assert backend_for("s3:/bucket/run") is LocalStorage  # a URL pathlib mangled is a local path (refused on save)
    assert backend_for("s3://b/x") is FsspecStorage and backend_for("MEMORY://x") is FsspecStorage
    assert LocalStorage.local_files and LocalStorage.load_index
    assert not FsspecStorage.local_files and FsspecStorage.load_index  # the index is read by ranges there


def test_a_registered_scheme_wins_over_the_url_fallback_and_an_unserved_one_is_named():
    reg = StorageRegistry()
    reg.register((PLAIN,), LocalStorage)
    with pytest.raises(ValueError, match=r"no storage backend serves s3:// paths \('s3://b/x'\)"):
        reg.backend_for("s3://b/x")
    reg.register((ANY_URL,), FsspecStorage)
    reg.register(("dict",), f"{FAKE}:DictStorage")
    assert reg.backend_for("s3://b/x") is FsspecStorage
    assert reg.backend_for("dict://b/x").__name__ == "DictStorage"
    assert reg.backend_for("x") is LocalStorage
    with pytest.raises(ValueError, match="'package.module:Class'"):
        reg.register(("y",), "no_colon_here")


def test_a_backend_is_imported_on_first_use_and_a_missing_one_says_what_to_install():
    reg = StorageRegistry()
    reg.register(("nope",), "tests.unit.storage.no_such_backend:Nope", install="pip install 'solosave[nope]'")
    with pytest.raises(ImportError, match=r"nope://b/x needs the storage backend tests\.unit\.storage\.no_such_backend"
                                          r".*: pip install 'solosave\[nope\]'"):
        reg.storage_for("nope://b/x")
    sys.modules.pop(FAKE, None)
    reg.register(("dict",), f"{FAKE}:DictStorage")
    assert FAKE not in sys.modules  # registering imports nothing
    reg.backend_for("dict://b")
    assert FAKE in sys.modules


def test_urls_without_fsspec_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # what an environment without fsspec sees
    with pytest.raises(ImportError, match=r"s3://b/x is a URL, and URLs need fsspec: pip install 'solosave\[s3\]'"):
        storage_for("s3://b/x")
    # path operations need no client: an aborted save still names its directory
    assert normalize_directory("s3://b/x/") == "s3://b/x" and backend_for("s3://b").join("s3://b/", "c") == "s3://b/c"


def test_local_work_imports_no_optional_backend():
    dcp_alone = subprocess.run([sys.executable, "-c", "import sys, torch.distributed.checkpoint; "
                                "print('fsspec' in sys.modules)"], capture_output=True, text=True, timeout=50)
    if dcp_alone.stdout.strip() == "True":
        pytest.skip("this torch's DCP imports fsspec itself (torch 2.8): nothing of solosave's to check")
    code = ("import sys, solosave; from solosave._src.storage.registry import backend_for, storage_for; "
            "storage_for('/tmp').exists('/tmp'); backend_for('s3://b/x').normalize('s3://b/x/'); "
            "print(sorted(m for m in ('fsspec', 's3fs') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.fixture
def dict_backend():
    REGISTRY.register(("dict",), f"{FAKE}:DictStorage")
    yield {"objects": {}}
    REGISTRY.unregister(("dict",))


def _save_one_rank(sd: dict, path: str, options: dict) -> None:
    """One rank's engine writes ``sd`` to ``path`` (no processes: an in-process channel)."""
    (ch,) = local_channels(1, timeout=10)
    engine = Engine(ch, EngineSettings(storage_options=options), FileWriter(fsync=False, checksums=True))
    session = SaveSession(0, 1, CheckpointerOptions(persistent_worker=False), None)
    try:
        out = engine.run(job_for(session, engine.io.reader, sd, path))
        assert out.ok, out.failures
    finally:
        session.close()
        engine.close()


def test_a_registered_backend_serves_saves_loads_prepared_files_and_retention(dict_backend):
    opts, objects = dict_backend, dict_backend["objects"]
    sd = {"w": torch.arange(12.0).reshape(3, 4), "step": 7, "name": "run"}
    _save_one_rank(sd, "dict://bucket/ck", opts)
    names = sorted(k.rsplit("/", 1)[1] for k in objects)
    assert names == [METADATA_FILE, "__0_0.distcp", "__0_0.distcp.crc32"]  # no load index: it could not be read
    got = {"w": torch.zeros(3, 4), "step": 0, "name": ""}
    solosave.load(got, "dict://bucket/ck/", storage_options=opts)  # ranged reads through the backend
    assert torch.equal(got["w"], sd["w"]) and got["step"] == 7 and got["name"] == "run"
    report = solosave.verify_checkpoint("dict://bucket/ck", storage_options=opts)
    assert report.ok and report.checksums == "verified" and report.index is None
    solosave.save_prepared_metadata(solosave.load_prepared_metadata("dict://bucket/ck", storage_options=opts),
                                    "dict://bucket/prepared", storage_options=opts)
    prepared = solosave.load_prepared_metadata("dict://bucket/prepared", storage_options=opts)
    assert set(prepared.metadata.state_dict_metadata) == {"w", "step", "name"}
    remove_checkpoint("dict://bucket/ck", opts)
    assert list(objects) == ["dict://bucket/prepared"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_metadata_bytes("dict://bucket/ck", opts)
