"""The harness between properties and kernels: calling, contract checks, assertions, recording.

Assertion helpers take keyword-only arguments, hide themselves from tracebacks and word their message
so it reads without the code open: the implementation, the property, the case, the metric, its value,
its limit, and the one command that replays the case.

Faults other than wrong results are worded the same way. A kernel whose forward runs out of device
memory fails its property with that reason (after the memory it held is released, so the next tests
can run); a test that runs past its time limit ends with a :class:`TimeoutFailure` naming the case that
was running (raised by the timer the plugin installs, see ``conftest.py``). A kernel that cannot run a
case for a resource reason (Triton's ``OutOfResources``, a compile error, a CUDA launch it is refused)
fails its property with that reason in words (:func:`resource_failure`), distinct from a wrong answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from flashverify_kernels.conventions import ContractError
from flashverify_kernels.registry import Implementation
from strategies.cases import dtype_name
from references import criteria
from references.metrics import ErrorStats, abs_error, error_stats, max_ratio
from verify.replay import replay_command

Recorder = Callable[[dict[str, Any]], None]

# torch.cuda.OutOfMemoryError is the same class in recent torch; torch.OutOfMemoryError is newer.
OutOfMemoryError: type[RuntimeError] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


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


def declare_hint(error: BaseException | None = None, *, case: Any = None, joiner: str = "\n  ") -> str:
    """The hint for a kernel that raised on a case its declaration allows: declare the limits it has, so
    that the suite draws only what it supports (as ``scale=None`` gets its own hint)."""
    what = "this dtype, head dim or length"
    if case is not None and getattr(case, "head_dim", None) is not None:
        what = f"{case.dtype} inputs, head_dim {case.head_dim} or Nq={case.len_q}, Nk={case.len_k}"
    return (f"{joiner}if the kernel does not support {what}, declare its limits (dtypes=, head_dims=, "
            "max_head_dim=, len_k_multiple=, ...: README.md, \"Declaring a kernel's limits\") and the suite draws "
            "only cases within them; otherwise the replay command reproduces the error")


def free_device_memory() -> None:
    """Release what dead tensors hold: collect reference cycles (tracebacks make them), then return
    the CUDA caching allocator's free blocks to the device."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def exception_line(exc: BaseException) -> str:
    """``module.Type: first line of the message`` (a CUDA out-of-memory message goes on for lines)."""
    kind = type(exc).__name__ if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{type(exc).__name__}"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{kind}: {first}" if first else kind


def release_out_of_memory(exc: BaseException) -> str:
    """Drop the tensors an out-of-memory exception keeps alive through its traceback (the locals of
    the frames it unwound), free the device memory, and return :func:`exception_line`."""
    text = exception_line(exc)
    traceback.clear_frames(exc.__traceback__)
    free_device_memory()
    return text


# --- a kernel that cannot run a case: resource limits, compile failures, refused launches ------------------

# Triton's OutOfResources names (``triton/compiler/compiler.py``) and the unit of their numbers.
_RESOURCE_UNITS = {"shared memory": "bytes of shared memory", "tensor memory": "columns of tensor memory",
                   "threads": "threads per block"}
# OutOfResources's own words, for one that reached us as text only (re-raised as another type).
_OUT_OF_RESOURCES_TEXT = re.compile(r"out of resource: (?P<name>[\w ]+?), Required: (?P<required>\d+), "
                                    r"Hardware limit: (?P<limit>\d+)")
# CUDA (and HIP) errors of a launch the driver refuses for this configuration, which leave the context
# usable (the sticky ones are verify.gpu.STICKY_PATTERNS): too many registers or threads per block, a
# grid or block dimension past the card's limits.
_LAUNCH_REFUSED = re.compile(r"too many resources requested for launch|LAUNCH_OUT_OF_RESOURCES|"
                             r"LaunchOutOfResources|invalid configuration argument|INVALID_CONFIGURATION|"
                             r"\bout of resources\b|ErrorOutOfResources", re.IGNORECASE)
