"""Online softmax: the running ``(m, l)`` state behind every FlashAttention kernel.

A row ``x`` is summarised by ``m = max_j x_j`` and ``l = sum_j exp(x_j - m)``; ``lse = m + log(l)``
and ``softmax(x)_j = exp(x_j - lse)``. Two states of disjoint parts of a row merge exactly::

    m = max(m_a, m_b);  l = l_a * exp(m_a - m) + l_b * exp(m_b - m)

with identity ``(-inf, 0)``. Merging is associative and commutative (up to rounding), so a row can be
consumed one element at a time (streaming), a block at a time (blocked) or all at once, in any
partition, and always gives the same state. All-``-inf`` rows stay ``(-inf, 0)`` and give a zero
softmax with ``lse = -inf``, never NaN.

Kernels take a 2-D float tensor ``[rows, n]`` and return ``(softmax, lse)`` over the last dimension,
computed in float32 (float64 for float64 inputs), the softmax rounded to the input dtype.
"""

from __future__ import annotations

import torch

from flashverify_kernels.declaration import ALL_DTYPES

NEG_INF = float("-inf")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(x, kernel: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{kernel}: x is a {type(x).__name__}, but should be a torch.Tensor")
    if x.dim() != 2:
        raise ValueError(f"{kernel}: x.shape={tuple(x.shape)}, but should be 2-D [rows, n]")
    if x.dtype not in ALL_DTYPES:
        raise ValueError(f"{kernel}: x.dtype={x.dtype}, but should be one of float16, bfloat16, float32, float64")


def identity_state(rows: int, *, dtype=torch.float32, device=None):
    """The merge identity ``(-inf, 0)`` for ``rows`` rows."""
    return (torch.full((rows,), NEG_INF, dtype=dtype, device=device),
            torch.zeros((rows,), dtype=dtype, device=device))


def merge(a, b):
    """Merge two ``(m, l)`` states of disjoint parts of the same rows."""
    m_a, l_a = a
    m_b, l_b = b
    m = torch.maximum(m_a, m_b)
    m_ref = torch.where(m == NEG_INF, 0.0, m)  # both parts empty: keep (-inf, 0) without NaN
    l = l_a * torch.exp(m_a - m_ref) + l_b * torch.exp(m_b - m_ref)
    return m, l


def state(x: torch.Tensor):
    """The ``(m, l)`` state of each row of ``x`` (last dimension), in ``x``'s dtype."""
    m = x.amax(dim=-1) if x.shape[-1] else torch.full(x.shape[:-1], NEG_INF, dtype=x.dtype, device=x.device)
    m_ref = torch.where(m == NEG_INF, 0.0, m)
    return m, torch.exp(x - m_ref[..., None]).sum(dim=-1)


def lse_of(st):
    """``lse = m + log(l)``; ``-inf`` for the empty state."""
    m, l = st
    return torch.where(l == 0, NEG_INF, m + torch.log(l))


def _normalise(x_acc, st, dtype):
    lse = lse_of(st)
    y = torch.exp(x_acc - torch.where(lse == NEG_INF, 0.0, lse)[..., None])
    y = torch.where(lse[..., None] == NEG_INF, 0.0, y)
    return y.to(dtype), lse


def streaming_softmax(x: torch.Tensor):
    """One element at a time: the state absorbs ``x[:, j]`` for j = 0, 1, ...; then one normalising pass."""
    _check(x, "streaming_softmax")
    xa = x.to(_acc_dtype(x.dtype))
    st = identity_state(x.shape[0], dtype=xa.dtype, device=x.device)
    for j in range(x.shape[1]):
        x_j = xa[:, j]
        # The state of the one-element row x_j is (x_j, 1), or the identity (-inf, 0) if x_j = -inf.
        st = merge(st, (x_j, (x_j != NEG_INF).to(xa.dtype)))
    return _normalise(xa, st, x.dtype)


def blocked_softmax(x: torch.Tensor, *, block_n: int = 64):
    """A block of ``block_n`` elements at a time, merged into the running state."""
    _check(x, "blocked_softmax")
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 1:
        raise ValueError(f"blocked_softmax: block_n={block_n!r}, but should be a positive int")
    xa = x.to(_acc_dtype(x.dtype))
    st = identity_state(x.shape[0], dtype=xa.dtype, device=x.device)
    for n0 in range(0, x.shape[1], block_n):
        st = merge(st, state(xa[:, n0:n0 + block_n]))
    return _normalise(xa, st, x.dtype)


def batched_softmax(x: torch.Tensor):
    """All rows at once, one state per row from the whole row."""
    _check(x, "batched_softmax")
    xa = x.to(_acc_dtype(x.dtype))
    return _normalise(xa, state(xa), x.dtype)
