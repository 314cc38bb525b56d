"""Experiment (timed, not adopted): the Gluon dK/dV kernel software-pipelined across Q tiles.

The shipped kernel (kernels/gluon_backward.py) overlaps, per Q tile, P^T with dP^T's product and dS^T
with dV's product, then waits for dK and dV with nothing else to do. Here tile i + 1's S^T and dP^T are
issued before tile i's dV and dK products, so the tensor cores have up to four products queued while
the exponentials and dS of tile i + 1 run, the forward's order (kernels/gluon_forward.py)::

    S_0, dP_0;  P_0, dS_0
    for i in 0 .. n - 2:
        issue S_{i+1} = K Q_{i+1}^T, dP_{i+1} = V dO_{i+1}^T, dV += P_i dO_i, dK += dS_i Q_i
        wait for S_{i+1};  P_{i+1}                      <- overlaps dP_{i+1}, dV_i, dK_i
        wait for dP_{i+1};  dS_{i+1}                    <- overlaps dV_i, dK_i
        wait for dV_i, dK_i;  release tile i's stage
    dV += P_{n-1} dO_{n-1};  dK += dS_{n-1} Q_{n-1}

Nothing is in flight across the back edge (no C7514). The same products summed in the same order as the
shipped kernel, so dK and dV should be bitwise the same. Tile i's stage is held until the end of
iteration i while tile i + 1's is read: three stages, so that the producer runs a tile ahead.

    PYTHONPATH=. python docs/experiments/gluon_dkdv_pipe.py compile   # offline sm_90: registers, spills, C7514
    PYTHONPATH=. python docs/experiments/gluon_dkdv_pipe.py            # on an H100/H200: equality and ms

Offline compile and the H200's times (2026-11-27): docs/benchmarks.md ("Tried, not adopted: the dK/dV
kernel pipelined across Q tiles"): 1.4-1.5x slower at head dim 128 (spills), within 3% at 64.
"""
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import torch

from kernels import gluon_backward as gb
from kernels import gluon_forward

LOG2E = math.log2(math.e)
STAGES = 3