# A compile failure raised as a plain error: MLIR's pass manager in Triton's backends.
_COMPILE_TEXT = re.compile(r"PassManager::run failed")


def _triton_class(module: str, name: str) -> type | None:
    """A Triton exception class, or None where Triton (or that class) is not loaded: an exception of that
    class can only have been raised once its module was, so Triton is never imported here (it may not be
    installed, and importing it is slow)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def _resource_cause(exc: BaseException) -> tuple[str, BaseException, dict[str, Any]] | None:
    """``(kind, error, details)`` for the resource failure in ``exc`` or what it was explicitly raised
    from (``raise ... from``; not an exception it was merely raised while handling, such as a fallback
    that failed for another reason): kind ``resources`` (Triton's OutOfResources: ``required``, ``limit``,
    ``name``), ``compile`` (a Triton compile error) or ``launch`` (a launch CUDA refused); else None."""
    out_of_resources = _triton_class("triton.runtime.errors", "OutOfResources")
    ptxas = _triton_class("triton.runtime.errors", "PTXASError")
    compilation = _triton_class("triton.compiler.errors", "CompilationError")
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (AssertionError, OutOfMemoryError)):  # a property's own failure, or out of memory
            return None
        if out_of_resources is not None and isinstance(e, out_of_resources):
            return "resources", e, {"required": getattr(e, "required", None), "limit": getattr(e, "limit", None),
                                    "name": getattr(e, "name", None)}
        if any(cls is not None and isinstance(e, cls) for cls in (compilation, ptxas)):
            return "compile", e, {}
        text = str(e)
        found = _OUT_OF_RESOURCES_TEXT.search(text)
        if found:
            return "resources", e, {"required": int(found["required"]), "limit": int(found["limit"]),
                                    "name": found["name"]}
        if isinstance(e, RuntimeError) and _COMPILE_TEXT.search(text):
            return "compile", e, {}
        if isinstance(e, RuntimeError) and _LAUNCH_REFUSED.search(text):
            return "launch", e, {}
        e = e.__cause__
    return None


def _where(case: Any) -> str:
    """``at head_dim 256 block 128x128 (float16)`` for a case (what it has of these)."""
    parts = []
    head_dim = getattr(case, "head_dim", None)
    if head_dim is not None:
        parts.append(f"head_dim {head_dim}")
    block_m, block_n = getattr(case, "block_m", None), getattr(case, "block_n", None)
    if block_m is None and block_n is None:
        parts.append("with the kernel's own blocks")
    else:
        parts.append(f"block {block_m if block_m is not None else 'own'}x{block_n if block_n is not None else 'own'}")
    dtype = getattr(case, "dtype", None)
    return "at " + " ".join(parts) + (f" ({dtype})" if dtype else "")


def _card(device: Any) -> str | None:
    """The CUDA device's name (``torch.cuda.get_device_name``), or None off CUDA or when it cannot be read."""
    try:
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_name(device)
    except Exception:
        return None


def _error_text(exc: BaseException, *, max_lines: int = 16) -> str:
    """The exception's type and full message (a compile error's source excerpt included), indented."""
    kind = type(exc).__name__ if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{type(exc).__name__}"
    body = str(exc).strip().splitlines()
    if not body:
        return kind
    if len(body) > max_lines:
        body = body[:max_lines] + [f"... ({len(body) - max_lines} more lines)"]
    return f"{kind}: " + "\n    ".join(body)


