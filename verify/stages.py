"""Where a test's time goes, stage by stage: the kernel under test, the float64 reference, the rounding-error
bounds and the eager baseline. What no stage claims (drawing cases, building inputs, the comparisons, the
report) is the rest. The plugin starts a clock around each test body and writes the seconds of each stage
with the test's wall time (``timing-<worker>.jsonl``); ``report.md`` adds them up per property.

Stages nest: time spent in a stage entered from another (the reference computed for the first time inside
the bounds) counts for the inner one only. On a GPU the device is synchronised at each stage's edges, so that
a kernel's queued work is not charged to the next stage that waits for it; these are a few synchronisations
an example, which the checks make anyway.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

STAGES = ("kernel", "reference", "bounds", "baseline")


class Clock:
    """The seconds of each stage within one test (exclusive of nested stages)."""

    def __init__(self) -> None:
        self.seconds = {name: 0.0 for name in STAGES}
        self._stack: list[str] = []
        self._since = 0.0

    def enter(self, name: str) -> None:
        now = _now()
        if self._stack:
            self.seconds[self._stack[-1]] += now - self._since
        self._stack.append(name)
        self._since = now

    def leave(self) -> None:
        now = _now()
        self.seconds[self._stack.pop()] += now - self._since
        self._since = now


_clock: Clock | None = None


def _now() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a kernel's device error surfaces where the checks wait, as without timing
            pass
    return time.perf_counter()


def start_test() -> None:
    """Start timing one test's stages (the plugin calls it as the test body starts)."""
    global _clock
    _clock = Clock()


def end_test() -> dict[str, float]:
    """The stages' seconds of the test started last, rounded; the clock stops."""
    global _clock
    clock, _clock = _clock, None
    return {name: round(s, 4) for name, s in (clock.seconds if clock else {}).items()}


@contextmanager
def stage(name: str):
    """Charge the time of the block to ``name`` (one of :data:`STAGES`); nothing outside a timed test."""
    if name not in STAGES:
        raise ValueError(f"stage={name!r}, but should be one of {STAGES}")
    clock = _clock
    if clock is None:
        yield
        return
    clock.enter(name)
    try:
        yield
    finally:
        clock.leave()
