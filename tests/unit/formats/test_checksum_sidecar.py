"""The checksum sidecar (``formats/checksum_sidecar.py``): the bytes the writer puts in
``<data file>.crc32`` are those of the format as solosave has always written it, old sidecars
parse, and damaged or oversized ones are refused with a ``ValueError`` that says what is wrong."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from solosave._src.formats.checksum_sidecar import CHECKSUM_FORMAT, parse_sidecar, sidecar_bytes, sidecar_limit

#: A sidecar as ``checksums=True`` saves wrote it before the format got its own module.
OLD = (b'{"format":"solosave-crc32/1","records":[{"offset":0,"length":1577,"crc32":3405691582},'
       b'{"offset":1577,"length":900,"crc32":0}]}')
OLD_RECORDS = {(0, 1577): 3405691582, (1577, 900): 0}


def test_the_writer_side_writes_the_format_unchanged():
    assert CHECKSUM_FORMAT == "solosave-crc32/1"
    assert sidecar_bytes([(0, 1577, 3405691582), (1577, 900, 0)]) == OLD
    assert sidecar_bytes([]) == b'{"format":"solosave-crc32/1","records":[]}'


def test_old_sidecars_and_other_json_spacing_parse():
    assert parse_sidecar(OLD, 2) == OLD_RECORDS
    spaced = json.dumps(json.loads(OLD), indent=2).encode()
    assert parse_sidecar(spaced, 2) == OLD_RECORDS
    assert parse_sidecar(sidecar_bytes([]), 0) == {}


def _doc(**changes) -> bytes:
    doc = json.loads(OLD)
    doc.update(changes)
    return json.dumps(doc).encode()


def _record(**changes) -> bytes:
    return _doc(records=[{"offset": 0, "length": 10, "crc32": 1, **changes}])


DAMAGED = {
    "not UTF-8": (b"\xff{not json", "not a JSON document"),
    "not JSON": (OLD[:-3], "not a JSON document"),
    "a list": (b"[1, 2, 3]", "a JSON list, not an object"),
    "another format": (_doc(format="solosave-crc32/2"), "format 'solosave-crc32/2', not 'solosave-crc32/1'"),
    "no format": (b'{"records": []}', "format None"),
    "no records": (b'{"format": "solosave-crc32/1"}', "no list of records"),
    "records an object": (_doc(records={"a": 1}), r"no list of records \(\"records\" is a JSON dict\)"),
    "a record a list": (_doc(records=[[0, 10, 1]]), "record 0 is a JSON list, not an object"),
    "an offset missing": (_doc(records=[{"length": 10, "crc32": 1}]), "record 0: offset is None"),
    "an offset a string": (_record(offset="0"), "record 0: offset is '0', not a non-negative integer"),
    "a length a float": (_record(length=10.0), "record 0: length is 10.0"),
    "a length true": (_record(length=True), "record 0: length is True"),
    "a negative offset": (_record(offset=-1), "record 0: offset is -1"),
    "a crc of 33 bits": (_record(crc32=1 << 32), "crc32 4294967296 does not fit in 32 bits"),
    "a range twice": (_doc(records=[{"offset": 0, "length": 10, "crc32": 1}, {"offset": 0, "length": 10, "crc32": 2}]),
                      "record 1: the range 0\\+10 is listed twice with different CRC32s"),
    "nested too deep": (b'{"format": "solosave-crc32/1", "records": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                        "not a JSON document"),
    "a number of 5,000 digits": (_doc(records=[]).replace(b"[]", b"[" + b"9" * 5000 + b"]"), "not a JSON document"),
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_sidecar_is_refused_with_what_is_wrong(name):
    data, why = DAMAGED[name]
    with pytest.raises(ValueError, match=why) as e:
        parse_sidecar(data, 1000)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_the_same_range_twice_with_one_crc_is_one_record():
    twice = _doc(records=[{"offset": 0, "length": 10, "crc32": 1}] * 2)
    assert parse_sidecar(twice, 2) == {(0, 10): 1}


def test_a_sidecar_longer_than_its_records_can_need_is_refused_before_it_is_parsed():
    """The bound grows with the records ``.metadata`` gives the file; a sidecar past it (here
    valid JSON, padded) is refused without being parsed: no allocation beyond its bytes."""
    limit = sidecar_limit(2)
    assert sidecar_limit(3) > limit > len(OLD) * 2
    padded = OLD[:-1] + b" " * (limit - len(OLD)) + b"}"
    assert len(padded) == limit and parse_sidecar(padded, 2) == OLD_RECORDS
    too_long = OLD[:-1] + b" " * (limit + 1 - len(OLD)) + b"}"
    with pytest.raises(ValueError, match=f"longer than the {limit} bytes a checksum file of 2 record"):
        parse_sidecar(too_long, 2)
    big = b"[" + b"0," * (1 << 20) + b"0]"
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="longer than"):
            parse_sidecar(big, 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 16
