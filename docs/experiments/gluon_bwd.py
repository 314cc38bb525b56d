"""Experiment: the FA2 backward's kernels in Gluon on Hopper, beside the Triton ones and cuDNN (a record
of what was timed, not tested code).

    PYTHONPATH=. [LENGTHS=1024,4096,16384] [DIMS=128,64] [BM64=64,128] [BM128=64] [DQK64=64,128] \
        [DQK128=64] python docs/experiments/gluon_bwd.py

For each head dim, length N (B * N = 16384 tokens, H * D = 2048) and causal flag, float16: the shipped
Triton backward (``fa2_backward``, autotuned; its kernels' times from the torch profiler), the Gluon
dK/dV kernel of kernels/gluon_backward.py at each Q tile height (``BM64``, ``BM128``), the Gluon dQ
kernel below at each KV tile width (``DQK64``, ``DQK128``), cuDNN's backward, the largest difference of
each Gluon result from the Triton one, and the backward's estimated TFLOP/s with the fastest Gluon kernels
in place of the Triton ones (``tf_est_gluon``, ``ratio_est`` = cuDNN time / that estimate).

The dQ kernel here is the shipped forward's structure (kernels/gluon_forward.py: one producer warp, two
consumer warpgroups of 64 query rows) running ``S = Q K^T``, ``dP = dO V^T``, ``dQ += dS K`` per KV block,
with block j's dQ product overlapping block j + 1's exponentials. It computes the same dQ as the Triton
dQ kernel, bitwise on every case tried, but hardly faster: on an H200, head dim 128 0.88-1.01 of the
Triton kernel's time, head dim 64 1.13-1.25 (docs/benchmarks.md). Not shipped; kept as the record of
what was timed.
"""
import json
import math
import os

import torch
import triton.testing

from kernels import gluon_backward as gb
from kernels import gluon_forward
from kernels import triton_attention as ta

dev = "cuda"
LOG2E = math.log2(math.e)
DQ_ROWS = 64  # query rows per consumer warpgroup; a program covers 2 * DQ_ROWS
DQ_KEYS = {64: 128, 128: 64}  # keys per KV stage, by head dim (128 at head dim 128 needs more shared memory than there is)
DQ_STAGES = 3