def resource_failure(exc: BaseException, case: Any, *, device: Any = None, where: str = "forward") -> str | None:
    """Words for a kernel that could not run ``case`` for a resource reason, or None for any other error.

    Recognised in ``exc`` or what it was raised from (``raise ... from``): Triton's ``OutOfResources``
    (shared memory, tensor memory or threads per block past the card's limit), Triton's compile errors
    (``CompilationError`` and its subclasses, ``PTXASError``, MLIR's failed pass manager), and the CUDA
    errors of a launch refused for its configuration ("too many resources requested for launch",
    "invalid configuration argument", "out of resources"). A sticky CUDA
    error (:func:`verify.gpu.sticky_cuda_error`), an out-of-memory error and a property's own failure are
    not resource failures: each keeps its own path. ``where`` is the kernel's ``forward`` or ``backward``;
    ``device`` names the card on CUDA.

    The words start with what kind of failure it is and ``(not a wrong answer)``, say what the kernel
    needed at the case's head dim, blocks and dtype, and end with the kernel's own error::

        resource limit (not a wrong answer): the kernel's forward needs 393216 bytes of shared memory,
        the card has 232448, at head_dim 256 block 128x128 (float16)
    """
    from verify.gpu import sticky_cuda_error

    if sticky_cuda_error(exc) is not None:
        return None
    found = _resource_cause(exc)
    if found is None:
        return None
    kind, error, details = found
    card = _card(device)
    the_card = f"the card ({card})" if card else "the card"
    at = _where(case)
    if kind == "resources":
        name = details.get("name") or "resources"
        unit = _RESOURCE_UNITS.get(name, name)
        words = (f"resource limit (not a wrong answer): the kernel's {where} needs {details.get('required')} {unit}, "
                 f"{the_card} has {details.get('limit')}, {at}")
    elif kind == "compile":
        first = (str(getattr(error, "error_message", None) or "").strip().splitlines()
                 or str(error).strip().splitlines() or [type(error).__name__])[0]
        words = (f"compile failure (not a wrong answer): the kernel's {where} failed to compile for this case, "
                 f"{at}{' on ' + card if card else ''} ({first})")
    else:
        why = ("a grid or block dimension past the card's limits" if "config" in str(error).lower()
               else "more registers, threads or shared memory per block than the card has")
        words = (f"resource limit (not a wrong answer): CUDA refused to launch the kernel's {where} for this case "
                 f"({why}), {at}{' on ' + card if card else ''}")
    return f"{words}\n  the kernel raised {_error_text(error)}"


@contextlib.contextmanager
def resource_failures_fail(ctx: "Context", case, *, device, where: str):
    """A resource failure of the kernel inside the block fails ``ctx`` in words (:func:`resource_failure`:
    a PropertyFailure with the case and its replay, chained to the kernel's error); any other error,
    sticky CUDA errors and out-of-memory included, goes on as it was."""
    __tracebackhide__ = True
    try:
        yield
    except Exception as exc:
        words = resource_failure(exc, case, device=device, where=where)
        if words is None:
            raise
        traceback.clear_frames(exc.__traceback__)  # the kernel's tensors need not live as long as the failure
        ctx.fail(words)


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


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensor(ctx: Context, *, label: str, actual: Any, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, inputs: tuple[torch.Tensor, ...] = ()) -> None:
    """The contract on one returned tensor: type, shape, dtype, device, and not an input object."""
    __tracebackhide__ = True
    if not isinstance(actual, torch.Tensor):
        ctx.fail(f"{label} is a {type(actual).__name__}, but should be a torch.Tensor")
    if tuple(actual.shape) != tuple(shape):
        ctx.fail(f"{label}.shape={tuple(actual.shape)}, but should be {tuple(shape)}")
    if actual.dtype != dtype:
        ctx.fail(f"{label}.dtype={dtype_name(actual.dtype)}, but should be {dtype_name(dtype)}")
    if actual.device != device:
        ctx.fail(f"{label} is on {actual.device}, but should be on {device} (the inputs' device)")
    for t in inputs:
        if actual is t or (actual.numel() and t.numel() and actual.data_ptr() == t.data_ptr()
                           and actual.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()):
            ctx.fail(f"{label} is (a view of) one of the input tensors, not a newly computed result")


