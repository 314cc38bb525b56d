"""Where the backward's time goes, ours beside cuDNN's: each CUDA kernel's time per call (torch profiler)
and the call's time (``do_bench``, as kernels.bench times it: autograd, in alternating rounds); then each
forward's kernels the same way, with every kernel's launch shape (grid, block, registers, shared memory).

    PYTHONPATH=. EXP_ROWS="128:4096 64:4096 128:4096c" EXP_ROUNDS=5 python docs/experiments/bwd_breakdown.py

Rows are ``D:N`` (``c``: causal) with kernels.bench's shapes (B * N = 16384 tokens, H * D = 2048), float16
(``EXP_DTYPE=bf16`` for bfloat16). For each row it prints the call's median time and TFLOP/s for both, and
each kernel's microseconds per call, so that the side kernels (Delta, the zero fill and the conversion of a
float32 dQ, a dQ kernel) show beside the main ones. A record of how docs/benchmarks.md found where the
backward's time goes, not tested code.
"""

from __future__ import annotations

import os
import statistics

import torch
import triton
import triton.testing

from kernels import triton_attention as ta


def kernels(fn, reps: int = 5) -> tuple[list[tuple[str, float, int]], dict]:
    """(name, microseconds per call, launches per call) of every CUDA kernel ``fn`` runs, and each kernel's
    launch shape from the profiler's trace (grid, block, registers a thread, shared memory)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if total:
            rows.append((evt.key[:90], total / reps, evt.count // reps))
    shapes = {}
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            with open(f.name) as trace:
                events = json.load(trace).get("traceEvents", [])
        for e in events:
            a = e.get("args", {})
            if e.get("cat") == "kernel" and "grid" in a:
                shapes[e["name"][:90]] = (f"grid {a.get('grid')} block {a.get('block')} regs "
                                          f"{a.get('registers per thread')} smem {a.get('shared memory')}")
    except Exception as exc:  # noqa: BLE001 - a record: the times stand without the shapes
        print(f"  (no launch shapes: {type(exc).__name__}: {exc})")
    return sorted(rows, key=lambda r: -r[1]), shapes


def row(d: int, n: int, causal: bool, dtype: torch.dtype, rounds: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads = max(1, 16384 // n), 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((batch, heads, n, d), generator=gen, device="cuda", dtype=dtype).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)
    flops = 2.5 * 4.0 * batch * heads * n * n * d / (2 if causal else 1)
    out_t = ta.fa2_forward(q, k, v, causal=causal)[0]
    def cudnn_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out_c = cudnn_fwd()
    fns = {"triton": lambda: torch.autograd.grad(out_t, (q, k, v), dout, retain_graph=True),
           "cudnn": lambda: torch.autograd.grad(out_c, (q, k, v), dout, retain_graph=True)}
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            fns[name]()
            torch.cuda.synchronize()
            times[name].append(triton.testing.do_bench(fns[name], warmup=25, rep=100, return_mode="median"))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nD={d} N={n} causal={causal} {dtype} B x H = {batch} x {heads}: "
          + ", ".join(f"{name} {med[name] * 1e3:.0f} us = {flops / (med[name] * 1e-3) / 1e12:.0f} TFLOP/s "
                      f"(rounds {' '.join(f'{t * 1e3:.0f}' for t in times[name])})" for name in fns)
          + f"; ratio {med['cudnn'] / med['triton']:.3f}")
    fwds = {"triton fwd": lambda: ta.fa2_forward(q, k, v, causal=causal)[0], "cudnn fwd": cudnn_fwd}
    for name, fn in [*fns.items(), *fwds.items()]:
        ks, shapes = kernels(fn)
        print(f"  {name}: kernels {sum(us for _, us, _ in ks):.0f} us per call")
        for kname, us, count in ks:
            print(f"    {us:8.1f} us  x{count}  {kname}  [{shapes.get(kname, '')}]")
    del q, k, v, dout, out_t, out_c
    torch.cuda.empty_cache()


def main() -> None:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[os.environ.get("EXP_DTYPE", "fp16")]
    rounds = int(os.environ.get("EXP_ROUNDS", "5"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for spec in os.environ.get("EXP_ROWS", "128:1024 128:4096 128:16384 64:4096").split():
        causal = spec.endswith("c")
        d, n = (int(x) for x in spec.rstrip("c").split(":"))
        row(d, n, causal, dtype, rounds)


if __name__ == "__main__":
    main()
