"""Two-pass softmax: a first pass over every key tile finds each row's max, a second sums ``exp(s - max)``
and accumulates ``p @ v`` with no rescaling (the "safe softmax" of kernels that can afford to read K twice:
decode kernels with short contexts, xformers' and FlashDecoding++'s fixed-max variants)."""

from __future__ import annotations

import torch

from tests.zoo.common import (
    NEG_INF, acc_dtype, any_visible, expand, forward_rows, masked_scores, softmax_scale, tiles, visible)


def forward(q, k, v, *, causal=False, scale=None, block_m=16, block_n=16):
    scale = softmax_scale(q, scale)
    acc = acc_dtype(q.dtype)
    hq, len_q, len_k = q.shape[1], q.shape[2], k.shape[2]
    ke, ve = expand(k, hq), expand(v, hq)
    out = q.new_empty((*q.shape[:3], v.shape[3]))  # v may have a head dim of its own
    lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    for m0, m1 in forward_rows(len_q):
        key_tiles = [(n0, n1, visible(m0, m1, n0, n1, len_q, len_k, causal, q.device))
                     for n0, n1 in tiles(len_k, block_n) if any_visible(m1, n0, len_q, len_k, causal)]
        shape = (q.shape[0], hq, m1 - m0)
        m = torch.full(shape, NEG_INF, dtype=acc, device=q.device)
        for n0, n1, vis in key_tiles:  # pass 1: the row max
            m = torch.maximum(m, masked_scores(q[:, :, m0:m1], ke[:, :, n0:n1], scale, acc, vis).amax(dim=-1))
        m_ref = torch.where(torch.isneginf(m), 0.0, m)
        l = torch.zeros(shape, dtype=acc, device=q.device)
        o = torch.zeros(shape + (v.shape[3],), dtype=acc, device=q.device)
        for n0, n1, vis in key_tiles:  # pass 2: the sum and the output, against the final max
            p = torch.exp(masked_scores(q[:, :, m0:m1], ke[:, :, n0:n1], scale, acc, vis) - m_ref[..., None])
            l = l + p.sum(dim=-1)
            o = o + p.to(q.dtype).to(acc) @ ve[:, :, n0:n1].to(acc)
        empty = l == 0
        out[:, :, m0:m1] = (o / torch.where(empty, 1.0, l)[..., None]).to(q.dtype)
        lse[:, :, m0:m1] = torch.where(empty, NEG_INF, m + torch.log(l))
    return out, lse
