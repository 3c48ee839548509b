"""Benchmark fixture: log every ``torch.distributed`` collective of *every* process of a run.

``python -m benchmarks`` puts this directory on ``PYTHONPATH`` and sets
``SOLOSAVE_BENCH_COLLECTIVE_LOG=<dir>`` before it spawns the rank processes, so this module runs
at start-up in the ranks and in every process they spawn (solosave's worker processes, DCP's
process-executor daemon). Each outermost call of a wrapped public ``torch.distributed`` function
appends one line to ``<dir>/<pid>.log``::

    start  end  RANK  pid  where  kind  payload_bytes

``where`` is ``calling`` for the main thread of the trainer process (the process whose pid is in
``SOLOSAVE_BENCH_TRAINER_PID``) and ``background`` for every other thread or process. The
payload follows ``solosave.SaveResult``'s convention: pickled object bytes for object collectives
(the root of a scatter counts what it sends; every rank of a broadcast counts the object), tensor
bytes otherwise. Nested calls (``gather_object`` runs ``gather`` inside) are logged once.
"""

import os

_LOG = os.environ.get("SOLOSAVE_BENCH_COLLECTIVE_LOG")

KINDS = ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object",
         "all_reduce", "broadcast", "barrier", "all_gather", "gather", "scatter", "reduce",
         "reduce_scatter", "all_to_all", "send", "recv", "monitored_barrier")


def _install(log_dir: str) -> None:
    import functools
    import inspect
    import pickle
    import threading
    import time

    import torch.distributed as dist

    local = threading.local()
    path = os.path.join(log_dir, f"{os.getpid()}.log")

    def pickled(obj):
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def tensor_bytes(t):
        return int(t.numel() * t.element_size()) if t is not None else 0

    def payload(name, a):
        if name in ("gather_object", "all_gather_object"):
            return pickled(a["obj"])
        if name == "scatter_object_list":
            sent = a.get("scatter_object_input_list")
            return sum(map(pickled, sent)) if sent is not None else pickled(a["scatter_object_output_list"][0])
        if name == "broadcast_object_list":
            return sum(map(pickled, a["object_list"]))
        if "tensor" in a:
            return tensor_bytes(a["tensor"])
        return 0

    def wrap(name, fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if getattr(local, "inside", False):
                return fn(*args, **kwargs)
            local.inside = True
            t0 = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                local.inside = False
                t1 = time.time()
                try:
                    nbytes = payload(name, sig.bind(*args, **kwargs).arguments)
                except Exception:  # noqa: BLE001 - counting never breaks the call
                    nbytes = -1
                trainer = os.environ.get("SOLOSAVE_BENCH_TRAINER_PID") == str(os.getpid())
                main = threading.current_thread() is threading.main_thread()
                where = "calling" if trainer and main else "background"
                with open(path, "a") as f:
                    f.write(f"{t0:.6f}\t{t1:.6f}\t{os.environ.get('RANK', '?')}\t{os.getpid()}\t"
                            f"{where}\t{name}\t{nbytes}\n")

        return inner

    for n in KINDS:
        if hasattr(dist, n):
            setattr(dist, n, wrap(n, getattr(dist, n)))


if _LOG:
    _install(_LOG)
