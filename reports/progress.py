"""A one-line progress bar on stderr for long sweeps; silent when stderr is not a terminal (CI logs,
pipes), so logs hold results, not carriage returns."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """``Progress(total)``; ``update(label=...)`` after each step; ``close()`` at the end.

    ``enabled=None`` means: only when ``stream`` is a terminal.
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None,
                 width: int = 28, min_interval: float = 0.1):
        self.total = max(0, int(total))
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled
        self.width = width
        self.min_interval = min_interval
        self.started = time.monotonic()
        self._last = 0.0
        self._shown = False

    def line(self, label: str = "") -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        elapsed = time.monotonic() - self.started
        eta = f", ~{_clock(elapsed / self.done * (self.total - self.done))} left" if 0 < self.done < self.total else ""
        text = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {frac:4.0%} "
                f"{_clock(elapsed)}{eta}")
        return f"{text}  {label}" if label else text

    def update(self, n: int = 1, *, label: str = "") -> None:
        self.done = min(self.total, self.done + n)
        self.show(label, force=self.done == self.total)

    def show(self, label: str = "", *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return
        self._last = now
        self.stream.write("\r\x1b[2K" + self.line(label)[:200])
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\n")
            self.stream.flush()
