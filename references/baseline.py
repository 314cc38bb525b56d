"""Same-precision eager attention: the baseline of pass criterion 1.

FlashAttention's and PyTorch's own tests hold a kernel to a multiple of the error that plain eager
attention makes at the same precision. Here that eager attention is defined exactly, as a GPU
framework would run it for float16/bfloat16/float32 inputs:

forward
    scores and softmax in float32 (float64 for float64 inputs), the spec's score modifications (softcap,
    ALiBi) in the same precision, ``P`` cast to the input dtype,
    ``P @ V`` accumulated in float32, output rounded to the input dtype once; LSE kept in float32.
backward
    ``dV = P^T dO`` with ``P`` in the input dtype, ``dP = dO V^T`` and ``Delta = rowsum(dO * O)`` in
    float32 (``O`` being the baseline's own rounded output), ``dS = P (dP - Delta)`` (times softcap's
    ``1 - tanh^2`` in float32) cast to the input
    dtype, ``dQ = scale dS K`` and ``dK = scale dS^T Q`` accumulated in float32, each rounded once.

Products of two float16 or bfloat16 numbers are exact in float32, so up-casting both operands and
multiplying in float32 is what a tensor-core dot with a float32 accumulator computes.

Both run in chunks of query rows (``references.attention.row_chunks``): everything but ``dK`` and
``dV`` is row-wise and unchanged by the chunking; ``dK`` and ``dV`` add the chunks' partial sums in
the accumulator dtype, which is one more valid float32 summation order of an eager backward. With one
chunk (every case within the memory budget) the arithmetic is the unchunked one.
"""

from __future__ import annotations

import math

import torch

from references.attention import expand_kv, reduce_group, row_chunks
from references.spec import AttentionSpec, require_spec


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _low(t: torch.Tensor, dtype: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    """Round to the input dtype, then hold exactly in the accumulator dtype."""
    return t.to(dtype).to(acc)


def forward(q, k, v, *, spec: AttentionSpec = AttentionSpec(), scale: float | None = None):
    """Eager ``(out, lse)`` at the precision of the inputs (see module docstring)."""
    require_spec(spec)
    dtype, acc = q.dtype, acc_dtype(q.dtype)
    b, hq, len_q, d = q.shape
    len_k = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    ke, ve = expand_kv(k, hq).to(acc), expand_kv(v, hq).to(acc)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    for r0, r1 in row_chunks(len_q, len_k, d, b * hq):
        rows = slice(r0, r1)
        visible = spec.rows(len_q, len_k, device=q.device, rows=(r0, r1))
        raw = (q[:, :, rows].to(acc) @ ke.transpose(-1, -2)) * scale
        s = torch.where(visible, spec.modify(raw, len_q, len_k, rows=(r0, r1)), -math.inf)
        m = s.amax(dim=-1, keepdim=True) if len_k else torch.full((*s.shape[:3], 1), -math.inf,
                                                                   dtype=acc, device=q.device)
        m = torch.where(torch.isneginf(m), 0.0, m)
        e = torch.exp(s - m)
        l = e.sum(dim=-1, keepdim=True)
        p = torch.where(l == 0, 0.0, e / torch.where(l == 0, 1.0, l))
        out[:, :, rows] = (_low(p, dtype, acc) @ ve).to(dtype)
        lse[:, :, rows] = torch.where(l == 0, -math.inf, m + torch.log(l)).squeeze(-1)
    return out, lse


def backward(q, k, v, dout, *, spec: AttentionSpec = AttentionSpec(), scale: float | None = None,
             out: torch.Tensor | None = None):
    """Eager ``(dq, dk, dv, delta)`` at the precision of the inputs (see module docstring)."""
    require_spec(spec)
    dtype, acc = q.dtype, acc_dtype(q.dtype)
    hq, hkv = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if out is None:
        out, _ = forward(q, k, v, spec=spec, scale=scale)
    ke, ve = expand_kv(k, hq).to(acc), expand_kv(v, hq).to(acc)
    b, _, len_q, d = q.shape
    len_k = k.shape[2]
    do_all, out_all = dout.to(acc), out.to(acc)
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)
    delta = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    dk = dv = torch.zeros(ke.shape, dtype=acc, device=q.device)  # replaced by the first chunk's sums
    for n, (r0, r1) in enumerate(row_chunks(len_q, len_k, d, b * hq)):
        rows = slice(r0, r1)
        visible = spec.rows(len_q, len_k, device=q.device, rows=(r0, r1))
        q_rows = q[:, :, rows].to(acc)
        raw = (q_rows @ ke.transpose(-1, -2)) * scale
        s = torch.where(visible, spec.modify(raw, len_q, len_k, rows=(r0, r1)), -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        do = do_all[:, :, rows]
        dv_part = _low(p, dtype, acc).transpose(-1, -2) @ do
        dp = do @ ve.transpose(-1, -2)
        delta[:, :, rows] = (do * out_all[:, :, rows]).sum(dim=-1)
        ds = p * (dp - delta[:, :, rows, None])
        chain = spec.modify_grad(raw)  # softcap: the gradient of the raw scores, before the cast
        ds = _low(ds if chain is None else torch.where(visible, ds * chain, 0.0), dtype, acc)
        dq[:, :, rows] = ((ds @ ke) * scale).to(dtype)
        dk_part = ds.transpose(-1, -2) @ q_rows
        # Partial sums over rows, added in the accumulator (the scale multiplies the total, as unchunked).
        dk, dv = (dk_part, dv_part) if n == 0 else (dk + dk_part, dv + dv_part)
    dk = dk * scale
    return (dq, reduce_group(dk, hkv).to(dtype), reduce_group(dv, hkv).to(dtype), delta)
