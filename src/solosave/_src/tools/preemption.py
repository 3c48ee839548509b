"""Stopping on a preemption notice: every rank saves once more at one step boundary, then stops.

A notice (a signal such as SIGTERM, a scheduler's notice file, a callable the user's watchdog
sets, or :meth:`StopAgreement.request`) reaches one rank or several, at different moments; the
ranks must all save at the *same* step and stop there, without a collective in the training
loop. How (:class:`StopAgreement`, every rank):

* A watcher thread per rank, on a channel of its own (a gloo group made at construction), runs
  a *round* every ``interval`` seconds: one ``all_reduce(MAX)`` of three int64 (24 bytes):
  ``[notice here, closing, 0]``. The training loop never waits for it.
* When a round's result carries a notice (every rank sees the same result of the same round),
  every watcher, under the lock the loop also takes, marks the decision *pending* and reads the
  last boundary its loop passed, ``b`` -> a second round of ``[1, closing, b + 1]`` -> ``S``,
  the maximum: the **stop step**. The watchers end there (every rank alike).
* The loop calls :meth:`StopAgreement.stop_here` at every step boundary: it records the step
  and answers ``step >= S``. While the decision is pending, a loop that reaches a boundary
  waits for ``S`` (bounded by ``timeout``; normally one round's latency, and only after a
  notice). No rank can pass ``S`` unaware: its contribution was its next boundary, ``S`` is at
  least that, and at that boundary it waits for ``S``.

Closing (:meth:`StopAgreement.close`, any rank) sends ``closing`` in its next round (at once);
every watcher ends after that round, every rank alike. A watcher whose round fails (a peer
gone) ends with the error; the loop is told only when it needs the answer (a pending decision).
Alone (no process group), there are no rounds: a notice stops the loop at its next boundary.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from solosave._src.coordination.channel import Channel, CollectiveCounter, DistChannel
from solosave._src.coordination.rendezvous import new_gloo_group
from solosave._src.core.errors import ChannelError, SolosaveError

log = logging.getLogger("solosave")

#: Fields of a round's 24 bytes.
_NOTICE, _CLOSING, _STEP = 0, 1, 2


class StopAgreement:
    """The ranks' agreement on the step to stop at (see the module docstring).

    Every rank constructs one with its own ``channel`` (``None``: alone) and calls
    :meth:`stop_here` at every step boundary with the same step numbers, then :meth:`close`.
    ``notice_file``: a path whose existence is a notice; ``requested``: a callable that returns
    ``True`` for a notice (called on the watcher thread, every ``interval`` seconds; alone, at
    every boundary)."""

    def __init__(self, channel: Channel | None, *, interval: float = 1.0, timeout: float = 60.0,
                 notice_file: str | os.PathLike | None = None, requested: Callable[[], bool] | None = None,
                 name: str = "solosave-preemption") -> None:
        if not interval > 0 or not timeout > 0:
            raise ValueError(f"interval and timeout must be positive seconds, got {interval} and {timeout}")
        self.channel = channel
        self.interval = interval
        self.timeout = timeout
        self.notice_file = None if notice_file is None else os.fspath(notice_file)
        self.requested = requested
        self._notice = False
        self._reason: str | None = None
        self._cond = threading.Condition()
        self._reached: int | None = None
        self._pending = False
        self._stop_step: int | None = None
        self._error: str | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        if channel is not None and channel.world_size > 1:
            self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
            self._thread.start()

    # -- any thread -------------------------------------------------------------------------------
    def request(self, reason: str = "requested") -> None:
        """A notice on this rank (safe in a signal handler: it only sets two attributes)."""
        self._reason = self._reason or reason
        self._notice = True

    @property
    def reason(self) -> str | None:
        """What this rank's notice was (the first one), if it had one."""
        return self._reason

    @property
    def stop_step(self) -> int | None:
        """The agreed step to stop at, once known."""
        return self._stop_step

    def _noticed(self) -> bool:
        if self._notice:
            return True
        if self.notice_file is not None and os.path.exists(self.notice_file):
            self.request(f"notice file {self.notice_file}")
        elif self.requested is not None and self.requested():
            self.request("requested by the callable")
        return self._notice

    def _noticed_safely(self) -> bool:
        """:meth:`_noticed`, where a raising ``requested()`` counts as no notice."""
        try:
            return self._noticed()
        except Exception:  # noqa: BLE001 - the watcher reported it already
            return self._notice

    # -- the training loop ------------------------------------------------------------------------
    def stop_here(self, step: int) -> bool:
        """The loop, at the boundary after step ``step``: whether every rank stops here (the
        agreed step, or past it). Never a collective; waits (bounded by ``timeout``) only while a
        decision is pending. Raises ``ChannelError`` when the decision cannot be had (a round
        failed, or it did not come in time) and it matters: after a notice here, or while pending."""
        if self._thread is None:
            if self._stop_step is None and self._noticed():
                self._stop_step = step
            return self._stop_step is not None and step >= self._stop_step
        with self._cond:
            self._reached = step
            if self._stop_step is None and self._error is not None and self._noticed_safely():
                raise ChannelError(f"a preemption notice here ({self._reason}) could not be agreed with the other "
                                   f"ranks: {self._error}")
            if self._stop_step is None and self._pending:
                deadline = time.monotonic() + self.timeout
                while self._stop_step is None and self._error is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ChannelError(f"the ranks did not agree on a step to stop at within {self.timeout:g} s "
                                           "of a preemption notice (a rank gone or stalled)")
                    self._cond.wait(left)
                if self._stop_step is None:
                    raise ChannelError(f"the preemption agreement failed: {self._error}")
            return self._stop_step is not None and step >= self._stop_step

    def close(self, timeout: float | None = None) -> None:
        """End the watcher (every watcher ends after the round that carries it). Bounded by
        ``timeout`` (default ``interval + timeout``); a watcher left running is a daemon."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(self.interval + self.timeout if timeout is None else timeout)
            if self._thread.is_alive():
                log.warning("solosave: the preemption watcher did not end in time (a rank gone?); left running")

    # -- the watcher ------------------------------------------------------------------------------
    def _watch(self) -> None:
        ch = self.channel
        assert ch is not None  # noqa: S101 - started only with a channel
        try:
            while True:
                closing = self._closing.wait(self.interval)
                got = ch.all_reduce_max([int(self._noticed()), int(closing), 0])
                if got[_NOTICE]:
                    with self._cond:
                        self._pending = True
                        mine = 0 if self._reached is None else self._reached + 1
                    got = ch.all_reduce_max([1, int(self._closing.is_set()), mine])
                    with self._cond:
                        self._stop_step, self._pending = got[_STEP], False
                        self._cond.notify_all()
                    log.info("solosave: preemption notice (%s): every rank stops after step %d",
                             self._reason or "on another rank", got[_STEP])
                    return
                if got[_CLOSING]:
                    return
        except Exception as e:  # noqa: BLE001 - a round failed, or the user's requested() raised
            with self._cond:
                self._error = f"{type(e).__name__}: {e}"
                self._cond.notify_all()
            if not self._closing.is_set():
                log.warning("solosave: the preemption watcher stopped: %s", self._error)


@dataclass(frozen=True)
class StopOutcome:
    """What :meth:`PreemptionGuard.stop_here` did at the agreed step (every rank alike)."""

    step: int
    #: This rank's notice (``None``: the notice came from another rank).
    reason: str | None
    #: The save of ``step`` is published on the fast tier (``None``: no manager, nothing saved).
    published: bool | None
    #: Its durable copy is published (``None``: no durable tier, or nothing saved).
    durable: bool | None
    #: What went wrong, if anything.
    error: str | None = None


class PreemptionGuard:
    """Save once more and stop, every rank at one step boundary, on a preemption notice.

    Every rank constructs it at the same point (collective: a gloo group for its rounds) and
    calls :meth:`stop_here` after every step, with the same step numbers::

        guard = PreemptionGuard(manager)                  # SIGTERM is a notice
        for step in range(start, steps):
            train_step()
            manager.poll()
            if step % interval == 0:
                manager.save(step, state_dict())
            if guard.stop_here(step, state_dict):         # every rank at the same step
                break                                     # saved, published, durable copy waited
        guard.close()
        manager.finish()

    A notice is one of ``signals`` (installed on construction, from the main thread; the
    previous handlers come back at :meth:`close`), the existence of ``notice_file`` (a
    scheduler's notice), ``requested()`` returning ``True`` (a watchdog; called every
    ``interval`` seconds on a background thread), or :meth:`request`. Within about ``interval``
    seconds every rank knows and agrees on the step to stop at: the first boundary that no rank
    has passed (:class:`StopAgreement`; a 24-byte ``all_reduce`` every ``interval`` seconds on
    its own thread, never in the loop). At that step :meth:`stop_here` saves through
    ``manager`` (unless the loop saved that step already), waits for the fast publication and
    then, with two tiers, the durable copy, each bounded by ``save_timeout``; then it raises
    ``SystemExit(exit_code)`` after :meth:`close` and ``manager.finish()``, or (``exit_code``
    ``None``) returns ``True`` and leaves the rest to the caller (:attr:`outcome` says what
    happened). Without ``manager`` it only says where to stop.

    A second signal changes nothing (the save is already decided); a SIGKILL at any moment
    leaves the previous checkpoint the newest published one: a save publishes ``.metadata``
    last and ``latest`` moves only after it.
    """

    def __init__(self, manager: Any = None, *, signals: Iterable[int] = (signal.SIGTERM,),
                 notice_file: str | os.PathLike | None = None, requested: Callable[[], bool] | None = None,
                 exit_code: int | None = None, save_timeout: float = 300.0, interval: float = 1.0,
                 timeout: float = 60.0, process_group: Any = None) -> None:
        self.manager = manager
        self.exit_code = exit_code
        self.save_timeout = save_timeout
        #: What :meth:`stop_here` did at the agreed step (``None`` until then).
        self.outcome: StopOutcome | None = None
        #: Signals received (a second one is counted and otherwise ignored).
        self.signals_received = 0
        sigs = list(signals)
        if sigs and threading.current_thread() is not threading.main_thread():
            raise ValueError("PreemptionGuard installs signal handlers, which only the main thread can: construct "
                             "it on the main thread, or pass signals=() and a notice_file or requested=")
        channel = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
            channel = DistChannel(new_gloo_group(process_group, CollectiveCounter(), timeout), timeout=timeout)
        self.agreement = StopAgreement(channel, interval=interval, timeout=timeout, notice_file=notice_file,
                                       requested=requested)
        self._previous: Mapping[int, Any] = {sig: signal.signal(sig, self._on_signal) for sig in sigs}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals_received += 1
        self.agreement.request(f"signal {signal.Signals(signum).name}")

    def request(self, reason: str = "requested") -> None:
        """A notice on this rank (any thread)."""
        self.agreement.request(reason)

    @property
    def stop_step(self) -> int | None:
        """The agreed step to stop at, once known."""
        return self.agreement.stop_step

    def stop_here(self, step: int, state_dict: Any = None) -> bool:
        """Whether to stop after step ``step``; at the agreed step, save first.

        Every rank, after each step: ``False`` (go on) until the agreed step; there, save
        ``state_dict`` (a dict, or a callable that returns one, called only then) and stop
        (see the class docstring). Raises ``ChannelError`` when the ranks cannot agree."""
        if not self.agreement.stop_here(step):
            return False
        if self.outcome is None:
            self.outcome = self._save(step, state_dict)
        if self.exit_code is not None:
            self.close()
            if self.manager is not None:
                self.manager.finish(self.save_timeout)
            raise SystemExit(self.exit_code)
        return True

    def _save(self, step: int, state_dict: Any) -> StopOutcome:
        reason = self.agreement.reason
        m = self.manager
        if m is None:
            return StopOutcome(step, reason, None, None)
        deadline = time.monotonic() + self.save_timeout  # one bound for the save and its copy
        durable: bool | None = None
        try:
            if getattr(m, "last_saved_step", None) != step:
                m.save(step, state_dict() if callable(state_dict) else state_dict)
            m.wait(self.save_timeout)
            mine = next((d for d in reversed(m.done) if d.step == step), None)  # every save that ended
            published = mine is not None and mine.error is None and mine.result is not None
            error = None if published else str(mine.error if mine is not None else "the save did not end in time")
        except (SolosaveError, OSError, ValueError) as e:
            published, error = False, str(e)
        if published and getattr(m, "durable_root", None):
            try:
                m.wait_for_copies(max(deadline - time.monotonic(), 0.0))
                ended = next((c for c in reversed(m.durable_done) if c.step == step), None)
                durable = ended is not None and ended.result.ok
                if not durable:
                    error = "its durable copy failed: " + str(ended.result.error if ended else "not reported")
            except (SolosaveError, OSError) as e:  # published on the fast tier; the copy did not end in time
                durable, error = False, f"its durable copy did not end within {self.save_timeout:g} s: {e}"
        if not published:
            log.error("solosave: the preemption save of step %d failed: %s", step, error)
        elif error:
            log.error("solosave: preemption (%s): step %d published on the fast tier, but %s; stopping",
                      reason or "notice on another rank", step, error)
        else:
            log.warning("solosave: preemption (%s): step %d saved%s; stopping", reason or "notice on another rank",
                        step, "" if durable is None else (" and durable" if durable else ", durable copy NOT done"))
        return StopOutcome(step, reason, published, durable, error)

    def close(self) -> None:
        """End the watcher and put the previous signal handlers back (every rank; idempotent)."""
        self.agreement.close()
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = ["PreemptionGuard", "StopAgreement", "StopOutcome"]
