"""Tests of ``solosave._src.testing.ports``: the slices of test ports that pytest processes
running side by side take their rendezvous ports from."""

import random
import socket

import pytest

from solosave._src.testing.ports import PortRange, ephemeral_range, free_port, is_free


def test_slices_are_disjoint_and_below_the_ephemeral_range():
    eph = (32768, 60999)
    slices = [PortRange(i, 4, ephemeral=eph) for i in range(4)]
    assert slices[0].low == 10000 and slices[-1].high <= eph[0]
    for a, b in zip(slices, slices[1:]):
        assert a.high == b.low  # adjacent, no overlap
    for i, r in enumerate(slices):
        got = {r.take() for _ in range(20)}
        assert len(got) == 20 and all(r.low <= p < r.high for p in got), i


def test_take_skips_a_port_in_use_and_wraps_around(monkeypatch):
    from solosave._src.testing import ports

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        held.listen()
        assert not is_free(port)  # a port held by a listening socket is seen as in use
        # the neighbours of that ephemeral port may be taken by other processes meanwhile (tests
        # run side by side): only the held one counts as in use for the order checked here
        monkeypatch.setattr(ports, "is_free", lambda p: p != port)
        r = PortRange(0, 1, ephemeral=(port + 40, port + 100))
        r.low, r.high, r._next = port - 2, port + 2, port  # the slice's next port is the one held
        taken = [r.take() for _ in range(3)]
    assert port not in taken and taken == [port + 1, port - 2, port - 1]


def test_bad_slices_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"must lie in \[0, count\)"):
        PortRange(4, 4)
    with pytest.raises(ValueError, match="run fewer test processes"):
        PortRange(0, 2000, ephemeral=(32768, 60999))


def test_the_ephemeral_range_is_read_or_defaults(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(str(f)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    assert free_port() > 0


def test_the_start_is_random_within_the_slice():
    starts = {PortRange(1, 3, ephemeral=(32768, 60999), rng=random.Random(seed))._next for seed in range(5)}
    r = PortRange(1, 3, ephemeral=(32768, 60999))
    assert len(starts) > 1 and all(r.low <= s < r.high for s in starts)
