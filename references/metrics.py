"""Error metrics, computed in one place and reused by the properties, the tests and the reports.

All metrics compare an ``actual`` tensor with a float64 ``expected`` one, elementwise, in float64.
Infinities are compared as values: the same infinity in both places is no error (a fully masked
row's ``lse = -inf``), any other disagreement involving an infinity or a NaN is an infinite error, so
NaN can never hide inside a max or a mean.
"""

from __future__ import annotations

import dataclasses
import math

import torch

F64 = torch.float64

# Unit roundoff u = 2^-p (half the spacing of floats in [1, 2)) and the smallest positive normal.
UNIT_ROUNDOFF = {
    torch.float16: 2.0 ** -11,
    torch.bfloat16: 2.0 ** -8,
    torch.float32: 2.0 ** -24,
    torch.float64: 2.0 ** -53,
    torch.float8_e4m3fn: 2.0 ** -4,
    torch.float8_e5m2: 2.0 ** -3,
}
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52,
                 torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def unit_roundoff(dtype: torch.dtype) -> float:
    try:
        return UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(f"dtype={dtype} has no unit roundoff here; floating dtypes: "
                         f"{', '.join(str(d) for d in UNIT_ROUNDOFF)}") from None


def abs_error(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Elementwise ``|actual - expected|`` in float64: 0 where both are the same infinity,
    ``inf`` where either is NaN or they disagree about an infinity.

    With ``dtype``, an expected value beyond that dtype's range counts as the infinity it rounds to:
    a kernel storing a true -77216 in float16 can only store -inf, and that is no error.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"actual.shape={tuple(actual.shape)} and expected.shape={tuple(expected.shape)} differ")
    a, e = actual.detach().to(F64), expected.detach().to(F64)
    if dtype is not None and dtype != F64:
        e = torch.where(torch.isinf(e.to(dtype)), e.to(dtype).to(F64), e)
    err = (a - e).abs()
    same_inf = torch.isinf(a) & (a == e)
    err = torch.where(same_inf, 0.0, err)
    return torch.where(torch.isnan(err), math.inf, err)


def ulp(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` floats at each value of ``expected`` (subnormal spacing near zero)."""
    e = expected.detach().to(F64).abs()
    finfo = torch.finfo(dtype)
    mant = MANTISSA_BITS[dtype]
    min_exp = math.log2(finfo.tiny)
    exp = torch.floor(torch.log2(torch.where(e > 0, e, finfo.tiny)))
    exp = torch.clamp(torch.where(torch.isfinite(exp), exp, min_exp), min=min_exp)
    return torch.pow(2.0, exp - mant).to(F64)


@dataclasses.dataclass(frozen=True)
class ErrorStats:
    """Summary of one comparison. ``worst_index`` is the index of the largest absolute error."""

    max_abs: float
    max_rel: float
    rmse: float
    max_ulp: float
    worst_index: tuple[int, ...]
    worst_actual: float
    worst_expected: float
    nan_count: int
    numel: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def error_stats(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None) -> ErrorStats:
    """Max abs, max rel, RMSE and max ULP (in ``dtype``, default ``actual.dtype``) of ``actual``.

    Max ULP is in units in the last place of each row's scale: the largest finite reference magnitude of
    the row (the last dimension of a ``[B, H, N, D]`` result; the whole tensor for ``[B, H, N]`` ones, the
    LSE and Delta). An element near zero in a row of ones is rounded in the units of the ones, so its ULP
    figure says how many of those units it is off (measured in its own, a cancelled gradient's 1e-9 reads
    as 1e7 ULP). Rows whose scale is zero or subnormal are left out (0 when every row is)."""
    dtype = actual.dtype if dtype is None else dtype
    err = abs_error(actual, expected, dtype=dtype)
    e = expected.detach().to(F64)
    finite_e = torch.where(torch.isfinite(e), e.abs(), 0.0)
    tiny = torch.finfo(dtype).tiny
    rel = err / torch.clamp(finite_e, min=tiny)
    # ULPs of the row's scale (its largest finite reference magnitude): a row that is all zero or subnormal
    # (a fully masked row) has no meaningful unit and is left out (its error is in max abs and RMSE).
    if e.dim() >= 4:
        scale = finite_e.amax(dim=-1, keepdim=True).expand_as(finite_e) if e.shape[-1] else finite_e
    else:
        scale = torch.full_like(finite_e, float(finite_e.max()) if finite_e.numel() else 0.0)
    normal = scale >= tiny
    ulps = torch.where(normal, err / ulp(torch.where(normal, scale, 1.0), dtype), 0.0)
    n = err.numel()
    if n == 0:
        return ErrorStats(0.0, 0.0, 0.0, 0.0, (), 0.0, 0.0, 0, 0)
    flat = int(torch.argmax(err).item())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
    return ErrorStats(
        max_abs=float(err.max()),
        max_rel=float(rel.max()),
        rmse=float(torch.sqrt((err ** 2).mean())),
        max_ulp=float(ulps.max()),
        worst_index=idx,
        worst_actual=float(actual.detach().to(F64)[idx]) if idx else 0.0,
        worst_expected=float(e[idx]) if idx else 0.0,
        nan_count=int(torch.isnan(actual.detach()).sum()),
        numel=n,
    )


def max_ratio(err: torch.Tensor, bound: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """Largest ``err / bound`` and where it is; 0/0 counts as 0, x/0 with x > 0 as inf."""
    ratio = torch.where(err == 0, 0.0, err / bound.to(F64))
    ratio = torch.where(torch.isnan(ratio), math.inf, ratio)
    if ratio.numel() == 0:
        return 0.0, ()
    flat = int(torch.argmax(ratio).item())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ratio.shape))
    return float(ratio[idx]), idx
