"""The two kinds of check a property makes, with messages that read without the code open.

:func:`assert_accurate` holds one result of the kernel to both pass criteria against the float64 reference
and records the measurement; :func:`assert_close` compares two results of the kernel within a tolerance
derived from the rounding bounds (a metamorphic property) and records its margin. Both take keyword-only
arguments, hide themselves from tracebacks, report their worst ratio to Hypothesis's ``target()`` and name the
implementation, the property, the case, the metric, its value, its limit and the replay command.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from references import criteria
from references.metrics import ErrorStats, abs_error, error_stats, max_ratio
from strategies.cases import dtype_name
from verify.context import Context

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
