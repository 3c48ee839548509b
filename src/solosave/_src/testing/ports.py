"""TCP ports on 127.0.0.1 for the local ranks and servers of tests and benchmarks.

``free_port()`` asks the kernel for any free port (its ephemeral range): enough for one process
that starts one job at a time (the benchmarks). Test sessions run side by side (pytest-xdist
workers, other checkouts' suites) use a :class:`PortRange` each instead: a port is chosen some
time before the rank that serves it binds it, and in that window a port from the ephemeral
range can be taken by any outgoing connection (gloo opens many) or by another session's choice.
A range below the ephemeral one, split into one slice per session, leaves only ports that
nothing else hands out.
"""

from __future__ import annotations

import random
import socket

_EPHEMERAL_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default, where the file cannot be read
_LOWEST = 10000  # below this lie well-known and registered services' ports


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_range(path: str = _EPHEMERAL_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range ``(first, last)``, both included."""
    try:
        with open(path) as f:
            first, last = (int(x) for x in f.read().split())
        return first, last
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def is_free(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 now (with ``SO_REUSEADDR``, as servers bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortRange:
    """Ports handed out in turn from a slice of ``[_LOWEST, first ephemeral port)``.

    ``PortRange(index, count)`` owns slice ``index`` of ``count`` equal slices (one per pytest
    worker: ``index`` from 0). Each call of :meth:`take` returns the next port of the slice that
    is free now, starting at a random place (two sessions with the same slice, e.g. two checkouts'
    suites, rarely meet) and wrapping around; a port is handed out again only after the whole
    slice has been. Raises ``ValueError`` for a slice index out of range or a slice under 16
    ports, ``OSError`` when no port of the slice is free.
    """

    def __init__(self, index: int = 0, count: int = 1, ephemeral: tuple[int, int] | None = None,
                 rng: random.Random | None = None) -> None:
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"port slice {index} of {count}: the index must lie in [0, count)")
        top = (ephemeral or ephemeral_range())[0]
        size = (top - _LOWEST) // count
        if size < 16:
            raise ValueError(f"{count} port slices below the ephemeral range (from {top}) leave "
                             f"{max(size, 0)} ports each; run fewer test processes")
        self.low = _LOWEST + index * size
        self.high = self.low + size  # exclusive
        self._next = self.low + (rng or random.Random()).randrange(size)  # noqa: S311 - spreading, not secrecy

    def take(self) -> int:
        """The next port of the slice that is free on 127.0.0.1 now."""
        for _ in range(self.high - self.low):
            port = self._next
            self._next = self.low if port + 1 >= self.high else port + 1
            if is_free(port):
                return port
        raise OSError(f"no free TCP port on 127.0.0.1 in [{self.low}, {self.high})")
