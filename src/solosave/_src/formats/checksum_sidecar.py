"""The checksum sidecar of a data file: what ``<data file>.crc32`` holds, written and read here only.

A save with ``checksums=True`` writes, beside each data file and before ``.metadata`` is
published, one JSON object (UTF-8, no whitespace)::

    {"format":"solosave-crc32/1","records":[{"offset":0,"length":1577,"crc32":3405691582},...]}

one entry per record of the file, in file order: its byte range and the CRC32 (zip's polynomial,
:mod:`solosave._src.core.checksum`) of its bytes. Stock DCP ignores the file.

* Writer side (``write/writer.py``, the worker of each rank): :func:`sidecar_bytes`.
* Reader side (``tools/verify.py``, one process): :func:`parse_sidecar` turns a sidecar's bytes
  into ``{(offset, length): crc32}``, refusing anything else with a ``ValueError`` that says what
  is wrong. A sidecar is untrusted: it is refused unread past :func:`sidecar_limit` bytes (what a
  sidecar of the file's records can hold), so a reader reads at most that many.

The file names (``CHECKSUM_SUFFIX``, ``checksum_path``) stay with every other name of a
checkpoint directory in :mod:`solosave._src.formats.dcp`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

#: The ``format`` of every sidecar solosave writes; a reader refuses any other.
CHECKSUM_FORMAT = "solosave-crc32/1"

#: Room for the object around the records, and for each record: a record's entry takes at most
#: 80 bytes as written (two 20-digit integers, a 10-digit one, the keys), about 100 with the
#: spaces another JSON writer puts in. The bound leaves room for both.
_HEAD_BYTES = 4096
_RECORD_BYTES = 256
_CRC_END = 1 << 32


def sidecar_bytes(records: Iterable[tuple[int, int, int]]) -> bytes:
    """The sidecar of a data file whose records are ``(offset, length, crc32)``, in file order."""
    doc = {"format": CHECKSUM_FORMAT,
           "records": [{"offset": off, "length": n, "crc32": crc} for off, n, crc in records]}
    return json.dumps(doc, separators=(",", ":")).encode()


def sidecar_limit(records: int) -> int:
    """The most bytes the sidecar of a data file of ``records`` records (as ``.metadata`` counts
    them) can hold: a reader refuses a longer one without parsing it."""
    return _HEAD_BYTES + _RECORD_BYTES * max(records, 0)


def parse_sidecar(data: bytes, records: int) -> dict[tuple[int, int], int]:
    """``{(offset, length): crc32}`` of the sidecar ``data`` of a data file of ``records``
    records. ``ValueError`` naming the problem for anything but a sidecar as
    :func:`sidecar_bytes` writes it (any JSON spacing accepted): longer than
    :func:`sidecar_limit`, not JSON, another format, a record that is not three non-negative
    integers (a CRC32 below 2**32), or one byte range given two CRC32s."""
    limit = sidecar_limit(records)
    if len(data) > limit:
        raise ValueError(f"longer than the {limit} bytes a checksum file of {records} record(s) can "
                         "hold: not this data file's checksum file")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"not a JSON document ({_one_line(e)})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"a JSON {type(doc).__name__}, not an object")
    if doc.get("format") != CHECKSUM_FORMAT:
        raise ValueError(f"format {_short(doc.get('format'))}, not {CHECKSUM_FORMAT!r}")
    listed = doc.get("records")
    if not isinstance(listed, list):
        raise ValueError(f"no list of records (\"records\" is {_short(listed)})")
    out: dict[tuple[int, int], int] = {}
    for i, r in enumerate(listed):
        offset, length, crc = (_field(r, i, name) for name in ("offset", "length", "crc32"))
        if crc >= _CRC_END:
            raise ValueError(f"record {i}: crc32 {crc} does not fit in 32 bits")
        if out.setdefault((offset, length), crc) != crc:
            raise ValueError(f"record {i}: the range {offset}+{length} is listed twice with different CRC32s")
    return out


def _field(record: Any, i: int, name: str) -> int:
    if not isinstance(record, dict):
        raise ValueError(f"record {i} is a JSON {type(record).__name__}, not an object")
    value = record.get(name)
    if type(value) is not int or value < 0:
        raise ValueError(f"record {i}: {name} is {_short(value)}, not a non-negative integer")
    return value


def _short(value: Any) -> str:
    """A JSON value in a message: a scalar as written (cut short), a container by its kind."""
    if value is not None and not isinstance(value, (str, int, float)):
        return f"a JSON {type(value).__name__}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]
