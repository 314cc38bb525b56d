"""Triton FlashAttention: FA1 (inner-scaled) and FA2 (outer-scaled) forward, FA2 backward.

The algorithms are those of :mod:`kernels.blocked`, written as Triton programs with the same
conventions and the same precision behaviour:

* scores ``s = scale * q k^T`` and the statistics ``m`` (running max) and ``l`` (running sum) in
  float32; ``p`` cast to the input dtype before the ``p @ v`` dot; float32 accumulators; the output
  rounded once. Float32 inputs use IEEE float32 dots (``input_precision="ieee"``, never TF32).
* Exponentials are base 2, the GPU's native one: the kernels scale the scores by ``scale * log2(e)``,
  so ``s2 = log2(e) * s`` and the running max ``m2`` are in log2 units and ``p = exp2(s2 - m2)`` equals
  ``exp(s - m)``. The LSE is converted back to the natural log: ``lse = ln(2) * m2 + log(l)``.
  The forward keeps its running max in raw units (``m = max sign(scale) q.k``) and forms the exponent
  as ``(q.k - m) * |scale| * log2(e)``: the difference is exact near the max, so each ``p`` errs by a
  rounding of ``s2 - m2``, not of ``s2`` (with logits near 1e4, about 1e-7 instead of 1e-3 relative),
  and the largest ``p`` of a row is exactly 1. The backward recomputes ``p = exp2(s2 - log2(e) lse)``
  with ``s2`` rounded as before; the forward's LSE is built from the same rounded ``s2`` of the row's
  max, so that rounding cancels at the entries that matter most.

Forward, one program per (Q block, batch * query head), looping over KV blocks::

    s     = scale * q @ k^T, set to -inf where a key is not visible     (held as s2 = log2(e) * s)
    m_new = max(m, rowmax(s));  alpha = exp(m - m_new);  p = exp(s - m_new)
    l_new = alpha * l + rowsum(p)
    FA2 (outer-scaled):  acc = alpha * acc + p @ v               out = acc / l   (once, at the end)
    FA1 (inner-scaled):  acc = (alpha * l * acc + p @ v) / l_new  out = acc       (renormalised each step)
    lse = m + log(l)

Causal masking is bottom-right aligned: key ``j`` is visible to query ``i`` iff ``j <= i + Nk - Nq``.
The KV loop of a Q block runs in two stages: the blocks every row of the Q block sees entirely, with no
mask at all, then the blocks that cross the diagonal or the end of the keys, where the scores are masked
with ``where(visible, s, -inf)`` (float32 runs every block through the masked loop: see
:func:`_split_stages`). KV blocks that no row of the Q block can see are never visited. A row
that sees no key keeps ``(m, l) = (-inf, 0)`` (``exp(-inf - 0) = 0`` guards the subtraction) and gets
``out = 0``, ``lse = -inf``.

Backward (three launches, no atomics, so it is deterministic)::

    Delta = rowsum(dO * O)                     one program per (Q block, batch * query head)
    dK/dV: one program per (KV block, batch * kv head), looping over the query heads of the group
           and over the Q blocks that see the KV block:
           p^T = exp(s^T - lse)        (computed as exp2(log2(e) * scale * k q^T - log2(e) * lse))
           dV += p^T dO;  dP^T = V dO^T;  dS^T = p^T (dP^T - Delta);  dK += dS^T Q
           finally dK *= scale
    dQ:    one program per (Q block, batch * query head), looping over the visible KV blocks:
           p = exp(s - lse);  dP = dO V^T;  dS = p (dP - Delta);  dQ += dS K
           finally dQ *= scale

``p`` and ``dS`` are cast to the input dtype before their dots. A row with ``lse = -inf`` gets ``p = 0``.

Boundaries: any ``Nq``, ``Nk``; head dims 16 to 256 in steps of 8, padded inside the kernel to a power of
two with masked loads (the scale uses the true head dim). Every load of a row past the end of a tensor,
or of a head-dim column past ``D``, is masked with ``other=0``; keys past the last one a Q block can see
are loaded as zero, and their scores are masked, so such values never reach the output. Inputs are read
through their strides (no copies); grouped-query attention maps query head ``h`` to key/value head
``h // (Hq // Hkv)``.

Block sizes are powers of two >= 16. With ``block_m=None, block_n=None`` the tiles, warps and pipeline
stages are autotuned on the GPU (per padded head dim, dtype, causal flag and a coarse sequence-length
bucket); under the Triton interpreter one small fixed configuration is used.
"""

from __future__ import annotations

import functools
import inspect
import math
import os

import torch
import triton
import triton.language as tl

from kernels import _autograd, _validate

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEVICES = ("cpu", "cuda") if INTERPRET else ("cuda",)
HEAD_DIMS = range(16, 257, 8)
# Block sizes accepted by the launchers: powers of two, at least 16 (tl.dot's smallest tile).
BLOCK_SIZES = (16, 32, 64, 128, 256)
# Fixed tiles used when a block size is not given: under the interpreter for every call (small tiles
# keep it fast), on the GPU when only one of block_m, block_n is given.
INTERPRET_BLOCKS = (16, 32)
DEFAULT_BLOCKS = (64, 64)

