"""Experiment behind docs/benchmarks.md ("Forward experiment"): a stripped copy of the Triton FA2 forward
(not shipped; dense, contiguous, head dim a power of two, Nq == Nk, bottom-right causal, the kernel's
numerics: raw-unit running max, sign(scale) folded into Q) in three forms, each in 7 tile configurations:

A: pointer loads.  B: device-built tensor descriptors (TMA).  C: B with warp specialization.
D: descriptors built once on the host (``TensorDescriptor`` over the ``[B * H * N, D]`` rows, passed to
the kernel as arguments), so no program builds its own.  E: D with ``[B, H, N, D]`` descriptors (tile
``[1, 1, BLOCK_N, D]``, reshaped in the loop), as the shipped launchers build them.  F: D with ``[B * H,
N, D]`` descriptors (tile ``[1, BLOCK_N, D]``, reshaped): whether the rank or the reshape costs E its speed.
G: D with its unmasked loop software-pipelined by hand (block j + 1's scores asked for before block j's
softmax): whether Triton keeps a product in flight across the exponentials when the source asks for it
(compiled offline with Triton 3.6 for sm_90 it does not: every warpgroup MMA is waited for with no
product pending, and at 128 x 128 tiles the second score tile spills; docs/benchmarks.md).

``EXP_VARIANTS="B_tma D_host"`` runs only those forms, ``EXP_CONFIGS=3`` the first three configurations,
``EXP_PEERS=sdpa_cudnn`` that peer alone.

Timed beside the shipped forward (a27991c's when the figures in docs/benchmarks.md were made), cuDNN, SDPA flash and compiled Flex, fp16, on a GPU:

    PYTHONPATH=. EXP_N=8192 OUT=. python docs/experiments/fwd_tma_ws.py

One JSON line per (head dim, causal) goes to $OUT/fwd_exp.jsonl; each configuration's TFLOP/s, largest
difference from the shipped forward and seconds (compile included) go to stderr.
"""
import json
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)


