"""A dependency-free progress bar for the command line (rank 0 / one process only).

On a terminal it redraws one line with ``\\r``; otherwise (a log file, CI) it prints a line at
most every ``min_interval`` seconds and at the end, so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``bar = ProgressBar(total, "saving"); bar.update(n, note="..."); bar.close()``."""

    def __init__(self, total: float, label: str, *, unit: str = "", stream: TextIO | None = None,
                 enabled: bool = True, width: int = 28, min_interval: float | None = None) -> None:
        self.total = max(float(total), 1e-12)
        self.label = label
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.min_interval = min_interval if min_interval is not None else (0.1 if self.tty else 10.0)
        self.done = 0.0
        self.note = ""
        self._t0 = time.monotonic()
        self._last = -1e9
        self._closed = False

    def update(self, n: float = 1, note: str | None = None) -> None:
        self.done = min(self.done + n, self.total)
        if note is not None:
            self.note = note
        now = time.monotonic()
        if now - self._last >= self.min_interval or self.done >= self.total:
            self._draw(now)

    def _line(self, now: float) -> str:
        frac = self.done / self.total
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        done = f"{self.done:.0f}" if self.unit == "" else f"{self.done:.1f}{self.unit}"
        total = f"{self.total:.0f}" if self.unit == "" else f"{self.total:.1f}{self.unit}"
        return (f"{self.label} [{bar}] {frac * 100:5.1f}% {done}/{total} "
                f"{now - self._t0:6.1f}s {self.note}").rstrip()

    def _draw(self, now: float) -> None:
        self._last = now
        if not self.enabled:
            return
        line = self._line(now)
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def write(self, text: str, stream: TextIO | None = None) -> None:
        """Print ``text`` on its own line (to ``stream``, default stdout) without breaking the bar;
        printed even when the bar is disabled."""
        out = stream if stream is not None else sys.stdout
        if self.enabled and self.tty:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
        out.write(text + "\n")
        out.flush()
        if self.enabled and self.tty and not self._closed:
            self.stream.write(self._line(time.monotonic()))
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
