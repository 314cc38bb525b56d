"""Experiment: a forward written in Gluon (Triton's lower-level language) for Hopper, to measure what the
overlap that Triton's compiler does not build is worth: the scores of KV block j + 1 are asked of the
tensor cores (an asynchronous warpgroup MMA) before the softmax of block j, and P_j V_j runs while the
next iteration's softmax starts (FlashAttention-3's overlap within a warpgroup). The shipped kernel, in
Triton, waits for every product right after issuing it (its compiled loop waits with 0 products in
flight: docs/benchmarks.md).

Not shipped: dense contiguous ``[B, H, N, D]`` float16/bfloat16, Nq == Nk, N a multiple of the tiles,
head dim 64 or 128, causal (top-left == bottom-right here) or not, positive scale; the kernel's numerics
(running max in raw ``q.k`` units, exponent ``(s - m) * scale * log2(e)``). K in three shared-memory
stages, V in two, loaded by TMA; one barrier of the whole program per KV block (before a stage is
refilled).

    PYTHONPATH=. OUT=. python docs/experiments/gluon_fwd.py

``EXP_N`` (default "1024 4096 16384"), ``EXP_DIMS`` ("128 64"), ``EXP_DTYPE`` (fp16, bf16), ``EXP_KINDS``
("gluon ws": the single-partition kernel, the warp-specialized one). B * N = 16384
tokens, H * D = 2048 as in kernels.bench. One JSON line per row to stdout and ``$OUT/gluon_fwd.jsonl``:
TFLOP/s of each Gluon tile configuration, the shipped forward and cuDNN, and the largest differences of
the Gluon outputs and LSEs from the shipped forward's.

A record of an experiment, not tested code.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = math.log2(math.e)
K_STAGES = gl.constexpr(3)
V_STAGES = gl.constexpr(2)


@gluon.jit
def _softmax(s, m_i, l_i, c, ROW_O: gl.constexpr, P_LAYOUT: gl.constexpr, dtype: gl.constexpr):
    """One online-softmax step on the scores ``s`` of a block: new running max and sum, the rescale factor
    of the accumulator (in its row layout) and P as the A operand of the next product."""
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2((m_i - m_new) * c)
    p = gl.exp2((s - gl.expand_dims(m_new, 1)) * c)
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(dtype), P_LAYOUT), gl.convert_layout(alpha, ROW_O), m_new, l_i


@gluon.jit
def _mask(s, j, n_full, start_m, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          S_LAYOUT: gl.constexpr):
    """Causal: keys past a row's own index get -inf, in the blocks that cross the diagonal only."""
    if CAUSAL:
        if j >= n_full:
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_LAYOUT))
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
            visible = gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1)
            s = gl.where(visible, s, float("-inf"))
    return s


