"""Rank 0's store outlives the other ranks' use of it: the closing handshake of
``coordination/rendezvous.py``, on a real ``TCPStore`` in one process."""

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

from solosave._src.coordination.rendezvous import linger_until_closed, report_closed


def _served_store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return (server, None), ("127.0.0.1", server.port, "solosave/test/")


def test_rank_0_lingers_until_every_other_rank_reported_closed():
    store, addr = _served_store()
    late = threading.Timer(0.5, report_closed, args=(addr,))
    report_closed(addr)  # one rank closes at once, the other half a second later
    t0 = time.monotonic()
    late.start()
    assert linger_until_closed(store, addr, others=2, timeout_s=20.0)
    assert 0.4 < time.monotonic() - t0 < 15.0  # it waited for the late rank, not for its timeout
    late.join()


def test_rank_0_stops_lingering_at_its_bound_when_a_rank_never_reports():
    store, addr = _served_store()
    report_closed(addr)
    t0 = time.monotonic()
    assert not linger_until_closed(store, addr, others=2, timeout_s=0.3)
    assert time.monotonic() - t0 < 10.0


def test_reporting_to_a_rank_0_that_is_gone_is_bounded_and_silent():
    with socket.socket() as s:  # a port that nothing listens on any more
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Exception):  # noqa: B017, PT011 - torch's connection error: nothing serves it
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=0.5))
    t0 = time.monotonic()
    report_closed(("127.0.0.1", port, "solosave/test/"), connect_timeout_s=0.5)  # raises nothing
    assert time.monotonic() - t0 < 10.0