def run_forward(ctx: Context, case, q, k, v, *, sinks: torch.Tensor | None = None, handed=None):
    """Call the implementation's forward and check the output contract; returns ``(out, lse|None)`` in the
    references' frame (``Implementation.call``). ``sinks``: the sinks tensor to pass (a leaf whose gradient
    the caller reads), instead of one made from the spec; ``handed``: ``Implementation.call``'s."""
    __tracebackhide__ = True
    out_of_memory = None
    contract = None
    try:
        with resource_failures_fail(ctx, case, device=q.device, where="forward"):
            out, lse = ctx.impl.call(q, k, v, spec=case.spec, scale=case.scale,
                                     block_m=case.block_m, block_n=case.block_n, sinks=sinks, handed=handed)
    except ContractError as exc:
        contract = str(exc)
    except OutOfMemoryError as exc:
        out_of_memory = release_out_of_memory(exc)
    except Exception as exc:
        from verify.gpu import sticky_cuda_error

        if sticky_cuda_error(exc) is not None:
            raise StickyDeviceError(ctx, exc, where="forward") from exc
        raise
    if contract is not None:
        ctx.fail(contract)
    if out_of_memory is not None:  # failed outside the except block: the new failure holds no traceback
        ctx.fail(f"the kernel ran out of device memory in its forward ({out_of_memory}); "
                 "its memory was released and the run goes on")
    check_tensor(ctx, label="out", actual=out, shape=tuple(q.shape), dtype=q.dtype, device=q.device,
                 inputs=(q, k, v))
    if lse is not None:
        check_tensor(ctx, label="lse", actual=lse, shape=tuple(q.shape[:3]), dtype=lse_dtype(q.dtype),
                     device=q.device, inputs=(q, k, v))
    return out, lse


def _fmt_index(idx: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in idx) + "]"


def assert_accurate(ctx: Context, *, op: str, actual: torch.Tensor, expected: torch.Tensor,
                    baseline: torch.Tensor, bound: torch.Tensor, input_dtype: torch.dtype,
                    magnitude: criteria.Magnitudes,
                    diagnose: Callable[[], list[str]] | None = None) -> ErrorStats:
    """Both pass criteria for one op (``out``, ``lse``, ``delta``, ``dq``, ``dk``, ``dv``).

    ``actual`` is the kernel's result, ``expected`` the float64 reference, ``baseline`` the
    same-precision eager result, ``bound`` the componentwise rounding-error bound and ``magnitude``
    what criterion 1's floor scales with (:func:`references.criteria.magnitudes`). ``diagnose``, asked
    only on a failure, gives lines that name a likely cause (e.g. another LSE convention).
    """
    __tracebackhide__ = True
    if expected.dtype != torch.float64:
        raise TypeError(f"expected.dtype={dtype_name(expected.dtype)}, but should be float64 "
                        "(the reference): are actual and expected swapped?")
    stored = criteria.stored_dtype(op, input_dtype)
    if actual.dtype != stored and not (op in ("lse", "delta") and actual.dtype in (torch.float32, torch.float64)):
        ctx.fail(f"{op}.dtype={dtype_name(actual.dtype)}, but should be {dtype_name(stored)}")
    if actual.shape != expected.shape:
        ctx.fail(f"{op}.shape={tuple(actual.shape)}, but should be {tuple(expected.shape)}")
    stats = error_stats(actual, expected, dtype=stored)
    err = abs_error(actual, expected, dtype=stored)
    base_err = float(abs_error(baseline, expected).max()) if baseline.numel() else 0.0
    allowed = criteria.allowed_error(op, input_dtype, baseline_error=base_err, magnitude=magnitude)
    ratio, ratio_at = max_ratio(err, bound)
    passed = stats.max_abs <= allowed and ratio <= 1.0 and stats.nan_count == 0
    over_eager = error_over_eager(stats.max_abs, base_err, criteria.floor(op, input_dtype, magnitude))
    ctx.observe(f"{op} error/bound", ratio)
    ctx.observe(f"{op} error/eager", over_eager)
    ctx.record({
        "implementation": ctx.impl.name, "property": ctx.prop, "op": op, "case": ctx.case.to_dict(),
        **{key: value for key, value in stats.as_dict().items() if key not in ("worst_index",)},
        "worst_index": list(stats.worst_index), "baseline_max_abs": base_err, "allowed_max_abs": allowed,
        "error_over_bound": ratio, "error_over_baseline": over_eager, "pass": passed,
    })
    if passed:
        return stats
    lines = [f"{op} differs from the float64 reference"]
    lines += _non_finite_lines(op, actual, expected, dtype=stored)
    masked = masked_row_note(ctx, stats.worst_index, op)
    if masked:
        lines.append(masked)
    at = _fmt_index(stats.worst_index)
    lines.append(f"max abs error {stats.max_abs:.3e} at {at} (got {stats.worst_actual:.6g}, "
                 f"expected {stats.worst_expected:.6g}); allowed {criteria.FACTOR[op]:g} x eager "
                 f"{base_err:.3e} + floor = {allowed:.3e}"
                 + ("  [criterion 1 FAILED]" if stats.max_abs > allowed or stats.nan_count else ""))
    lines.append(f"error/bound {ratio:.3g} at {_fmt_index(ratio_at)} (bound there "
                 f"{float(bound[ratio_at]) if ratio_at else 0.0:.3e})"
                 + ("  [criterion 2 FAILED]" if ratio > 1 else ""))
    lines.append(f"max rel {stats.max_rel:.3e}, rmse {stats.rmse:.3e}, max ulp {stats.max_ulp:.3g} "
                 f"({dtype_name(stored)})")
    if diagnose is not None:
        lines += diagnose()
    ctx.fail("\n  ".join(lines))
    return stats


