"""Counting the ``torch.distributed`` calls a training thread makes (tests and benchmarks only).

``DistCalls()`` replaces the functions named in :data:`WATCHED` on the ``torch.distributed``
module of this process by counting wrappers (Lightning, DCP and solosave all call them through
that module); ``with calls.counting() as seen:`` then counts, in ``seen``, the calls the main
thread makes inside the block. Background threads (solosave's pump, DCP's executors) are not
counted, nor are other processes (solosave's workers count their own collectives).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

#: The collectives (and the barrier) a training thread might call.
WATCHED = ("barrier", "broadcast_object_list", "all_reduce", "all_gather_object", "gather_object",
           "scatter_object_list", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")


class DistCalls:
    """Installs counting wrappers once; :meth:`counting` counts the main thread's calls."""

    def __init__(self, names: tuple[str, ...] = WATCHED) -> None:
        import torch.distributed as dist

        self._seen: Counter | None = None
        main = threading.main_thread()
        for name in names:
            real = getattr(dist, name)

            def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
                seen = self._seen
                if seen is not None and threading.current_thread() is main:
                    seen[_name] += 1
                return _real(*args, **kwargs)

            setattr(dist, name, counted)

    @contextlib.contextmanager
    def counting(self) -> Iterator[Counter]:
        """Count the main thread's calls inside the block (one block at a time)."""
        seen: Counter = Counter()
        self._seen = seen
        try:
            yield seen
        finally:
            self._seen = None