LOG2E = math.log2(math.e)
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(math.log(2.0))


# --------------------------------------------------------------------------------------------------
# Capability helpers
# --------------------------------------------------------------------------------------------------

def _padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _seq_bucket(length: int) -> int:
    """Coarse sequence-length class for the autotuning key (multiples of 16: no extra specialisation)."""
    return 1024 if length <= 1024 else 4096 if length <= 4096 else 16384


def _launch_options(block_m: int, block_n: int, block_d: int, dtype: torch.dtype) -> dict:
    """Warps and pipeline depth for explicitly given tiles. Float32 IEEE dots run on the FMA units,
    unrolled per thread: more warps keep each thread's code, and the compile time, smaller."""
    if dtype == torch.float32:
        # About 512 FMAs per thread per dot: 64x64 tiles with head dim 256 compile in seconds, not minutes.
        warps = min(16, max(4, triton.next_power_of_2(block_m * block_n * block_d // (32 * 512))))
        return {"num_warps": warps, "num_stages": 1 if block_d > 128 else 2}
    return {"num_warps": 8 if block_m * block_n >= 128 * 64 else 4, "num_stages": 2 if block_d > 128 else 3}


# Integer arguments Triton would otherwise compile a variant for by value (divisible by 16, equal to 1):
# the head dim and the lengths and head counts only bound masks and loops, so one compiled kernel per
# padded head dim serves them all (31 accepted head dims, 5 padded ones). EVEN_D (head dim = padded
# head dim) keeps the unmasked column loads of the common head dims. The batch and head strides change
# with every length (Nq * D, Hq * Nq * D): one flag, ALIGNED (every one of them a multiple of 16), tells
# the kernel what the per-stride specialisation did, so that aligned tiles still load in vectors; the
# row and column strides stay specialised.
_ALIGNABLE = ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_vb", "stride_vh", "stride_ob", "stride_oh",
              "stride_gb", "stride_gh", "stride_dkb", "stride_dkh", "stride_dvb", "stride_dvh", "stride_dqb",
              "stride_dqh")
_NOT_SPECIALIZED = ("head_dim", "len_q", "len_k", "heads_q", "heads_kv", "group", "stride_lb", "stride_lh",
                    *_ALIGNABLE)


def _kernel(fn):
    """``triton.jit`` for a launched kernel: no value specialisation of :data:`_NOT_SPECIALIZED`."""
    params = inspect.signature(fn).parameters
    return triton.jit(fn, do_not_specialize=[name for name in _NOT_SPECIALIZED if name in params])


def _head_dim_meta(head_dim: int, block_d: int) -> dict:
    return {"head_dim": head_dim, "BLOCK_D": block_d, "EVEN_D": head_dim == block_d}


def _aligned(*tensors) -> bool:
    """ALIGNED: the batch and head strides of every tensor (dims 0 and 1) are multiples of 16."""
    return all(t.stride(dim) % 16 == 0 for t in tensors for dim in (0, 1))


def _split_stages(dtype: torch.dtype) -> bool:
    """Run the blocks that need no mask through their own unmasked loop (the fast path). Not for float32:
    its IEEE dots are unrolled into FMAs per thread, and one masked loop keeps the code and the compile
    time several times smaller; float32 is for accuracy, not speed."""
    return dtype != torch.float32


def _check_blocks(block_m, block_n, *, kernel: str) -> tuple[int | None, int | None]:
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None:
            _validate.check_block(name, value, kernel=kernel, allowed=BLOCK_SIZES)
    return block_m, block_n


def _fixed_blocks(block_m, block_n) -> tuple[int, int] | None:
    """The tiles to use, or None to autotune (GPU, neither given)."""
    if INTERPRET:
        return (block_m or INTERPRET_BLOCKS[0], block_n or INTERPRET_BLOCKS[1])
    if block_m is None and block_n is None:
        return None
    return (block_m or DEFAULT_BLOCKS[0], block_n or DEFAULT_BLOCKS[1])


def _check_inputs(q, k, v, *, kernel: str, scale, block_m, block_n) -> float:
    _check_blocks(block_m, block_n, kernel=kernel)
    scale = _validate.check_attention_inputs(q, k, v, kernel=kernel, dtypes=DTYPES, devices=DEVICES,
                                             gqa=True, head_dims=HEAD_DIMS, scale=scale)
    return scale


# Autotuning candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) by tile class. In the backward, dK/dV
# programs hold a KV tile of BLOCK_N rows and loop over Q tiles of BLOCK_M rows; dQ programs the reverse.
_FWD_TILES = {
    "half": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
    "half_wide": [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
    "fp32": [(64, 64, 16, 1)],
    "fp32_wide": [(64, 64, 16, 1)],
}
_BWD_TILES = {
    "half": [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3)],
    "half_wide": [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2)],
    "fp32": [(64, 64, 16, 1)],
    "fp32_wide": [(32, 32, 16, 1)],
}


def _tile_class(block_d: int, dtype: torch.dtype) -> str:
    """float16/bfloat16 ("half") or float32, with padded head dim up to 128 or above ("wide")."""
    return ("fp32" if dtype == torch.float32 else "half") + ("_wide" if block_d > 128 else "")


def _configs(table: dict) -> list[triton.Config]:
    tiles = sorted({t for tiles in table.values() for t in tiles})
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tiles]


