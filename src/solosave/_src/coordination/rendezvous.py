"""Setting up the background channel: the store address and the background gloo group."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import uuid
from typing import Any

import torch.distributed as dist

from solosave._src.coordination.channel import CollectiveCall, CollectiveCounter, DistChannel
from solosave._src.core.compat import check_torch


def share_store_address(group: Any, counter: CollectiveCounter, timeout_s: float) -> tuple[Any, tuple[str, int, str]]:
    """Group rank 0 serves a fresh ``TCPStore``, listening only on the address of the training
    store (``MASTER_ADDR``; ``SOLOSAVE_STORE_HOST`` overrides it); its address reaches every rank
    through one ``broadcast_object_list`` on ``group`` (counted). Returns ``(server_or_None,
    (host, port, prefix))``; the server (the store and its socket) must live as long as the
    workers use it (rank 0 keeps it)."""
    check_torch()  # on every rank, before the collective: an older torch fails here on all of them
    ch = DistChannel(group, counter)
    store = None
    addr = None
    if ch.is_coordinator:
        host = os.environ.get("SOLOSAVE_STORE_HOST") or os.environ.get("MASTER_ADDR") or socket.gethostname()
        listener = _listen(host)
        port = listener.getsockname()[1]
        server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                               master_listen_fd=listener.fileno(), timeout=datetime.timedelta(seconds=timeout_s))
        store = (server, listener)  # the server serves on the listener's socket: keep both
        addr = (host, port, f"solosave/{uuid.uuid4().hex}/")
    addr = ch.broadcast_object(addr)
    return store, addr


#: The key of rank 0's store that counts the other ranks whose checkpointer has closed.
_CLOSED_KEY = "closed"


def report_closed(addr: tuple[str, int, str], connect_timeout_s: float = 2.0) -> None:
    """A rank other than group rank 0, last in its checkpointer's ``close()`` (its worker has
    stopped: nothing of this rank reads the store any more): count itself closed on rank 0's
    store. Best effort and bounded: rank 0 may have gone already."""
    host, port, prefix = addr
    try:
        client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=connect_timeout_s))
        client.add(prefix + _CLOSED_KEY, 1)
    except Exception:  # noqa: BLE001, S110 - rank 0 is gone: it needs no report
        pass


def linger_until_closed(store: Any, addr: tuple[str, int, str], others: int, timeout_s: float) -> bool:
    """Group rank 0, in ``close()`` before it drops the store it serves (``store``, from
    :func:`share_store_address`): wait, at most ``timeout_s``, until the ``others`` ranks have
    reported closed (:func:`report_closed`). A rank a moment behind is still waiting for the
    receipt of its last save or durable copy, which it reads from this store: dropped at once,
    that rank would report a published save or copy as failed. Returns whether every rank
    reported."""
    server, _listener = store
    key = addr[2] + _CLOSED_KEY
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if server.add(key, 0) >= others:
                return True
        except Exception:  # noqa: BLE001 - the store is unusable: nobody can read from it either
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _listen(host: str) -> socket.socket:
    """A listening TCP socket bound to ``host``'s address (not every interface)."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(sockaddr[:2] if family == socket.AF_INET else sockaddr)
    s.listen(1024)
    return s


def new_gloo_group(group: Any, counter: CollectiveCounter, timeout_s: float) -> Any:
    """A gloo group over the same ranks as ``group`` (thread mode). Collective over the *world*
    group (``torch.distributed.new_group``'s rule): every rank of the job must call it."""
    t0 = time.perf_counter()
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    g = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    counter.record(CollectiveCall("new_group", 0, threading.current_thread().name, time.perf_counter() - t0))
    return g


