"""Damaged records and storage entries meet ``solosave.load`` (findings of
``tests/faults/test_fuzz.py``, each pinned here): a record that neither the quick decoder nor
``torch.load(weights_only=True)`` can read is a :class:`solosave.CorruptCheckpointError` naming
its key, never torch's ``RuntimeError`` / ``UnicodeDecodeError``; a chunk without a storage entry
likewise, never a ``KeyError``."""

import pickle

import pytest
import torch

import solosave
from tests.support import dcp_save_local


@pytest.fixture()
def ckpt(tmp_path):
    d = tmp_path / "ck"
    dcp_save_local({"a": torch.arange(100.0), "meta": {"step": 7, "name": "run"}}, checkpoint_id=str(d))
    return d


def _target():
    return {"a": torch.zeros(100), "meta": {"step": 0, "name": ""}}


def _damage_record(ckpt, fqn):
    """Overwrite the end-of-central-directory signature of ``fqn``'s record: not a zip any more."""
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    path = ckpt / info.relative_path
    data = bytearray(path.read_bytes())
    record = data[info.offset:info.offset + info.length]
    at = info.offset + record.rindex(b"PK\x05\x06")
    data[at:at + 4] = b"XXXX"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fqn", ["a", "meta.name"])
def test_a_record_torch_load_cannot_read_is_a_corrupt_checkpoint(ckpt, fqn):
    _damage_record(ckpt, fqn)
    with pytest.raises(solosave.CorruptCheckpointError, match=f"the record of '{fqn}' is damaged: torch.load "
                       "cannot read it") as e:
        solosave.load(_target(), ckpt)
    assert e.value.problems and fqn in e.value.problems[0]


def test_a_chunk_without_a_storage_entry_is_a_corrupt_checkpoint(ckpt):
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "a"}
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(solosave.CorruptCheckpointError, match="declares .*'a'.* but has no storage entry"):
        solosave.load(_target(), ckpt)
