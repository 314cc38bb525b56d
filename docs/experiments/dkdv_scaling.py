"""Why the causal dK/dV kernel at N = 1024 takes as long as the non-causal one (docs/benchmarks.md,
"Short sequences"): how its time scales with the number of programs and with the work per program.

    PYTHONPATH=. python docs/experiments/dkdv_scaling.py

float16, D = 128, fixed tiles (``block_m``/``block_n``, as the autotuner picked at N = 1024: 64-row Q
tiles, 128-row KV tiles), Nq = Nk = N. For each N and B x H it prints the dK/dV kernel's and the dQ
kernel's mean time (torch profiler), causal and not, and the causal / non-causal ratio, next to the ratio
of the tile pairs each computes. With B x H small enough that every program runs at once (one wave),
the time is that of the longest program: equal times there are expected (the first KV tile's program
sees every Q row either way); with many waves the causal time should follow the work. Then the compiled
kernels' registers, spills and shared memory.

``EXP_MODULE=path/to/triton_attention.py`` times another version of the kernels' module instead (one
that has ``fa2_forward_raw``, ``fa2_backward`` and the two backward kernels), e.g. the one of c21c35b,
whose H200 figures at N = 1024 were far above today's H100 ones: ``git show
c21c35b:kernels/triton_attention.py > .exp/old.py`` in a folder git ignores, carried to the GPU machine.

A record of an experiment, not tested code.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import triton

if os.environ.get("EXP_MODULE"):
    _spec = importlib.util.spec_from_file_location("exp_triton_attention", os.environ["EXP_MODULE"])
    ta = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(ta)
else:
    from kernels import triton_attention as ta


def _kernel_us(fn, reps: int = 10) -> dict[str, float]:
    """The two backward kernels' mean times (us) per call of ``fn`` (the profiler reading of short_n.py,
    this script's neighbour: run as a script, its folder is on the import path)."""
    from short_n import _kernels

    return {name: us for key, us in _kernels(fn, reps) for name in ("_attn_bwd_dkdv", "_attn_bwd_dq")
            if key.startswith(name)}


def _pairs(n: int, block_m: int, block_n: int, causal: bool) -> int:
    """(Q tile, KV tile) pairs the dK/dV kernel visits: causally, Q tiles from the KV tile's first row on."""
    if not causal:
        return (n // block_m) * (n // block_n)
    return sum((n - start) // block_m for start in range(0, n, block_n))


def _compiled(fn) -> None:
    for device, entry in getattr(fn, "device_caches", {}).items():
        for key, kernel in entry[0].items():
            meta = kernel.metadata
            regs, spills = getattr(kernel, "n_regs", "?"), getattr(kernel, "n_spills", "?")
            print(f"    {kernel.name}: regs {regs}, spills {spills}, "
                  f"shared {getattr(meta, 'shared', '?')} B, warps {meta.num_warps}, stages {meta.num_stages}")


def main() -> None:
    print(f"module {ta.__file__}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    block_m, block_n, d = 64, 128, 128
    for n, bh_list in ((1024, (16, 64, 256, 1024)), (4096, (16, 64))):
        for bh in bh_list:
            times = {}
            for causal in (False, True):
                q, k, v, dout = (torch.randn((1, bh, n, d), device="cuda", dtype=torch.float16) for _ in range(4))
                out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
                times[causal] = _kernel_us(lambda: ta.fa2_backward(q, k, v, out, lse, dout, causal=causal,
                                                                   block_m=block_m, block_n=block_n))
                del q, k, v, dout, out, lse
            work = _pairs(n, block_m, block_n, True) / _pairs(n, block_m, block_n, False)
            programs = bh * (n // block_n)
            cells = []
            for name in ("_attn_bwd_dkdv", "_attn_bwd_dq"):
                full, causal_t = times[False].get(name), times[True].get(name)
                if full and causal_t:
                    cells.append(f"{name[10:]} {full:7.1f} / {causal_t:7.1f} us (ratio {causal_t / full:.2f})")
            print(f"N={n:5d} B*H={bh:4d} dK/dV programs={programs:5d}: " + "; ".join(cells)
                  + f"; causal work ratio {work:.2f}")
    print("compiled dK/dV kernels:")
    _compiled(ta._attn_bwd_dkdv)
    print("compiled dQ kernels:")
    _compiled(ta._attn_bwd_dq)


if __name__ == "__main__":
    main()
