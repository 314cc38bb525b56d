"""Host time of one FA2 call before and after the Gluon descriptors got cheaper (1af0e34, 9383c1d).

Before (1e57c46), ``kernels/gluon_forward.py`` built every tensor descriptor through Gluon's constructor,
with its checks, and derived the tile's shared-memory layout through Gluon's constexpr function each
time; ``readable`` looped over the strides of every tensor. This script swaps those two functions for
1e57c46's (copied below) and back, alternately in one process, and prints the host time per call of
``fa2_forward`` and of its backward through autograd (median over repetitions, microseconds).

    PYTHONPATH=. python docs/experiments/host_descriptors.py        # on an H100/H200: real launches
    PYTHONPATH=. python docs/experiments/host_descriptors.py cpu    # no GPU: the launches stubbed out

On the GPU: float16, N = 1024, kernels.bench's shapes (B * N = 16384, H * D = 2048), 4 x 200 calls
launched back to back without synchronising (the GPU queue never fills: the host is the slower). On the
CPU: the Python around the kernels only (launches replaced by no-ops, CPU tensors), 5 x 1000 calls.

Figures: docs/benchmarks.md ("Now: less host time per call"). A record of an experiment, not tested code.
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch

from kernels import gluon_backward as gb
from kernels import gluon_forward as gf
from kernels import triton_attention as ta
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


def readable_1e57c46(t: torch.Tensor) -> bool:
    size = t.element_size()
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and all(t.shape[i] == 1 or (t.stride(i) > 0 and t.stride(i) * size % 16 == 0) for i in range(3)))


def descriptor_1e57c46(t: torch.Tensor, rows: int) -> TensorDescriptor:
    block = [1, 1, rows, t.shape[3]]
    gdt = gl.float16 if t.dtype == torch.float16 else gl.bfloat16
    strides = [t.stride(i) if t.shape[i] != 1 else math.prod(t.shape[i + 1:]) for i in range(4)]
    return TensorDescriptor(t, list(t.shape), strides, block, gl.NVMMASharedLayout.get_default_for(block, gdt))


VERSIONS = {"1e57c46": (descriptor_1e57c46, readable_1e57c46), "now": (gf._descriptor, gf.readable)}


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_launches() -> None:
    """CPU: every kernel launch a no-op, CPU tensors accepted, the Gluon kernels taken."""
    gf._attn_fwd_ws = gb._attn_bwd_dkdv_ws = ta._attn_bwd_delta = _NoLaunch()
    ta._run = lambda *args, **kwargs: None
    ta.DEVICES = ("cpu", "cuda")
    gf.unsupported = lambda **rules: ""


def _host_us(fn, calls: int, sync) -> float:
    for _ in range(10):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    sync()
    return host


def main() -> None:
    on_cpu = sys.argv[1:] == ["cpu"]
    if on_cpu:
        _stub_launches()
        device, reps, calls, sync, rows = "cpu", 5, 1000, (lambda: None), [(128, False)]
    else:
        device, reps, calls, sync = "cuda", 4, 200, torch.cuda.synchronize
        rows = [(d, causal) for d in (128, 64) for causal in (False, True)]
    for d, causal in rows:
        b, h, n = 16, 2048 // d, 1024
        q, k, v = (torch.randn(b, h, n, d, device=device, dtype=torch.float16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        out = ta.fa2_forward(q, k, v, causal=causal)[0]

        def forward():
            ta.fa2_forward(q, k, v, causal=causal)

        def backward():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        times: dict[str, list[float]] = {}
        for _ in range(reps):
            for name, (descriptor, readable) in VERSIONS.items():
                gf._descriptor, gf.readable = descriptor, readable
                for what, fn in (("fwd", forward), ("bwd", backward)):
                    times.setdefault(f"{what} {name}", []).append(_host_us(fn, calls, sync))
        print(f"D={d} causal={causal} ({device}): " + "  ".join(
            f"{key} {statistics.median(v):.0f} (min {min(v):.0f})" for key, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