if gb.AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, \
        warpgroup_mma, warpgroup_mma_wait

    _tma_store = gluon_forward._tma_store

    @gluon.jit
    def _tile_rows(step, n_tiles_nz, lo, off_b, off_hkv, group, Lse, Delta, stride_lb, stride_lh, stride_ln,
                   stride_db, stride_dh, len_q, COL: gl.constexpr, BLOCK_M: gl.constexpr):
        """(first row, rows, log2-unit LSE (+inf where a row sees no key or is past Nq), Delta) of step's tile."""
        g = step // n_tiles_nz
        start_m = lo + (step - g * n_tiles_nz) * BLOCK_M
        off_h = off_hkv * group + g
        rows = start_m + gl.arange(0, BLOCK_M, layout=COL)
        in_q = rows < len_q
        lse = gl.load(Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + rows * stride_ln,
                      mask=in_q, other=float("inf"))
        delta = gl.load(Delta + off_b.to(gl.int64) * stride_db + off_h.to(gl.int64) * stride_dh + rows,
                        mask=in_q, other=0.0)
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        return start_m, rows, gl.expand_dims(lse2, 0), gl.expand_dims(delta, 0)

    @gluon.jit
    def _probs(s, c, lse2, keys, rows, start_m, unmasked_from, causal_offset, CAUSAL: gl.constexpr):
        arg = s * c - lse2
        if CAUSAL:
            if start_m < unmasked_from:
                arg = gl.where(keys <= gl.expand_dims(rows, 0) + causal_offset, arg, float("-inf"))
        return gl.exp2(arg)

    @gluon.jit
    def _consumer_pipe(k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty, dk_desc, dv_desc, Lse, Delta,
                       stride_lb, stride_lh, stride_ln, stride_db, stride_dh, c, scale, off_b, off_hkv, group,
                       start_n, lo, n_tiles, len_q, causal_offset, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        dtype: gl.constexpr = dk_desc.dtype
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        A_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=A_LAYOUT, k_width=2)
        COL: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        k_tile = k_smem.reshape([BLOCK_N, D])
        v_tile = v_smem.reshape([BLOCK_N, D])
        dk = gl.zeros([BLOCK_N, D], gl.float32, layout=A_LAYOUT)
        dv = gl.zeros([BLOCK_N, D], gl.float32, layout=A_LAYOUT)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=S_LAYOUT)
        keys = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=ROW), 1)
        unmasked_from = start_n + BLOCK_N - 1 - causal_offset
        mbarrier.wait(kv_bar, 0)
        n_tiles_nz = gl.maximum(n_tiles, 1)
        total = group * n_tiles
        if total > 0:
            start_m, rows, lse2, delta = _tile_rows(0, n_tiles_nz, lo, off_b, off_hkv, group, Lse, Delta, stride_lb,
                                                    stride_lh, stride_ln, stride_db, stride_dh, len_q, COL, BLOCK_M)
            mbarrier.wait(ready.index(0), 0)
            s = warpgroup_mma(k_tile, q_smem.index(0).reshape([BLOCK_M, D]).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            dp = warpgroup_mma(v_tile, do_smem.index(0).reshape([BLOCK_M, D]).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))
            p = _probs(s, c, lse2, keys, rows, start_m, unmasked_from, causal_offset, CAUSAL)
            dp = warpgroup_mma_wait(0, deps=(dp, ))
            p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
            ds_op = gl.convert_layout((p * (dp - delta)).to(dtype), P_LAYOUT)
            for step in range(0, total - 1):
                st = step % STAGES
                nx = (step + 1) % STAGES
                start_m, rows, lse2, delta = _tile_rows(step + 1, n_tiles_nz, lo, off_b, off_hkv, group, Lse, Delta,
                                                        stride_lb, stride_lh, stride_ln, stride_db, stride_dh, len_q,
                                                        COL, BLOCK_M)
                mbarrier.wait(ready.index(nx), ((step + 1) // STAGES) & 1)
                s = warpgroup_mma(k_tile, q_smem.index(nx).reshape([BLOCK_M, D]).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
                dp = warpgroup_mma(v_tile, do_smem.index(nx).reshape([BLOCK_M, D]).permute((1, 0)), s_zero,
                                   use_acc=False, is_async=True)
                dv = warpgroup_mma(p_op, do_smem.index(st).reshape([BLOCK_M, D]), dv, is_async=True)
                dk = warpgroup_mma(ds_op, q_smem.index(st).reshape([BLOCK_M, D]), dk, is_async=True)
                s = warpgroup_mma_wait(3, deps=(s, ))
                p = _probs(s, c, lse2, keys, rows, start_m, unmasked_from, causal_offset, CAUSAL)
                dp = warpgroup_mma_wait(2, deps=(dp, ))
                p_next = p.to(dtype)
                ds_next = (p * (dp - delta)).to(dtype)
                dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
                mbarrier.arrive(empty.index(st), count=1)
                p_op = gl.convert_layout(p_next, P_LAYOUT)
                ds_op = gl.convert_layout(ds_next, P_LAYOUT)
            st = (total - 1) % STAGES
            dv = warpgroup_mma(p_op, do_smem.index(st).reshape([BLOCK_M, D]), dv, is_async=True)
            dk = warpgroup_mma(ds_op, q_smem.index(st).reshape([BLOCK_M, D]), dk, is_async=True)
            dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
            mbarrier.arrive(empty.index(st), count=1)
        k_tile.store((dk * scale).to(dtype))
        v_tile.store(dv.to(dtype))
        fence_async_shared()
        _tma_store(dk_desc, [off_b, off_hkv, start_n, 0], k_smem)
        _tma_store(dv_desc, [off_b, off_hkv, start_n, 0], v_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _attn_bwd_dkdv_pipe(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, stride_lb, stride_lh,
                            stride_ln, stride_db, stride_dh, c, scale, heads_kv, group, len_q, len_k,
                            CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                            STAGES: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        off_b = pid_bh // heads_kv
        off_hkv = pid_bh % heads_kv
        start_n = pid_n * 2 * BLOCK_N
        causal_offset = len_k - len_q
        if CAUSAL:
            lo = (gl.maximum(start_n - causal_offset, 0) // BLOCK_M) * BLOCK_M
        else:
            lo = start_n * 0
        n_tiles = gl.maximum(gl.cdiv(len_q - lo, BLOCK_M), 0)
        k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_N, D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, D], do_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(kv_bar.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize([
            (_consumer_pipe, (k_smem.index(0), v_smem.index(0), q_smem, do_smem, kv_bar.index(0), ready, empty,
                              dk_desc, dv_desc, Lse, Delta, stride_lb, stride_lh, stride_ln, stride_db, stride_dh, c,
                              scale, off_b, off_hkv, group, start_n, lo, n_tiles, len_q, causal_offset, CAUSAL,
                              BLOCK_M, BLOCK_N, D, STAGES)),
            (_consumer_pipe, (k_smem.index(1), v_smem.index(1), q_smem, do_smem, kv_bar.index(1), ready, empty,
                              dk_desc, dv_desc, Lse, Delta, stride_lb, stride_lh, stride_ln, stride_db, stride_dh, c,
                              scale, off_b, off_hkv, group, start_n + BLOCK_N, lo, n_tiles, len_q, causal_offset,
                              CAUSAL, BLOCK_M, BLOCK_N, D, STAGES)),
            (gb._producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
                            off_b, off_hkv, group, start_n, lo, n_tiles, BLOCK_M, BLOCK_N, STAGES)),
        ], [4, 1], [240, 24])


def dkdv_pipe(q, k, v, dout, lse, delta, dk, dv, *, causal: bool, scale: float) -> None:
    """:func:`kernels.gluon_backward.dkdv` with the pipelined kernel (readable tensors only, Nq, Nk > 0)."""
    b, hkv, len_k, d = k.shape
    hq, len_q = q.shape[1], q.shape[2]
    desc = gluon_forward._descriptor
    _attn_bwd_dkdv_pipe[(-(-len_k // (2 * gb.BLOCK_N)), b * hkv)](
        desc(q, gb.BLOCK_M), desc(k, gb.BLOCK_N), desc(v, gb.BLOCK_N), desc(dout, gb.BLOCK_M), desc(dk, gb.BLOCK_N),
        desc(dv, gb.BLOCK_N), lse, delta, lse.stride(0), lse.stride(1), lse.stride(2), delta.stride(0),
        delta.stride(1), scale * LOG2E, scale, hkv, hq // hkv, len_q, len_k, CAUSAL=causal, BLOCK_M=gb.BLOCK_M,
        BLOCK_N=gb.BLOCK_N, D=d, STAGES=STAGES, num_warps=4)


def _compile() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    ptxas = get_ptxas(90).path
    for d in gb.HEAD_DIMS:
        for causal in (False, True):
            def desc(rows):
                block = [1, 1, rows, d]
                layout = gl.NVMMASharedLayout.get_default_for(block, gl.float16)
                return f"tensordesc<fp16[{','.join(map(str, block))}],{layout!r}>"
            sig = {"q_desc": desc(gb.BLOCK_M), "k_desc": desc(gb.BLOCK_N), "v_desc": desc(gb.BLOCK_N),
                   "do_desc": desc(gb.BLOCK_M), "dk_desc": desc(gb.BLOCK_N), "dv_desc": desc(gb.BLOCK_N),
                   "Lse": "*fp32", "Delta": "*fp32",
                   **{n: "i32" for n in ("stride_lb", "stride_lh", "stride_ln", "stride_db", "stride_dh")},
                   "c": "fp32", "scale": "fp32", **{n: "i32" for n in ("heads_kv", "group", "len_q", "len_k")},
                   **{n: "constexpr" for n in ("CAUSAL", "BLOCK_M", "BLOCK_N", "D", "STAGES")}}
            kernel = triton.compile(GluonASTSource(fn=_attn_bwd_dkdv_pipe, signature=sig, constexprs={
                "CAUSAL": causal, "BLOCK_M": gb.BLOCK_M, "BLOCK_N": gb.BLOCK_N, "D": d, "STAGES": STAGES}),
                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
                fh.write(kernel.asm["ptx"])
            run = subprocess.run([ptxas, "-v", "-arch=sm_90a", fh.name, "-o", fh.name + ".o"], capture_output=True,
                                 text=True)
            spill = re.search(r"(\d+) bytes spill stores", run.stderr)
            print(json.dumps({"d": d, "causal": causal, "rc": run.returncode, "C7514": "C7514" in run.stderr,
                              "spill_bytes": int(spill.group(1)) if spill else None,
                              "registers": re.findall(r"Used (\d+) registers", run.stderr)}))


def _time() -> None:
    import triton.testing

    from kernels import triton_attention as ta
    for d in (128, 64):
        for n in [int(x) for x in os.environ.get("LENGTHS", "1024,4096,16384").split(",")]:
            for causal in (False, True):
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(4))
                out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
                _, dk_ref, dv_ref, delta = ta.fa2_backward(q, k, v, out, lse, do, causal=causal)
                dk, dv = torch.empty_like(k), torch.empty_like(v)
                row = {"d": d, "n": n, "causal": causal}
                for name, fn in (("shipped", gb.dkdv), ("pipelined", dkdv_pipe)):
                    def call():
                        fn(q, k, v, do, lse, delta, dk, dv, causal=causal, scale=d ** -0.5)
                    call()
                    torch.cuda.synchronize()
                    row[f"{name}_equal"] = bool(torch.equal(dk, dk_ref) and torch.equal(dv, dv_ref))
                    row[f"{name}_ms"] = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _compile() if sys.argv[1:] == ["compile"] else _time()