@triton.jit
def _inner(acc, m_i, l_i, q, K, V, stride_n, offs_m, offs_n, offs_d, lo, hi, c_abs, desc_k, desc_v, row0, tb, th,
           BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
           RANK: tl.constexpr, D: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if RANK == 4:  # [B, H, N, D] descriptors, as the shipped kernel reads them
            k = desc_k.load([tb, th, start_n, 0]).reshape(BLOCK_N, D)
            v = desc_v.load([tb, th, start_n, 0]).reshape(BLOCK_N, D)
        elif RANK == 3:  # [B * H, N, D] descriptors, (batch, head) folded (row0 = its index), tile reshaped
            k = desc_k.load([row0, start_n, 0]).reshape(BLOCK_N, D)
            v = desc_v.load([row0, start_n, 0]).reshape(BLOCK_N, D)
        elif TMA:
            k = desc_k.load([row0 + start_n, 0])
            v = desc_v.load([row0 + start_n, 0])
        else:
            cols = start_n + offs_n
            k = tl.load(K + cols[:, None] * stride_n + offs_d[None, :])
            v = tl.load(V + cols[:, None] * stride_n + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            visible = (start_n + offs_n)[None, :] <= offs_m[:, None]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2((m_i - m_new) * c_abs)
        p = tl.math.exp2((qk - m_new[:, None]) * c_abs)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _softmax_step(acc, m_i, l_i, qk, v, c_abs):
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2((m_i - m_new) * c_abs)
    p = tl.math.exp2((qk - m_new[:, None]) * c_abs)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@triton.jit
def _inner_pipe(acc, m_i, l_i, q, desc_k, desc_v, row0, lo, hi, c_abs, BLOCK_N: tl.constexpr):
    """Unmasked blocks [lo, hi), software-pipelined by hand: the scores of block j + 1 are asked for before
    the softmax of block j, so that (if the compiler keeps that product in flight) the tensor cores work
    while the exponentials are computed (the overlap FlashAttention-3 builds within a warpgroup)."""
    if lo < hi:
        qk = tl.dot(q, tl.trans(desc_k.load([row0 + lo, 0])))
        for start_n in range(lo, hi - BLOCK_N, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            qk_next = tl.dot(q, tl.trans(desc_k.load([row0 + start_n + BLOCK_N, 0])))
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, desc_v.load([row0 + start_n, 0]), c_abs)
            qk = qk_next
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, desc_v.load([row0 + hi - BLOCK_N, 0]), c_abs)
    return acc, m_i, l_i


@triton.jit
def _fwd(Q, K, V, Out, Lse, DK, DV, qk_scale, heads, N, stride_b, stride_h, stride_n,
         D: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, HOST: tl.constexpr,
         RANK: tl.constexpr, PIPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off = (pid_bh // heads).to(tl.int64) * stride_b + (pid_bh % heads).to(tl.int64) * stride_h
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    sign = tl.where(qk_scale < 0, -1.0, 1.0)
    c_abs = qk_scale * sign
    q = tl.load(Q + off + offs_m[:, None] * stride_n + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
    q = q * sign.to(q.dtype)
    desc_k = K
    desc_v = V
    row0 = 0
    tb = (pid_bh // heads).to(tl.int32)
    th = (pid_bh % heads).to(tl.int32)
    if HOST:  # descriptors built on the host over the [B * H * N, D] rows: this head's start at row0
        desc_k = DK
        desc_v = DV
        row0 = pid_bh if RANK == 3 else pid_bh * N
    elif TMA:
        desc_k = tl.make_tensor_descriptor(K + off, shape=[N, D], strides=[stride_n, 1], block_shape=[BLOCK_N, D])
        desc_v = tl.make_tensor_descriptor(V + off, shape=[N, D], strides=[stride_n, 1], block_shape=[BLOCK_N, D])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        full_end = (start_m // BLOCK_N) * BLOCK_N
        kv_end = tl.minimum(start_m + BLOCK_M, N)
    else:
        full_end = N
        kv_end = N
    if PIPE:
        acc, m_i, l_i = _inner_pipe(acc, m_i, l_i, q, desc_k, desc_v, row0, 0, full_end, c_abs, BLOCK_N)
    else:
        acc, m_i, l_i = _inner(acc, m_i, l_i, q, K + off, V + off, stride_n, offs_m, offs_n, offs_d, 0, full_end,
                               c_abs, desc_k, desc_v, row0, tb, th, BLOCK_N, False, TMA, WS, RANK, D)
    if CAUSAL:
        acc, m_i, l_i = _inner(acc, m_i, l_i, q, K + off, V + off, stride_n, offs_m, offs_n, offs_d, full_end, kv_end,
                               c_abs, desc_k, desc_v, row0, tb, th, BLOCK_N, True, TMA, False, RANK, D)
    out = acc / l_i[:, None]
    lse = (m_i * c_abs + tl.log2(l_i)) * 0.6931471805599453
    tl.store(Out + off + offs_m[:, None] * stride_n + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=offs_m[:, None] < N)
    tl.store(Lse + pid_bh.to(tl.int64) * N + offs_m, lse, mask=offs_m < N)


def _alloc(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


triton.set_allocator(_alloc)


def run(q, k, v, causal, tma, ws, bm, bn, warps, stages, host=False):
    b, h, n, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(n, bm), b * h)
    dk, dv = k, v
    if host == "4d":  # [B, H, N, D] descriptors over the tensors' own strides, as the shipped launchers build
        from triton.tools.tensor_descriptor import TensorDescriptor
        dk, dv = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, bn, d]) for t in (k, v))
    elif host == "3d":  # [B * H, N, D]: contiguous [B, H, N, D] tensors fold their batch and head dims
        from triton.tools.tensor_descriptor import TensorDescriptor
        dk, dv = (TensorDescriptor.from_tensor(t.view(b * h, n, d), [1, bn, d]) for t in (k, v))
    elif host:
        from triton.tools.tensor_descriptor import TensorDescriptor
        dk, dv = (TensorDescriptor.from_tensor(t.view(b * h * n, d), [bn, d]) for t in (k, v))
    _fwd[grid](q, k, v, out, lse, dk, dv, d ** -0.5 * LOG2E, h, n, q.stride(0), q.stride(1), q.stride(2),
               D=d, CAUSAL=causal, TMA=tma or bool(host), WS=ws, HOST=bool(host),
               RANK={"4d": 4, "3d": 3}.get(host, 2), PIPE=host == "pipe", BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
               num_stages=stages)
    return out, lse


CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 4, 2),
           (64, 64, 4, 3)]
VARIANTS = {"A_ptr": (False, False, False), "B_tma": (True, False, False), "C_tma_ws": (True, True, False),
            "D_host": (False, False, True), "E_host4d": (False, False, "4d"), "F_host3d": (False, False, "3d"),
            "G_pipe": (False, False, "pipe")}


def main():
    import triton.testing
    from kernels import triton_attention
    from kernels.bench import PEER_MAKERS

    out_dir = os.environ.get("OUT", ".")
    results = []
    n = int(os.environ.get("EXP_N", "8192"))
    for d in (128, 64):
        for causal in (False, True):
            b, h = 16384 // n, 2048 // d
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=torch.float16) for _ in range(3))
            flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
            ref_out, ref_lse = triton_attention.fa2_forward_raw(q, k, v, causal=causal)
            ms = triton.testing.do_bench(lambda: triton_attention.fa2_forward_raw(q, k, v, causal=causal),
                                         warmup=25, rep=100, return_mode="median")
            row = {"d": d, "causal": causal, "n": n, "current": flops / ms / 1e9}
            for name in os.environ.get("EXP_PEERS", "sdpa_cudnn sdpa_flash flex").split():
                try:
                    fn = PEER_MAKERS[name](q, k, v, causal)
                    fn()
                    row[name] = flops / triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e9
                except Exception as exc:  # noqa: BLE001
                    row[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
            for vname, (tma, ws, host) in VARIANTS.items():
                if os.environ.get("EXP_VARIANTS") and vname not in os.environ["EXP_VARIANTS"].split():
                    continue
                configs = CONFIGS if not causal else CONFIGS[:4]
                if os.environ.get("EXP_CONFIGS"):
                    configs = configs[:int(os.environ["EXP_CONFIGS"])]
                for cfg in configs:
                    key = f"{vname}{cfg}"
                    t0 = time.time()
                    try:
                        o, l = run(q, k, v, causal, tma, ws, *cfg, host=host)
                        err = max((o.float() - ref_out.float()).abs().max().item(),
                                  (l - ref_lse).abs().max().item())
                        msec = triton.testing.do_bench(lambda: run(q, k, v, causal, tma, ws, *cfg, host=host),
                                                       warmup=25, rep=100,
                                                       return_mode="median")
                        row[key] = (round(flops / msec / 1e9, 1), f"{err:.1e}", round(time.time() - t0, 1))
                    except Exception as exc:  # noqa: BLE001
                        row[key] = f"{type(exc).__name__}: {str(exc)[:160]}"
                    print(d, causal, key, row[key], file=sys.stderr, flush=True)
            results.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(out_dir, "fwd_exp.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
