"""What the zoo's kernels share: input handling, the tile loops' masks, an FA2 backward and the autograd glue.

Each family module computes its forward its own way; the pieces here are the ones every FlashAttention
kernel has in common and that the family does not change: the contract's inputs (``[B, H, N, D]``, grouped
heads, ``scale=None`` meaning ``1/sqrt(D)``), the bottom-right causal mask of a tile, and the FA2 backward
(``P`` recomputed from the stored LSE, ``Delta = rowsum(dO * O)``, ``dS`` cast to the input dtype).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

NEG_INF = float("-inf")
BLOCKS = (1, 2, 3, 5, 8, 16, 32, 64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulator and statistics dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    if q.dim() != 4:
        raise ValueError(f"q should be [B, H, N, D]; got shape {tuple(q.shape)}")
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def expand(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads of their group (head h reads h // group)."""
    return t.repeat_interleave(heads_q // t.shape[1], dim=1)


def reduce_heads(grad: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """A per-query-head key gradient summed over each group (in its dtype, the accumulator's)."""
    b, hq, n, d = grad.shape
    return grad.view(b, heads_kv, hq // heads_kv, n, d).sum(dim=2)


def tiles(n: int, block: int) -> list[tuple[int, int]]:
    return [(i, min(i + block, n)) for i in range(0, n, block)]


def forward_rows(len_q: int) -> list[tuple[int, int]]:
    """The query tiles of a zoo forward: one tile of every row. A forward's rows are independent (each keeps
    its own max, sum and accumulator over the key tiles), so a tile of ``block_m`` rows computes what this
    one computes for them; the Python loops then run once per key tile, not once per (query tile, key
    tile) pair. ``block_m`` still sets the backward's query tiles, over which dK and dV are summed."""
    return tiles(len_q, max(len_q, 1))


def visible(m0: int, m1: int, n0: int, n1: int, len_q: int, len_k: int, causal: bool, device) -> torch.Tensor:
    """Keys ``n0:n1`` visible to queries ``m0:m1`` (bottom-right causal alignment), bool ``[rows, keys]``."""
    rows = torch.arange(m0, m1, device=device)[:, None]
    cols = torch.arange(n0, n1, device=device)[None, :]
    return (cols <= rows + (len_k - len_q)) | (not causal)


def any_visible(m1: int, n0: int, len_q: int, len_k: int, causal: bool) -> bool:
    """Whether some query of rows ``< m1`` sees key ``n0`` (the tile's first key): decided without looking at
    the mask, so a GPU run does not wait for the device once a tile."""
    return not causal or n0 <= m1 - 1 + len_k - len_q


def masked_scores(q_tile, k_tile, scale, acc, vis) -> torch.Tensor:
    """``scale * q k^T`` in the accumulator, ``-inf`` where hidden (selected, so NaN in a hidden key stays out)."""
    s = (q_tile.to(acc) @ k_tile.to(acc).transpose(-1, -2)) * scale
    return s.masked_fill(~vis, NEG_INF)


def natural_exp(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``P = exp(s - lse)`` of the backward (0 on rows that see no key, whose ``lse`` is -inf)."""
    return torch.exp(s - torch.where(torch.isneginf(lse), math.inf, lse)[..., None])


def fa2_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale: float | None = None,
                 block_m: int = 16, block_n: int = 16, probabilities: Callable = None, shuffle: bool = False):
    """The FA2 backward: ``(dq, dk, dv, delta)``. KV tiles outer, Q tiles inner; ``P`` from the stored LSE
    (``probabilities(q_tile, k_tile, scale, lse_tile, vis)``, default ``exp(s - lse)``); ``dS`` cast to the
    input dtype before ``dQ`` and ``dK``. ``shuffle``: every accumulation (dQ over key tiles, dK and dV over
    query tiles and over a group's heads) is summed in a random order, as atomics sum them."""
    scale = softmax_scale(q, scale)
    acc = acc_dtype(q.dtype)
    b, hq, len_q, d = q.shape
    hkv, len_k = k.shape[1], k.shape[2]
    ke, ve = expand(k, hq), expand(v, hq)
    do = dout.to(acc)
    delta = (do * out.to(acc)).sum(dim=-1)
    parts_dq: dict[int, list] = {m0: [] for m0, _ in tiles(len_q, block_m)}
    dk = torch.zeros((b, hq, len_k, d), dtype=acc, device=q.device)
    dv = torch.zeros((b, hq, len_k, v.shape[3]), dtype=acc, device=q.device)  # v's head dim
    for n0, n1 in tiles(len_k, block_n):
        k_tile, v_tile = ke[:, :, n0:n1], ve[:, :, n0:n1].to(acc)
        parts_dk, parts_dv = [], []
        for m0, m1 in tiles(len_q, block_m):
            if not any_visible(m1, n0, len_q, len_k, causal):
                continue
            vis = visible(m0, m1, n0, n1, len_q, len_k, causal, q.device)
            q_tile = q[:, :, m0:m1]
            if probabilities is None:
                p = natural_exp(masked_scores(q_tile, k_tile, scale, acc, vis), lse[:, :, m0:m1].to(acc))
            else:
                p = probabilities(q_tile, k_tile, scale, lse[:, :, m0:m1].to(acc), vis)
            p = torch.where(vis, p, 0.0)
            parts_dv.append(p.to(q.dtype).to(acc).transpose(-1, -2) @ do[:, :, m0:m1])
            dp = do[:, :, m0:m1] @ v_tile.transpose(-1, -2)
            ds = (p * (dp - delta[:, :, m0:m1, None])).to(q.dtype).to(acc)
            parts_dk.append(ds.transpose(-1, -2) @ q_tile.to(acc))
            parts_dq[m0].append(ds @ k_tile.to(acc))
        dk[:, :, n0:n1] = _sum(parts_dk, shuffle, like=dk[:, :, n0:n1]) * scale
        dv[:, :, n0:n1] = _sum(parts_dv, shuffle, like=dv[:, :, n0:n1])
    dq = torch.zeros((b, hq, len_q, d), dtype=acc, device=q.device)
    for m0, m1 in tiles(len_q, block_m):
        dq[:, :, m0:m1] = _sum(parts_dq[m0], shuffle, like=dq[:, :, m0:m1]) * scale
    if shuffle:
        dk, dv = _shuffled_group_sum(dk, hkv), _shuffled_group_sum(dv, hkv)
    else:
        dk, dv = reduce_heads(dk, hkv), reduce_heads(dv, hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), delta


def _sum(parts: list, shuffle: bool, *, like: torch.Tensor) -> torch.Tensor:
    """``parts`` added one after another in the accumulator (in a random order when ``shuffle``)."""
    if shuffle:
        parts = random.sample(parts, len(parts))
    total = torch.zeros_like(like)
    for part in parts:
        total = total + part
    return total


def _shuffled_group_sum(grad: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """:func:`reduce_heads` with the group's heads added in a random order."""
    b, hq, n, d = grad.shape
    heads = list(grad.view(b, heads_kv, hq // heads_kv, n, d).unbind(dim=2))
    return _sum(heads, True, like=heads[0])


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_m, block_n, forward, backward):
        out, lse = forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = dict(causal=causal, scale=scale, block_m=block_m, block_n=block_n)
        ctx.backward_fn = backward
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, _ = ctx.backward_fn(q, k, v, out, lse, dout, **ctx.settings)
        return dq, dk, dv, None, None, None, None, None, None


def with_autograd(raw_forward: Callable, raw_backward: Callable = fa2_backward) -> Callable:
    """The kernel the suite calls: ``raw_forward`` with ``raw_backward`` as its autograd backward."""

    def attention(q, k, v, *, causal: bool = False, scale: float | None = None, block_m: int = 16,
                  block_n: int = 16):
        return _Attention.apply(q, k, v, causal, scale, block_m, block_n, raw_forward, raw_backward)

    attention.__name__ = attention.__qualname__ = getattr(raw_forward, "__name__", "attention")
    return attention
