"""The Triton FA2 backward with grouped-query attention: TFLOP/s as the group grows, for the module of
the working tree or (``EXP_MODULE``, as in dkdv_scaling.py, this script's neighbour) another version.

    PYTHONPATH=. python docs/experiments/gqa_backward.py

float16, D = 128, Hq = 32 query heads sharing Hq / group KV heads, B * N = 16384 tokens, autotuned
tiles; the backward alone (``fa2_backward`` on a saved forward), median of ``triton.testing.do_bench``,
FLOPs as kernels.bench counts them (2.5 x 4 B Hq N^2 D, halved if causal). Written when the dK/dV
kernel's loop over a group's query heads was found to spill (docs/experiments/kernel_resources.py).

A record of an experiment, not tested code.
"""

from __future__ import annotations

import torch
import triton
import triton.testing

from dkdv_scaling import ta


def main() -> None:
    print(f"module {ta.__file__}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    heads, d = 32, 128
    for n in (1024, 4096):
        batch = 16384 // n
        for causal in (False, True):
            cells = []
            for group in (1, 4, 8):
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, dout = (torch.randn((batch, heads, n, d), generator=gen, device="cuda", dtype=torch.float16)
                           for _ in range(2))
                k, v = (torch.randn((batch, heads // group, n, d), generator=gen, device="cuda",
                                    dtype=torch.float16) for _ in range(2))
                out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
                ms = triton.testing.do_bench(lambda: ta.fa2_backward(q, k, v, out, lse, dout, causal=causal),
                                             warmup=25, rep=100, return_mode="median")
                flops = 2.5 * 4.0 * batch * heads * n * n * d / (2 if causal else 1)
                cells.append(f"group {group}: {flops / (ms * 1e-3) / 1e12:4.0f}")
                del q, k, v, dout, out, lse
            print(f"N={n:5d} B x Hq={batch} x {heads} causal={causal!s:5}: " + ", ".join(cells) + " TFLOP/s")


if __name__ == "__main__":
    main()
