"""The zip layout of ``torch.save`` archives (``formats/torch_zip.py``): the one parser that the
record writer and the record reader share, checked against Python's ``zipfile`` on real archives
and on damaged ones (where it may only answer or raise ``ValueError``)."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch

from solosave._src.formats import torch_zip


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


ARCHIVES = {
    "one float tensor": lambda: _saved(torch.arange(12.0).reshape(3, 4)),
    "a scalar bf16": lambda: _saved(torch.tensor(1.5, dtype=torch.bfloat16)),
    "an empty tensor": lambda: _saved(torch.empty(0)),
    "a dict of three tensors": lambda: _saved({"a": torch.ones(3), "b": torch.zeros(2, 2), "c": torch.arange(5)}),
}


def _parse(data: bytes) -> tuple[torch_zip.Directory, list[torch_zip.CentralEntry], list[tuple[int, bytes]]]:
    """Everything the parsers give for ``data``: its directory, its entries, and where each
    entry's bytes start (with its local header)."""
    get = lambda at, n: data[at:at + n]  # noqa: E731
    d = torch_zip.find_directory(get, len(data), torch_zip.ONE_TENSOR_MAX_ENTRIES)
    entries = torch_zip.central_entries(torch_zip.read_exact(get, d.offset, d.size, len(data)), d.count)
    return d, entries, [torch_zip.stored_data(get, e, len(data)) for e in entries]


@pytest.mark.parametrize("name", list(ARCHIVES))
def test_the_parser_reads_what_zipfile_reads(name):
    data = ARCHIVES[name]()
    d, entries, starts = _parse(data)
    infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    assert [(e.name.decode(), e.crc, e.size, e.compressed, e.local, e.method) for e in entries] == [
        (i.filename, i.CRC, i.file_size, i.compress_size, i.header_offset, i.compress_type) for i in infos]
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for e, (start, header) in zip(entries, starts):
            assert data[start:start + e.size] == zf.read(e.name.decode())
            assert header == data[e.local:start] and header.startswith(torch_zip.LOCAL_SIG)
    cd = data[d.offset:d.offset + d.size]
    assert all(struct.unpack_from("<I", cd, e.crc_at)[0] == e.crc for e in entries)
    # the end records: the last 22 bytes, the locator before them, and the zip64 record it names
    assert [at for at, _ in d.ends][:2] == [len(data) - 22, len(data) - 42]
    assert all(data[at:at + len(b)] == b for at, b in d.ends) and len(d.ends) == 3


@pytest.mark.parametrize("name", list(ARCHIVES))
def test_every_data_descriptor_holds_its_entrys_crc_where_the_parser_says(name):
    """``descriptor_crc_at`` (the writer patches CRC32s there) on every entry of a real archive;
    ``put_crc`` writes a field that reads back."""
    data = ARCHIVES[name]()
    _, entries, starts = _parse(data)
    described = 0
    for e, (start, header) in zip(entries, starts):
        if not torch_zip.LOCAL.unpack_from(header)[2] & 0x08:  # flag bit 3: a descriptor follows
            assert e.size == 0  # torch writes none for an empty entry (no frame is built for one)
            continue
        at = torch_zip.descriptor_crc_at(data, start + e.size)
        assert at == start + e.size + 4  # torch writes the optional signature
        assert struct.unpack_from("<I", data, at)[0] == e.crc
        described += 1
    assert described >= len(entries) - 1
    buf = bytearray(8)
    torch_zip.put_crc(buf, 2, 0xDEADBEEF)
    assert torch_zip.CRC.unpack_from(buf, 2)[0] == 0xDEADBEEF and buf[:2] == b"\0\0" and buf[6:] == b"\0\0"


def _with_zip64_local(cd: bytes, entry: torch_zip.CentralEntry) -> bytes:
    """``cd`` with ``entry``'s local header offset moved into a zip64 extra field."""
    fields = list(torch_zip.CENTRAL.unpack_from(cd, entry.at))
    name_len, extra_len, comment_len = fields[10:13]
    extra = struct.pack("<2HQ", torch_zip.ZIP64_TAG, 8, entry.local)
    fields[11], fields[16] = extra_len + len(extra), torch_zip.IN_ZIP64
    start = entry.at + torch_zip.CENTRAL.size
    end = start + name_len + extra_len + comment_len
    header = torch_zip.CENTRAL.pack(*fields) + cd[start:start + name_len] + cd[start + name_len:end - comment_len]
    return cd[:entry.at] + header + extra + cd[end - comment_len:]


def test_a_central_header_takes_what_it_marks_from_its_zip64_field():
    data = ARCHIVES["one float tensor"]()
    d, entries, _ = _parse(data)
    cd = data[d.offset:d.offset + d.size]
    crafted = _with_zip64_local(cd, entries[2])
    again = torch_zip.central_entries(crafted, d.count)
    assert [(e.name, e.local, e.size, e.crc) for e in again] == [(e.name, e.local, e.size, e.crc) for e in entries]
    assert again[3].at == entries[3].at + 12  # the headers after it moved by the field's 12 bytes


def test_a_zip64_field_is_refused_when_it_lacks_a_value_is_absent_or_runs_past_its_header():
    u32 = torch_zip.IN_ZIP64
    assert torch_zip.zip64_values(b"\x01\x00\x10\x00" + struct.pack("<QQ", 7, 5), u32, u32, 10) == (7, 5, 10)
    assert torch_zip.zip64_values(b"\x09\x00\x02\x00ab\x01\x00\x08\x00" + struct.pack("<Q", 3), 4, 4, u32) == (4, 4, 3)
    for extra, why in [(b"\x01\x00\x08\x00" + bytes(8), "lacks a value"),
                       (b"\x09\x00\x02\x00ab", "no zip64 extra field"),
                       (b"\x01\x00\x10\x00" + bytes(8), "runs past")]:
        with pytest.raises(ValueError, match=why):
            torch_zip.zip64_values(extra, u32, u32, 10)


def test_damaged_archives_are_refused_with_value_error_and_nothing_else():
    """Every truncation of a record, and every byte of it set to 0x00 and to 0xFF: the parsers
    give an answer or a ``ValueError``, never ``struct.error``, ``IndexError`` or another."""
    good = ARCHIVES["one float tensor"]()
    damaged = [good[:n] for n in range(len(good))]
    for at in range(len(good)):
        for value in (0x00, 0xFF):
            data = bytearray(good)
            data[at] = value
            damaged.append(bytes(data))
    refused = 0
    for data in damaged:
        try:
            _parse(data)
        except ValueError:
            refused += 1
    assert refused >= len(good)  # every truncation at least


def test_reads_outside_the_archive_are_refused_before_get_is_called():
    calls = []

    def get(at, n):
        calls.append((at, n))
        return b"\0" * n

    for at, n in [(-1, 4), (10, 7), (0, 17)]:
        with pytest.raises(ValueError, match="outside"):
            torch_zip.read_exact(get, at, n, 16)
    with pytest.raises(ValueError, match="could not be read"):
        torch_zip.read_exact(lambda at, n: b"\0", 0, 4, 16)
    assert calls == []
