"""Pass criteria as data: the baseline factors and the absolute floors, keyed by op and dtype.

Criterion 1 (baseline-relative): ``max|kernel - ref| <= FACTOR[op] * max|eager - ref| + floor``, where
``eager`` is the same-precision eager attention of :mod:`references.baseline` on the same inputs.
The factors are the ones FlashAttention's and PyTorch's own tests use (2 for the forward, 3 for the
gradients, whose reduction order differs more between kernels).

The floor keeps criterion 1 meaningful when the eager baseline happens to be exact (a constant V, a
single visible key): one rounding of the largest reference value in the stored dtype, plus the
smallest normal of that dtype for results that underflow. A kernel within one rounding of the largest
entry has done all that its output format allows.

Criterion 2 (the componentwise rounding-error bound) lives in :mod:`references.bounds`.
"""

from __future__ import annotations

import torch

from references.metrics import unit_roundoff

FACTOR = {"out": 2.0, "lse": 2.0, "delta": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}


def stored_dtype(op: str, input_dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel stores ``op`` in: LSE and Delta in float32 (float64 for float64 inputs)."""
    if op in ("lse", "delta"):
        return torch.float64 if input_dtype == torch.float64 else torch.float32
    return input_dtype


def floor(op: str, input_dtype: torch.dtype, expected: torch.Tensor) -> float:
    """The tiny absolute floor of criterion 1 for ``op`` with these reference values."""
    dtype = stored_dtype(op, input_dtype)
    finite = expected[torch.isfinite(expected)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return unit_roundoff(dtype) * scale + torch.finfo(dtype).tiny


def allowed_error(op: str, input_dtype: torch.dtype, *, baseline_error: float, expected: torch.Tensor) -> float:
    """Criterion 1's limit on the max absolute error of ``op``."""
    try:
        factor = FACTOR[op]
    except KeyError:
        raise ValueError(f"op={op!r}, but should be one of {tuple(FACTOR)}") from None
    return factor * baseline_error + floor(op, input_dtype, expected)
