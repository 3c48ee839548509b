"""Damaged and crafted prepared files (every version read, 2 to 4): refused with a clear
:class:`solosave.PreparedMetadataError` before anything uses them, never a data file name
outside the checkpoint directory, never a ``.metadata`` template that does not read back."""

import pickle
from pathlib import Path

import pytest
import torch

import solosave
from solosave._src.prepared.prepared import load_prepared_metadata
from tests import crafted
from tests.support import dcp_save_local

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def prepared_bytes(tmp_path_factory):
    """A version-4 prepared file of a checkpoint of one rank with one file."""
    d = tmp_path_factory.mktemp("ck")
    dcp_save_local({"w": torch.randn(4, 4), "step": 3, "l": [1, 2]}, checkpoint_id=str(d))
    md = load_prepared_metadata(d).metadata
    return solosave.PreparedMetadata.from_metadata(md, world_size=1, workers=1).to_bytes()


def _open(tmp_path, data, name="crafted.prepared"):
    path = tmp_path / name
    path.write_bytes(data)
    return load_prepared_metadata(path)


def test_a_one_digit_change_in_a_version_4_header_is_refused_at_open(prepared_bytes, tmp_path):
    assert prepared_bytes.startswith(b"SOLOSAVE-PREPARED\n4\n")
    _open(tmp_path, prepared_bytes, "intact").checked_template()  # the intact file reads back
    with pytest.raises(solosave.PreparedMetadataError, match="header is truncated or corrupt .*checksum"):
        _open(tmp_path, crafted.nudge_template_position(prepared_bytes))


def test_a_version_3_template_that_does_not_read_back_is_never_published(prepared_bytes, tmp_path):
    """Version 3 had no header CRC: the file opens, but its template is refused before any
    publication uses it, every time it is asked for."""
    old = _open(tmp_path, crafted.as_version_3(prepared_bytes), "v3")
    assert old._reader.version == 3
    old.checked_template()
    bad = _open(tmp_path, crafted.nudge_template_position(crafted.as_version_3(prepared_bytes)))
    for _ in range(2):
        with pytest.raises(solosave.PreparedMetadataError, match="does not read back"):
            bad.checked_template()


@pytest.mark.parametrize("name", ["../pwned.bin", "/tmp/pwn.bin", "__1_0.distcp", "sub/__0_0.dist"])
@pytest.mark.parametrize("version", [3, 4])
def test_a_rank_section_naming_a_file_outside_the_checkpoint_is_refused(prepared_bytes, tmp_path, name, version):
    data = prepared_bytes if version == 4 else crafted.as_version_3(prepared_bytes)
    pm = _open(tmp_path, crafted.rename_data_file(data, 0, "__0_0.distcp", name))
    with pytest.raises(solosave.PreparedMetadataError, match="corrupt or crafted: .*not a data file name|of rank 1"):
        pm.rank_files(0)


def test_a_version_2_rank_section_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    data = (DATA / "prepared_v2.bin").read_bytes()
    rows = pickle.loads(crafted.rank_section(data, 0))
    assert rows[0][0] == "__0_0.distcp"
    rows[0] = ("../../pwned.distcp", rows[0][1])
    pm = _open(tmp_path, crafted.replace_rank_section(data, 0, pickle.dumps(rows, protocol=4)))
    assert pm._reader.version == 2
    with pytest.raises(solosave.PreparedMetadataError, match="'../../pwned.distcp' is not a data file name"):
        pm.rank_files(0)
    pm.rank_files(1)  # the other rank's section is intact


@pytest.mark.parametrize("field,value", [("structure", None), ("world", "2"), ("buckets", 0), ("width", -2),
                                         ("template", [1, 2, 3]), ("body_size", -1), ("fingerprint", []),
                                         ("storage_meta", [1, 2]), ("file_id", "zz")])
def test_header_fields_of_another_type_are_refused(prepared_bytes, tmp_path, field, value):
    version, header, body = crafted.split(prepared_bytes)
    header = {k: v for k, v in header.items() if k != field or value is not None}
    if value is not None:
        header[field] = value
    with pytest.raises(solosave.PreparedMetadataError, match="header is truncated or corrupt"):
        _open(tmp_path, crafted.join(version, header, body))


def test_a_section_longer_than_the_file_is_refused_before_it_is_read(prepared_bytes, tmp_path):
    version, header, body = crafted.split(prepared_bytes)
    entry = crafted.ENTRY.pack(0, 0xFFFFFFFF, 0)  # rank 0's section: 4 GiB at offset 0
    pm = _open(tmp_path, crafted.join(version, header, entry + body[crafted.ENTRY.size:]))
    with pytest.raises(solosave.PreparedMetadataError, match="the section of rank 0 lies outside the file"):
        pm.rank_files(0)
