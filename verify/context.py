"""What a property example runs in, and how it fails: the :class:`Context` of one example (the kernel, the
property, the case, the recorders), the failures that carry a case and its replay command, and the signals
that a property does not apply.

Every exception that leaves an example carries its context (:func:`running`, :func:`attach_context`), so
that a failure file names the case that ran, exactly as drawn, and its replay command. A test that runs past
its time limit ends with a :class:`TimeoutFailure` naming the case that was running (raised by the timer the
plugin installs); a sticky CUDA error ends it with :class:`StickyDeviceError`, which Hypothesis does not shrink.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

from flashverify_kernels.declaration import Implementation
from reports.session import replay_command
from verify.faults import exception_line


class NotForThisKernel(Exception):
    """The property cannot apply to this implementation (e.g. no LSE returned): the test is skipped."""


class NotForThisCase(Exception):
    """The property says nothing about this particular case: the example is rejected."""


Recorder = Callable[[dict[str, Any]], None]


def _no_record(_: dict[str, Any]) -> None:
    return None


class PropertyFailure(AssertionError):
    """A property failed; carries what the report needs to write a replayable failure file."""

    def __init__(self, message: str, *, impl: str, prop: str, case: Any, replay: str):
        super().__init__(message)
        self.impl, self.prop, self.case, self.replay = impl, prop, case, replay


class TimeoutFailure(BaseException):
    """A test ran past its time limit (a hang, or a run far slower than it should be).

    A ``BaseException``, like pytest's own outcomes, but not one Hypothesis catches: Hypothesis treats
    pytest's ``Failed`` (what pytest-timeout raises) as a failing example and replays and shrinks it,
    and the replay hangs again with no timer left. This one ends the test at once. It carries the
    property, case and replay command of the example that was running, when one was.
    """

    def __init__(self, message: str, *, ctx: Context | None = None):
        super().__init__(message)
        self.impl = ctx.impl.name if ctx is not None else None
        self.prop = ctx.prop if ctx is not None else None
        self.case = ctx.case if ctx is not None else None
        self.replay = ctx.replay_command() if ctx is not None and ctx.case is not None else None


class StickyDeviceError(BaseException):
    """The kernel hit a sticky CUDA error (an illegal memory access, a launch failure, a device-side
    assert: :func:`verify.gpu.sticky_cuda_error`), which leaves the process's CUDA context unusable.

    A ``BaseException``, like :class:`TimeoutFailure`, so Hypothesis does not shrink it: every later
    example in this process would fail the same way whatever its case, and the shrunk case would not be
    the one that failed. The test ends at once with the case that hit the error and its replay command
    (run it in a fresh process); the plugin then ends the process (``verify/failures.py``).
    """

    def __init__(self, ctx: Context, error: BaseException, *, where: str):
        self.impl, self.prop, self.case = ctx.impl.name, ctx.prop, ctx.case
        self.replay = ctx.replay_command()
        super().__init__(f"{ctx.impl.name}: the kernel hit a sticky CUDA error in its {where} "
                         f"({exception_line(error)})\n  property: {ctx.prop}\n  case: {ctx.case.describe()}\n"
                         f"  replay: {self.replay}  (in a fresh process)")


# The property example running now, pushed and popped by :func:`running` (verify.runner.run_example).
_RUNNING: list[Context] = []


@contextlib.contextmanager
def running(ctx: Context):
    """Mark ``ctx``'s example as the one running (for :func:`running_context`) while the block runs, and
    mark every exception that leaves it with ``ctx`` (:func:`attach_context`)."""
    _RUNNING.append(ctx)
    try:
        yield
    except Exception as exc:
        attach_context(exc, ctx)
        raise
    finally:
        _RUNNING.pop()


def running_context() -> Context | None:
    """The :class:`Context` of the property example running now, or None (read by the time-limit
    watchdog, possibly from another thread)."""
    return _RUNNING[-1] if _RUNNING else None


_CONTEXT_ATTRIBUTE = "_flashverify_context"


def attach_context(exc: BaseException, ctx: Context) -> None:
    """Mark ``exc`` as raised in the property example ``ctx`` (:func:`running` does, for every exception
    that leaves an example)."""
    try:
        setattr(exc, _CONTEXT_ATTRIBUTE, ctx)
    except AttributeError:  # an exception type without a __dict__: its failure file names no case
        pass


def failing_context(exc: BaseException) -> Context | None:
    """The :class:`Context` of the property example ``exc`` was raised in (:func:`attach_context`), or
    None when it was raised outside any example (a fixture, Hypothesis itself)."""
    ctx = getattr(exc, _CONTEXT_ATTRIBUTE, None)
    return ctx if isinstance(ctx, Context) and ctx.case is not None else None


def timeout_message(ctx: Context | None, *, seconds: float, native: bool = False) -> str:
    """What a :class:`TimeoutFailure` says: the limit, how to change it, and the case that was running."""
    lines = [f"Timeout: the test did not finish within {seconds:g} s (pytest-timeout's limit; "
             "--timeout SECONDS changes it, --timeout 0 turns it off)"]
    if native:
        lines.append("Python could not interrupt it: it is stuck in native code (a GPU kernel that does not "
                     "finish, a CUDA synchronisation, a C extension), so the process is ended here")
    if ctx is None or ctx.case is None:
        lines.append("no property example was running (the time ran out drawing or shrinking cases, or in "
                     "a fixture)")
    else:
        lines += [f"running when the time ran out: {ctx.impl.name}", f"  property: {ctx.prop}",
                  f"  case: {ctx.case.describe()}",
                  f"  replay: {ctx.replay_command()}  (runs this case alone: does it hang?)"]
    return "\n  ".join(lines)


@dataclasses.dataclass
class Context:
    """Everything a property needs besides the case: the implementation, the device, the recorder."""

    impl: Implementation
    prop: str
    device: str = "cpu"
    record: Recorder = _no_record
    case: Any = None
    # Receives one record per metamorphic comparison (:func:`assert_close`): its difference over its tolerance.
    margin: Recorder = _no_record
    # The worst value of each ratio the example measured ("dq error/bound", ...): the runner hands them
    # to Hypothesis's target(), so the search climbs toward the inputs closest to failing.
    observations: dict[str, float] = dataclasses.field(default_factory=dict)

    def observe(self, label: str, value: float) -> None:
        if not math.isnan(value):
            self.observations[label] = max(value, self.observations.get(label, -math.inf))

    def replay_command(self) -> str:
        return replay_command(impl=self.impl.cli_name, prop=self.prop, case=self.case.to_dict(), device=self.device)

    def fail(self, message: str) -> None:
        __tracebackhide__ = True
        replay = self.replay_command()
        raise PropertyFailure(f"{self.impl.name}: {message}\n  property: {self.prop}\n"
                              f"  case: {self.case.describe()}\n  replay: {replay}",
                              impl=self.impl.name, prop=self.prop, case=self.case, replay=replay)
