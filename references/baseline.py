"""Same-precision eager attention: the baseline of pass criterion 1.

FlashAttention's and PyTorch's own tests hold a kernel to a multiple of the error that plain eager
attention makes at the same precision. Here that eager attention is defined exactly, as a GPU
framework would run it for float16/bfloat16/float32 inputs:

forward
    scores and softmax in float32 (float64 for float64 inputs), the spec's score modifications (softcap,
    ALiBi) in the same precision, the spec's sink (one logit per query head) in the softmax's
    denominator, ``P`` cast to the input dtype,
    ``P @ V`` accumulated in float32, output rounded to the input dtype once; LSE kept in float32.
    With split-KV (the spec's ``num_splits`` > 1) each split of the keys (``AttentionSpec.key_splits``)
    is such an eager attention whose output stays in float32 (the sink joins the first split), and the
    splits are merged in float32 as a split-KV kernel merges them: ``lse = m + log(sum_t exp(lse_t - m))``
    with ``m = max_t lse_t``, ``out = sum_t exp(lse_t - lse) out_t``, rounded to the input dtype once.
backward
    ``dV = P^T dO`` with ``P`` in the input dtype, ``dP = dO V^T`` and ``Delta = rowsum(dO * O)`` in
    float32 (``O`` being the baseline's own rounded output), ``dS = P (dP - Delta)`` (times softcap's
    ``1 - tanh^2`` in float32) cast to the input
    dtype, ``dQ = scale dS K`` and ``dK = scale dS^T Q`` accumulated in float32, each rounded once;
    with sinks, ``dt_h = -sum_{b, i} P_sink Delta`` in float32 (the sink's own ``dS``), returned fifth.
float8 forward (``references/fp8.py``; there is no float8 backward), as FlashAttention-3's fp8 forward runs it
    the float8 values up-cast to float32, scores ``(q k^T) (scale q_descale k_descale)`` and the softmax in
    float32; the softmax's numerator ``exp(s - m)`` (at most 1, not yet divided by the row sum) cast to
    v's float8 format, ``P @ V`` accumulated in float32, divided by the float32 row sum of the uncast
    numerators, times ``v_descale``, rounded to bfloat16 once. (A cast of the normalised ``P`` would flush
    every weight of a long uniform row below float8's smallest subnormal to zero.)

Products of two float16, bfloat16 or float8 numbers are exact in float32, so up-casting both operands and
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
from references.fp8 import is_fp8, out_dtype, per_head
from references.spec import AttentionSpec, require_spec


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _low(t: torch.Tensor, dtype: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    """Round to the input dtype, then hold exactly in the accumulator dtype."""
    return t.to(dtype).to(acc)


def _numerators(s, sink):
    """The softmax's numerators ``exp(s - m)`` of masked scores ``s`` ``[B, Hq, rows, n]`` (-inf where hidden),
    with each head's ``sink`` logit ``[Hq]`` in the denominator (None: none), the row max (or the sink above
    it) subtracted: ``(numerators, row sums, lse)``, 0, 0 and -inf on empty rows."""
    m = s.amax(dim=-1, keepdim=True) if s.shape[-1] else torch.full((*s.shape[:3], 1), -math.inf, dtype=s.dtype,
                                                                    device=s.device)
    if sink is not None:
        m = torch.maximum(m, sink[:, None, None])
    m = torch.where(torch.isneginf(m), 0.0, m)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        l = l + torch.exp(sink[:, None, None] - m)
    return e, l, torch.where(l == 0, -math.inf, m + torch.log(l)).squeeze(-1)


def _softmax(s, sink):
    """Eager softmax of masked scores (:func:`_numerators`): ``(P, lse)``, 0 and -inf on empty rows."""
    e, l, lse = _numerators(s, sink)
    return torch.where(l == 0, 0.0, e / torch.where(l == 0, 1.0, l)), lse


def _merge(parts):
    """Split-KV's merge of ``[(out_t, lse_t), ...]`` (float32 partial outputs and LSEs) in their dtype."""
    lses = torch.stack([lse for _, lse in parts])
    top = lses.amax(dim=0)
    top = torch.where(torch.isneginf(top), 0.0, top)
    total = torch.exp(lses - top).sum(dim=0)
    lse = torch.where(total == 0, -math.inf, top + torch.log(total))
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    out = sum(torch.exp(lse_t - safe)[..., None] * out_t for out_t, lse_t in parts)
    return out, lse


def _descale_heads(descale, hq: int, like: torch.Tensor) -> torch.Tensor:
    """A ``[B, Hkv]`` descale as float32 ``[B, Hq, 1, 1]`` (1 without one)."""
    if descale is None:
        return torch.ones((1, 1, 1, 1), dtype=torch.float32, device=like.device)
    return per_head(descale, hq, dtype=torch.float32, device=like.device)


