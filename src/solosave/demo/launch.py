"""The demo's entry point: ``solosave train``, ``python -m solosave.demo`` and
``torchrun ... -m solosave.demo ...``.

Two ways to run it::

    solosave train --nproc 2 --steps 40 --save runs/train --save-interval 5 --async-save \\
        --use-persistent-ckpt-worker --ckpt-metadata runs/train/prepared.metadata --ckpt-metadata-create
    torchrun --nnodes 2 --nproc-per-node 8 ... -m solosave.demo -- --save /ckpt ...   # any launcher

Under a launcher (``LOCAL_RANK`` and ``WORLD_SIZE`` set) :func:`main` runs one rank
(:func:`solosave.demo.job.run_rank`). Otherwise it checks the flags and :func:`launch` runs
``--nproc`` ranks on this host, each a fork of this process, as ``torchrun --standalone
--nproc-per-node N`` would run them (the same environment, rendezvous and stopping rules).

Why forks: this process imports torch, DCP and the job once, then forks; each rank begins with
them imported instead of spending about 3 s of CPU importing them again as a fresh interpreter,
which is what torchrun starts (the same 2-rank, 2-step job here: 11.0-11.4 s of CPU and
7.1-7.5 s of wall time under torchrun, 5.3-5.4 s and 4.7-5.2 s forked; docs/benchmarks.md,
section 9).
Forking is safe here: nothing in this process has initialised CUDA (checked before the fork;
each rank initialises its own device), and its other threads (the rendezvous store's server,
one that importing torch starts) hold nothing a rank uses: a rank reaches the store through its
own socket. Each rank runs in a session of its own, as under torchrun: a terminal's Ctrl-C
reaches the launcher alone, which passes it on once. ``torchrun ... -m solosave.demo`` still
starts fresh interpreters, for jobs across hosts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

from .args import build_parser, check_args

#: A stopped rank gets SIGTERM, then SIGKILL after this many seconds (torchrun's grace period).
STOP_GRACE_S = 30.0
#: The signals that stop the job: each is passed on to every rank (as torchrun does).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if under_launcher():  # one rank, started by torchrun / torch.distributed.run or launch()
        if argv[:1] == ["--"]:  # a separator before the job's flags, should a launcher pass it on
            argv = argv[1:]
        args = build_parser().parse_args(argv)
        check_args(args)
        from .job import run_rank

        return run_rank(args)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    t0 = time.perf_counter()
    outcome = launch(args.nproc, argv)
    failed = sorted({code for code in outcome.exit_codes if code != 0})
    if outcome.stop_signal is not None and not args.exit_signal_handler:
        # the ranks were stopped, as the signal asked (SIGINT's KeyboardInterrupt exits one with 1)
        return 128 + outcome.stop_signal
    if outcome.stop_signal is not None and not failed:
        print(f"stopped by signal {signal.Signals(outcome.stop_signal).name}: the ranks saved and exited",
              file=sys.stderr)
        return 0
    if failed:  # a rank failed (with --exit-signal-handler: perhaps while it saved)
        print(f"solosave train failed: a rank exited with code {failed} (its error is above; -N: "
              "killed by signal N)", file=sys.stderr)
        return 2 if 2 in failed else 1  # 2: a user error (the other ranks may have been stopped)
    print(f"training finished in {time.perf_counter() - t0:.1f} s" +
          (f"; checkpoints in {args.save}" if args.save else ""))
    return 0


@dataclass
class Outcome:
    """How the ranks ended: ``exit_codes[r]`` is rank r's exit status (``-N``: killed by signal
    N); ``stop_signal`` is the signal that stopped the job, if one did."""

    exit_codes: list[int]
    stop_signal: int | None = None


def launch(nproc: int, argv: list[str], stop_grace: float = STOP_GRACE_S) -> Outcome:
    """Run ``nproc`` ranks of the job with ``argv`` on this host; returns when every rank exited.

    1. This process imports the job, then hosts the rendezvous store (a ``TCPStore`` on a free
       port of 127.0.0.1; the ranks connect to it as to torchrun's agent store).
    2. It forks the ranks, each in a session of its own, with torchrun's environment (``RANK``,
       ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, the
       ``TORCHELASTIC_*``, ``ROLE_*`` and ``GROUP_*`` variables, and ``OMP_NUM_THREADS=1`` unless
       set), and waits for them. A rank ends if this process dies (``PR_SET_PDEATHSIG``).
    3. When a rank fails (exits non-zero or is killed), it stops the others; a stop signal
       (SIGTERM, SIGINT, SIGHUP, SIGQUIT) is passed on to every rank. Stopped ranks get SIGTERM,
       then SIGKILL after ``stop_grace`` seconds (they may be saving: ``--exit-signal-handler``).
    """
    import uuid
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore

    from . import job  # noqa: F401 - imported once, here: every rank is a fork of this process

    if torch.cuda.is_initialized():  # a fork cannot use it: each rank initialises its own
        raise RuntimeError("solosave train: CUDA was initialised before the ranks were forked")
    store = TCPStore(host_name="127.0.0.1", port=0, world_size=None, is_master=True,
                     timeout=timedelta(seconds=300), wait_for_workers=False)
    base_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": str(uuid.uuid4()),
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    one_thread = "OMP_NUM_THREADS" not in os.environ and nproc > 1  # as torchrun: ranks share the cores
    if one_thread:
        base_env["OMP_NUM_THREADS"] = "1"
    received: list[int] = []
    pids: dict[int, int] = {}  # pid -> rank, while it runs

    def on_stop_signal(signum: int, frame: object) -> None:
        received.append(signum)
        for pid in pids:
            _signal(pid, signum)

    previous = {sig: signal.signal(sig, on_stop_signal) for sig in STOP_SIGNALS}
    previous_chld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # waitpid needs its children kept
    launcher = os.getpid()
    sys.stdout.flush()  # a fork copies what is buffered: it would be printed once per rank
    sys.stderr.flush()
    # Blocked while forking: a stop signal then is delivered once every rank is in `pids`, and a
    # new rank never runs the launcher's handler (it unblocks them after resetting its own).
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        try:
            for rank in range(nproc):
                pid = os.fork()
                if pid == 0:  # the rank: it never returns from here (os._exit)
                    _run_forked_rank(argv, {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                            "ROLE_RANK": str(rank)}, one_thread, launcher)
                pids[pid] = rank
        except BaseException:  # a fork failed: the ranks already started go too
            for pid in pids:
                _signal(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        codes = _wait(pids, received, stop_grace)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGCHLD, previous_chld)
        del store
    return Outcome([codes[r] for r in range(nproc)], received[0] if received else None)


def _wait(pids: dict[int, int], received: list[int], stop_grace: float) -> dict[int, int]:
    """Reap the ranks; after the first failure or stop signal, stop the rest (see :func:`launch`).
    Returns rank -> exit status."""
    codes: dict[int, int] = {}
    kill_at: float | None = None
    while pids:
        for pid in list(pids):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pids.pop(pid)] = os.waitstatus_to_exitcode(status)
        failed = any(code != 0 for code in codes.values())
        if kill_at is None and (failed or received):
            kill_at = time.monotonic() + stop_grace
            if failed:
                for pid in pids:
                    _signal(pid, signal.SIGTERM)
        if kill_at is not None and time.monotonic() > kill_at:
            for pid in pids:
                _signal(pid, signal.SIGKILL)
        if pids:
            time.sleep(0.05)
    return codes


def _run_forked_rank(argv: list[str], env: dict[str, str], one_thread: bool, launcher: int) -> None:
    """The body of a forked rank: the job with ``env`` set; exits with its status (1 with the
    traceback printed, as a fresh interpreter would, if it raised)."""
    code = 1
    try:  # everything in it: a rank must reach os._exit below, never the launcher's code
        from solosave._src.worker.host import signal_on_parent_death

        # The fork copied the launcher's handlers; a rank starts with an interpreter's own.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        os.setsid()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        # SIGTERM when the launcher dies, so that one killed outright leaves no rank behind (a
        # rank under --exit-signal-handler saves first); it may have died before this line
        signal_on_parent_death(signal.SIGTERM)
        if os.getppid() != launcher:
            return
        os.environ.update(env)
        if one_thread:  # torch read OMP_NUM_THREADS when the launcher imported it
            import torch

            torch.set_num_threads(1)
        code = main(argv)
    except SystemExit as e:  # as the interpreter maps it: None is 0, a message is printed and is 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed, as a fresh interpreter prints it
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001,S110 - a closed pipe: exit all the same
                pass
        os._exit(code)


def _signal(pid: int, signum: int) -> None:
    """Signal a rank's session (the rank and what it started), or the rank alone if it has not
    made its session yet."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # exited; reaped on the next round
            pass