def error_over_eager(max_abs: float, eager_error: float, floor: float) -> float:
    """The report's err/eager: the max abs error over that of the same-precision eager attention, where
    criterion 1's absolute floor stands in for an eager error below it (an exact eager result, error 0,
    included), so the ratio is finite and 1 means "as accurate as eager, or within the floor"."""
    scale = max(eager_error, floor)
    if scale > 0:
        return max_abs / scale
    return 0.0 if max_abs == 0 else math.inf


def _non_finite_lines(op: str, actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype) -> list[str]:
    """Name NaN and infinities the kernel returned where the reference has none: "3 of 96 out values
    are NaN, first at [0, 0, 2, 1] (expected 0.25)"."""
    a = actual.detach()
    e = expected.detach().to(torch.float64)
    e_stored = e.to(dtype).to(torch.float64) if dtype != torch.float64 else e
    lines = []
    for word, bad in (("NaN", torch.isnan(a)), ("+inf", torch.isposinf(a) & ~torch.isposinf(e_stored)),
                      ("-inf", torch.isneginf(a) & ~torch.isneginf(e_stored))):
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            lines.append(f"{int(bad.sum())} of {a.numel()} {op} values are {word}, first at {_fmt_index(idx)} "
                         f"(expected {float(e[idx]):.6g})")
    return lines


# Results indexed by query row ([b, h, i, ...]) and by key ([b, h_kv, j, ...]); anything else names no row.
ROW_RESULTS = ("out", "lse", "dq", "delta")
KEY_RESULTS = ("dk", "dv")


def result_of(what: str) -> str | None:
    """The result a metamorphic comparison is about, from the first word of its words ("out after ...",
    "dK with GQA ..."): ``out``, ``lse``, ``dq``, ``dk``, ``dv``, ``delta``, or None."""
    first = (what.split() or [""])[0].lower()
    return first if first in ROW_RESULTS + KEY_RESULTS else None