if gb.AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, \
        warpgroup_mma, warpgroup_mma_wait

    _tma_load = gluon_forward._tma_load
    _tma_store = gluon_forward._tma_store
    _blocks = gluon_forward._blocks
    _mask = gluon_forward._mask

    @gluon.jit
    def _dq_consumer(q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, dq_desc, Lse, Delta, stride_lb, stride_lh,
                     stride_ln, stride_db, stride_dh, c, scale, off_b, off_h, start_m, len_q, len_k, causal_offset,
                     n_blocks, n_full, n_loaded, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup: dQ of query rows [start_m, start_m + BLOCK_M) over KV blocks [0, n_blocks), in
        the forward's order (kernels/gluon_forward.py): block j's dQ product overlaps block j + 1's
        exponentials; then it releases the stages loaded for the other warpgroup only (up to ``n_loaded``)."""
        dtype: gl.constexpr = dq_desc.dtype
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        A_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        DS_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=A_LAYOUT, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        q_tile = q_smem.reshape([BLOCK_M, D])
        do_tile = do_smem.reshape([BLOCK_M, D])
        rows = start_m + gl.arange(0, BLOCK_M, layout=ROW)
        in_q = rows < len_q
        lse = gl.load(Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + rows * stride_ln,
                      mask=in_q, other=float("inf"))
        delta = gl.expand_dims(gl.load(Delta + off_b.to(gl.int64) * stride_db + off_h.to(gl.int64) * stride_dh + rows,
                                       mask=in_q, other=0.0), 1)
        lse2 = gl.expand_dims(gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), 1)
        dq = gl.zeros([BLOCK_M, D], gl.float32, layout=A_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT)
        mbarrier.wait(q_bar, 0)
        if n_blocks > 0:
            mbarrier.wait(ready.index(0), 0)
            s = warpgroup_mma(q_tile, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            dp = warpgroup_mma(do_tile, v_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))
            s = _mask(s, 0, n_full, start_m, len_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N, S_LAYOUT)
            p = gl.exp2(s * c - lse2)
            dp = warpgroup_mma_wait(0, deps=(dp, ))
            ds = gl.convert_layout((p * (dp - delta)).to(dtype), DS_LAYOUT)
            for j in range(0, n_blocks - 1):
                st = j % STAGES
                nx = (j + 1) % STAGES
                mbarrier.wait(ready.index(nx), ((j + 1) // STAGES) & 1)
                s = warpgroup_mma(q_tile, k_smem.index(nx).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
                dp = warpgroup_mma(do_tile, v_smem.index(nx).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                                   use_acc=False, is_async=True)
                dq = warpgroup_mma(ds, k_smem.index(st).reshape([BLOCK_N, D]), dq, is_async=True)
                s = warpgroup_mma_wait(2, deps=(s, ))  # S_{j+1} done; dP_{j+1} and dQ_j still running ...
                s = _mask(s, j + 1, n_full, start_m, len_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N, S_LAYOUT)
                p = gl.exp2(s * c - lse2)  # ... during this
                dp = warpgroup_mma_wait(1, deps=(dp, ))
                ds_next = (p * (dp - delta)).to(dtype)  # ... and this
                dq = warpgroup_mma_wait(0, deps=(dq, ))
                mbarrier.arrive(empty.index(st), count=1)
                ds = gl.convert_layout(ds_next, DS_LAYOUT)
            j = n_blocks - 1
            dq = warpgroup_mma(ds, k_smem.index(j % STAGES).reshape([BLOCK_N, D]), dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq, ))
            mbarrier.arrive(empty.index(j % STAGES), count=1)
        for i in range(gl.maximum(n_blocks, 0), n_loaded):
            mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
            mbarrier.arrive(empty.index(i % STAGES), count=1)
        q_tile.store((dq * scale).to(dtype))  # Q is read no more: its buffer stages dQ (rows past the end clipped)
        fence_async_shared()
        _tma_store(dq_desc, [off_b, off_h, start_m, 0], q_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, off_b,
                     off_h, off_hkv, start_m, n_loaded, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):
        """One warp: both warpgroups' Q and dO tiles, then K and V block by block as the stages are freed."""
        for w in gl.static_range(2):
            mbarrier.expect(q_bar.index(w), 2 * q_desc.block_type.nbytes)
            _tma_load(q_desc, [off_b, off_h, start_m + w * BLOCK_M, 0], q_bar.index(w), q_smem.index(w))
            _tma_load(do_desc, [off_b, off_h, start_m + w * BLOCK_M, 0], q_bar.index(w), do_smem.index(w))
        for i in range(n_loaded):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
            mbarrier.expect(ready.index(st), 2 * k_desc.block_type.nbytes)
            _tma_load(k_desc, [off_b, off_hkv, i * BLOCK_N, 0], ready.index(st), k_smem.index(st))
            _tma_load(v_desc, [off_b, off_hkv, i * BLOCK_N, 0], ready.index(st), v_smem.index(st))

    @gluon.jit
    def _attn_bwd_dq_ws(q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, stride_lb, stride_lh, stride_ln,
                        stride_db, stride_dh, c, scale, heads_q, group, len_q, len_k, CAUSAL: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        if CAUSAL:  # the longest rows first
            pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        else:
            pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        off_b = pid_bh // heads_q
        off_h = pid_bh % heads_q
        start_m = pid_m * 2 * BLOCK_M
        causal_offset = len_k - len_q
        n0, full0 = _blocks(start_m, len_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
        n1, full1 = _blocks(start_m + BLOCK_M, len_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
        n_loaded = gl.maximum(n0, n1)

        q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, D], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bar.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one release per consumer warpgroup
        gl.warp_specialize([
            (_dq_consumer, (q_smem.index(0), do_smem.index(0), k_smem, v_smem, q_bar.index(0), ready, empty, dq_desc,
                            Lse, Delta, stride_lb, stride_lh, stride_ln, stride_db, stride_dh, c, scale, off_b, off_h,
                            start_m, len_q, len_k, causal_offset, n0, full0, n_loaded, CAUSAL, BLOCK_M, BLOCK_N, D,
                            STAGES)),
            (_dq_consumer, (q_smem.index(1), do_smem.index(1), k_smem, v_smem, q_bar.index(1), ready, empty, dq_desc,
                            Lse, Delta, stride_lb, stride_lh, stride_ln, stride_db, stride_dh, c, scale, off_b, off_h,
                            start_m + BLOCK_M, len_q, len_k, causal_offset, n1, full1, n_loaded, CAUSAL, BLOCK_M,
                            BLOCK_N, D, STAGES)),
            (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty,
                            off_b, off_h, off_h // group, start_m, n_loaded, BLOCK_M, BLOCK_N, STAGES)),
        ], [4, 1], [240, 24])


def dq(q, k, v, dout, lse, delta, dq_out, *, causal: bool, scale: float) -> None:
    """Write dQ of the FA2 backward into ``dq_out`` (``q``'s shape); the arguments as :func:`dkdv`'s."""
    b, hq, len_q, d = q.shape
    len_k = k.shape[2]
    if b * hq * len_q == 0:
        return
    if len_k == 0:
        dq_out.zero_()
        return
    readable = gluon_forward.readable
    q, k, v, dout = (t if readable(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
                     for t in (q, k, v, dout))
    target = dq_out if readable(dq_out) else torch.empty(dq_out.shape, dtype=dq_out.dtype, device=dq_out.device)
    keys = DQ_KEYS[d]
    descriptor = gluon_forward._descriptor
    _attn_bwd_dq_ws[(-(-len_q // (2 * DQ_ROWS)), b * hq)](
        descriptor(q, DQ_ROWS), descriptor(k, keys), descriptor(v, keys), descriptor(dout, DQ_ROWS),
        descriptor(target, DQ_ROWS), lse, delta, lse.stride(0), lse.stride(1), lse.stride(2), delta.stride(0),
        delta.stride(1), scale * LOG2E, scale, hq, hq // k.shape[1], len_q, len_k, CAUSAL=causal, BLOCK_M=DQ_ROWS,
        BLOCK_N=keys, D=d, STAGES=DQ_STAGES, num_warps=4)
    if target is not dq_out:
        dq_out.copy_(target)


def kernel_times(fn):
    """ms per call of each kernel ``fn`` launches (the torch profiler, ten calls)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    t = {}
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dt:
            t[ev.key] = dt / 10 / 1000
    return t


if __name__ == "__main__":
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lengths = [int(x) for x in os.environ.get("LENGTHS", "1024,4096,16384").split(",")]
    bms = {64: [int(x) for x in os.environ.get("BM64", "64").split(",")], 128: [int(x) for x in os.environ.get("BM128", "64").split(",")]}
    dqk = {64: [int(x) for x in os.environ.get("DQK64", "64,128").split(",")], 128: [int(x) for x in os.environ.get("DQK128", "64").split(",")]}
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
    for d in [int(x) for x in os.environ.get("DIMS", "128,64").split(",")]:
        for n in lengths:
            for causal in (False, True):
                dtype = torch.float16
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v, do = (torch.randn(b, h, n, d, device=dev, dtype=dtype) for _ in range(4))
                scale = d ** -0.5
                out, lse = ta.fa2_forward_raw(q, k, v, causal=causal, scale=scale, gluon=False)
                dq_t, dk_t, dv_t, delta = ta.fa2_backward(q, k, v, out, lse, do, causal=causal, scale=scale, gluon=False)
                row = dict(d=d, n=n, causal=causal)
                tb = lambda: ta.fa2_backward(q, k, v, out, lse, do, causal=causal, scale=scale, gluon=False)
                row["triton_bwd_ms"] = bench(tb)
                kt = kernel_times(tb)
                row["triton_dkdv"] = sum(v_ for k_, v_ in kt.items() if "dkdv" in k_)
                row["triton_dq"] = sum(v_ for k_, v_ in kt.items() if "_attn_bwd_dq" in k_)
                row["delta"] = sum(v_ for k_, v_ in kt.items() if "_attn_bwd_delta" in k_)
                dk, dv, dq_buf = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
                for bm in bms[d]:
                    gb.BLOCK_M = bm
                    g = lambda: gb.dkdv(q, k, v, do, lse, delta, dk, dv, causal=causal, scale=scale)
                    g(); torch.cuda.synchronize()
                    row[f"dkdv_bm{bm}_diff"] = max((dk - dk_t).abs().max().item(), (dv - dv_t).abs().max().item())
                    row[f"dkdv_bm{bm}"] = bench(g)
                for kk_ in dqk[d]:
                    DQ_KEYS[d] = kk_
                    g = lambda: dq(q, k, v, do, lse, delta, dq_buf, causal=causal, scale=scale)
                    g(); torch.cuda.synchronize()
                    row[f"dq_k{kk_}_diff"] = (dq_buf - dq_t).abs().max().item()
                    row[f"dq_k{kk_}"] = bench(g)
                qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                row["cudnn_ms"] = bench(lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True))
                fl = 4.0 * b * h * n * n * d * (0.5 if causal else 1) * 2.5
                tf = lambda ms: round(fl / (ms * 1e-3) / 1e12)
                best_dkdv = min(row[f"dkdv_bm{bm}"] for bm in bms[d])
                best_dq = min(row[f"dq_k{x}"] for x in dqk[d])
                est = row["triton_bwd_ms"] - row["triton_dkdv"] - row["triton_dq"] + best_dkdv + best_dq
                row.update(tf_triton=tf(row["triton_bwd_ms"]), tf_est_gluon=tf(est), tf_cudnn=tf(row["cudnn_ms"]),
                           ratio_est=round(row["cudnn_ms"] / est, 3))
                print("TIME", json.dumps({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}), flush=True)
