"""Where a test's time goes, stage by stage: the kernel under test, Triton's compiles, the float64 reference, the
rounding-error bounds and the eager baseline. What no stage claims (drawing cases, building inputs, the
comparisons, the report) is the rest. The plugin starts a clock around each test body and writes the seconds of
each stage with the test's wall time (``timing-<worker>.jsonl``); ``report.md`` adds them up per property.

Stages nest: time spent in a stage entered from another (the reference computed for the first time inside
the bounds) counts for the inner one only. On a GPU the device is synchronised at each stage's edges, so that
a kernel's queued work is not charged to the next stage that waits for it; these are a few synchronisations
an example, which the checks make anyway.

``compile`` is the time Triton's JIT spends making a kernel this process has not run yet with these
constexprs and specialisations: compiling it, or loading it from Triton's cache on disk
(:func:`time_triton_compiles` wraps Triton's compile; a kernel run through the interpreter compiles nothing).
It is taken out of the stage it happens in (the kernel's, mostly), and the test's record counts them.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager

import torch

STAGES = ("kernel", "compile", "reference", "bounds", "baseline")


class Clock:
    """The seconds of each stage within one test (exclusive of nested stages)."""

    def __init__(self) -> None:
        self.seconds = {name: 0.0 for name in STAGES}
        self.compiles = 0
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


def end_test() -> tuple[dict[str, float], int]:
    """The stages' seconds of the test started last, rounded, and the number of Triton kernels it compiled (or
    loaded from Triton's cache); the clock stops."""
    global _clock
    clock, _clock = _clock, None
    if clock is None:
        return {}, 0
    return {name: round(s, 4) for name, s in clock.seconds.items()}, clock.compiles


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


def _timed_compile(compile_):
    """Triton's ``compile`` charging its time to the ``compile`` stage, and counting it, in a timed test."""
    @functools.wraps(compile_)
    def compile(*args, **kwargs):
        if _clock is not None:
            _clock.compiles += 1
        with stage("compile"):
            return compile_(*args, **kwargs)
    compile._flashverify = True
    return compile


def time_triton_compiles() -> bool:
    """Charge Triton's JIT compiles to the ``compile`` stage: ``triton.compiler.compile``, which a kernel's
    launcher calls when it meets constexprs or specialisations it has not run with in this process, wrapped
    (call it before the first launch: a kernel launched before keeps the unwrapped one). Triton's own compile
    hooks are not used: setting one makes Triton serialise every compile's constexprs, which fails for
    Gluon's layouts. False where Triton is not installed."""
    try:
        import triton.compiler as compiler
    except Exception:  # noqa: BLE001 - no Triton: nothing is compiled that we could time
        return False
    found = getattr(compiler, "compile", None)
    if not callable(found):
        return False
    if not getattr(found, "_flashverify", False):
        compiler.compile = _timed_compile(found)
    return True
