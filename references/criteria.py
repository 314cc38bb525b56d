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

Criterion 2 (the componentwise rounding-error bound) lives in :mod:`references.bounds`.
"""

from __future__ import annotations

import torch

from references.metrics import unit_roundoff

FACTOR = {"out": 2.0, "lse": 2.0, "delta": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
EXTRA_ROUNDINGS = 4


def stored_dtype(op: str, input_dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel stores ``op`` in: LSE and Delta in float32 (float64 for float64 inputs)."""
    if op in ("lse", "delta"):
        return torch.float64 if input_dtype == torch.float64 else torch.float32
    return input_dtype


def summand_magnitude(op: str, ref) -> float:
    """The largest magnitude summed to form one entry of ``op``, from a float64
    :class:`references.attention.Reference` computed with ``dout``.

    ``dS = P (dP - Delta)`` is itself a difference that cancels (it sums to zero over each row), so
    the gradients' magnitudes use ``P (|dO| |V|^T + rowsum |dO| |O|)`` in place of ``|dS|``.
    """
    f64 = torch.float64
    if op == "out":
        mag = ref.p @ ref.v_expanded.abs()
    elif op == "lse":
        mag = torch.where(torch.isfinite(ref.row_max), ref.row_max.abs(), 0.0) + torch.where(
            torch.isfinite(ref.lse), ref.lse.abs(), 0.0)
    elif op == "delta":
        mag = (ref.dout.abs() * ref.out.abs()).sum(dim=-1)
    elif op == "dv":
        mag = ref.p.transpose(-1, -2) @ ref.dout.abs()
    elif op in ("dq", "dk"):
        ds_mag = ds_magnitude(ref)
        mag = ref.scale * (ds_mag @ ref.k_expanded.abs() if op == "dq" else
                           ds_mag.transpose(-1, -2) @ ref.q64.abs())
    else:
        raise ValueError(f"op={op!r}, but should be one of {tuple(FACTOR)}")
    return float(mag.to(f64).max()) if mag.numel() else 0.0


def ds_magnitude(ref) -> torch.Tensor:
    """``P (|dO| |V|^T + rowsum(|dO| |O|))``: the size of the terms that cancel in ``dS``."""
    dp_mag = ref.dout.abs() @ ref.v_expanded.abs().transpose(-1, -2)
    delta_mag = (ref.dout.abs() * ref.out.abs()).sum(dim=-1, keepdim=True)
    return ref.p * (dp_mag + delta_mag)


def floor(op: str, input_dtype: torch.dtype, magnitude: float, *, max_lse: float = 0.0) -> float:
    """The tiny absolute floor of criterion 1 for ``op`` whose summands reach ``magnitude``.

    For the gradients it adds the price of the contract's float32 LSE: a backward that recomputes
    ``P = exp(s - lse)`` from the stored LSE (FlashAttention's backward does) sees every ``P`` with a
    relative error of up to ``u32 * |lse|``, which eager autograd, keeping P, never pays.
    """
    dtype = stored_dtype(op, input_dtype)
    u_acc = unit_roundoff(stored_dtype("lse", input_dtype))
    # One rounding in the stored dtype, plus EXTRA_ROUNDINGS in the accumulator: fast kernels use the
    # hardware's approximate exp2 (up to 2 ulp where eager's exp is within 1) and fold the scale into
    # log2(e), converting scores to base 2 and the LSE back, each one more rounding eager never does.
    relative = unit_roundoff(dtype) + EXTRA_ROUNDINGS * u_acc
    if op in ("dq", "dk", "dv"):
        relative += u_acc * (max_lse + 1.0)
    return relative * magnitude + torch.finfo(dtype).tiny


def allowed_error(op: str, input_dtype: torch.dtype, *, baseline_error: float, magnitude: float,
                  max_lse: float = 0.0) -> float:
    """Criterion 1's limit on the max absolute error of ``op``."""
    try:
        factor = FACTOR[op]
    except KeyError:
        raise ValueError(f"op={op!r}, but should be one of {tuple(FACTOR)}") from None
    return factor * baseline_error + floor(op, input_dtype, magnitude, max_lse=max_lse)


def max_finite_lse(ref) -> float:
    finite = ref.lse[torch.isfinite(ref.lse)]
    return float(finite.abs().max()) if finite.numel() else 0.0
