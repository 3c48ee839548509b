"""The zip layout of a ``torch.save`` archive, in one place: its constants, the parsing of its end
records (zip64 included), central directory headers, zip64 extra fields, local headers and data
descriptors, and the one write made into an archive (a CRC32 field).

``torch.save`` writes a zip of stored (uncompressed) entries. In order: per entry, a local header
(30 bytes, the name, an extra field of padding that aligns the entry's bytes), the bytes, and,
where the local header's flags announce one (every non-empty entry), a data descriptor
(signature, CRC32, sizes; the local header leaves those fields zero); then the central directory
(per entry a 46-byte header, the name and, where a size or offset does not fit in 32 bits, a
zip64 extra field), the zip64 end-of-central-directory record, its locator, and the
end-of-central-directory record, with no comment. Offsets are counted from the archive's first
byte.

Two modules rely on it: :mod:`solosave._src.formats.record_writer` finds, in the bytes after a
record's storage, the CRC32 fields it patches (in its own ``torch.save`` output), and
:mod:`solosave._src.formats.record_reader` decodes records read back from ``.distcp`` files.
Every parser here takes its input as untrusted: bytes come through ``get(offset, n)``, every
offset and length is checked against the bytes the caller vouches for before it is used, nothing
is allocated beyond what was read, and anything out of the form above is refused with a
``ValueError`` (the one exception callers catch).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: ``get(offset, n)``: ``n`` bytes from ``offset`` of an archive (any bytes-like object).
Getter = Callable[[int, int], Any]

LOCAL_SIG = b"PK\x03\x04"
CENTRAL_SIG = b"PK\x01\x02"
DESCRIPTOR_SIG = b"PK\x07\x08"
Z64_EOCD_SIG = b"PK\x06\x06"
Z64_LOCATOR_SIG = b"PK\x06\x07"
EOCD_SIG = b"PK\x05\x06"

EOCD = struct.Struct("<4s4H2IH")          # end of central directory, 22 bytes
Z64_LOCATOR = struct.Struct("<4sIQI")      # zip64 end-of-central-directory locator, 20 bytes
Z64_EOCD = struct.Struct("<4sQ2H2I4Q")     # zip64 end of central directory, 56 bytes
CENTRAL = struct.Struct("<4s6H3I5H2I")     # central directory file header, 46 bytes
LOCAL = struct.Struct("<4s5H3I2H")         # local file header, 30 bytes
#: A CRC32 field (in a central header, a data descriptor).
CRC = struct.Struct("<I")
_EXTRA_HEADER = struct.Struct("<2H")       # an extra field's tag and size

#: A 32-bit size or offset holding this has its value in the entry's zip64 extra field.
IN_ZIP64 = 0xFFFFFFFF
ZIP64_TAG = 1
#: The compression method of an entry stored as is (the only one ``torch.save`` uses).
STORED = 0
#: Where a central directory header holds its entry's CRC32, from the header's first byte.
CENTRAL_CRC_AT = 16
#: More entries than an archive of one tensor has (``torch.save`` writes 7): what the record
#: parsers accept, so that a damaged entry count is refused before anything is read for it.
ONE_TENSOR_MAX_ENTRIES = 64


def read_exact(get: Getter, at: int, n: int, end: int) -> bytes:
    """The ``n`` bytes at ``at``, which must lie inside ``[0, end)``; ``ValueError`` otherwise or
    if ``get`` gives fewer."""
    if at < 0 or n < 0 or at + n > end:
        raise ValueError(f"bytes {at}+{n} lie outside the {end} bytes of the archive")
    data = bytes(get(at, n))
    if len(data) != n:
        raise ValueError(f"bytes {at}+{n} of the archive could not be read ({len(data)} came)")
    return data


@dataclass(frozen=True, slots=True)
class Directory:
    """Where an archive's central directory lies, as its end records say."""

    count: int
    offset: int
    size: int
    #: ``(offset, bytes)`` of every end record read to find it: the end-of-central-directory
    #: record, the 20 bytes before it (the zip64 locator, when there is room for one), and the
    #: zip64 end record the locator points to. A decoder that caches its result compares these.
    ends: tuple[tuple[int, bytes], ...]


def find_directory(get: Getter, length: int, max_entries: int) -> Directory:
    """The central directory of the ``length``-byte archive read through ``get``, from its
    end-of-central-directory record (its zip64 one where a locator precedes it, as
    ``torch.save`` always writes). Refuses more than ``max_entries`` entries and a directory
    that does not lie inside the archive."""
    eocd_at = length - EOCD.size
    eocd = read_exact(get, eocd_at, EOCD.size, length)
    sig, _, _, _, count, size, offset, comment = EOCD.unpack(eocd)
    if sig != EOCD_SIG or comment:
        raise ValueError("the archive does not end with an end-of-central-directory record")
    ends = [(eocd_at, eocd)]
    loc_at = eocd_at - Z64_LOCATOR.size
    if loc_at >= 0:
        locator = read_exact(get, loc_at, Z64_LOCATOR.size, length)
        ends.append((loc_at, locator))
        lsig, _, z64_at, _ = Z64_LOCATOR.unpack(locator)
        if lsig == Z64_LOCATOR_SIG:
            if z64_at + Z64_EOCD.size > loc_at:
                raise ValueError("the zip64 end record does not end before its locator")
            record = read_exact(get, z64_at, Z64_EOCD.size, length)
            fields = Z64_EOCD.unpack(record)
            if fields[0] != Z64_EOCD_SIG:
                raise ValueError("the zip64 locator points at no zip64 end record")
            ends.append((z64_at, record))
            count, size, offset = fields[7], fields[8], fields[9]
    if count > max_entries:
        raise ValueError(f"the archive claims {count} entries, more than {max_entries}")
    if offset + size > length:
        raise ValueError("the central directory does not lie inside the archive")
    return Directory(count, offset, size, tuple(ends))


