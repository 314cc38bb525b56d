"""Why kernels.bench reads the D = 128 causal N = 1024 backward far below other timings of the same kernels
(docs/benchmarks.md: 131-141 TFLOP/s in three bench runs, 200-212 from module_ab.py): the backward timed
through autograd (as kernels.bench does) and called directly, and what the autotuner chose and measured.

    PYTHONPATH=. python docs/experiments/bwd_autotune.py

float16, D = 128, N = 1024, B x H = 16 x 16, causal (``EXP_D``, ``EXP_N``, ``EXP_CAUSAL`` to change).
After the first timing, the autotuner's caches are emptied and it tunes again, ``EXP_RETUNES`` (3) times,
printing each kernel's chosen configuration, every candidate's time and the backward's TFLOP/s with it.

A record of an experiment, not tested code.
"""

from __future__ import annotations

import os

import torch
import triton

from kernels import triton_attention as ta
from kernels.bench import _flops, bench_one
from module_ab import _ms  # this script's neighbour: run as a script, its folder is on the import path


def choices(name: str, tuned) -> str:
    """What the autotuner ``tuned`` chose last, and every candidate's time (ms) as it measured them."""
    timings = getattr(tuned, "configs_timings", None) or {}
    cells = ", ".join(f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}/w{c.num_warps}/s{c.num_stages}: "
                      f"{t[0] if isinstance(t, (list, tuple)) else t:.3f}" for c, t in timings.items())
    best = tuned.best_config
    return (f"  {name} chose {best.kwargs['BLOCK_M']}x{best.kwargs['BLOCK_N']}/w{best.num_warps}/"
            f"s{best.num_stages}; candidates (ms): {cells}")


def _report(label: str, tflops: float) -> None:
    print(f"{label}: {tflops:.0f} TFLOP/s", flush=True)
    for name, tuned in (("dK/dV", ta._attn_bwd_dkdv_tuned), ("dQ", ta._attn_bwd_dq_tuned)):
        print(choices(name, tuned), flush=True)


def main() -> None:
    d, n = int(os.environ.get("EXP_D", "128")), int(os.environ.get("EXP_N", "1024"))
    causal = os.environ.get("EXP_CAUSAL", "1") == "1"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"D={d} N={n} causal={causal}", flush=True)
    row = bench_one(d, n, causal, torch.float16, peers=("sdpa_cudnn",))
    print(f"kernels.bench row: triton bwd {row['triton_bwd_tflops']:.0f}, cuDNN bwd {row['sdpa_cudnn_bwd_tflops']:.0f}",
          flush=True)
    batch, heads = 16384 // n, 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn((batch, heads, n, d), generator=gen, device="cuda", dtype=torch.float16)
                     for _ in range(4))
    flops = _flops(batch, heads, n, d, causal, True)
    out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
    direct = lambda: ta.fa2_backward(q, k, v, out, lse, dout, causal=causal)  # noqa: E731
    _report("direct, configurations of the bench row", flops / (_ms(direct) * 1e-3) / 1e12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = ta.fa2_forward(*leaves, causal=causal)[0]
    auto = lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True)  # noqa: E731
    print(f"autograd, same configurations: {flops / (_ms(auto) * 1e-3) / 1e12:.0f} TFLOP/s", flush=True)
    for i in range(int(os.environ.get("EXP_RETUNES", "3"))):
        ta._attn_bwd_dkdv_tuned.cache.clear()
        ta._attn_bwd_dq_tuned.cache.clear()
        _report(f"retune {i + 1}, direct", flops / (_ms(direct) * 1e-3) / 1e12)


if __name__ == "__main__":
    main()
