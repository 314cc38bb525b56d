"""Same-precision eager attention: the baseline of pass criterion 1.

FlashAttention's and PyTorch's own tests hold a kernel to a multiple of the error that plain eager
attention makes at the same precision. Here that eager attention is defined exactly, as a GPU
framework would run it for float16/bfloat16/float32 inputs:

forward
    scores and softmax in float32 (float64 for float64 inputs), ``P`` cast to the input dtype,
    ``P @ V`` accumulated in float32, output rounded to the input dtype once; LSE kept in float32.
backward
    ``dV = P^T dO`` with ``P`` in the input dtype, ``dP = dO V^T`` and ``Delta = rowsum(dO * O)`` in
    float32 (``O`` being the baseline's own rounded output), ``dS = P (dP - Delta)`` cast to the input
    dtype, ``dQ = scale dS K`` and ``dK = scale dS^T Q`` accumulated in float32, each rounded once.

Products of two float16 or bfloat16 numbers are exact in float32, so up-casting both operands and
multiplying in float32 is what a tensor-core dot with a float32 accumulator computes.
"""

from __future__ import annotations

import math

import torch

from references.attention import expand_kv, reduce_group, visible_mask


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _low(t: torch.Tensor, dtype: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    """Round to the input dtype, then hold exactly in the accumulator dtype."""
    return t.to(dtype).to(acc)


def forward(q, k, v, *, causal: bool = False, scale: float | None = None,
            alignment: str = "bottom_right"):
    """Eager ``(out, lse)`` at the precision of the inputs (see module docstring)."""
    dtype, acc = q.dtype, acc_dtype(q.dtype)
    hq = q.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    ke, ve = expand_kv(k, hq).to(acc), expand_kv(v, hq).to(acc)
    visible = visible_mask(q.shape[2], k.shape[2], causal=causal, alignment=alignment, device=q.device)
    s = torch.where(visible, (q.to(acc) @ ke.transpose(-1, -2)) * scale, -math.inf)
    m = s.amax(dim=-1, keepdim=True) if k.shape[2] else torch.full((*q.shape[:3], 1), -math.inf,
                                                                     dtype=acc, device=q.device)
    m = torch.where(torch.isneginf(m), 0.0, m)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    p = torch.where(l == 0, 0.0, e / torch.where(l == 0, 1.0, l))
    out = (_low(p, dtype, acc) @ ve).to(dtype)
    lse = torch.where(l == 0, -math.inf, m + torch.log(l)).squeeze(-1)
    return out, lse


def backward(q, k, v, dout, *, causal: bool = False, scale: float | None = None,
             alignment: str = "bottom_right", out: torch.Tensor | None = None):
    """Eager ``(dq, dk, dv, delta)`` at the precision of the inputs (see module docstring)."""
    dtype, acc = q.dtype, acc_dtype(q.dtype)
    hq, hkv = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if out is None:
        out, _ = forward(q, k, v, causal=causal, scale=scale, alignment=alignment)
    ke, ve = expand_kv(k, hq).to(acc), expand_kv(v, hq).to(acc)
    visible = visible_mask(q.shape[2], k.shape[2], causal=causal, alignment=alignment, device=q.device)
    s = torch.where(visible, (q.to(acc) @ ke.transpose(-1, -2)) * scale, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    do = dout.to(acc)
    dv = _low(p, dtype, acc).transpose(-1, -2) @ do
    dp = do @ ve.transpose(-1, -2)
    delta = (do * out.to(acc)).sum(dim=-1)
    ds = _low(p * (dp - delta[..., None]), dtype, acc)
    dq = (ds @ ke) * scale
    dk = (ds.transpose(-1, -2) @ q.to(acc)) * scale
    return (dq.to(dtype), reduce_group(dk, hkv).to(dtype), reduce_group(dv, hkv).to(dtype), delta)
