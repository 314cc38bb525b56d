"""Measuring a kernel against the float64 reference, once for the whole suite.

:class:`Truth` holds what one case's inputs are compared with: the float64 reference, the
same-precision eager baseline (criterion 1) and the rounding-error bounds (criterion 2). :func:`check`
and :func:`check_delta` apply both criteria to one op of the kernel and write its measurement record
(:func:`verify.asserts.assert_accurate`). The properties of :mod:`verify.properties` and the accuracy
sweep (:func:`sweep_case`, driven by :mod:`reports.accuracy`) both measure through this module, so the
sweep decides every op as ``pytest verify`` does.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property

import torch

from references import attention as reference, baseline, bounds
from references.fp8 import dequantise, is_fp8
from references.criteria import magnitudes
from references.metrics import ErrorStats, abs_error
from verify.asserts import assert_accurate
from verify.calls import run_backward, run_forward
from verify.context import Context, NotForThisCase, NotForThisKernel, PropertyFailure
from verify.faults import OutOfMemoryError, release_out_of_memory
from verify.stages import stage

# The ops the accuracy sweep measures, each recorded under the property that checks it (so that the
# report's replay command reruns exactly that check).
PROPERTY_OF = {"out": "out_matches_reference", "lse": "lse_matches_reference", "dq": "gradients_match_reference",
               "dk": "gradients_match_reference", "dv": "gradients_match_reference",
               "dsinks": "gradients_match_reference"}
GRADIENTS = ("dv", "dk", "dq")  # the order gradients_match_reference checks them in (then dsinks, with sinks)
BACKWARD = ("dq", "dk", "dv", "delta", "dsinks")  # what a backward returns, in order (dsinks with sinks)


def gradients_of(case) -> tuple[str, ...]:
    """The gradients checked on ``case``: dV, dK, dQ, and the sinks' with sinks."""
    return GRADIENTS + (("dsinks",) if case.spec.sinks is not None else ())


def representable_gradients(ref: reference.Reference, dtype: torch.dtype) -> None:
    """Raise :class:`NotForThisCase` when an exact gradient of ``ref`` lies past the largest finite value
    of the inputs' ``dtype``, or ``dS`` comes within a factor 2 of it: every kernel that rounds it to
    ``dtype`` correctly returns inf (or NaN) there, and no bound or identity (``sum_j dK_j = 0``) can be
    checked on it. (Inputs with row-scaled values, like
    ``v_wide_range`` in float16, reach it: dK = scale dS^T Q grows with |V| |dO| |Q|.) Outputs cannot:
    O is a convex combination of the rows of V."""
    if dtype == torch.float64 or not dtype.is_floating_point:
        return
    top = torch.finfo(dtype).max
    name = str(dtype).removeprefix('torch.')
    for op in ("dq", "dk", "dv", "dsinks"):
        x = getattr(ref, op)
        if x is not None and x.numel() and (biggest := x.abs().max().item()) > top:
            raise NotForThisCase(f"the exact {op} reaches {biggest:.4g}, past {name}'s "
                                 f"largest finite value {top:.6g}: rounded to the dtype it is inf")
    # The contract's backward casts dS to the input dtype for the dQ and dK products (FlashAttention-2 and 3
    # feed it to the tensor cores so): within a factor 2 of the largest finite value, its own rounding error
    # may carry it past, and a correct kernel's dQ and dK are inf or NaN whatever the exact gradients are.
    if ref.ds_max is not None and ref.ds_max > top / 2:
        raise NotForThisCase(f"the exact dS = P (dP - Delta) reaches {ref.ds_max:.4g}, within a factor 2 of "
                             f"{name}'s largest finite value {top:.6g}: a backward that casts dS to {name} "
                             "before dQ and dK overflows there")