def _pruner(table: dict):
    """Keep the candidates of the call's tile class (shared memory and registers grow with the head dim
    and the element size; float32 IEEE dots compile to long FMA sequences, so they get one config)."""
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        wanted = set(table[_tile_class(args["BLOCK_D"], args["Q"].dtype)])
        return [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]
    return prune


def _bwd_tiles(block_m: int, block_n: int, block_d: int, dtype: torch.dtype):
    """Tiles of the (dK/dV, dQ) kernels for given block sizes. The backward holds more tiles at once
    than the forward, so with a padded head dim of 256 it caps them to fit shared memory: at 64 for
    float16/bfloat16, and for float32 the inner tile of each kernel (dK/dV: Q rows, dQ: KV rows) at 32
    and the outer one at 64. The gradients are the same sums; only their order changes."""
    tile_class = _tile_class(block_d, dtype)
    if tile_class == "half_wide":
        tiles = (min(block_m, 64), min(block_n, 64))
        return tiles, tiles
    if tile_class == "fp32_wide":
        return (min(block_m, 32), min(block_n, 64)), (min(block_m, 64), min(block_n, 32))
    return (block_m, block_n), (block_m, block_n)


# --------------------------------------------------------------------------------------------------
# Tile helpers and the forward inner loop
# --------------------------------------------------------------------------------------------------

