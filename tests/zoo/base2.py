"""The exponent in base 2 (FlashAttention-3, FlexAttention, Triton's fused-attention tutorial).

``log2(e)`` is folded into the scale once, ``c = fl(scale * log2(e))``; the running max is kept over the
base-2 scores ``t = fl(qk * c)``; each probability is ``exp2`` of one fused multiply-add,
``p = exp2(fma(qk, c, -m2))`` (the product is not rounded before the subtraction); the LSE is kept in base 2,
``lse2 = m2 + log2(l)``, and converted at the end, ``lse = lse2 * ln(2)``. The backward recomputes
``P = exp2(fma(qk, c, -lse * log2(e)))`` from the stored LSE, as FlashAttention-2/3's backward does.
A fused multiply-add rounds once: the float32 product of two float32 values is exact in float64, so it is
computed there and rounded once (float64 inputs round in float64 throughout).
"""

from __future__ import annotations

import math

import torch

from tests.zoo.common import NEG_INF, acc_dtype, any_visible, expand, forward_rows, softmax_scale, tiles, visible

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to ``a``'s dtype."""
    if a.dtype == torch.float64:
        return a * b + c
    return (a.double() * b.double() + c.double()).to(a.dtype)


def _qk(q_tile, k_tile, acc):
    return q_tile.to(acc) @ k_tile.to(acc).transpose(-1, -2)


def _c(scale: float, acc) -> torch.Tensor:
    return torch.tensor(scale, dtype=acc) * torch.tensor(LOG2E, dtype=acc)


def forward(q, k, v, *, causal=False, scale=None, block_m=16, block_n=16):
    scale = softmax_scale(q, scale)
    acc = acc_dtype(q.dtype)
    hq, len_q, len_k = q.shape[1], q.shape[2], k.shape[2]
    ke, ve = expand(k, hq), expand(v, hq)
    c = _c(scale, acc)
    out = q.new_empty((*q.shape[:3], v.shape[3]))  # v may have a head dim of its own
    lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    for m0, m1 in forward_rows(len_q):
        shape = (q.shape[0], hq, m1 - m0)
        m2 = torch.full(shape, NEG_INF, dtype=acc, device=q.device)
        l = torch.zeros(shape, dtype=acc, device=q.device)
        o = torch.zeros(shape + (v.shape[3],), dtype=acc, device=q.device)
        for n0, n1 in tiles(len_k, block_n):
            if not any_visible(m1, n0, len_q, len_k, causal):
                continue
            vis = visible(m0, m1, n0, n1, len_q, len_k, causal, q.device)
            qk = torch.where(vis, _qk(q[:, :, m0:m1], ke[:, :, n0:n1], acc), 0.0)
            t = torch.where(vis, qk * c, NEG_INF)
            m_new = torch.maximum(m2, t.amax(dim=-1))
            m_ref = torch.where(torch.isneginf(m_new), 0.0, m_new)
            alpha = torch.exp2(m2 - m_ref)
            p = torch.where(vis, torch.exp2(_fma(qk, c, -m_ref[..., None])), 0.0)
            l = alpha * l + p.sum(dim=-1)
            o = alpha[..., None] * o + p.to(q.dtype).to(acc) @ ve[:, :, n0:n1].to(acc)
            m2 = m_new
        empty = l == 0
        out[:, :, m0:m1] = (o / torch.where(empty, 1.0, l)[..., None]).to(q.dtype)
        lse2 = m2 + torch.log2(l)
        lse[:, :, m0:m1] = torch.where(empty, NEG_INF, lse2 * torch.tensor(LN2, dtype=acc))
    return out, lse


def probabilities(q_tile, k_tile, scale, lse_tile, vis):
    """The backward's ``P = exp2(fma(qk, c, -lse * log2(e)))``."""
    acc = lse_tile.dtype
    c = _c(scale, acc)
    lse2 = torch.where(torch.isneginf(lse_tile), torch.inf, lse_tile * torch.tensor(LOG2E, dtype=acc))
    qk = torch.where(vis, _qk(q_tile, k_tile, acc), 0.0)
    return torch.where(vis, torch.exp2(_fma(qk, c, -lse2[..., None])), 0.0)