class Truth:
    """The float64 reference, the eager baseline and the bounds of one case's inputs ``q, k, v`` (with
    ``dout``: of the backward too) under the case's attention spec; each computed once, when first needed.

    Nothing here depends on the kernel but the gradient bounds, which :meth:`gradient_bounds` computes
    per kernel: kernels that compute the same spec can share one ``Truth``.

    Float8 inputs come with their ``descales`` (``(q_descale, k_descale, v_descale)`` or None): the
    reference and the bounds see the dequantised values (:func:`references.fp8.dequantise`), the eager
    baseline the float8 ones and the descales, as a float8 kernel does."""

    def __init__(self, case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 dout: torch.Tensor | None = None, descales=None):
        self.case, self.q, self.k, self.v, self.dout = case, q, k, v, dout
        self.options = {"spec": case.spec, "scale": case.scale}
        self.descales = descales
        if descales is not None and not is_fp8(q.dtype):
            raise ValueError(f"descales come with float8 inputs only; q is {q.dtype}")

    @cached_property
    def exact_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v`` as the values they stand for: the inputs themselves, float8 ones dequantised."""
        if not is_fp8(self.q.dtype):
            return self.q, self.k, self.v
        descales = self.descales if self.descales is not None else (None, None, None)
        return tuple(dequantise(x, d) for x, d in zip((self.q, self.k, self.v), descales))

    @cached_property
    def ref(self) -> reference.Reference:
        try:
            with stage("reference"):
                ref = reference.attention(*self.exact_inputs, dout=self.dout, **self.options)
        except OutOfMemoryError as exc:
            # The suite's own float64 reference, not the kernel, ran out: the case is too large for this
            # device, which says nothing about the kernel. Skip with the reason (the memory is released).
            why = release_out_of_memory(exc)
            c = self.case
            raise NotForThisKernel(f"the float64 reference ran out of device memory on {c.describe()} "
                                f"({c.batch * c.heads_q * c.len_q * c.len_k} scores; lower the profile's "
                                f"max_scores): {why}") from None
        representable_gradients(ref, self.q.dtype)
        return ref

    @cached_property
    def eager(self) -> dict[str, torch.Tensor]:
        """The eager baseline's ``out`` and ``lse`` and, with ``dout``, its ``dq``, ``dk``, ``dv``, ``delta``."""
        return self._eager(self.options)

    @cached_property
    def eager_unsplit(self) -> dict[str, torch.Tensor] | None:
        """With split-KV (``num_splits > 1``): the eager baseline of the same case without it; None otherwise.

        A split-KV kernel chooses its splits (FlashAttention-2 cuts whole key tiles, so a short sequence
        may get fewer splits than asked, or one), and the splits change the rounding: in a split of its
        own a key's probability is taken against that split's maximum, where next to a large sink logit
        or score it underflows in the input dtype. Criterion 1 therefore holds a split case's kernel to
        the less accurate of the two eager baselines (:meth:`baseline_for`)."""
        if self.case.spec.num_splits <= 1:
            return None
        return self._eager({**self.options, "spec": dataclasses.replace(self.case.spec, num_splits=1)})

    def _eager(self, options: dict) -> dict[str, torch.Tensor]:
        with stage("baseline"):
            out, lse = baseline.forward(self.q, self.k, self.v, **options,
                                        **({"descales": self.descales} if self.descales is not None else {}))
            results = {"out": out, "lse": lse}
            if self.dout is not None:
                grads = baseline.backward(self.q, self.k, self.v, self.dout, out=out, **options)
                results.update(zip(BACKWARD, grads))
        return results

    def baseline_for(self, op: str) -> torch.Tensor:
        """Criterion 1's eager result for ``op``: :attr:`eager`'s, or with split-KV whichever of it and
        :attr:`eager_unsplit`'s is further from the reference (its largest absolute error)."""
        candidates = [self.eager[op]] + ([self.eager_unsplit[op]] if self.eager_unsplit is not None else [])
        expected = getattr(self.ref, op)
        return max(candidates, key=lambda b: float(abs_error(b, expected).max()) if b.numel() else 0.0)

    @cached_property
    def forward_bounds(self) -> dict[str, torch.Tensor]:
        """The rounding bounds of ``out`` and ``lse``."""
        ref = self.ref
        with stage("bounds"):
            return dict(zip(("out", "lse"), bounds.forward_bounds(ref, *self.exact_inputs, dtype=self.q.dtype)))

    def lse_error(self, lse: torch.Tensor | None) -> float:
        """The largest error of the kernel's stored ``lse`` on a row with keys, each row's capped at that
        row's LSE bound (0 without an LSE, or with one of another shape): how far from the exact LSE a
        backward that recomputes P from it starts (:func:`references.criteria.floor`)."""
        if lse is None or lse.shape != self.ref.lse.shape:
            return 0.0
        exact = self.ref.lse
        got = lse.detach().to(device=exact.device, dtype=torch.float64)
        rows = torch.isfinite(exact) & torch.isfinite(got)
        if not bool(rows.any()):
            return 0.0
        bound = self.forward_bounds["lse"].to(exact.device)
        return float(torch.minimum((got - exact).abs(), bound)[rows].max())

    def gradient_bounds(self, impl, out: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rounding bounds of ``dq``, ``dk``, ``dv`` and ``delta`` of ``impl``, whose forward gave ``out``.

        A kernel that declares its own backward follows the FlashAttention algorithm the default model
        describes (Delta from O, P recomputed from the LSE); for one differentiated by autograd through
        unknown code the bound also covers autograd's eager algorithm (Delta from P and dP, per-op
        rounding): the elementwise larger of the two."""
        dtype, ref = self.q.dtype, self.ref
        with stage("bounds"):
            result = bounds.backward_bounds(ref, self.q, self.k, self.v, dtype=dtype, out=out)
            if impl.backward is None:
                autograd = bounds.backward_bounds(ref, self.q, self.k, self.v, dtype=dtype, out=out,
                                                  model=bounds.kernel_model(dtype, autograd_eager=True))
                result = tuple(torch.maximum(a, b) for a, b in zip(result, autograd))
        return dict(zip(BACKWARD, result))


def check(ctx: Context, truth: Truth, op: str, actual: torch.Tensor, bounds_of: dict[str, torch.Tensor], *,
          lse_error: float = 0.0) -> ErrorStats:
    """Both criteria for the kernel's ``op`` (``out``, ``lse``, ``dq``, ``dk`` or ``dv``) against ``truth``,
    with the bound ``bounds_of[op]`` (:attr:`Truth.forward_bounds` or :meth:`Truth.gradient_bounds`); the
    measurement is recorded under ``ctx`` and a failed criterion fails ``ctx``. ``lse_error``: for a
    gradient, :meth:`Truth.lse_error` of the LSE the kernel's forward stored (its backward inherits it)."""
    __tracebackhide__ = True
    if op not in PROPERTY_OF:
        raise ValueError(f"op={op!r}, but should be one of {tuple(PROPERTY_OF)} (delta: check_delta)")
    diagnose = (lambda: lse_convention(actual, truth.ref, bounds_of[op])) if op == "lse" else None
    magnitude = magnitudes(op, truth.ref, lse_error=lse_error)
    return assert_accurate(ctx, op=op, actual=actual, expected=getattr(truth.ref, op), baseline=truth.baseline_for(op),
                           bound=bounds_of[op], input_dtype=truth.q.dtype, magnitude=magnitude,
                           diagnose=diagnose)


