"""Test fixture: count torch.distributed collectives in *every* process of a test run.

Put this directory on PYTHONPATH and set SOLOSAVE_TEST_COLLECTIVE_LOG=<dir>: each process that
calls a wrapped ``torch.distributed`` function appends ``<process name>\t<thread>\t<kind>`` to
``<dir>/<pid>.log``. Workers spawned by trainers inherit the environment, so they are counted
too. Only public entry points on the ``torch.distributed`` module are wrapped (the wire
operations inside them are not counted separately).
"""

import os

_LOG = os.environ.get("SOLOSAVE_TEST_COLLECTIVE_LOG")

if _LOG:
    import functools
    import multiprocessing
    import threading

    import torch.distributed as _dist

    _KINDS = ["gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object",
              "all_reduce", "broadcast", "barrier", "all_gather", "gather", "scatter", "reduce",
              "reduce_scatter", "all_to_all", "send", "recv"]

    def _wrap(name, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            with open(os.path.join(_LOG, f"{os.getpid()}.log"), "a") as f:
                f.write(f"{multiprocessing.current_process().name}\t{threading.current_thread().name}\t{name}\n")
            return fn(*a, **k)
        return inner

    for _n in _KINDS:
        if hasattr(_dist, _n):
            setattr(_dist, _n, _wrap(_n, getattr(_dist, _n)))
