"""A persistent form of the stripped Triton FA2 forward of fwd_tma_ws.py (its form D: K and V through
descriptors built on the host), against that form as it is, one program per (Q tile, batch x head).

Persistent: a fixed number of programs (``EXP_PROGRAMS`` x the GPU's SM count, default "1 2") walks the
(batch x head, Q tile) pairs in turn (tile t, t + P, t + 2P, ...; a batch x head's Q tiles are consecutive,
causal ones from the last tile, the heaviest, down), so no program's start-up and end (the Q load, the
output store) stands alone; with ``flatten`` (Triton's ``tl.range(..., flatten=True)``) the compiler may
also pipeline the next tile's loads into the current one's end. The issue's lever "persistent scheduling",
not tried before. On a GPU:

    PYTHONPATH=. OUT=. EXP_N="1024 4096" python docs/experiments/fwd_persistent.py

fp16, B * N = 16384 tokens and H * D = 2048 as in kernels.bench, N a multiple of 128; three tile
configurations (BLOCK_M, BLOCK_N, warps, stages). Per (N, D, causal): TFLOP/s of the form D and of each
persistent form, the largest difference from form D's output, cuDNN's forward beside. One JSON line per
(N, D, causal) to stdout and ``$OUT/fwd_persistent.jsonl``.

A record of an experiment, not tested code.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from fwd_tma_ws import LOG2E, _inner, run  # this script's neighbour: its folder is on the import path


@triton.jit
def _fwd_persistent(Q, Out, Lse, DK, DV, qk_scale, bh_count, N, stride_n,
                    D: tl.constexpr, CAUSAL: tl.constexpr, FLATTEN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    n_m = tl.cdiv(N, BLOCK_M)
    total = n_m * bh_count
    sign = tl.where(qk_scale < 0, -1.0, 1.0)
    c_abs = qk_scale * sign
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
        pid_bh = tile // n_m
        pid_m = tile % n_m
        if CAUSAL:  # a batch x head's heaviest Q tile first
            pid_m = n_m - 1 - pid_m
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row0 = pid_bh * N
        rows = (row0 + offs_m).to(tl.int64)
        q = tl.load(Q + rows[:, None] * stride_n + offs_d[None, :])
        q = q * sign.to(q.dtype)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        if CAUSAL:
            full_end = (start_m // BLOCK_N) * BLOCK_N
            kv_end = tl.minimum(start_m + BLOCK_M, N)
        else:
            full_end = N
            kv_end = N
        acc, m_i, l_i = _inner(acc, m_i, l_i, q, Q, Q, stride_n, offs_m, offs_n, offs_d, 0, full_end, c_abs,
                               DK, DV, row0, BLOCK_N, False, True, False)
        if CAUSAL:
            acc, m_i, l_i = _inner(acc, m_i, l_i, q, Q, Q, stride_n, offs_m, offs_n, offs_d, full_end, kv_end,
                                   c_abs, DK, DV, row0, BLOCK_N, True, True, False)
        out = acc / l_i[:, None]
        lse = (m_i * c_abs + tl.log2(l_i)) * 0.6931471805599453
        tl.store(Out + rows[:, None] * stride_n + offs_d[None, :], out.to(Out.dtype.element_ty))
        tl.store(Lse + rows, lse)


def run_persistent(q, k, v, causal, bm, bn, warps, stages, programs, flatten):
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, n, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    dk, dv = (TensorDescriptor.from_tensor(t.view(b * h * n, d), [bn, d]) for t in (k, v))
    total = triton.cdiv(n, bm) * b * h
    _fwd_persistent[(min(programs, total),)](q, out, lse, dk, dv, d ** -0.5 * LOG2E, b * h, n, q.stride(2), D=d,
                                            CAUSAL=causal, FLATTEN=flatten, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                            num_stages=stages)
    return out, lse


CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3)]


def main() -> None:
    import triton.testing
    from kernels.bench import PEER_MAKERS

    def tflops(fn, flops):
        fn()
        torch.cuda.synchronize()
        return round(flops / triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e9, 1)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    multiples = [int(x) for x in os.environ.get("EXP_PROGRAMS", "1 2").split()]
    out_path = os.path.join(os.environ.get("OUT", "."), "fwd_persistent.jsonl")
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    for n in (int(x) for x in os.environ.get("EXP_N", "1024 4096").split()):
        for d in (128, 64):
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=torch.float16)
                           for _ in range(3))
                flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
                row = {"n": n, "d": d, "causal": causal,
                       "cudnn": tflops(PEER_MAKERS["sdpa_cudnn"](q, k, v, causal), flops)}
                for cfg in CONFIGS:
                    ref, _ = run(q, k, v, causal, False, False, *cfg, host=True)
                    row[f"D_host{cfg}"] = tflops(lambda: run(q, k, v, causal, False, False, *cfg, host=True), flops)
                    for mult in multiples:
                        for flatten in (False, True):
                            key = f"persistent x{mult}{' flatten' if flatten else ''}{cfg}"
                            try:
                                o, _ = run_persistent(q, k, v, causal, *cfg, mult * sms, flatten)
                                err = (o.float() - ref.float()).abs().max().item()
                                row[key] = (tflops(lambda: run_persistent(q, k, v, causal, *cfg, mult * sms, flatten),
                                                   flops), f"{err:.1e}")
                            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                                row[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                            print(n, d, causal, key, row[key], file=sys.stderr, flush=True)
                print(json.dumps(row), flush=True)
                with open(out_path, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
                del q, k, v


if __name__ == "__main__":
    main()