# Other LSE conventions real kernels store, and what converts them to the contract's natural-log LSE.
# (words, the reference's LSE in that convention, the factor that scales the bound into it)
_LSE_CONVENTIONS = (
    ("a base-2 logarithm (log2 of the row sum, as kernels that use exp2 store it): multiply by ln 2 "
     "= 0.6931 to get the natural-log LSE the contract asks for",
     lambda ref: ref.lse / math.log(2.0), 1 / math.log(2.0)),
    ("log(sum_j exp(s_ij - m_i)), the running max m_i left out: add the row max",
     lambda ref: ref.lse - ref.row_max, 1.0),
    ("the LSE of the keys alone, the sink left out: the contract's LSE is the softmax's whole normaliser, "
     "log(exp(t_h) + sum_j exp(s_ij)) (its backward needs it)",
     lambda ref: None if ref.p_sink is None else ref.lse + torch.log1p(-ref.p_sink), 1.0),
)


def lse_convention(actual: torch.Tensor, ref, bound: torch.Tensor) -> list[str]:
    """When a kernel's LSE fails, whether it is the contract's LSE in another known convention (base 2,
    the row max left out) on every row with keys, within the bound scaled to that convention: the words
    that say so, or nothing."""
    got = actual.detach().to(torch.float64)
    rows = torch.isfinite(ref.lse) & torch.isfinite(got)
    if not bool(rows.any()):
        return []
    for words, convert, factor in _LSE_CONVENTIONS:
        other = convert(ref)
        if other is None:
            continue
        slack = factor * 2 * bound.to(got.device) + 4 * torch.finfo(torch.float32).eps * other.abs()
        if bool(((got - other).abs() <= slack)[rows].all()):
            return [f"the kernel's lse equals the reference's in another convention on every row with keys: "
                    f"it looks like {words}"]
    return []