@dataclass(frozen=True, slots=True)
class CentralEntry:
    """One central directory header, its zip64 values resolved."""

    name: bytes
    method: int
    crc: int
    compressed: int
    size: int
    #: Offset of the entry's local header in the archive.
    local: int
    #: Offset of this header in the central directory.
    at: int

    @property
    def crc_at(self) -> int:
        """Offset of this header's CRC32 field in the central directory."""
        return self.at + CENTRAL_CRC_AT


def central_entries(cd: Any, count: int) -> list[CentralEntry]:
    """The ``count`` headers of the central directory ``cd`` (bytes-like), in order; each must
    lie whole inside ``cd``."""
    out = []
    pos = 0
    for _ in range(count):
        if pos + CENTRAL.size > len(cd):
            raise ValueError("the central directory ends inside a header")
        (sig, _, _, _, method, _, _, crc, compressed, size, name_len, extra_len, comment_len, _, _, _,
         local) = CENTRAL.unpack_from(cd, pos)
        if sig != CENTRAL_SIG:
            raise ValueError(f"no central directory header at {pos}")
        name_at = pos + CENTRAL.size
        extra_at = name_at + name_len
        end = extra_at + extra_len + comment_len
        if end > len(cd):
            raise ValueError("a central directory header runs past the directory")
        if IN_ZIP64 in (size, compressed, local):
            size, compressed, local = zip64_values(cd[extra_at:extra_at + extra_len], size, compressed, local)
        out.append(CentralEntry(bytes(cd[name_at:extra_at]), method, crc, compressed, size, local, pos))
        pos = end
    return out


def zip64_values(extra: Any, size: int, compressed: int, local: int) -> tuple[int, int, int]:
    """``(size, compressed, local)`` of a central header whose fields holding :data:`IN_ZIP64`
    take their values from its zip64 extra field (in that order, only those so marked). Refuses
    a header without that field, a field that lacks a value the header says it holds, and an
    extra field that runs past ``extra``."""
    pos = 0
    while pos + _EXTRA_HEADER.size <= len(extra):
        tag, n = _EXTRA_HEADER.unpack_from(extra, pos)
        start = pos + _EXTRA_HEADER.size
        if start + n > len(extra):
            raise ValueError("an extra field runs past its header's extra bytes")
        if tag == ZIP64_TAG:
            values = list(struct.unpack_from(f"<{n // 8}Q", extra, start))
            if len(values) < (size, compressed, local).count(IN_ZIP64):
                raise ValueError("a zip64 extra field lacks a value its entry says it holds")
            if size == IN_ZIP64:
                size = values.pop(0)
            if compressed == IN_ZIP64:
                compressed = values.pop(0)
            if local == IN_ZIP64:
                local = values.pop(0)
            return size, compressed, local
        pos = start + n
    raise ValueError("an entry's zip64 values have no zip64 extra field")


def stored_data(get: Getter, entry: CentralEntry, end: int) -> tuple[int, bytes]:
    """``(start, local header)`` of a stored (uncompressed) entry: the offset of its bytes, and
    its local header with name and extra field. Its header and bytes must end by ``end``."""
    if entry.method != STORED or entry.compressed != entry.size:
        raise ValueError(f"entry {entry.name!r} is compressed")
    head = read_exact(get, entry.local, LOCAL.size, end)
    sig, _, _, method, _, _, _, _, _, name_len, extra_len = LOCAL.unpack(head)
    start = entry.local + LOCAL.size + name_len + extra_len
    if sig != LOCAL_SIG or method != STORED:
        raise ValueError(f"entry {entry.name!r} has no local header of a stored entry")
    if start + entry.size > end:
        raise ValueError(f"entry {entry.name!r} does not end inside the archive")
    return start, read_exact(get, entry.local, start - entry.local, end)


def descriptor_crc_at(data: bytes, at: int) -> int:
    """Where the CRC32 lies in the data descriptor that starts at ``at`` of ``data`` (after
    the descriptor's signature, which the format makes optional)."""
    return at + len(DESCRIPTOR_SIG) if data[at:at + len(DESCRIPTOR_SIG)] == DESCRIPTOR_SIG else at


def put_crc(data: bytearray, at: int, crc: int) -> None:
    """Write ``crc`` into the CRC32 field at ``at`` of ``data``."""
    CRC.pack_into(data, at, crc)
