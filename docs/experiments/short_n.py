"""Where the Triton FA2's time goes at short sequences: host overhead, each kernel's GPU time, the tiles
the autotuner picked and what every candidate measured.

    PYTHONPATH=. python docs/experiments/short_n.py          # N = 1024 (EXP_N=4096 ... for others)

For D = 128 and 64, causal and not, float16, with kernels.bench's shapes (B * N = 16384 tokens,
H * D = 2048), it prints per configuration:

- ``events``: ``triton.testing.do_bench`` of the call as kernels.bench times it (autograd; median ms);
- ``graph``: the same kernels replayed from a CUDA graph (no Python between launches);
- ``host``: the Python time of one call, measured with the GPU queue not full (microseconds);
- each CUDA kernel's mean time from the torch profiler, forward and backward (deterministic and atomic dQ);
- the autotuned configurations chosen, with every candidate's time.

A record of how the short-sequence figures in docs/benchmarks.md were found, not tested code.
"""

from __future__ import annotations

import os
import time

import torch
import triton
import triton.testing

from kernels import triton_attention as ta


def _host_us(fn, calls: int = 30) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _kernels(fn, reps: int = 5) -> list[tuple[str, float]]:
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
            rows.append((evt.key[:60], total / reps))
    return sorted(rows, key=lambda r: -r[1])


def _tuned(name: str, tuner) -> None:
    for key, cfg in getattr(tuner, "cache", {}).items():
        print(f"    {name} chose {cfg} for key {key}")
    timings = getattr(tuner, "configs_timings", None) or {}  # the last key tuned
    for cfg, ms in timings.items():
        print(f"      {name} candidate {cfg}: {ms}")


def main() -> None:
    n = int(os.environ.get("EXP_N", "1024"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, N = {n}")
    for d in (128, 64):
        for causal in (False, True):
            batch, heads = max(1, 16384 // n), 2048 // d
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn((batch, heads, n, d), generator=gen, device="cuda", dtype=torch.float16)
                       .requires_grad_() for _ in range(3))
            dout = torch.randn_like(q)
            flops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
            print(f"\nD={d} causal={causal} B x H = {batch} x {heads}")

            def fwd():
                return ta.fa2_forward(q, k, v, causal=causal)[0]
            out = fwd()
            _, lse = ta.fa2_forward_raw(q.detach(), k.detach(), v.detach(), causal=causal)
            qd, kd, vd, od = q.detach(), k.detach(), v.detach(), out.detach()

            def raw_fwd():
                return ta.fa2_forward_raw(qd, kd, vd, causal=causal)

            def raw_bwd(deterministic=True):
                return ta.fa2_backward(qd, kd, vd, od, lse, dout, causal=causal, deterministic=deterministic)

            def bwd():
                return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            raw_bwd(False)
            for label, fn, f in (("fwd", fwd, flops), ("fwd raw", raw_fwd, flops), ("bwd", bwd, 2.5 * flops),
                                 ("bwd raw", raw_bwd, 2.5 * flops),
                                 ("bwd raw atomic dQ", lambda: raw_bwd(False), 2.5 * flops)):
                fn()
                torch.cuda.synchronize()
                ev = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                graph = None
                if label != "bwd":
                    try:
                        graph = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
                    except Exception as exc:  # noqa: BLE001 - a record, not a gate
                        print(f"  {label}: no CUDA graph ({type(exc).__name__}: {exc})")
                host = _host_us(fn)
                g = f", graph {graph * 1e3:.0f} us = {f / (graph * 1e-3) / 1e12:.0f} TFLOP/s" if graph else ""
                rate = f / (ev * 1e-3) / 1e12
                print(f"  {label}: events {ev * 1e3:.0f} us = {rate:.0f} TFLOP/s{g}, host {host:.0f} us")
            for label, fn in (("forward", raw_fwd), ("backward", raw_bwd),
                              ("backward atomic dQ", lambda: raw_bwd(False))):
                print(f"  kernels of the {label} (us per call):")
                for name, us in _kernels(fn):
                    print(f"    {us:8.1f}  {name}")
            _tuned("fwd", ta._attn_fwd_tuned)
            _tuned("dkdv", ta._attn_bwd_dkdv_tuned)
            _tuned("dq", ta._attn_bwd_dq_tuned)
            del q, k, v, dout, out, lse
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
