"""A reference attention kernel written to flashverify's contract: copy it, then replace its body.

    pytest --pyargs verify --impl examples/reference_attention.py:attention -x

The contract (README.md, "The contract"), all of which this file follows:

- ``attention(q, k, v, *, causal, scale)`` with ``q`` ``[B, Hq, Nq, D]`` and ``k``, ``v`` ``[B, Hkv, Nk, D]``
  (``Hkv == Hq`` for a plain callable: it is assumed not to support grouped-query attention); any
  strides (transposed views, views into larger buffers, non-zero storage offsets);
- ``scale=None`` means ``1/sqrt(D)``; any other finite float (0, negative, large) is used as given;
- returns ``(out, lse)``: ``out`` with q's shape, dtype and device, ``lse`` ``[B, Hq, Nq]`` in float32
  (float64 for float64 inputs), the natural-log logsumexp of the scaled scores over the visible keys
  (or ``out`` alone: the LSE properties are then skipped);
- causal masks are aligned bottom-right: key ``j`` is visible to query ``i`` iff ``j <= i + Nk - Nq``;
- a row that sees no key (causal with ``Nq > Nk``, or ``Nk = 0``) gives ``out = 0`` and ``lse = -inf``,
  never NaN;
- keys a row cannot see may hold NaN, inf or huge values: they must not reach that row;
- float16, bfloat16, float32 and float64 inputs, any head dim, on the device of the inputs;
- gradients flow through ``out`` with autograd.

Everything is computed in float32 (float64 for float64 inputs) and rounded once at the end, like the
suite's same-precision eager baseline.
"""

from __future__ import annotations

import math

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax(scale q k^T, masked) v, and the LSE of the masked scaled scores."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v should be [B, H, N, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    len_q, len_k, head_dim = q.shape[2], k.shape[2], q.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)

    # Scores in the accumulator dtype; hidden keys get -inf (selected, never multiplied: NaN in a
    # hidden key cannot leak).
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(len_k - len_q)
        s = s.masked_fill(~visible, -math.inf)

    # Softmax with the row max subtracted; a row with no visible key (or Nk = 0) has max -inf: use 0
    # there, so its exponentials are exp(-inf) = 0 and its sum 0 (no NaN from -inf - -inf). The max is
    # a constant to autograd: the softmax does not depend on it, and differentiating through it only
    # adds rounding error to dQ and dK.
    m = s.amax(dim=-1, keepdim=True) if len_k else s.new_full((*s.shape[:-1], 1), -math.inf)
    m = torch.where(torch.isneginf(m), 0.0, m).detach()
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)

    # A row with no key: out = 0 (divide by 1 instead of 0), lse = -inf.
    out = (p / torch.where(l == 0, 1.0, l)) @ v.to(acc)
    lse = torch.where(l == 0, -math.inf, m + torch.log(l)).squeeze(-1)
    return out.to(q.dtype), lse.detach()