@triton.jit
def _load_rows(ptrs, rows, row_end, offs_d, head_dim, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """Load a [rows, BLOCK_D] tile; rows >= row_end and columns >= head_dim read as 0."""
    if CHECK_ROWS:
        tile = tl.load(ptrs, mask=(rows[:, None] < row_end) & (offs_d[None, :] < head_dim), other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
    return tile


@triton.jit
def _hint16(stride, ALIGNED: tl.constexpr):
    """``stride``, known to the compiler as a multiple of 16 when ALIGNED (the launcher checked it)."""
    if ALIGNED:
        stride = (stride // 16) * 16
    return stride


@triton.jit
def _store_rows(ptrs, tile, rows, row_end, offs_d, head_dim):
    tl.store(ptrs, tile, mask=(rows[:, None] < row_end) & (offs_d[None, :] < head_dim))


@triton.jit
def _attn_fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                    lo, hi, kv_end, causal_offset, qk_scale,
                    head_dim, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, MASKED: tl.constexpr, INNER_SCALED: tl.constexpr):
    """Consume the KV blocks lo, lo + BLOCK_N, ... < hi into the running (acc, m, l) of one Q tile;
    ``qk_scale = scale * log2(e)``; ``m`` is the running max of ``sign(scale) * q.k`` (raw units).

    MASKED: keys at or past ``kv_end`` are loaded as 0 and their scores (and, if CAUSAL, those of keys
    a row may not see) are set to -inf; otherwise every key in [lo, hi) is visible to every row.
    """
    sign = tl.where(qk_scale < 0, -1.0, 1.0)
    c_abs = qk_scale * sign
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_rows(K + cols[:, None] * stride_kn, cols, kv_end, offs_d, head_dim, BLOCK_D, EVEN_D, MASKED)
        v = _load_rows(V + cols[:, None] * stride_vn, cols, kv_end, offs_d, head_dim, BLOCK_D, EVEN_D, MASKED)
        # -- raw scores q.k in float32, sign-adjusted so that the largest is the largest scaled score
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sign
        if MASKED:
            visible = cols[None, :] < kv_end
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
            qk = tl.where(visible, qk, float("-inf"))
        # -- new running max (raw units); a row that has seen only masked keys subtracts 0, not -inf
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        if MASKED:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        # p = exp2((qk - m) * |scale| log2(e)): qk - m is exact for the keys near the max (Sterbenz), so
        # each p errs by a rounding of its exponent s - m, not of s (about 1e-7 against 1e-3 relative for
        # scores near 1e4), and the max itself gets p = 1 exactly.
        alpha = tl.where(m_i == float("-inf"), 0.0, tl.math.exp2((m_i - m_ref) * c_abs))
        arg = (qk - m_ref[:, None]) * c_abs
        if MASKED:
            arg = tl.where(visible, arg, float("-inf"))
        p = tl.math.exp2(arg)
        l_new = l_i * alpha + tl.sum(p, axis=1)
        # -- p in the input dtype for the P @ V dot, accumulated in float32
        p_low = p.to(v.dtype)
        if INNER_SCALED:
            pv = tl.dot(p_low, v, input_precision="ieee")
            numer = acc * (alpha * l_i)[:, None] + pv
            acc = numer / tl.where(l_new == 0.0, 1.0, l_new)[:, None]
        else:
            acc = tl.dot(p_low, v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
        l_i = l_new
    return acc, m_i, l_i


# --------------------------------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------------------------------

@_kernel
def _attn_fwd(Q, K, V, Out, Lse, qk_scale,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_lb, stride_lh, stride_lm,
              heads_q, group, len_q, len_k, seq_bucket,
              head_dim, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
              INNER_SCALED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    stride_qb, stride_qh = _hint16(stride_qb, ALIGNED), _hint16(stride_qh, ALIGNED)
    stride_kb, stride_kh = _hint16(stride_kb, ALIGNED), _hint16(stride_kh, ALIGNED)
    stride_vb, stride_vh = _hint16(stride_vb, ALIGNED), _hint16(stride_vh, ALIGNED)
    stride_ob, stride_oh = _hint16(stride_ob, ALIGNED), _hint16(stride_oh, ALIGNED)
    # Causal: heavy (late) Q blocks first, so the light ones fill the last wave.
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    off_hkv = off_h // group
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + off_b * stride_qb + off_h * stride_qh
                   + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, True)
    # [1, BLOCK_D] pointers to the head-dim columns of this (batch, kv head); the loop adds the key rows.
    K += off_b * stride_kb + off_hkv * stride_kh + offs_d[None, :] * stride_kd
    V += off_b * stride_vb + off_hkv * stride_vh + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # KV range: [0, kv_end) is what some row of this block sees; [0, full_end) what every row sees.
    causal_offset = len_k - len_q
    if CAUSAL:
        kv_end = tl.maximum(tl.minimum(tl.minimum(start_m + BLOCK_M, len_q) + causal_offset, len_k), 0)
        full_end = tl.maximum(tl.minimum(start_m + causal_offset + 1, kv_end), 0)
    else:
        kv_end = len_k
        full_end = len_k
    if SPLIT:
        # Stage 1: blocks visible to every row, no masks.
        full_end = (full_end // BLOCK_N) * BLOCK_N
        acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                                        0, full_end, kv_end, causal_offset, qk_scale,
                                        head_dim, BLOCK_D, EVEN_D, BLOCK_N, CAUSAL, False, INNER_SCALED)
    else:
        full_end = 0
    # Stage 2: blocks crossing the diagonal or the end of the keys, masked (every block if not SPLIT).
    acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                                    full_end, kv_end, kv_end, causal_offset, qk_scale,
                                    head_dim, BLOCK_D, EVEN_D, BLOCK_N, CAUSAL, True, INNER_SCALED)

    # Epilogue: rows with no visible key have l = 0, acc = 0: out = 0, lse = -inf. Natural-log LSE.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if INNER_SCALED:
        out = acc
    else:
        out = acc / l_safe[:, None]
    # m is in raw units: lse = ln(2) (m |scale| log2(e) + log2(l)). m * |scale| log2(e) is rounded exactly
    # as the backward rounds q.k * scale log2(e) (one product of the same two numbers), so at a row's
    # largest score the backward's exponent s2 - lse2 sees that rounding cancel, as the forward's did.
    c_abs = tl.where(qk_scale < 0, -qk_scale, qk_scale)
    lse = tl.where(empty, float("-inf"), (m_i * c_abs + tl.log2(l_safe)) * _LN2)
    _store_rows(Out + off_b * stride_ob + off_h * stride_oh
                + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                out.to(Out.dtype.element_ty), offs_m, len_q, offs_d, head_dim)
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm, lse, mask=offs_m < len_q)


_attn_fwd_tuned = triton.autotune(
    configs=_configs(_FWD_TILES),
    key=["BLOCK_D", "CAUSAL", "INNER_SCALED", "seq_bucket"],
    prune_configs_by={"early_config_prune": _pruner(_FWD_TILES)},
)(_attn_fwd)


# --------------------------------------------------------------------------------------------------
# Backward kernels
# --------------------------------------------------------------------------------------------------

@_kernel
def _attn_bwd_delta(Out, DOut, Delta,
                    stride_ob, stride_oh, stride_om, stride_od,
                    stride_gb, stride_gh, stride_gm, stride_gd,
                    heads_q, len_q,
                    head_dim, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, ALIGNED: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """Delta = rowsum(dO * O) in float32, stored as a contiguous [B, Hq, Nq] tensor."""
    stride_ob, stride_oh = _hint16(stride_ob, ALIGNED), _hint16(stride_oh, ALIGNED)
    stride_gb, stride_gh = _hint16(stride_gb, ALIGNED), _hint16(stride_gh, ALIGNED)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(Out + off_b * stride_ob + off_h * stride_oh
                   + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                   offs_m, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, True)
    do = _load_rows(DOut + off_b * stride_gb + off_h * stride_gh
                    + offs_m[:, None] * stride_gm + offs_d[None, :] * stride_gd,
                    offs_m, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + pid_bh.to(tl.int64) * len_q + offs_m, delta, mask=offs_m < len_q)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, Lse, Delta, stride_qm, stride_gm, stride_lm,
                         offs_n, offs_d, lo, hi, len_q, causal_offset, qk_scale,
                         head_dim, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """Add the Q blocks lo, lo + BLOCK_M, ... < hi of one query head to a KV tile's dK, dV (transposed
    form: rows are keys, columns queries). MASKED: rows past len_q are read as 0, and (if CAUSAL)
    scores of keys a query may not see are set to -inf."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(Q + rows[:, None] * stride_qm, rows, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, MASKED)
        do = _load_rows(DO + rows[:, None] * stride_gm, rows, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, MASKED)
        if MASKED:
            lse = tl.load(Lse + rows * stride_lm, mask=rows < len_q, other=float("inf"))
            delta = tl.load(Delta + rows, mask=rows < len_q, other=0.0)
        else:
            lse = tl.load(Lse + rows * stride_lm)
            delta = tl.load(Delta + rows)
        # A row that sees no key has lse = -inf: use +inf so that p = exp2(-inf) = 0, not exp2(NaN).
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
        # -- p^T = exp(s^T - lse) = exp2(qk_scale * k q^T - log2(e) * lse)
        arg = tl.dot(k, tl.trans(q), input_precision="ieee") * qk_scale - lse2[None, :]
        if MASKED:
            visible = rows[None, :] < len_q
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :] + causal_offset)
            arg = tl.where(visible, arg, float("-inf"))
        p_t = tl.math.exp2(arg)
        # -- dV += p^T dO
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
        # -- dS^T = p^T (dP^T - Delta), dP^T = v dO^T;  dK += dS^T q
        dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision="ieee")
    return dk, dv


@_kernel
def _attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV, sm_scale, qk_scale,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_gb, stride_gh, stride_gm, stride_gd,
                   stride_lb, stride_lh, stride_lm,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   heads_q, heads_kv, group, len_q, len_k, seq_bucket,
                   head_dim, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
                   ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    stride_qb, stride_qh = _hint16(stride_qb, ALIGNED), _hint16(stride_qh, ALIGNED)
    stride_kb, stride_kh = _hint16(stride_kb, ALIGNED), _hint16(stride_kh, ALIGNED)
    stride_vb, stride_vh = _hint16(stride_vb, ALIGNED), _hint16(stride_vh, ALIGNED)
    stride_gb, stride_gh = _hint16(stride_gb, ALIGNED), _hint16(stride_gh, ALIGNED)
    stride_dkb, stride_dkh = _hint16(stride_dkb, ALIGNED), _hint16(stride_dkh, ALIGNED)
    stride_dvb, stride_dvh = _hint16(stride_dvb, ALIGNED), _hint16(stride_dvh, ALIGNED)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_kv).to(tl.int64)
    off_hkv = (pid_bh % heads_kv).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    # The KV tile stays in registers for the whole program; keys past len_k read as 0 (never stored).
    k = _load_rows(K + off_b * stride_kb + off_hkv * stride_kh
                   + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                   offs_n, len_k, offs_d, head_dim, BLOCK_D, EVEN_D, True)
    v = _load_rows(V + off_b * stride_vb + off_hkv * stride_vh
                   + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                   offs_n, len_k, offs_d, head_dim, BLOCK_D, EVEN_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # Q range: rows >= lo see key start_n; rows >= diag_end see every key of this tile.
    causal_offset = len_k - len_q
    len_q_blocks = tl.cdiv(len_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        first_row = tl.maximum(start_n - causal_offset, 0)
        lo = tl.minimum((first_row // BLOCK_M) * BLOCK_M, len_q_blocks)
        last_key = start_n + BLOCK_N - 1
        diag_end = tl.cdiv(tl.maximum(last_key - causal_offset, 0), BLOCK_M) * BLOCK_M
        diag_end = tl.minimum(tl.maximum(diag_end, lo), len_q_blocks)
    else:
        lo = 0
        diag_end = 0
    even_end = tl.maximum((len_q // BLOCK_M) * BLOCK_M, diag_end)

    # Sum over the query heads of the group, in a fixed order (deterministic, no atomics).
    for g in range(0, group):
        off_h = off_hkv * group + g
        Qh = Q + off_b * stride_qb + off_h * stride_qh + offs_d[None, :] * stride_qd
        DOh = DO + off_b * stride_gb + off_h * stride_gh + offs_d[None, :] * stride_gd
        Lseh = Lse + off_b * stride_lb + off_h * stride_lh
        Deltah = Delta + (off_b * heads_q + off_h) * len_q
        if SPLIT:
            # Q blocks crossing the diagonal (masked), those seeing the whole tile, then the ragged tail.
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, Lseh, Deltah, stride_qm, stride_gm, stride_lm,
                                          offs_n, offs_d, lo, diag_end, len_q, causal_offset, qk_scale,
                                          head_dim, BLOCK_D, EVEN_D, BLOCK_M, CAUSAL, True)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, Lseh, Deltah, stride_qm, stride_gm, stride_lm,
                                          offs_n, offs_d, diag_end, even_end, len_q, causal_offset, qk_scale,
                                          head_dim, BLOCK_D, EVEN_D, BLOCK_M, CAUSAL, False)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, Lseh, Deltah, stride_qm, stride_gm, stride_lm,
                                          offs_n, offs_d, even_end, len_q, len_q, causal_offset, qk_scale,
                                          head_dim, BLOCK_D, EVEN_D, BLOCK_M, CAUSAL, True)
        else:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, Lseh, Deltah, stride_qm, stride_gm, stride_lm,
                                          offs_n, offs_d, lo, len_q, len_q, causal_offset, qk_scale,
                                          head_dim, BLOCK_D, EVEN_D, BLOCK_M, CAUSAL, True)

    dk = dk * sm_scale
    _store_rows(DK + off_b * stride_dkb + off_hkv * stride_dkh
                + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
                dk.to(DK.dtype.element_ty), offs_n, len_k, offs_d, head_dim)
    _store_rows(DV + off_b * stride_dvb + off_hkv * stride_dvh
                + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
                dv.to(DV.dtype.element_ty), offs_n, len_k, offs_d, head_dim)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                       lo, hi, kv_end, causal_offset, qk_scale,
                       head_dim, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """Add the KV blocks lo, lo + BLOCK_N, ... < hi to a Q tile's dQ (masking as in the forward);
    ``lse2 = log2(e) * lse`` (+inf for rows that see no key), ``qk_scale = log2(e) * scale``."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_rows(K + cols[:, None] * stride_kn, cols, kv_end, offs_d, head_dim, BLOCK_D, EVEN_D, MASKED)
        v = _load_rows(V + cols[:, None] * stride_vn, cols, kv_end, offs_d, head_dim, BLOCK_D, EVEN_D, MASKED)
        arg = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale - lse2[:, None]
        if MASKED:
            visible = cols[None, :] < kv_end
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
            arg = tl.where(visible, arg, float("-inf"))
        p = tl.math.exp2(arg)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
    return dq


@_kernel
def _attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ, sm_scale, qk_scale,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_gb, stride_gh, stride_gm, stride_gd,
                 stride_lb, stride_lh, stride_lm,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 heads_q, group, len_q, len_k, seq_bucket,
                 head_dim, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
                 ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    stride_qb, stride_qh = _hint16(stride_qb, ALIGNED), _hint16(stride_qh, ALIGNED)
    stride_kb, stride_kh = _hint16(stride_kb, ALIGNED), _hint16(stride_kh, ALIGNED)
    stride_vb, stride_vh = _hint16(stride_vb, ALIGNED), _hint16(stride_vh, ALIGNED)
    stride_gb, stride_gh = _hint16(stride_gb, ALIGNED), _hint16(stride_gh, ALIGNED)
    stride_dqb, stride_dqh = _hint16(stride_dqb, ALIGNED), _hint16(stride_dqh, ALIGNED)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    off_hkv = off_h // group
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q = _load_rows(Q + off_b * stride_qb + off_h * stride_qh
                   + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, True)
    do = _load_rows(DO + off_b * stride_gb + off_h * stride_gh
                    + offs_m[:, None] * stride_gm + offs_d[None, :] * stride_gd,
                    offs_m, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, True)
    lse = tl.load(Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm,
                  mask=offs_m < len_q, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    delta = tl.load(Delta + pid_bh.to(tl.int64) * len_q + offs_m, mask=offs_m < len_q, other=0.0)
    K += off_b * stride_kb + off_hkv * stride_kh + offs_d[None, :] * stride_kd
    V += off_b * stride_vb + off_hkv * stride_vh + offs_d[None, :] * stride_vd
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    causal_offset = len_k - len_q
    if CAUSAL:
        kv_end = tl.maximum(tl.minimum(tl.minimum(start_m + BLOCK_M, len_q) + causal_offset, len_k), 0)
        full_end = tl.maximum(tl.minimum(start_m + causal_offset + 1, kv_end), 0)
    else:
        kv_end = len_k
        full_end = len_k
    if SPLIT:
        full_end = (full_end // BLOCK_N) * BLOCK_N
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                                0, full_end, kv_end, causal_offset, qk_scale,
                                head_dim, BLOCK_D, EVEN_D, BLOCK_N, CAUSAL, False)
    else:
        full_end = 0
    dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                            full_end, kv_end, kv_end, causal_offset, qk_scale,
                            head_dim, BLOCK_D, EVEN_D, BLOCK_N, CAUSAL, True)
    dq = dq * sm_scale
    _store_rows(DQ + off_b * stride_dqb + off_h * stride_dqh
                + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
                dq.to(DQ.dtype.element_ty), offs_m, len_q, offs_d, head_dim)


_bwd_key = ["BLOCK_D", "CAUSAL", "seq_bucket"]
_attn_bwd_dkdv_tuned = triton.autotune(configs=_configs(_BWD_TILES), key=_bwd_key,
                                       prune_configs_by={"early_config_prune": _pruner(_BWD_TILES)})(_attn_bwd_dkdv)
_attn_bwd_dq_tuned = triton.autotune(configs=_configs(_BWD_TILES), key=_bwd_key,
                                     prune_configs_by={"early_config_prune": _pruner(_BWD_TILES)})(_attn_bwd_dq)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

def _run(kernel, tuned, grid_of, args: tuple, meta: dict, blocks, block_d: int, dtype, *, name: str):
    """Launch ``kernel`` with fixed tiles, or ``tuned`` (its autotuned twin) when ``blocks`` is None."""
    if blocks is None:
        tuned[lambda cfg: grid_of(cfg["BLOCK_M"], cfg["BLOCK_N"])](*args, **meta)
        return
    block_m, block_n = blocks
    grid = grid_of(block_m, block_n)
    if grid[0] * grid[1] == 0:
        return
    options = _launch_options(block_m, block_n, block_d, dtype)
    try:
        kernel[grid](*args, **meta, BLOCK_M=block_m, BLOCK_N=block_n, **options)
    except triton.runtime.errors.OutOfResources as exc:
        if options["num_stages"] == 1:
            raise ValueError(f"{name}: block_m={block_m}, block_n={block_n} do not fit this GPU for "
                             f"head_dim padded to {block_d} and {dtype}: {exc}") from exc
        kernel[grid](*args, **meta, BLOCK_M=block_m, BLOCK_N=block_n,
                     num_warps=options["num_warps"], num_stages=1)


def _outputs(q, k, v, out, lse, *, kernel: str):
    """The ``(out, lse)`` tensors the forward writes: the caller's buffers where given (validated; the
    kernel writes through their strides, so any strided view works), else new contiguous ones."""
    _validate.check_out_buffers(q, k, v, out, lse, kernel=kernel, lse_dtypes=(torch.float32,))
    b, hq, len_q, d = q.shape
    if out is None:
        out = torch.empty((b, hq, len_q, d), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((b, hq, len_q), dtype=torch.float32, device=q.device)
    return out, lse


def _forward(q, k, v, *, causal: bool, scale, block_m, block_n, inner_scaled: bool, kernel: str,
             out=None, lse=None):
    """Shared launcher of the FA1 and FA2 forward kernels: returns ``(out, lse)``, no autograd.
    ``out``/``lse`` given: the kernel writes into them and they are returned."""
    scale = _check_inputs(q, k, v, kernel=kernel, scale=scale, block_m=block_m, block_n=block_n)
    if not isinstance(causal, bool):
        raise TypeError(f"{kernel}: causal={causal!r}, but should be a bool")
    b, hq, len_q, d = q.shape
    hkv, len_k = k.shape[1], k.shape[2]
    out, lse = _outputs(q, k, v, out, lse, kernel=kernel)
    if b * hq * len_q == 0:
        return out, lse
    block_d = _padded_head_dim(d)
    args = (q, k, v, out, lse, scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
            hq, hq // hkv, len_q, len_k, _seq_bucket(max(len_q, len_k)))
    meta = {**_head_dim_meta(d, block_d), "CAUSAL": causal, "SPLIT": _split_stages(q.dtype),
            "INNER_SCALED": inner_scaled, "ALIGNED": _aligned(q, k, v, out)}
    _run(_attn_fwd, _attn_fwd_tuned, lambda bm, bn: (triton.cdiv(len_q, bm), b * hq), args, meta,
         _fixed_blocks(block_m, block_n), block_d, q.dtype, name=kernel)
    return out, lse


def fa2_forward_raw(q, k, v, *, causal: bool = False, scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, out=None, lse=None):
    """Triton FA2 forward (outer-scaled) without autograd: returns ``(out, lse)`` (written into the
    ``out``/``lse`` buffers when given)."""
    return _forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                    inner_scaled=False, kernel="triton_fa2", out=out, lse=lse)


def fa1_forward_raw(q, k, v, *, causal: bool = False, scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, out=None, lse=None):
    """Triton FA1 forward (inner-scaled: renormalised every KV step) without autograd: ``(out, lse)``
    (written into the ``out``/``lse`` buffers when given)."""
    return _forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                    inner_scaled=True, kernel="triton_fa1", out=out, lse=lse)


def fa2_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale: float | None = None,
                 block_m: int | None = None, block_n: int | None = None):
    """Triton FA2 backward: returns ``(dq, dk, dv, delta)`` with ``delta = rowsum(dO * O)`` (float32).

    ``dk`` and ``dv`` have ``k``'s shape (summed over the query heads of each group). Deterministic:
    no atomics, and every sum runs in a fixed order. ``block_m``/``block_n`` are the Q and KV tiles of
    both kernels (see :func:`_bwd_tiles` for the float32 cap at head dims above 128); both ``None``
    autotunes each kernel's tiles on the GPU.
    """
    kernel = "triton_fa2 backward"
    scale = _check_inputs(q, k, v, kernel=kernel, scale=scale, block_m=block_m, block_n=block_n)
    if not isinstance(causal, bool):
        raise TypeError(f"{kernel}: causal={causal!r}, but should be a bool")
    _validate.check_backward_inputs(q, k, v, out, lse, dout, kernel=kernel)
    if lse.dtype != torch.float32:
        raise ValueError(f"{kernel}: lse.dtype={_validate.dtype_name(lse.dtype)}, but should be float32")
    b, hq, len_q, d = q.shape
    hkv, len_k = k.shape[1], k.shape[2]
    group = hq // hkv
    block_d = _padded_head_dim(d)
    bucket = _seq_bucket(max(len_q, len_k))
    blocks = _fixed_blocks(block_m, block_n)
    dkdv_blocks, dq_blocks = (None, None) if blocks is None else _bwd_tiles(*blocks, block_d, q.dtype)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = torch.empty((b, hq, len_q), dtype=torch.float32, device=q.device)

    if b * hq * len_q > 0:
        delta_block = 32 if INTERPRET or block_d > 128 else 64
        _attn_bwd_delta[(triton.cdiv(len_q, delta_block), b * hq)](
            out, dout, delta, *out.stride(), *dout.stride(), hq, len_q,
            **_head_dim_meta(d, block_d), ALIGNED=_aligned(out, dout), BLOCK_M=delta_block)
    common = (scale, scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride())
    meta = {**_head_dim_meta(d, block_d), "CAUSAL": causal, "SPLIT": _split_stages(q.dtype)}
    if b * hkv * len_k > 0:
        meta["ALIGNED"] = _aligned(q, k, v, dout, dk, dv)
        _run(_attn_bwd_dkdv, _attn_bwd_dkdv_tuned, lambda bm, bn: (triton.cdiv(len_k, bn), b * hkv),
             (q, k, v, dout, lse, delta, dk, dv, *common, *dk.stride(), *dv.stride(),
              hq, hkv, group, len_q, len_k, bucket),
             meta, dkdv_blocks, block_d, q.dtype, name=kernel)
    if b * hq * len_q > 0:
        meta["ALIGNED"] = _aligned(q, k, v, dout, dq)
        _run(_attn_bwd_dq, _attn_bwd_dq_tuned, lambda bm, bn: (triton.cdiv(len_q, bm), b * hq),
             (q, k, v, dout, lse, delta, dq, *common, *dq.stride(), hq, group, len_q, len_k, bucket),
             meta, dq_blocks, block_d, q.dtype, name=kernel)
    return dq, dk, dv, delta


# --------------------------------------------------------------------------------------------------
# Autograd and the public functions
# --------------------------------------------------------------------------------------------------

def _apply(q, k, v, causal, scale, block_m, block_n, inner_scaled: bool, out, lse):
    kernel = "triton_fa1" if inner_scaled else "triton_fa2"
    buffers = None
    if out is not None or lse is not None:
        _check_inputs(q, k, v, kernel=kernel, scale=scale, block_m=block_m, block_n=block_n)
        buffers = _outputs(q, k, v, out, lse, kernel=kernel)
    return _autograd.apply(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                           forward=functools.partial(_forward, inner_scaled=inner_scaled, kernel=kernel),
                           backward=fa2_backward, buffers=buffers)


def fa2_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                block_m: int | None = None, block_n: int | None = None, out=None, lse=None):
    """Triton FlashAttention-2 forward: ``(out, lse)``; gradients flow through ``out``.

    ``q`` is ``[B, Hq, Nq, D]``, ``k`` and ``v`` ``[B, Hkv, Nk, D]`` (``Hq % Hkv == 0``), any strides;
    float16, bfloat16 or float32; ``D`` in 16..256, a multiple of 8. ``causal`` is bottom-right aligned;
    ``scale=None`` means ``1/sqrt(D)``. ``block_m``/``block_n`` (powers of two >= 16) fix the tiles;
    both ``None`` autotunes them on the GPU. ``out=`` (q's shape and dtype) and ``lse=`` (``[B, Hq, Nq]``
    float32), views with any strides, receive the results and are returned (``out_buffers`` in
    :class:`kernels.registry.Implementation`); gradients still flow to q, k, v through the returned out.
    """
    return _apply(q, k, v, causal, scale, block_m, block_n, False, out, lse)


def fa1_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                block_m: int | None = None, block_n: int | None = None, out=None, lse=None):
    """Triton FlashAttention-1 forward (inner-scaled), same contract as :func:`fa2_forward`; its backward
    is the FA2 backward, which needs only ``out`` and the LSE."""
    return _apply(q, k, v, causal, scale, block_m, block_n, True, out, lse)
