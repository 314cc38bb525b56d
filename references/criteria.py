"""Pass criteria as data: the baseline factors and the absolute floors, keyed by op and dtype.

Criterion 1 (baseline-relative): ``max|kernel - ref| <= FACTOR[op] * max|eager - ref| + floor``, where
``eager`` is the same-precision eager attention of :mod:`references.baseline` on the same inputs.
The factors are the ones FlashAttention's and PyTorch's own tests use (2 for the forward, 3 for the
gradients, whose reduction order differs more between kernels).

The floor keeps criterion 1 meaningful when the eager baseline happens to be (nearly) exact: one
rounding, in the stored dtype, of the largest *summand magnitude* of the op (``max P|V|`` for out,
``max scale |dS||K|`` for dQ, ...), plus the smallest normal of that dtype for results that underflow.
The summand magnitude, not the result, sets the scale because results that cancel (``sum_j dS_ij = 0``
makes dQ and dK small sums of large terms; V with a large common offset) carry errors proportional to
the terms summed, whatever the summation order: two correct kernels that sum in different orders
differ by about one rounding of that magnitude, and a baseline that is exact by luck says nothing
about the other order.

The scores are sums too: ``s_ij = scale * sum_d q_id k_jd`` carries an absolute error of about one
rounding of ``scale * sum_d |q_id| |k_jd|`` (the *score magnitude*), whatever the order, and
``P = exp(s - m)`` turns it into a relative error of every P. So the floor also holds one rounding of
the score magnitude, relative, for everything computed from P (out and the gradients), and absolute
for the LSE. In float32 this channel dominates: with head dim 120 and N(0, 1) inputs the score
magnitude is about 10, and a GPU kernel's FMA-chain dot differs from cuBLAS's order by more than
twice eager's whole output error.

Criterion 2 (the componentwise rounding-error bound) lives in :mod:`references.bounds`.

The magnitudes are maxima over the score-level matrices, taken one chunk of query rows at a time
(:meth:`references.attention.Reference.chunks`); the per-key sums of ``dK`` and ``dV`` are added over
the chunks, so no ``Nq x Nk`` matrix of the whole problem is held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from references.attention import reduce_group
from references.fp8 import is_fp8, out_dtype
from references.metrics import unit_roundoff

FACTOR = {"out": 2.0, "lse": 2.0, "delta": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0, "dsinks": 3.0}
EXTRA_ROUNDINGS = 4
# dsinks: the gradient of the attention sinks' logits (one per query head), a sum over batch and rows.
GRADIENTS = ("dq", "dk", "dv", "dsinks")
# Ops computed from P, whose every entry inherits the scores' relative error.
FROM_P = ("out",) + GRADIENTS


@dataclass(frozen=True)
class Magnitudes:
    """What criterion 1's floor of one op scales with (see :func:`magnitudes`)."""

    summands: float
    scores: float = 0.0
    lse: float = 0.0
    head_dim: int = 1  # the length of the score dot products
    # The kernel's own stored LSE's largest error on a row (within that row's LSE bound): what a backward
    # that recomputes P from it inherits (gradients; 0 when the kernel returns no LSE).
    lse_error: float = 0.0


def magnitudes(op: str, ref, *, lse_error: float = 0.0) -> Magnitudes:
    """The floor's magnitudes of ``op`` from a float64 :class:`references.attention.Reference`:
    the op's largest summand magnitude, the score magnitude (ops that depend on the scores), the
    largest finite |LSE| and ``lse_error``, the error of the LSE the kernel stored (gradients; see
    :func:`floor`)."""
    gradient = op in GRADIENTS
    return Magnitudes(summands=summand_magnitude(op, ref),
                      scores=score_magnitude(ref) if op != "delta" else 0.0,
                      lse=max_finite_lse(ref) if gradient else 0.0,
                      head_dim=int(ref.q64.shape[-1]),
                      lse_error=float(lse_error) if gradient else 0.0)