def forward(q, k, v, *, spec: AttentionSpec = AttentionSpec(), scale: float | None = None, descales=None):
    """Eager ``(out, lse)`` at the precision of the inputs (see module docstring); float8 inputs with their
    ``descales`` ``(q_descale, k_descale, v_descale)`` (None: all 1) give out in bfloat16."""
    require_spec(spec)
    dtype, acc = q.dtype, acc_dtype(q.dtype)
    b, hq, len_q, d = q.shape
    len_k = k.shape[2]
    spec.check_lengths(len_q, len_k)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    sink = spec.sink_logits(hq, device=q.device, dtype=acc)
    splits = spec.key_splits(len_k, device=q.device) if spec.num_splits > 1 else None
    ke, ve = expand_kv(k, hq).to(acc), expand_kv(v, hq).to(acc)
    out = torch.empty((*q.shape[:3], v.shape[-1]), dtype=out_dtype(dtype), device=q.device)
    lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    if is_fp8(dtype):  # one float32 score factor per head; v's descale on the normalised output
        qd, kd, vd = descales if descales is not None else (None, None, None)
        scale = (torch.tensor(scale, dtype=acc, device=q.device) * _descale_heads(qd, hq, q)) * _descale_heads(kd, hq, q)
        v_factor = _descale_heads(vd, hq, q)

        def part(s, sink_t):  # the numerators cast to float8, divided by the uncast row sum after P @ V
            e, l, lse_t = _numerators(s, sink_t)
            pv = _low(e, dtype, acc) @ ve
            return torch.where(l == 0, 0.0, pv / torch.where(l == 0, 1.0, l)) * v_factor, lse_t
    else:
        def part(s, sink_t):  # P normalised, then cast
            p, lse_t = _softmax(s, sink_t)
            return _low(p, dtype, acc) @ ve, lse_t

    for r0, r1 in row_chunks(len_q, len_k, d, b * hq):
        rows = slice(r0, r1)
        visible = spec.rows(len_q, len_k, device=q.device, rows=(r0, r1))
        raw = (q[:, :, rows].to(acc) @ ke.transpose(-1, -2)) * scale
        s = torch.where(visible, spec.modify(raw, len_q, len_k, rows=(r0, r1)), -math.inf)
        if splits is None:
            o, lse[:, :, rows] = part(s, sink)
        else:  # each split an eager attention with a float32 output (the sink joins the first)
            o, lse[:, :, rows] = _merge([part(torch.where(splits == t, s, -math.inf), sink if t == 0 else None)
                                         for t in range(spec.num_splits)])
        out[:, :, rows] = o.to(out.dtype)
    return out, lse


def backward(q, k, v, dout, *, spec: AttentionSpec = AttentionSpec(), scale: float | None = None,
             out: torch.Tensor | None = None):
    """Eager ``(dq, dk, dv, delta)`` at the precision of the inputs (see module docstring); with sinks,
    ``(dq, dk, dv, delta, dsinks)``."""
    require_spec(spec)
    dtype, acc = q.dtype, acc_dtype(q.dtype)
    hq, hkv = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    sink = spec.sink_logits(hq, device=q.device, dtype=acc)
    if out is None:
        out, _ = forward(q, k, v, spec=spec, scale=scale)
    ke, ve = expand_kv(k, hq).to(acc), expand_kv(v, hq).to(acc)
    b, _, len_q, d = q.shape
    len_k = k.shape[2]
    do_all, out_all = dout.to(acc), out.to(acc)
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)
    delta = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    dsinks = None if sink is None else torch.zeros(hq, dtype=acc, device=q.device)
    # replaced by the first chunk's sums
    dk, dv = torch.zeros(ke.shape, dtype=acc, device=q.device), torch.zeros(ve.shape, dtype=acc, device=q.device)
    for n, (r0, r1) in enumerate(row_chunks(len_q, len_k, d, b * hq)):
        rows = slice(r0, r1)
        visible = spec.rows(len_q, len_k, device=q.device, rows=(r0, r1))
        q_rows = q[:, :, rows].to(acc)
        raw = (q_rows @ ke.transpose(-1, -2)) * scale
        s = torch.where(visible, spec.modify(raw, len_q, len_k, rows=(r0, r1)), -math.inf)
        if sink is None:
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        else:
            p, lse = _softmax(s, sink)
        do = do_all[:, :, rows]
        dv_part = _low(p, dtype, acc).transpose(-1, -2) @ do
        dp = do @ ve.transpose(-1, -2)
        delta[:, :, rows] = (do * out_all[:, :, rows]).sum(dim=-1)
        if sink is not None:  # the sink's dS: P_sink (0 - Delta)
            dsinks -= (torch.exp(sink[:, None] - lse) * delta[:, :, rows]).sum(dim=(0, 2))
        ds = p * (dp - delta[:, :, rows, None])
        chain = spec.modify_grad(raw)  # softcap: the gradient of the raw scores, before the cast
        ds = _low(ds if chain is None else torch.where(visible, ds * chain, 0.0), dtype, acc)
        dq[:, :, rows] = ((ds @ ke) * scale).to(dtype)
        dk_part = ds.transpose(-1, -2) @ q_rows
        # Partial sums over rows, added in the accumulator (the scale multiplies the total, as unchunked).
        dk, dv = (dk_part, dv_part) if n == 0 else (dk + dk_part, dv + dv_part)
    dk = dk * scale
    grads = (dq, reduce_group(dk, hkv).to(dtype), reduce_group(dv, hkv).to(dtype), delta)
    return grads if sink is None else (*grads, dsinks)
