"""Damaged and crafted inputs for the untrusted-input tests: surgery on prepared files (any
version from 2 on), with every checksum recomputed as an attacker would, so that what is tested
is the check a crafted file meets, not the CRC it would fail first.

A prepared file is ``MAGIC, version line, JSON header line, [CRC line (version 4)], body``; the
body starts with the offset table (``(offset u64, length u32, crc u32)`` per rank, then per
directory bucket) and every offset is relative to the body (``solosave._src.prepared.sections``).
"""

from __future__ import annotations

import json
import re
import struct
import zlib

MAGIC = b"SOLOSAVE-PREPARED\n"
ENTRY = struct.Struct("<QII")


def split(data: bytes) -> tuple[int, dict, bytes]:
    """``(version, header, body)`` of a prepared file."""
    assert data.startswith(MAGIC), data[:40]
    start = len(MAGIC) + 2
    version = int(data[len(MAGIC):start - 1])
    end = data.index(b"\n", start)
    body = end + 1 + (9 if version >= 4 else 0)
    return version, json.loads(data[start:end]), data[body:]


def join(version: int, header: dict, body: bytes) -> bytes:
    """A prepared file of ``version`` (its header's CRC line recomputed for version 4)."""
    head = MAGIC + b"%d\n" % version + json.dumps(header, sort_keys=True).encode() + b"\n"
    crc = b"%08x\n" % zlib.crc32(head) if version >= 4 else b""
    return head + crc + body


def as_version_3(data: bytes) -> bytes:
    """The same prepared file as version 3 wrote it: no CRC line over the header."""
    _, header, body = split(data)
    header = {**header, "version": 3, "fingerprint": {**header["fingerprint"], "format_version": 3}}
    return join(3, header, body)


def section_crc(header: dict, blob: bytes) -> int:
    """A section's CRC32, seeded with the file's ``file_id`` as the writer does."""
    return zlib.crc32(blob, zlib.crc32(bytes.fromhex(header["file_id"])))


def rank_section(data: bytes, rank: int) -> bytes:
    _, header, body = split(data)
    off, length, _ = ENTRY.unpack_from(body, rank * ENTRY.size)
    return body[off:off + length]


def replace_rank_section(data: bytes, rank: int, blob: bytes) -> bytes:
    """``data`` with rank ``rank``'s section replaced by ``blob`` (appended to the body; its
    offset table entry, ``body_size`` and every checksum made to match)."""
    version, header, body = split(data)
    entry = ENTRY.pack(len(body), len(blob), section_crc(header, blob))
    at = rank * ENTRY.size
    body = body[:at] + entry + body[at + ENTRY.size:] + blob
    return join(version, {**header, "body_size": len(body)}, body)


def rename_data_file(data: bytes, rank: int, old: str, new: str) -> bytes:
    """Rename the data file ``old`` of ``rank``'s section to ``new`` (version 3 on: the names
    are ``u32 rows, u16 length, name`` after the section's file count)."""
    blob = rank_section(data, rank)
    at = blob.index(old.encode())
    n = struct.unpack_from("<H", blob, at - 2)[0]
    assert n == len(old.encode()), (n, old)
    blob = blob[:at - 2] + struct.pack("<H", len(new.encode())) + new.encode() + blob[at + n:]
    return replace_rank_section(data, rank, blob)


def nudge_template_position(data: bytes) -> bytes:
    """The last digit of the template's first placeholder position changed (still valid JSON):
    a one-digit change of a number in the header. The JSON text is edited in place, as a bit flip
    would, so a version-4 file's header CRC no longer matches."""
    start = len(MAGIC) + 2
    end = data.index(b"\n", start)
    line = data[start:end]
    m = re.search(rb'"template": \[(\d+), (\d+), (\d+), (\d+)', line)
    assert m, line
    digits = m.group(4)
    last = digits[-1:]
    nudged = digits[:-1] + (b"3" if last != b"3" else b"7")
    line = line[:m.start(4)] + nudged + line[m.end(4):]
    return data[:start] + line + data[end:]


# -- load indexes (``.solosave-index``, solosave._src.index.writer) ---------------------------------
INDEX_MAGIC = b"SOLOSAVE-INDEX\n1\n"
INDEX_PREFIX = struct.Struct("<QI")
INDEX_ROW = struct.Struct("<IQQ")


def index_split(data: bytes) -> tuple[dict, dict, bytes]:
    """``(header, directory, blobs)`` of a load index (blob offsets are relative to ``blobs``)."""
    assert data.startswith(INDEX_MAGIC), data[:40]
    end = data.index(b"\n", len(INDEX_MAGIC))
    header = json.loads(data[len(INDEX_MAGIC):end])
    body = data[end + 1:]
    n, _ = INDEX_PREFIX.unpack_from(body)
    at = INDEX_PREFIX.size
    return header, json.loads(body[at:at + n]), body[at + n:]


def index_join(header: dict, directory: dict, blobs: bytes, *, body_length: int | None = None) -> bytes:
    """A load index with every checksum an attacker can recompute (the directory's CRC) made to
    match, and ``body_length`` the body's real length unless given."""
    raw = json.dumps(directory, separators=(",", ":")).encode()
    body = INDEX_PREFIX.pack(len(raw), zlib.crc32(raw)) + raw + blobs
    header = {**header, "body_length": len(body) if body_length is None else body_length}
    return INDEX_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + body


def index_set_row(data: bytes, fqn: str, chunk: int = 0, **row: int) -> bytes:
    """The load index ``data`` with the row of tensor ``fqn`` in chunk ``chunk`` of its group
    changed (``file``, ``offset``, ``length``), the row block's CRC recomputed."""
    header, directory, blobs = index_split(data)
    e = directory["keys"][fqn]
    assert e[0] == "t", e
    _, _, keys, _, _, _, rows_at = directory["groups"][e[1]]
    width = keys * INDEX_ROW.size
    start = rows_at + chunk * (width + 4)
    block = bytearray(blobs[start:start + width])
    at = e[2] * INDEX_ROW.size
    old = dict(zip(("file", "offset", "length"), INDEX_ROW.unpack_from(block, at)))
    INDEX_ROW.pack_into(block, at, *(row.get(k, old[k]) for k in ("file", "offset", "length")))
    new = bytes(block) + struct.pack("<I", zlib.crc32(bytes(block)))
    return index_join(header, directory, blobs[:start] + new + blobs[start + width + 4:])
