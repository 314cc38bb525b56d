"""The causal forward at N = 1024 and 2048 (kernels.bench's shapes, head dims 64 and 128, float16 and bfloat16):
each call of ours (fa2_forward through autograd) and of cuDNN's SDPA timed as kernels.bench times calls
(:func:`kernels.bench.timed_interleaved`, two rounds), then the CUDA kernels each call launches with their
device times (torch.profiler, 20 calls each after a 256 MB flush; medians; "small"/"big": the one-element
fill of our walk's counter and the flush, both one elementwise kernel). Written to split the call's ratio
into the kernel's and the call's fixed cost (docs/benchmarks.md, fourteenth session).

    PYTHONPATH=. python docs/experiments/fwd_kernel_times.py

A record of an experiment, not tested code.
"""
import collections, torch
from kernels import triton_attention as ta, bench
from torch.nn.attention import SDPBackend, sdpa_kernel
F = torch.nn.functional
print(torch.cuda.get_device_name(), flush=True)
for d in (64, 128):
    for n in (1024, 2048):
        for dt in (torch.float16, torch.bfloat16):
            b, h = 16384 // n, 2048 // d
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dt, generator=g).requires_grad_() for _ in range(3))
            def cud():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            fns = {"ours": lambda: ta.fa2_forward(q, k, v, causal=True)[0], "cudnn": cud}
            for fn in fns.values():
                fn(); fn()
            torch.cuda.synchronize()
            t = bench.timed_interleaved(fns, 2)
            flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
            line = [f"D{d} N{n} {str(dt)[6:]} calls(us): ours {t['ours']*1e3:.1f} cudnn {t['cudnn']*1e3:.1f} "
                    f"ratio {t['cudnn']/t['ours']:.3f} |"]
            for name, fn in fns.items():
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        flush.zero_(); fn()
                    torch.cuda.synchronize()
                kern = collections.defaultdict(list)
                for ev in prof.events():
                    if ev.device_type == torch.autograd.DeviceType.CUDA:
                        kern[ev.name[:40]].append(ev.device_time_total)
                for kn, ts in kern.items():
                    if len(ts) == 20 and "flush" not in kn:
                        ts = sorted(ts)
                        line.append(f"{name}:{kn} {ts[10]:.1f}")
                    elif len(ts) == 40:  # fill kernels: flush's and ours together
                        ts = sorted(ts)
                        line.append(f"{name}:{kn} small {ts[10]:.1f} big {ts[30]:.1f}")
            print(" ".join(line), flush=True)
            del flush