def masked_row_note(ctx: Context, index: tuple[int, ...], op: str | None) -> str | None:
    """A note on where ``index`` lies when it explains the failure, else None: a query row that sees no key
    under the case's bottom-right causal mask (``op`` indexed by row: out, lse, dq, Delta), or a key that no
    query row sees (``op`` indexed by key: dk, dv). Any other ``op`` (None included) gets no note."""
    spec = getattr(ctx.case, "spec", None)
    if len(index) < 3 or spec is None or op not in ROW_RESULTS + KEY_RESULTS:
        return None
    nq, nk = ctx.case.len_q, ctx.case.len_k
    rows_seen, keys_seen = spec.counts(nq, nk)
    if op in KEY_RESULTS:
        key = index[2]
        if key >= len(keys_seen) or int(keys_seen[key]) > 0:
            return None
        return (f"key {key} is seen by no query row, so d{op[1].upper()} should be exactly 0 there: its gradient "
                "comes only from the rows that see it")
    row = index[2]
    if not spec.causal or spec.alignment != "bottom_right" or row >= len(rows_seen) or int(rows_seen[row]) > 0:
        return None
    return (f"row {row} sees no key: causal masks are aligned bottom-right (key j visible to query i iff "
            f"j <= i + Nk - Nq; Nq={nq} > Nk={nk} leaves rows 0..{nq - nk - 1} without keys), so out "
            "should be 0 and lse -inf there. A kernel that aligns causal masks top-left (as PyTorch SDPA's "
            "is_causal does) must declare causal_alignment='top_left' in an Implementation")


def _digits(a: float, b: float) -> tuple[str, str]:
    """Two values with enough digits to tell them apart (6, or up to 17 when they look equal)."""
    for digits in (6, 9, 12, 17):
        sa, sb = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if sa != sb:
            break
    return sa, sb


def assert_close(ctx: Context, *, what: str, actual: torch.Tensor, expected: torch.Tensor,
                 tolerance: torch.Tensor | float, exact: bool = False) -> None:
    """``|actual - expected| <= tolerance`` elementwise (``exact``: bitwise equal values).

    Used by the metamorphic properties, where both sides come from the kernel under test.
    """
    __tracebackhide__ = True
    if actual.shape != expected.shape:
        ctx.fail(f"{what}: shapes {tuple(actual.shape)} and {tuple(expected.shape)} differ")
    err = abs_error(actual, expected, dtype=actual.dtype)
    if exact:
        same = (actual == expected) | (torch.isnan(actual) & torch.isnan(expected))
        bad = ~same
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            ctx.fail(f"{what}: {int(bad.sum())} values differ, first at {_fmt_index(idx)}: "
                     f"{float(actual[idx]):.6g} vs {float(expected[idx]):.6g} (should be identical)")
        return
    tol = tolerance if isinstance(tolerance, torch.Tensor) else torch.full_like(err, float(tolerance))
    ratio, at = max_ratio(err, tol.expand_as(err))
    ctx.observe("difference/tolerance", ratio)
    ctx.margin({"implementation": ctx.impl.name, "property": ctx.prop, "check": what,
                "dtype": getattr(ctx.case, "dtype", None), "case": ctx.case.to_dict() if ctx.case is not None else None,
                "difference_over_tolerance": ratio, "pass": ratio <= 1.0})
    if ratio > 1.0:
        limit = float(tol.expand_as(err)[at])
        a, b = _digits(float(actual[at]), float(expected[at]))
        lines = [f"{what}: |difference| {float(err[at]):.3e} at {_fmt_index(at)} ({a} vs {b}) exceeds the "
                 f"tolerance {limit:.3e}" + (f" by {ratio:.3g}x" if limit > 0 else "")]
        masked = masked_row_note(ctx, at, result_of(what))
        if masked:
            lines.append(masked)
        elif limit == 0:
            lines.append("the tolerance there is 0: the rounding-error bounds of both results are 0 at this "
                         "element (an exact result is owed: no rounding can occur there), so any difference fails")
        ctx.fail("\n  ".join(lines))


def assert_no_nan(ctx: Context, *, what: str, actual: torch.Tensor) -> None:
    __tracebackhide__ = True
    nan = torch.isnan(actual)
    if bool(nan.any()):
        idx = tuple(int(i) for i in nan.nonzero()[0])
        ctx.fail(f"{what}: {int(nan.sum())} of {actual.numel()} values are NaN, first at {_fmt_index(idx)}")
