"""Triton split-KV decoding from a paged KV cache: a forward for a few queries per sequence and its combine.

The case is decoding (``Nq = 1``) or speculative decoding (a few queries, up to :data:`MAX_QUERIES`) against
a long KV cache held in pages, as flash_attn_with_kvcache takes it: ``q [S, Hq, Nq, D]``, the cache ``k
[num_pages, page_size, Hkv, D]`` and ``v [num_pages, page_size, Hkv, Dv]``, ``block_table [S, max pages]``
(int32: sequence ``s``'s key ``j`` is slot ``j % page_size`` of page ``block_table[s, j // page_size]``)
and ``seqlens_k [S]`` (the cache lengths). The value head dim ``Dv`` may differ from ``D`` (multi-head
latent attention decodes with q/k 576 and v 512, or 192/128; FlashAttention-3's ``headdim_v``): V, the
accumulator, the partial outputs and ``out [S, Hq, Nq, Dv]`` have tiles ``BLOCK_DV`` wide, q and k
``BLOCK_D``; the default scale stays ``1/sqrt(D)``.
One query tile holds every query of a sequence's head, so there is little to parallelise over but the
keys: the keys are cut into ``num_splits`` splits, each program runs the online softmax of the FA2
forward (:mod:`flashverify_kernels.triton.attention`'s conventions and precision: float32 statistics, ``p`` cast to
the input dtype for ``P @ V``, exponentials in base 2, the running max in raw units unless a softcap,
ALiBi or sinks need the modified scores) over its split, and writes a float32 partial output and LSE::

    split t of sequence s:   out_t = acc_t / l_t,   lse_t = m_t + log(l_t)      (lse_t = -inf: no key)

then one program per (sequence, query head) merges the splits by their LSEs, in a fixed order::

    lse = top + log(sum_t exp(lse_t - top)), top = max_t lse_t;    out = sum_t exp(lse_t - lse) out_t

A sink (``sinks [Hq]``) starts the running state of split 0 (``m = t, l = 1``). Causal masks are
bottom-right per sequence (the queries are the last ``Nq`` positions of the cache); windows, a softcap
and ALiBi follow flash_attn's keywords. There is no backward: decoding is inference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashverify_kernels import _validate
from flashverify_kernels.triton.attention import (DEVICES, DTYPES, HEAD_DIMS, INTERPRET, LOG2E, _LN2, _LOG2E, _load_rows,
                                      _modified, _padded_head_dim, _visible)

MAX_QUERIES = 16  # queries per sequence (decoding and speculative decoding)
BLOCK_N = 16 if INTERPRET else 64  # keys per step of a split


@triton.jit
def _decode_split(Q, K, V, BlockTable, SeqlensK, Slopes, Sinks, OutPart, LsePart, qk_scale, sm_scale,
                  stride_qb, stride_qh, stride_qm, stride_qd,
                  stride_kp, stride_ks, stride_kh, stride_kd,
                  stride_vp, stride_vs, stride_vh, stride_vd,
                  stride_tb, stride_sb,
                  heads_q, group, len_q, page_size, num_splits, window_left, window_right, softcap,
                  head_dim, head_dim_v, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr,
                  NATURAL: tl.constexpr, LIBDEVICE: tl.constexpr):
    split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    off_hkv = off_h // group
    len_k = tl.load(SeqlensK + off_b)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)  # v's columns: the columns of acc, the partial outputs and out
    # head_dim_v is a compile-time None when v shares q/k's head dim (the launcher's choice): v's columns
    # are then masked against head_dim itself, and the kernel compiles to the code it had before Dv.
    dv_end = head_dim if head_dim_v is None else head_dim_v
    q = _load_rows(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm
                   + offs_d[None, :] * stride_qd, offs_m, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, True)
    slope = 0.0
    if ALIBI:
        slope = tl.load(Slopes + off_b * stride_sb + off_h).to(tl.float32)
    if SINKS and split == 0:  # the sink starts split 0's running state
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(Sinks + off_h).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    sign = tl.where(qk_scale < 0, -1.0, 1.0)
    c_abs = qk_scale * sign
    causal_offset = len_k - len_q
    # This split's keys: whole steps of BLOCK_N, cut evenly.
    steps = tl.cdiv(len_k, BLOCK_N)
    per = tl.cdiv(steps, num_splits) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, len_k)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        inside = cols < len_k
        # -- the keys' slots through the block table (logical page j // page_size, slot j % page_size)
        page = tl.load(BlockTable + off_b * stride_tb + cols // page_size, mask=inside, other=0).to(tl.int64)
        slot = (cols % page_size).to(tl.int64)
        k_ptrs = K + page[:, None] * stride_kp + slot[:, None] * stride_ks + off_hkv * stride_kh + offs_d[None, :] * stride_kd
        v_ptrs = V + page[:, None] * stride_vp + slot[:, None] * stride_vs + off_hkv * stride_vh + offs_dv[None, :] * stride_vd
        k = _load_rows(k_ptrs, cols, len_k, offs_d, head_dim, BLOCK_D, EVEN_D, True)
        v = _load_rows(v_ptrs, cols, len_k, offs_dv, dv_end, BLOCK_DV, EVEN_DV, True)
        if NATURAL:
            x, _ = _modified(tl.dot(q, tl.trans(k), input_precision="ieee"), sm_scale, softcap, slope,
                             offs_m[:, None], cols[None, :], causal_offset, SOFTCAP, ALIBI, LIBDEVICE)
            factor = _LOG2E + 0.0 * c_abs
        else:
            x = tl.dot(q, tl.trans(k), input_precision="ieee") * sign
            factor = c_abs
        visible = (offs_m[:, None] < len_q) & _visible(offs_m[:, None], cols[None, :], len_k, causal_offset,
                                                       window_left, window_right, 1, len_q, CAUSAL, WINDOW, False)
        x = tl.where(visible, x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_i == float("-inf"), 0.0, tl.math.exp2((m_i - m_ref) * factor))
        p = tl.math.exp2(tl.where(visible, (x - m_ref[:, None]) * factor, float("-inf")))
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if NATURAL:
        units = _LOG2E + 0.0 * c_abs
    else:
        units = c_abs
    lse = tl.where(empty, float("-inf"), (m_i * units + tl.log2(l_safe)) * _LN2)
    # partials: [S * Hq, num_splits, BLOCK_M, BLOCK_DV] and [S * Hq, num_splits, BLOCK_M], float32
    part = (pid_bh.to(tl.int64) * num_splits + split) * BLOCK_M
    tl.store(OutPart + (part + offs_m[:, None]) * BLOCK_DV + offs_dv[None, :], acc / l_safe[:, None])
    tl.store(LsePart + part + offs_m, lse)


@triton.jit
def _decode_combine(OutPart, LsePart, Out, Lse, num_splits,
                    stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
                    heads_q, len_q, head_dim, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    # Only out's head dim appears here: head_dim and BLOCK_D are v's (Dv and the split kernel's BLOCK_DV).
    pid_bh = tl.program_id(0)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    base = pid_bh.to(tl.int64) * num_splits * BLOCK_M
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for t in range(0, num_splits):
        top = tl.maximum(top, tl.load(LsePart + base + t * BLOCK_M + offs_m))
    top_ref = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_M], tl.float32)
    for t in range(0, num_splits):
        total += tl.exp(tl.load(LsePart + base + t * BLOCK_M + offs_m) - top_ref)
    lse = tl.where(total == 0.0, float("-inf"), top_ref + tl.log(tl.where(total == 0.0, 1.0, total)))
    lse_ref = tl.where(lse == float("-inf"), 0.0, lse)
    out = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t in range(0, num_splits):  # a fixed order: deterministic
        weight = tl.exp(tl.load(LsePart + base + t * BLOCK_M + offs_m) - lse_ref)
        out += weight[:, None] * tl.load(OutPart + (base + t * BLOCK_M + offs_m[:, None]) * BLOCK_D + offs_d[None, :])
    mask = (offs_m[:, None] < len_q) & (offs_d[None, :] < head_dim)
    tl.store(Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=mask)
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm, lse, mask=offs_m < len_q)


def decode_forward(q, k, v, *, block_table, seqlens_k, causal: bool = False, scale: float | None = None,
                   num_splits: int = 1, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None):
    """Split-KV decoding from a paged KV cache (module docstring): ``(out [S, Hq, Nq, Dv], lse [S, Hq, Nq])``.

    ``q [S, Hq, Nq, D]`` with ``1 <= Nq <= 16``; ``k [num_pages, page_size, Hkv, D]`` and ``v [num_pages,
    page_size, Hkv, Dv]`` (any strides; ``Dv`` may differ from ``D``); ``block_table`` int32 ``[S, max
    pages]``; ``seqlens_k`` int32 ``[S]``; float16, bfloat16 or float32; head dims ``D`` and ``Dv`` 16..256
    in steps of 8; ``scale`` defaults to ``1/sqrt(D)``; ``num_splits`` >= 1; ``window_size``, ``softcap``,
    ``alibi_slopes`` (float32 ``[Hq]`` or ``[S, Hq]``) and ``sinks`` (float32 ``[Hq]``) as the FA2 kernels
    take them."""
    kernel = "triton_decode"
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{kernel}: {label} should be a 4-D tensor (q [S, Hq, Nq, D], k [num_pages, page_size, "
                             f"Hkv, D], v [num_pages, page_size, Hkv, Dv]); got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"{kernel}: causal={causal!r}, but should be a bool")
    # Checked on the pages themselves: in the [B, H, N, D] views below, a v cut into other pages (4 x 8
    # slots against k's 8 x 4) would look like k.
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{kernel}: k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} should agree in "
                         "[num_pages, page_size, Hkv] (only the head dims may differ)")
    s, hq, len_q, d = q.shape
    pages, page_size, hkv, dv = v.shape

    def sequence_view(t):
        """The cache's slots as one sequence of keys beside each query batch, ``[S, Hkv, slots, t's dim]``."""
        return t.flatten(0, 1)[None].permute(0, 2, 1, 3).expand(s, -1, -1, -1)

    # The contract's checks (dtypes, devices, head dims of q/k and of v, GQA, scale: 1/sqrt(D)) on those views.
    scale = _validate.check_attention_inputs(q, sequence_view(k), sequence_view(v), kernel=kernel, dtypes=DTYPES,
                                             devices=DEVICES, head_dims=HEAD_DIMS, scale=scale, head_dim_v=True)
    if not 1 <= len_q <= MAX_QUERIES:
        raise ValueError(f"{kernel}: q has {len_q} queries per sequence, but should have 1..{MAX_QUERIES} "
                         "(decoding and speculative decoding)")
    lens = _validate.check_seqlens("seqlens_k", seqlens_k, batch=s, most=pages * page_size, device=q.device,
                                   kernel=kernel)
    _validate.check_block_table(block_table, batch=s, num_pages=pages, page_size=page_size, seqlens_k=lens,
                                device=q.device, kernel=kernel)
    var = _validate.variant(q, kernel=kernel, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            sinks=sinks, num_splits=num_splits)
    num_splits, window, softcap, slopes, sinks = var.splits, var.window, var.softcap, var.alibi_slopes, var.sinks
    out = torch.empty((s, hq, len_q, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((s, hq, len_q), dtype=torch.float32, device=q.device)
    if s * hq == 0:
        return out, lse
    block_d, block_dv = _padded_head_dim(d), _padded_head_dim(dv)
    out_part = torch.empty((s * hq, num_splits, MAX_QUERIES, block_dv), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((s * hq, num_splits, MAX_QUERIES), dtype=torch.float32, device=q.device)
    flags = dict(CAUSAL=causal, WINDOW=window != (-1, -1), SOFTCAP=softcap > 0, ALIBI=slopes is not None,
                 SINKS=sinks is not None, LIBDEVICE=not INTERPRET)
    flags["NATURAL"] = flags["SOFTCAP"] or flags["ALIBI"] or flags["SINKS"]
    stride_sb = 0 if slopes is None or slopes.dim() == 1 else slopes.stride(0)
    _decode_split[(num_splits, s * hq)](
        q, k, v, block_table, seqlens_k, q if slopes is None else slopes, q if sinks is None else sinks,
        out_part, lse_part, scale * LOG2E, scale, *q.stride(),
        k.stride(0), k.stride(1), k.stride(2), k.stride(3), v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        block_table.stride(0), stride_sb, hq, hq // hkv, len_q, page_size, num_splits, *window, softcap,
        d, None if dv == d else dv,  # None: Triton makes it a constant (the kernel's dv_end)
        BLOCK_D=block_d, EVEN_D=d == block_d, BLOCK_DV=block_dv, EVEN_DV=dv == block_dv, BLOCK_M=MAX_QUERIES,
        BLOCK_N=BLOCK_N, **flags)
    _decode_combine[(s * hq,)](out_part, lse_part, out, lse, num_splits, *out.stride(), *lse.stride(), hq, len_q, dv,
                               BLOCK_D=block_dv, BLOCK_M=MAX_QUERIES)
    return out, lse
