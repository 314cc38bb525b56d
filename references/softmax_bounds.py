"""A first-order rounding-error bound for online softmax kernels.

Model of the kernel. The row ``x`` (exact input values) is consumed in any partition; the state
``(m, l)`` is kept in the accumulator precision with unit roundoff ``u`` (float32: 2^-24; float64
inputs: 2^-53); then ``lse = m + log(l)`` and ``y_j = exp(x_j - lse)``, rounded to the input dtype
(unit roundoff ``u_out``). ``exp`` and ``log`` are assumed accurate to 2 ulp (``2u``).

Sum. Each term ``exp(x_j - m_cur)`` carries a relative error of at most ``u |x_j - m_cur| + 2u + u``
(the subtraction, the exponential, the product with later rescale factors). Each rescale
``l * exp(m_old - m_new)`` adds at most ``u |m_old - m_new| + 3u`` relative to the part of ``l``
it scales, whose weight in the final ``l`` is at most ``exp(m_old - m_new)``; since
``t exp(-t) <= 1/e``, one rescale contributes at most ``(3 + 1/e) u`` relative to the final ``l``.
Adding ``n`` terms in any order adds ``gamma_n <= 1.01 n u``. Writing ``w_j = exp(x_j - lse)`` for
the exact weights, the relative error of ``l`` is at most

    eps_l = (1.01 n + 4 n + 3) u + u * sum_j w_j |x_j - m|

(the ``|x_j - m_cur| >= |x_j - m|`` mismatch only lowers terms that a later rescale shrinks).

LSE. ``|d lse| <= eps_l (1 + eps_l) + u |log l| + u |lse| + 2u``.

Softmax. ``y_j`` carries ``|d lse| + u |x_j - lse| + 2u`` relative error before the output rounding
(``u_out`` relative, plus half the smallest subnormal spacing of the output dtype absolute, which
covers values that underflow). A factor 1.1 covers the second-order terms.

Worst-case sums make the float32 bound loose by about ``sqrt(n)`` on random rows; the low-precision
output rounding (``u_out``) dominates for float16 and bfloat16.
"""

from __future__ import annotations

import torch

from references.metrics import MANTISSA_BITS, unit_roundoff


def softmax_bounds(x: torch.Tensor, *, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise bounds ``(y_bound [rows, n], lse_bound [rows])`` for a softmax kernel on ``x``."""
    x64 = x.to(torch.float64)
    n = x64.shape[-1]
    u = unit_roundoff(torch.float64 if dtype == torch.float64 else torch.float32)
    u_out = unit_roundoff(dtype)
    lse = torch.logsumexp(x64, dim=-1)
    empty = torch.isneginf(lse)
    lse_safe = torch.where(empty, 0.0, lse)
    m = torch.where(empty, 0.0, x64.amax(dim=-1))
    w = torch.exp(x64 - lse_safe[..., None])
    w = torch.where(torch.isneginf(x64), 0.0, w)
    spread = torch.where(torch.isneginf(x64), 0.0, w * (x64 - m[..., None]).abs()).sum(dim=-1)
    eps_l = (5.01 * n + 3) * u + u * spread
    log_l = (lse_safe - m).abs()
    d_lse = eps_l * (1 + eps_l) + u * (log_l + lse_safe.abs() + 2)
    gap = torch.where(torch.isneginf(x64), 0.0, (x64 - lse_safe[..., None]).abs())
    y = torch.where(empty[..., None], 0.0, w)
    eta = torch.finfo(dtype).tiny * 2.0 ** -MANTISSA_BITS[dtype]
    y_bound = 1.1 * (y * (d_lse[..., None] + u * gap + 2 * u + u_out)) + eta
    y_bound = torch.where(empty[..., None] | torch.isneginf(x64), 0.0, y_bound)
    lse_bound = torch.where(empty, 0.0, 1.1 * d_lse)
    return y_bound, lse_bound
