"""Kernels that cut the keys into runs and merge the runs' ``(o, lse)`` partials through their float32 LSEs.

* :func:`split_kv`: split-KV chosen by the kernel, not the caller (FlashAttention-2's ``flash_fwd_splitkv``
  with its combine kernel, FlashDecoding, flashinfer's ``merge_state``): ``S`` splits picked from ``Nk`` (2 to
  128, often more than the keys, so some splits see no key), each split's normalised partial and LSE
  kept in float32, merged in one pass: ``lse = top + log(sum_s exp(lse_s - top))``, ``out = sum_s
  exp(lse_s - lse) o_s``.
* :func:`ring`: ring attention's merge: each device's chunk of keys gives a float32 partial, folded into the
  running result one chunk at a time, ``new = lse + log1p(exp(lse_c - lse))`` (larger first),
  ``out = exp(lse - new) out + exp(lse_c - new) o_c`` (the ring attention paper's update, as
  ring-flash-attention first wrote it).

Not in the zoo: :func:`ring_sigmoid`, the later rewrite of that update as ``out -= sigmoid(lse_c - lse) (out -
o_c)``. It computes the old result's weight ``1 - sigmoid(x)`` by cancellation, so where a chunk with tiny
weight holds large values its contribution keeps an absolute error of a rounding of those values: the
suite's componentwise bound flags it (``tests/test_zoo.py`` shows a float32 element with a relative error
above 1), and the update above is as cheap and has no such loss.
"""

from __future__ import annotations

import torch

from tests.zoo.common import NEG_INF, acc_dtype, expand, forward_rows, softmax_scale
from tests.zoo.online import partial


# The split counts the kernel picks from, by Nk: FlashAttention-2's heuristic ranges from 1 to 128 splits and
# makes more splits than key tiles at short lengths; here the choice varies with Nk so that every count is
# reached at the lengths a CPU run draws.
SPLIT_COUNTS = (2, 3, 4, 7, 16, 31, 64, 100, 128)


def num_splits(len_k: int) -> int:
    """The kernel's own split count for ``len_k`` keys (2 to 128; more than the keys for short ones)."""
    return SPLIT_COUNTS[len_k % len(SPLIT_COUNTS)]


def num_chunks(len_k: int) -> int:
    """Ring attention's devices for ``len_k`` keys: 2 to 8 chunks."""
    return 2 + len_k % 7


def _runs(len_k: int, count: int) -> list[tuple[int, int]]:
    per = -(-len_k // count)
    return [(min(len_k, t * per), min(len_k, (t + 1) * per)) for t in range(count)]


def _per_q_tile(q, k, v, *, causal, scale, block_m, block_n, count, merge):
    scale = softmax_scale(q, scale)
    hq, len_k = q.shape[1], k.shape[2]
    ke, ve = expand(k, hq), expand(v, hq)
    out = q.new_empty((*q.shape[:3], v.shape[3]))  # v may have a head dim of its own
    lse = torch.empty(q.shape[:3], dtype=acc_dtype(q.dtype), device=q.device)
    for m0, m1 in forward_rows(q.shape[2]):
        parts = [partial(q, ke, ve, m0=m0, m1=m1, k0=k0, k1=k1, causal=causal, scale=scale, block_n=block_n)
                 for k0, k1 in _runs(len_k, count(len_k))]
        o, lse[:, :, m0:m1] = merge(parts)
        out[:, :, m0:m1] = o.to(q.dtype)
    return out, lse


def _combine(parts):
    """One-pass merge of ``[(o_s, lse_s)]`` (empty splits have lse -inf and o 0)."""
    lses = torch.stack([lse_s for _, lse_s in parts])
    outs = torch.stack([o_s for o_s, _ in parts])
    top = lses.amax(dim=0)
    top = torch.where(torch.isneginf(top), 0.0, top)
    total = torch.exp(lses - top).sum(dim=0)
    lse = torch.where(total == 0, NEG_INF, top + torch.log(total))
    weights = torch.exp(lses - torch.where(torch.isneginf(lse), 0.0, lse))
    return (weights[..., None] * outs).sum(dim=0), lse


def _fold(parts):
    """Ring attention's merge, one chunk after another (a chunk that saw no key changes nothing)."""
    out, lse = parts[0]
    for o_c, lse_c in parts[1:]:
        hi, lo = torch.maximum(lse, lse_c), torch.minimum(lse, lse_c)
        hi_ref = torch.where(torch.isneginf(hi), 0.0, hi)
        new = torch.where(torch.isneginf(hi), NEG_INF, hi + torch.log1p(torch.exp(lo - hi_ref)))
        new_ref = torch.where(torch.isneginf(new), 0.0, new)
        out = torch.exp(lse - new_ref)[..., None] * out + torch.exp(lse_c - new_ref)[..., None] * o_c
        lse = new
    return out, lse


def split_kv(q, k, v, *, causal=False, scale=None, block_m=16, block_n=16):
    return _per_q_tile(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, count=num_splits,
                       merge=_combine)


def ring(q, k, v, *, causal=False, scale=None, block_m=16, block_n=16):
    return _per_q_tile(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, count=num_chunks,
                       merge=_fold)


def _fold_sigmoid(parts):
    """ring-flash-attention's ``update_out_and_lse``: the fold written with sigmoid and logsigmoid."""
    out, lse = parts[0]
    for o_c, lse_c in parts[1:]:
        first, skip = torch.isneginf(lse), torch.isneginf(lse_c)
        a = torch.where(first | skip, 0.0, lse)
        b = torch.where(first | skip, 0.0, lse_c)
        folded = out - torch.sigmoid(b - a)[..., None] * (out - o_c)
        new = a - torch.nn.functional.logsigmoid(a - b)
        out = torch.where(first[..., None], o_c, torch.where(skip[..., None], out, folded))
        lse = torch.where(first, lse_c, torch.where(skip, lse, new))
    return out, lse


def ring_sigmoid(q, k, v, *, causal=False, scale=None, block_m=16, block_n=16):
    return _per_q_tile(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, count=num_chunks,
                       merge=_fold_sigmoid)
