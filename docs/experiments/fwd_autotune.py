"""What the forward's autotuner picks at N = 1024, and what the candidates it weighed give when timed
alone: the stripped forward of fwd_tma_ws.py (form D) read 441 TFLOP/s with 128 x 128 tiles at D = 128
where the shipped, autotuned forward read about 400 (docs/benchmarks.md).

    PYTHONPATH=. python docs/experiments/fwd_autotune.py

float16, N = 1024, D = 128 and 64, causal and not, B x H as kernels.bench. Per row: the autotuned
forward's TFLOP/s with what it chose and every candidate's time as the autotuner measured it, then the
same after ``EXP_RETUNES`` (3) retunings, and the forward with fixed 128 x 64 and 128 x 128 tiles (8
warps, 3 stages, as the launcher gives fixed tiles).

A record of an experiment, not tested code.
"""

from __future__ import annotations

import os

import torch
import triton

from bwd_autotune import choices  # this script's neighbours: run as a script, its folder is on the path
from kernels import triton_attention as ta
from kernels.bench import _flops
from module_ab import _ms


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    n = 1024
    for d in (128, 64):
        for causal in (False, True):
            batch, heads = 16384 // n, 2048 // d
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn((batch, heads, n, d), generator=gen, device="cuda", dtype=torch.float16)
                       for _ in range(3))
            flops = _flops(batch, heads, n, d, causal, False)
            print(f"D={d} causal={causal}", flush=True)
            for i in range(1 + int(os.environ.get("EXP_RETUNES", "3"))):
                if i:
                    ta._attn_fwd_tuned.cache.clear()
                tuned = flops / (_ms(lambda: ta.fa2_forward_raw(q, k, v, causal=causal)) * 1e-3) / 1e12
                print(f" {'retune ' + str(i) if i else 'autotuned'}: {tuned:.0f} TFLOP/s", flush=True)
                print(choices("forward", ta._attn_fwd_tuned), flush=True)
            for bm, bn in ((128, 64), (128, 128)):
                fixed = flops / (_ms(lambda: ta.fa2_forward_raw(q, k, v, causal=causal, block_m=bm, block_n=bn))
                                 * 1e-3) / 1e12
                print(f" fixed {bm} x {bn}: {fixed:.0f} TFLOP/s", flush=True)
            del q, k, v


if __name__ == "__main__":
    main()