@gluon.jit
def _fwd(q_desc, k_desc, v_desc, o_desc, Lse, c, N, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
         BLOCK_N: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

    if CAUSAL:  # the longest rows first
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    row0 = pid_bh * N
    start_m = pid_m * BLOCK_M
    if CAUSAL:
        n_blocks = gl.cdiv(start_m + BLOCK_M, BLOCK_N)
        n_full = start_m // BLOCK_N
    else:
        n_blocks = N // BLOCK_N
        n_full = n_blocks

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_bar.index(i), count=1)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_bar.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + start_m, 0], q_bar, q_smem)
    for i in gl.static_range(K_STAGES):
        mbarrier.expect(k_bar.index(i), k_desc.block_type.nbytes, pred=i < n_blocks)
        tma.async_copy_global_to_shared(k_desc, [row0 + i * BLOCK_N, 0], k_bar.index(i), k_smem.index(i),
                                        pred=i < n_blocks)
    for i in gl.static_range(V_STAGES):
        mbarrier.expect(v_bar.index(i), v_desc.block_type.nbytes, pred=i < n_blocks)
        tma.async_copy_global_to_shared(v_desc, [row0 + i * BLOCK_N, 0], v_bar.index(i), v_smem.index(i),
                                        pred=i < n_blocks)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_S)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=ROW_S)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=O_LAYOUT)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    s = _mask(s, 0, n_full, start_m, CAUSAL, BLOCK_M, BLOCK_N, S_LAYOUT)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, c, ROW_O, P_LAYOUT, dtype)

    # No product is in flight across the loop's back edge (a register copy of an accumulator in flight makes
    # ptxas serialize every product of the kernel).
    for j in range(0, n_blocks - 1):
        kn = (j + 1) % K_STAGES
        mbarrier.wait(k_bar.index(kn), ((j + 1) // K_STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(kn).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = acc * gl.expand_dims(alpha, 1)
        mbarrier.wait(v_bar.index(j % V_STAGES), (j // V_STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(j % V_STAGES), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))  # S_{j+1} done, P_j V_j still running ...
        s = _mask(s, j + 1, n_full, start_m, CAUSAL, BLOCK_M, BLOCK_N, S_LAYOUT)
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, c, ROW_O, P_LAYOUT, dtype)  # ... during this softmax
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        # Every warpgroup is past S_{j+1} and P_j V_j: K_j's and V_j's stages may be refilled.
        gl.thread_barrier()
        kf = j + K_STAGES
        mbarrier.expect(k_bar.index(j % K_STAGES), k_desc.block_type.nbytes, pred=kf < n_blocks)
        tma.async_copy_global_to_shared(k_desc, [row0 + kf * BLOCK_N, 0], k_bar.index(j % K_STAGES),
                                        k_smem.index(j % K_STAGES), pred=kf < n_blocks)
        vf = j + V_STAGES
        mbarrier.expect(v_bar.index(j % V_STAGES), v_desc.block_type.nbytes, pred=vf < n_blocks)
        tma.async_copy_global_to_shared(v_desc, [row0 + vf * BLOCK_N, 0], v_bar.index(j % V_STAGES),
                                        v_smem.index(j % V_STAGES), pred=vf < n_blocks)

    j = n_blocks - 1
    acc = acc * gl.expand_dims(alpha, 1)
    mbarrier.wait(v_bar.index(j % V_STAGES), (j // V_STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(j % V_STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(K_STAGES):
        mbarrier.invalidate(k_bar.index(i))
    for i in gl.static_range(V_STAGES):
        mbarrier.invalidate(v_bar.index(i))

    l_o = gl.convert_layout(l_i, ROW_O)
    out = acc / gl.expand_dims(l_o, 1)
    lse = (gl.convert_layout(m_i, ROW_O) * c + gl.log2(l_o)) * 0.6931471805599453
    rows = start_m + gl.arange(0, BLOCK_M, layout=ROW_O)
    gl.store(Lse + row0 + rows, lse)
    q_smem.store(out.to(dtype))  # Q is no longer read: its buffer stages the output tile
    fence_async_shared()
    gl.thread_barrier()  # every warpgroup's rows are in place before one thread sends the tile
    tma.async_copy_shared_to_global(o_desc, [row0 + start_m, 0], q_smem)
    tma.store_wait(pendings=0)


# Warp-specialized form: a one-warp producer issues every TMA load; two consumer warpgroups (4 warps each,
# 64 rows of a 128-row tile apiece) run the loop above on their own rows, releasing K and V stages through
# "empty" barriers (one arrival per consumer) instead of stopping the whole program at a barrier per block.

@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, o_desc, Lse, c, row0, start_m,
                 n_blocks, n_full, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 D: gl.constexpr):
    dtype: gl.constexpr = o_desc.dtype
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_S)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=ROW_S)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=O_LAYOUT)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    s = _mask(s, 0, n_full, start_m, CAUSAL, BLOCK_M, BLOCK_N, S_LAYOUT)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, c, ROW_O, P_LAYOUT, dtype)
    for j in range(0, n_blocks - 1):
        kn = (j + 1) % K_STAGES
        mbarrier.wait(k_ready.index(kn), ((j + 1) // K_STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(kn).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = acc * gl.expand_dims(alpha, 1)
        mbarrier.wait(v_ready.index(j % V_STAGES), (j // V_STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(j % V_STAGES), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))
        mbarrier.arrive(k_empty.index(kn), count=1)
        s = _mask(s, j + 1, n_full, start_m, CAUSAL, BLOCK_M, BLOCK_N, S_LAYOUT)
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, c, ROW_O, P_LAYOUT, dtype)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(j % V_STAGES), count=1)
    j = n_blocks - 1
    acc = acc * gl.expand_dims(alpha, 1)
    mbarrier.wait(v_ready.index(j % V_STAGES), (j // V_STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(j % V_STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))

    l_o = gl.convert_layout(l_i, ROW_O)
    out = acc / gl.expand_dims(l_o, 1)
    lse = (gl.convert_layout(m_i, ROW_O) * c + gl.log2(l_o)) * 0.6931471805599453
    rows = start_m + gl.arange(0, BLOCK_M, layout=ROW_O)
    gl.store(Lse + row0 + rows, lse)
    q_smem.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0 + start_m, 0], q_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, row0,
                 start_m, n_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    mbarrier.expect(q_bar.index(0), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + start_m, 0], q_bar.index(0), q_smem.index(0))
    mbarrier.expect(q_bar.index(1), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + start_m + BLOCK_M, 0], q_bar.index(1), q_smem.index(1))
    for i in range(n_blocks):
        ks = i % K_STAGES
        mbarrier.wait(k_empty.index(ks), ((i // K_STAGES) & 1) ^ 1, pred=i >= K_STAGES)
        mbarrier.expect(k_ready.index(ks), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + i * BLOCK_N, 0], k_ready.index(ks), k_smem.index(ks))
        vs = i % V_STAGES
        mbarrier.wait(v_empty.index(vs), ((i // V_STAGES) & 1) ^ 1, pred=i >= V_STAGES)
        mbarrier.expect(v_ready.index(vs), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row0 + i * BLOCK_N, 0], v_ready.index(vs), v_smem.index(vs))


@gluon.jit
def _fwd_ws(q_desc, k_desc, v_desc, o_desc, Lse, c, N, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
    """BLOCK_M rows per consumer warpgroup, 2 * BLOCK_M per program."""
    dtype: gl.constexpr = q_desc.dtype
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    row0 = gl.program_id(1) * N
    start_m = pid_m * 2 * BLOCK_M
    if CAUSAL:
        n_blocks = gl.cdiv(start_m + 2 * BLOCK_M, BLOCK_N)  # the producer loads what the second warpgroup sees
        n_blocks0 = gl.cdiv(start_m + BLOCK_M, BLOCK_N)
        n_full0 = start_m // BLOCK_N
        n_full1 = (start_m + BLOCK_M) // BLOCK_N
    else:
        n_blocks = N // BLOCK_N
        n_blocks0 = n_blocks
        n_full0 = n_blocks
        n_full1 = n_blocks
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    # In the causal case the first warpgroup stops earlier: it still releases (arrives on) every stage the
    # producer fills, so that the counts of two arrivals per fill hold (see _ws_drain).
    gl.warp_specialize([
        (_ws_consumer_drain, (q_smem.index(0), k_smem, v_smem, q_bar.index(0), k_ready, v_ready, k_empty, v_empty,
                              o_desc, Lse, c, row0, start_m, n_blocks0, n_full0, n_blocks, CAUSAL, BLOCK_M, BLOCK_N,
                              D)),
        (_ws_consumer_drain, (q_smem.index(1), k_smem, v_smem, q_bar.index(1), k_ready, v_ready, k_empty, v_empty,
                              o_desc, Lse, c, row0, start_m + BLOCK_M, n_blocks, n_full1, n_blocks, CAUSAL, BLOCK_M,
                              BLOCK_N, D)),
        (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                        row0, start_m, n_blocks, BLOCK_M, BLOCK_N)),
    ], [4, 1], [240, 24])


@gluon.jit
def _ws_consumer_drain(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, o_desc, Lse, c, row0,
                       start_m, n_blocks, n_full, n_loaded, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, D: gl.constexpr):
    _ws_consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, o_desc, Lse, c, row0, start_m,
                 n_blocks, n_full, CAUSAL, BLOCK_M, BLOCK_N, D)
    # Release the last V stage it read, then every stage filled for blocks it does not read (causal only).
    mbarrier.arrive(v_empty.index((n_blocks - 1) % V_STAGES), count=1)
    for i in range(n_blocks, n_loaded):
        mbarrier.wait(k_ready.index(i % K_STAGES), (i // K_STAGES) & 1)
        mbarrier.arrive(k_empty.index(i % K_STAGES), count=1)
        mbarrier.wait(v_ready.index(i % V_STAGES), (i // V_STAGES) & 1)
        mbarrier.arrive(v_empty.index(i % V_STAGES), count=1)


def forward_ws(q, k, v, causal: bool, block_m: int = 64, block_n: int = 128, num_warps: int = 4):
    b, h, n, d = q.shape
    if n % (2 * block_m) or n % block_n or d not in (64, 128) or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"experiment limits: N % tiles == 0, D in (64, 128), fp16/bf16; got {tuple(q.shape)}")
    gdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    out = torch.empty_like(q)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)

    def desc(t, rows):
        flat = t.view(b * h * n, d)
        return TensorDescriptor.from_tensor(flat, [rows, d], gl.NVMMASharedLayout.get_default_for([rows, d], gdt))

    _fwd_ws[(n // (2 * block_m), b * h)](desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(out, block_m),
                                         lse, d ** -0.5 * LOG2E, n, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n,
                                         D=d, num_warps=num_warps)
    return out, lse


def forward(q, k, v, causal: bool, block_m: int = 128, block_n: int = 128, num_warps: int = 8):
    b, h, n, d = q.shape
    if n % block_m or n % block_n or d not in (64, 128) or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"experiment limits: N % tiles == 0, D in (64, 128), fp16/bf16; got {tuple(q.shape)}, "
                         f"{q.dtype}, tiles {block_m}x{block_n}")
    gdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    out = torch.empty_like(q)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)

    def desc(t, rows):
        flat = t.view(b * h * n, d)
        return TensorDescriptor.from_tensor(flat, [rows, d], gl.NVMMASharedLayout.get_default_for([rows, d], gdt))

    _fwd[(n // block_m, b * h)](desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(out, block_m), lse,
                                d ** -0.5 * LOG2E, n, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, D=d,
                                num_warps=num_warps)
    return out, lse


CONFIGS = [(128, 128, 8), (128, 64, 8), (128, 64, 4), (64, 64, 4)]
WS_CONFIGS = [(64, 128, 4), (64, 64, 4)]  # rows per consumer warpgroup, keys per block, warps of the default


def main():
    import triton.testing
    from kernels import triton_attention
    from kernels.bench import PEER_MAKERS

    out_dir = os.environ.get("OUT", ".")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[os.environ.get("EXP_DTYPE", "fp16")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for d in [int(x) for x in os.environ.get("EXP_DIMS", "128 64").split()]:
        for n in [int(x) for x in os.environ.get("EXP_N", "1024 4096 16384").split()]:
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=dtype) for _ in range(3))
                flops = 4.0 * b * h * n * n * d / (2 if causal else 1)

                def tflops(fn):
                    fn()
                    torch.cuda.synchronize()
                    return round(flops / triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e9, 1)

                ref_out, ref_lse = triton_attention.fa2_forward_raw(q, k, v, causal=causal)
                row = {"d": d, "n": n, "causal": causal, "dtype": str(dtype).split(".")[-1],
                       "shipped": tflops(lambda: triton_attention.fa2_forward_raw(q, k, v, causal=causal)),
                       "cudnn": tflops(PEER_MAKERS["sdpa_cudnn"](q, k, v, causal))}
                runs = [("gluon", forward, cfg) for cfg in CONFIGS] + [("ws", forward_ws, cfg) for cfg in WS_CONFIGS]
                kinds = os.environ.get("EXP_KINDS", "gluon ws").split()
                for kind, fn, (bm, bn, w) in runs:
                    if kind not in kinds:
                        continue
                    key = f"{kind}_{bm}x{bn}_{w}w"
                    try:
                        o, l = fn(q, k, v, causal, bm, bn, w)
                        torch.cuda.synchronize()
                        err = ((o.float() - ref_out.float()).abs().max().item(), (l - ref_lse).abs().max().item())
                        row[key] = (tflops(lambda: fn(q, k, v, causal, bm, bn, w)), f"{err[0]:.1e}",
                                    f"{err[1]:.1e}")
                    except Exception as exc:  # noqa: BLE001
                        row[key] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(d, n, causal, key, row[key], file=sys.stderr, flush=True)
                print(json.dumps(row), flush=True)
                with open(os.path.join(out_dir, "gluon_fwd.jsonl"), "a") as fh:
                    fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