def check_delta(ctx: Context, truth: Truth, out: torch.Tensor, delta: torch.Tensor,
                bounds_of: dict[str, torch.Tensor]) -> ErrorStats:
    """Both criteria for the kernel's own ``Delta = rowsum(dO * O)``, given the ``out`` it came from.

    Delta is a function of the kernel's own (rounded) O: it is compared with the exact rowsum over that
    O, so this checks the Delta computation (the forward's error is the out property's business); the
    eager baseline's Delta is moved by the same difference of O."""
    __tracebackhide__ = True
    do64 = truth.dout.to(torch.float64)
    exact = (do64 * out.to(torch.float64)).sum(dim=-1)
    eager_exact = (do64 * truth.eager["out"].to(torch.float64)).sum(dim=-1)
    return assert_accurate(ctx, op="delta", actual=delta, expected=exact,
                           baseline=truth.eager["delta"] + (exact - eager_exact), bound=bounds_of["delta"],
                           input_dtype=truth.q.dtype, magnitude=magnitudes("delta", truth.ref))


def sweep_case(impl, case, t, truth: Truth, *, device: str, backward: bool,
               outputs: dict[str, torch.Tensor] | None = None) -> tuple[list[dict], list[str]]:
    """Measure ``impl`` on one case of the accuracy sweep (inputs ``t``): the records of ``out``, ``lse``
    (when returned) and, with ``backward`` and a kernel that declares one, ``dq``, ``dk``, ``dv``, as
    ``pytest verify`` writes them, and
    the problems met (a broken contract, an op that could not be compared). Every op is measured even
    when an earlier one fails. ``outputs``, when given, receives the results measured (``out``, ``lse``,
    and the gradients), in the references' frame, for a table that measures them once more."""
    outputs = {} if outputs is None else outputs
    records: list[dict] = []
    problems: list[str] = []

    def ctx(op: str) -> Context:
        return Context(impl=impl, prop=PROPERTY_OF[op], device=device, record=records.append, case=case)

    def measure(op: str, actual: torch.Tensor, bounds_of: dict[str, torch.Tensor], *,
                lse_error: float = 0.0) -> None:
        before = len(records)
        try:
            check(ctx(op), truth, op, actual, bounds_of, lse_error=lse_error)
        except PropertyFailure as exc:
            if len(records) == before:  # failed before measuring: wrong dtype or shape
                problems.append(f"{op}: {str(exc).splitlines()[0]}")

    with torch.no_grad():
        out, lse = run_forward(ctx("out"), case, t.q, t.k, t.v, descales=t.descales)
    outputs.update(out=out, **({"lse": lse} if lse is not None else {}))
    measure("out", out, truth.forward_bounds)
    if lse is not None:
        measure("lse", lse, truth.forward_bounds)
    if not backward or not impl.autograd:  # a forward-only kernel: its forward is what there is to measure
        return records, problems
    try:
        got = run_backward(ctx("dq"), case, t.q, t.k, t.v, t.dout)
    except (NotForThisKernel, PropertyFailure) as exc:
        problems.append(f"gradients not measured: {str(exc).splitlines()[0]}")
        return records, problems
    outputs.update({op: got[op] for op in gradients_of(case)})
    grad_bounds = truth.gradient_bounds(impl, got["out"])
    lse_error = truth.lse_error(got.get("lse"))
    for op in gradients_of(case):
        measure(op, got[op], grad_bounds, lse_error=lse_error)
    return records, problems
