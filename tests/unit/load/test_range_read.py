"""Loads of checkpoints on storage that is not local files (issue 33, item 3): the load index read
by ranges, records read with concurrent ranged reads straight into the targets. Against an
in-memory backend (no server): the same bytes and the same checks as the local read path."""

import threading

import pytest
import torch

import solosave
from solosave._src.coordination.protocol import EngineSettings
from solosave._src.engine.engine import Engine
from solosave._src.load import range_read
from solosave._src.save.options import CheckpointerOptions
from solosave._src.save.session import SaveSession
from solosave._src.storage.registry import REGISTRY
from solosave._src.testing.introspect import job_for
from solosave._src.testing.local_channel import local_channels
from solosave._src.write.writer import FileWriter
from tests.unit.storage.dict_storage import DictStorage

pytestmark = pytest.mark.timeout(120)


class RangedDictStorage(DictStorage):
    """The in-memory backend, with the load index, counting ranged reads, the threads they ran on
    and how many reads of data files were in flight at once (``__overlap__["max"]``). With
    ``__overlap__["meet"]`` set, the first data read waits, at most 2 s, for a second one to
    start: reads issued concurrently then always overlap here, however the threads are
    scheduled; reads issued one after another never do."""

    load_index = True

    def __init__(self, objects):
        super().__init__(objects)
        self.ranges = objects.setdefault("__ranges__", [])
        self.overlap = objects.setdefault("__overlap__", {"cond": threading.Condition(), "now": 0, "max": 0,
                                                         "meet": False})

    def read_range(self, path, offset, length):
        name = path.rsplit("/", 1)[1]
        self.ranges.append((name, offset, length, threading.current_thread().name))
        if not name.endswith(".distcp"):
            return super().read_range(path, offset, length)
        o = self.overlap
        with o["cond"]:
            o["now"] += 1
            o["max"] = max(o["max"], o["now"])
            o["cond"].notify_all()
            if o["meet"]:
                o["cond"].wait_for(lambda: o["max"] > 1, timeout=2.0)
        try:
            return super().read_range(path, offset, length)
        finally:
            with o["cond"]:
                o["now"] -= 1


@pytest.fixture
def ranged():
    REGISTRY.register(("dict",), RangedDictStorage)
    yield {"objects": {}}
    REGISTRY.unregister(("dict",))


def _save(sd, path, options):
    (ch,) = local_channels(1, timeout=10)
    engine = Engine(ch, EngineSettings(storage_options=options), FileWriter(fsync=False))
    session = SaveSession(0, 1, CheckpointerOptions(persistent_worker=False), None)
    try:
        out = engine.run(job_for(session, engine.io.reader, sd, path))
        assert out.ok, out.failures
    finally:
        session.close()
        engine.close()


def _state():
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(512, 1024, generator=g),             # 2 MiB: read straight into its target
            "half": torch.randn(300, 300, generator=g).to(torch.bfloat16),
            "small": [torch.randn(16, generator=g) for _ in range(40)],  # coalesced spans
            "step": 12, "name": "run"}


def test_url_loads_use_the_index_and_ranged_reads_into_the_targets(ranged, monkeypatch):
    opts = ranged
    sd = _state()
    _save(sd, "dict://b/ck", opts)
    names = sorted(k.rsplit("/", 1)[1] for k in opts["objects"] if k.startswith("dict://"))
    assert names == [".metadata", ".solosave-index", "__0_0.distcp"]  # the index is written for this backend
    monkeypatch.setattr(range_read, "HUGE_BYTES", 1 << 20)  # the big tensor: straight into its target,
    monkeypatch.setattr(range_read, "PART_BYTES", 256 << 10)  # in 8 parts at once
    got = {"big": torch.zeros(512, 1024), "half": torch.zeros(300, 300, dtype=torch.bfloat16),
           "small": [torch.zeros(16) for _ in range(40)], "step": 0, "name": ""}
    opts["objects"]["__ranges__"].clear()
    RangedDictStorage(opts["objects"]).overlap.update(now=0, max=0, meet=True)
    assert solosave.load(got, "dict://b/ck", storage_options=opts) == "dict://b/ck"
    assert torch.equal(got["big"], sd["big"]) and torch.equal(got["half"], sd["half"])
    assert all(torch.equal(a, b) for a, b in zip(got["small"], sd["small"]))
    assert got["step"] == 12 and got["name"] == "run"
    ranges = opts["objects"]["__ranges__"]
    files = {f for f, *_ in ranges}
    assert ".solosave-index" in files and ".metadata" in files  # the index, and its check against .metadata
    data = [(o, n) for f, o, n, _ in ranges if f == "__0_0.distcp"]
    assert sum(1 for _, n in data if n == 256 << 10) >= 8  # the big payload's parts
    assert opts["objects"]["__overlap__"]["max"] > 1  # several reads of the data file in flight at once
    # the whole .metadata is never read: only the index and a few bytes of .metadata
    assert all(n < 4096 for f, _, n, _ in ranges if f == ".metadata")


def test_url_loads_read_spans_of_whole_records_convert_and_refuse_damage(ranged):
    opts = ranged
    sd = _state()
    _save(sd, "dict://b/ck", opts)
    got = _state()
    for v in (got["big"], got["half"], *got["small"]):
        v.zero_()
    opts["objects"]["__ranges__"].clear()
    solosave.load(got, "dict://b/ck", storage_options=opts)
    assert torch.equal(got["big"], sd["big"]) and all(torch.equal(a, b) for a, b in zip(got["small"], sd["small"]))
    data = [n for f, _, n, _ in opts["objects"]["__ranges__"] if f == "__0_0.distcp"]
    assert len(data) == 1  # one span: every record of the 2.4 MiB file in one request
    got = {"big": torch.zeros(512, 1024, dtype=torch.float64), "half": torch.zeros(300, 300)}
    solosave.load(got, "dict://b/ck", storage_options=opts, use_index=False)  # .metadata, DCP's planner
    assert torch.equal(got["big"], sd["big"].double()) and torch.equal(got["half"], sd["half"].float())
    key = "dict://b/ck/__0_0.distcp"
    opts["objects"][key] = opts["objects"][key][: len(opts["objects"][key]) // 2]  # truncated
    with pytest.raises(solosave.CorruptCheckpointError, match="is damaged"):
        solosave.load({"big": torch.zeros(512, 1024)}, "dict://b/ck", storage_options=opts)
