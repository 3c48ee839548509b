"""A dependency-free progress bar on stderr (one line, redrawn; plain lines when not a tty)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``step(label)`` starts the next of ``total`` steps; ``note(text)`` prints above the bar."""

    def __init__(self, total: int, width: int = 30, stream=None) -> None:
        self.total = max(total, 1)
        self.done = -1
        self.width = width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.label = ""

    def _draw(self) -> None:
        n = max(self.done, 0)
        filled = int(self.width * n / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {n}/{self.total} {time.perf_counter() - self.t0:6.0f} s  {self.label}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def step(self, label: str) -> None:
        self.done += 1
        self.label = label
        self._draw()

    def note(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        if self.tty:
            self._draw()
        self.stream.flush()

    def finish(self) -> None:
        self.done = self.total
        self.label = "done"
        self._draw()
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()