def stored_dtype(op: str, input_dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel stores ``op`` in: LSE, Delta and the sinks' gradient (the sinks are float32) in
    float32 (float64 for float64 inputs); out of float8 inputs in bfloat16."""
    if op in ("lse", "delta", "dsinks"):
        return torch.float64 if input_dtype == torch.float64 else torch.float32
    return out_dtype(input_dtype)


def summand_magnitude(op: str, ref) -> float:
    """The largest magnitude summed to form one entry of ``op``, from a float64
    :class:`references.attention.Reference` computed with ``dout``.

    ``dS = P (dP - Delta)`` is itself a difference that cancels (it sums to zero over each row), so
    the gradients' magnitudes use ``P (|dO| |V|^T + rowsum |dO| |O|)`` in place of ``|dS|``.
    """
    f64 = torch.float64
    if op == "out":
        av = ref.v_expanded.abs()
        mag = ref.rowwise(lambda c: c.p @ av)
    elif op == "lse":
        mag = torch.where(torch.isfinite(ref.row_max), ref.row_max.abs(), 0.0) + torch.where(
            torch.isfinite(ref.lse), ref.lse.abs(), 0.0)
    elif op == "delta":
        mag = (ref.dout.abs() * ref.out.abs()).sum(dim=-1)
    elif op == "dsinks":  # dt_h sums P_sink Delta over batch and rows (nothing without sinks), as dV sums
        if ref.p_sink is None:
            return 0.0
        mag = (ref.p_sink * (ref.dout.abs() * ref.out.abs()).sum(dim=-1)).sum(dim=(0, 2))
    elif op == "dv":  # a sum over rows: added chunk by chunk, then over the query heads of each KV head's group
        mag = _sum_over_group(ref, _sum_over_rows(
            ref, lambda c: c.p.transpose(-1, -2) @ ref.dout[:, :, c.r0:c.r1].abs(), ref.v_expanded))
    elif op == "dq":
        ak = ref.k_expanded.abs()
        # |scale|: a magnitude (a negative scale flips the scores, not the size of what is summed).
        mag = abs(ref.scale) * ref.rowwise(lambda c: ds_magnitude(ref, c) @ ak)
    elif op == "dk":
        aq = ref.q64.abs()
        mag = abs(ref.scale) * _sum_over_group(ref, _sum_over_rows(
            ref, lambda c: ds_magnitude(ref, c).transpose(-1, -2) @ aq[:, :, c.r0:c.r1], ref.k_expanded))
    else:
        raise ValueError(f"op={op!r}, but should be one of {tuple(FACTOR)}")
    return float(mag.to(f64).max()) if mag.numel() else 0.0


def _sum_over_rows(ref, fn, like: torch.Tensor) -> torch.Tensor:
    """``sum`` over the row chunks of ``fn(chunk)`` (each shaped ``like``: ``[B, Hq, Nk, D]`` for dK,
    ``[B, Hq, Nk, Dv]`` for dV)."""
    total = torch.zeros(like.shape, dtype=torch.float64, device=ref.q64.device)
    for c in ref.chunks():
        total += fn(c)
    return total


def _sum_over_group(ref, per_head: torch.Tensor) -> torch.Tensor:
    """``per_head`` (``[B, Hq, Nk, D]``) summed over the query heads of each KV head's group, ``[B, Hkv, Nk, D]``:
    a grouped-query dK or dV entry sums the terms of every row of every head of its group, and two correct
    kernels sum them in different orders (eager per head, then over the group; a FlashAttention backward
    through one float32 accumulator, head after head and tile after tile)."""
    return reduce_group(per_head, ref.dk.shape[1] if ref.dk is not None else per_head.shape[1])


def ds_magnitude(ref, chunk) -> torch.Tensor:
    """``P (|dO| |V|^T + rowsum(|dO| |O|))`` on the rows of ``chunk`` (a
    :class:`references.attention.Chunk` of ``ref``): the size of the terms that cancel in ``dS``."""
    rows = slice(chunk.r0, chunk.r1)
    dout = ref.dout[:, :, rows].abs()
    dp_mag = dout @ ref.v_expanded.abs().transpose(-1, -2)
    delta_mag = (dout * ref.out[:, :, rows].abs()).sum(dim=-1, keepdim=True)
    return chunk.p * (dp_mag + delta_mag)


def ds_magnitude_rowsum(ref) -> torch.Tensor:
    """``rowsum`` of :func:`ds_magnitude` over every row, ``[B, Hq, Nq]``, one chunk at a time."""
    return ref.rowwise(lambda c: ds_magnitude(ref, c).sum(dim=-1))


def floor(op: str, input_dtype: torch.dtype, magnitude: Magnitudes) -> float:
    """The tiny absolute floor of criterion 1 for ``op`` with the given magnitudes.

    For the gradients it adds the price of the contract's float32 LSE: a backward that recomputes
    ``P = exp(s - lse)`` from the stored LSE (FlashAttention's backward does) sees every ``P`` with a
    relative error of the stored LSE's absolute error, which eager autograd, keeping P, never pays. That
    error is at least one rounding, ``u32 |lse|``; a forward that merges partials through their LSEs
    (split-KV, ring attention: ``references/bounds.py``, section 14) stores an LSE off by several, within
    its own bound. So the price is the larger of one rounding and ``lse_error``, the kernel's measured LSE
    error capped row by row at the LSE's bound (an LSE past its bound fails its own check and buys no slack
    here), plus one rounding of the subtraction.
    """
    if not isinstance(magnitude, Magnitudes):
        raise TypeError(f"magnitude is a {type(magnitude).__name__}, but should be a "
                        "references.criteria.Magnitudes (see criteria.magnitudes(op, ref))")
    dtype = stored_dtype(op, input_dtype)
    u_acc = unit_roundoff(stored_dtype("lse", input_dtype))
    # One rounding in the stored dtype, plus EXTRA_ROUNDINGS in the accumulator: fast kernels use the
    # hardware's approximate exp2 (up to 2 ulp where eager's exp is within 1) and fold the scale into
    # log2(e), converting scores to base 2 and the LSE back, each one more rounding eager never does.
    # dsinks sums P_sink Delta with Delta = dO . O from the kernel's own O, rounded to the input dtype: one
    # rounding of O's size there (two kernels' O differ by it, and so do their dsinks).
    relative = unit_roundoff(input_dtype if op == "dsinks" else dtype) + EXTRA_ROUNDINGS * u_acc
    absolute = torch.finfo(dtype).tiny
    score_error = score_roundings(input_dtype, magnitude.head_dim, op=op) * u_acc * magnitude.scores
    if op in FROM_P:
        relative += score_error
    elif op == "lse":
        absolute += score_error
    if op in GRADIENTS:
        relative += max(u_acc * (magnitude.lse + 1.0), magnitude.lse_error + u_acc)
    return relative * magnitude.summands + absolute


# The k-depth of one tensor-core step for 16-bit inputs (mma/wgmma on float16 and bfloat16).
MATRIX_UNIT_K = 16


def score_roundings(input_dtype: torch.dtype, head_dim: int, *, op: str = "out") -> float:
    """How many roundings of the score magnitude two correct kernels' ``op`` may differ by through their scores.

    float32: one for the forward (dots summed in other orders, errors of both signs; the float64
    reference's own are negligible, and float32 eager's scores round as the kernel's do, so ``2 x eager``
    covers the rest). A gradient pays ``sqrt(D)``: a FlashAttention backward recomputes every score and
    takes ``P = exp(s - lse)`` against the LSE its forward stored, so the recomputed score's own dot error
    lands on ``P`` whole, where eager's softmax, shifting by the row's max, cancels it for the row's
    dominant key (the forward's share sits in the measured LSE error, see :func:`floor`). Seen
    (tests/test_zoo.py, ``RING_RECOMPUTED_SCORE``): a float32 dominant key at D = 23 whose recomputed score
    was 1.73 roundings of ``|s|`` off, P 7.6e-6 relative off, eager's dV 1.2e-7.
    float64: ``2 sqrt(D)``. There eager and the reference are the same float64 computation (eager's error
    is 0, and so is ``2 x eager``), while the reference's scores round as much as the kernel's: the two
    differ by the sum of two dot products' errors. A dot summed in order over D terms of one sign (all
    negative scores) carries ``u |partial sum|`` per addition, a spread of about ``sqrt(D / 3)``
    roundings of ``|s|``; ``sqrt(D)`` per side covers it with room for the largest of a tensor's entries.
    Seen (tests/test_property_regressions.py): a one-key row at D = 34 whose kernel and reference scores
    were 1.16 and 0.2 roundings off (out 26 u and 12.5 u from the exact value, opposite signs); an
    all-negative row at D = 24, |s| = 619, scores 1.35 roundings off in each (out 834 u and 1215 u,
    opposite signs). float16 and bfloat16
    scores come from matrix units that add ``MATRIX_UNIT_K`` exact products per step to a float32
    accumulator, ``ceil(D / 16)`` steps in sequence, each of which may truncate rather than round
    (``references/bounds.py``, section 12: ``2 u``). When every product has the same sign (all-negative
    scores) those errors do not cancel: a Triton kernel on an H100 gave an LSE 14 u |s| from the
    float64 one at D = 184 (12 steps), eager (cuBLAS) 1.2 u |s|."""
    if input_dtype in (torch.float16, torch.bfloat16):
        return max(1.0, 2.0 * -(-head_dim // MATRIX_UNIT_K))
    if is_fp8(input_dtype):  # the same matrix-unit steps, and the descales' two roundings of the score factor
        return max(1.0, 2.0 * -(-head_dim // MATRIX_UNIT_K)) + 2.0
    if input_dtype == torch.float64:
        return 2.0 * math.sqrt(head_dim)
    return max(1.0, math.sqrt(head_dim)) if op in GRADIENTS else 1.0


def allowed_error(op: str, input_dtype: torch.dtype, *, baseline_error: float, magnitude: Magnitudes) -> float:
    """Criterion 1's limit on the max absolute error of ``op``."""
    try:
        factor = FACTOR[op]
    except KeyError:
        raise ValueError(f"op={op!r}, but should be one of {tuple(FACTOR)}") from None
    return factor * baseline_error + floor(op, input_dtype, magnitude)


def max_finite_lse(ref) -> float:
    finite = ref.lse[torch.isfinite(ref.lse)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def score_magnitude(ref) -> float:
    """``max scale * sum_d |q_id| |k_jd|`` over the pairs with ``P_ij > 0``: the size of the terms
    summed into the scores that matter; with the spec's score modifications, plus what they round:
    the capped score (``|c tanh(s / c)| <= min(|s|, c)``) and ALiBi's ``|bias|``; with sinks, at least the
    largest ``|t_h|`` (a sink above the scores is the running max every exponent argument subtracts)."""
    ak_t = ref.k_expanded.abs().transpose(-1, -2)
    aq = ref.q64.abs()
    spec = ref.spec

    def top(c) -> torch.Tensor:
        size = abs(ref.scale) * (aq[:, :, c.r0:c.r1] @ ak_t)
        if spec.softcap is not None:  # the capped score |c tanh(s / c)| <= min(|s|, c) is rounded too
            size = size + size.clamp(max=spec.softcap)
        if spec.alibi_slopes is not None:
            size = size + spec.alibi_bias(ref.len_q, ref.len_k, heads=aq.shape[1], device=aq.device,
                                          rows=(c.r0, c.r1)).abs()
        return torch.where(c.p > 0, size, 0.0).max()

    tops = [top(c) for c in ref.chunks() if c.p.numel()]
    if ref.sink is not None:
        tops.append(ref.sink.abs().max())
    return float(torch.stack(tops).max()) if tops else 0.0
