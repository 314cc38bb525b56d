"""The single-pass online softmax over one run of key tiles, the loop every FA2-style family shares.

:func:`partial` keeps FA2's running ``(m, l, acc)`` over the key tiles ``k0:k1`` of one tile of query rows
and returns the run's normalised output and LSE in the accumulator dtype. Two knobs cover families of real
kernels without changing what is computed:

* ``reverse``: the key tiles are visited last-first (FlashAttention-2's CUDA forward walks ``n_block``
  down from the last one a Q tile sees);
* ``threshold``: lazy rescaling (FlashAttention-4 on Blackwell): the running max moves only when a new
  score beats it by more than ``threshold`` (in natural-log units), so ``p = exp(s - m)`` may reach
  ``exp(threshold)`` and the rescaling multiplies are skipped for most tiles.
"""

from __future__ import annotations

import torch

from tests.zoo.common import (
    NEG_INF, acc_dtype, any_visible, expand, forward_rows, masked_scores, softmax_scale, tiles, visible)


def partial(q, ke, ve, *, m0, m1, k0, k1, causal, scale, block_n, reverse=False, threshold=0.0):
    """``(o, lse)`` of keys ``k0:k1`` for query rows ``m0:m1`` of ``q`` (``ke``, ``ve``: keys and values
    expanded to the query heads): ``o`` normalised, in the accumulator dtype, 0 on rows that see no key
    of the run, whose ``lse`` is -inf."""
    acc = acc_dtype(q.dtype)
    len_q, len_k = q.shape[2], ke.shape[2]
    shape = (q.shape[0], q.shape[1], m1 - m0)
    m = torch.full(shape, NEG_INF, dtype=acc, device=q.device)
    l = torch.zeros(shape, dtype=acc, device=q.device)
    o = torch.zeros(shape + (ve.shape[3],), dtype=acc, device=q.device)
    runs = [(k0 + a, k0 + b) for a, b in tiles(k1 - k0, block_n)]
    for n0, n1 in (reversed(runs) if reverse else runs):
        if not any_visible(m1, n0, len_q, len_k, causal):
            continue
        vis = visible(m0, m1, n0, n1, len_q, len_k, causal, q.device)
        s = masked_scores(q[:, :, m0:m1], ke[:, :, n0:n1], scale, acc, vis)
        top = torch.maximum(m, s.amax(dim=-1))
        # Lazy rescaling: keep the old max unless the new one is more than `threshold` above it.
        m_new = torch.where(torch.isneginf(m) | (top > m + threshold), top, m)
        m_ref = torch.where(torch.isneginf(m_new), 0.0, m_new)
        alpha = torch.exp(m - m_ref)
        p = torch.exp(s - m_ref[..., None])
        l = alpha * l + p.sum(dim=-1)
        o = alpha[..., None] * o + p.to(q.dtype).to(acc) @ ve[:, :, n0:n1].to(acc)
        m = m_new
    empty = l == 0
    return o / torch.where(empty, 1.0, l)[..., None], torch.where(empty, NEG_INF, m + torch.log(l))


def forward(q, k, v, *, causal=False, scale=None, block_m=16, block_n=16, reverse=False, threshold=0.0):
    """FA2's forward: one :func:`partial` over every key per Q tile, rounded once to the input dtype."""
    scale = softmax_scale(q, scale)
    hq, len_k = q.shape[1], k.shape[2]
    ke, ve = expand(k, hq), expand(v, hq)
    out = q.new_empty((*q.shape[:3], v.shape[3]))  # v may have a head dim of its own
    lse = torch.empty(q.shape[:3], dtype=acc_dtype(q.dtype), device=q.device)
    for m0, m1 in forward_rows(q.shape[2]):
        o, lse[:, :, m0:m1] = partial(q, ke, ve, m0=m0, m1=m1, k0=0, k1=len_k, causal=causal, scale=scale,
                                      block_n=block_n, reverse=reverse, threshold=threshold)
        out[:, :, m0:m1] = o.to(q.dtype)
    return out, lse
