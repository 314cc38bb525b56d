"""What one forward call costs at N = 1024 (kernels.bench's shapes, float16, head dims 128 and 64, causal
both), the Triton FA2 forward through the public API (with and without autograd), the Gluon forward called
directly, and cuDNN's SDPA: host time per call (200 calls, no sync), wall time per call, ``do_bench``
(kernels.bench's timing, events around each call), ``do_bench_cudagraph`` (the A/B scripts' timing), and
the CUDA kernels a call launches with their device time (torch.profiler, 5 calls). Written to find where
kernels.bench's N = 1024 ratios and the A/B's differ (docs/benchmarks.md, seventh session).

    PYTHONPATH=. python docs/experiments/fwd_call_cost.py

A record of an experiment, not tested code.
"""
import math, time, collections, torch, triton, triton.testing
from kernels import triton_attention, gluon_forward as gf
from torch.nn.attention import sdpa_kernel, SDPBackend
F = torch.nn.functional
print(torch.cuda.get_device_name(), flush=True)
for d in (128, 64):
    for causal in (False, True):
        n = 1024; b, h = 16384 // n, 2048 // d
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g).requires_grad_()
                   for _ in range(3))
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        out = torch.empty_like(qd); lse = torch.empty(b, h, n, device="cuda")
        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        def cud_nograd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)
        fns = {"api": lambda: triton_attention.fa2_forward(q, k, v, causal=causal)[0],
               "api_nograd": lambda: triton_attention.fa2_forward(qd, kd, vd, causal=causal)[0],
               "direct": lambda: gf.forward(qd, kd, vd, out, lse, causal=causal, scale=d ** -0.5),
               "cudnn": cud, "cudnn_nograd": cud_nograd}
        res = {}
        for name, fn in fns.items():
            fn(); fn(); torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
            host_us = (t1 - t0) / 200 * 1e6; wall_us = (t2 - t0) / 200 * 1e6
            bench = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            try:
                graph = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
            except Exception as e:
                graph = float("nan")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            kern = collections.Counter(); dev = 0.0
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    kern[ev.name[:60]] += 1; dev += ev.device_time_total
            # the same kernels with do_bench's cache flush (a 256 MB zero fill) before each call
            flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    flush.zero_()
                    fn()
                torch.cuda.synchronize()
            flushed = sum(ev.device_time_total for ev in prof.events()
                          if ev.device_type == torch.autograd.DeviceType.CUDA and "Fill" not in ev.name) / 5
            del flush
            res[name] = (host_us, wall_us, bench, graph, dev / 5)
            print(f"D{d} causal={causal} {name:13s} host {host_us:6.1f}us wall/call {wall_us:6.1f} "
                  f"do_bench {bench:6.1f} graph {graph:6.1f} prof-dev/call {dev/5:6.1f} flushed {flushed:6.1f} "
                  f"kernels/call {dict((k2, c/5) for k2, c in kern.items())}", flush=True)
