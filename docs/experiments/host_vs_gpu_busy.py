"""At N = 1024: how long a call costs the host against how long the GPU is busy, ours beside cuDNN's.

    PYTHONPATH=. python docs/experiments/host_vs_gpu_busy.py      # an H100/H200

For D = 64 and 128, causal and not, float16, kernels.bench's shapes (B * N = 16384 tokens, H * D = 2048),
the forward and the backward through autograd (deterministic and not; cuDNN's through SDPA) as
kernels.bench times them, it prints per call: ``host`` (200 calls launched back to back, no
synchronisation: the Python and launch time), ``wall`` (the same loop up to the GPU's end), ``do_bench``
(``triton.testing.do_bench``) and ``gpu-busy`` (the device time of every kernel, memset and copy from
the torch profiler, 30 calls: the GPU's share with the host gaps left out); then a cProfile of 300
deterministic backwards (D = 64, causal). Figures: docs/benchmarks.md ("N = 1024: the host"). A record
of an experiment, not tested code.
"""
import cProfile, pstats, time, io
import torch, triton
from triton.testing import do_bench
from kernels import triton_attention as ta
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)

def host_us(f, calls=200):
    for _ in range(5): f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls): f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6

def gpu_busy_us(f, iters=30):
    """GPU busy time per call (us): the kernels' own device time from the profiler, host gaps excluded."""
    from torch.profiler import profile, ProfilerActivity
    for _ in range(3): f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters): f()
        torch.cuda.synchronize()
    return round(sum(e.self_device_time_total for e in prof.key_averages()) / iters)

def line(host, wall, f) -> str:
    return f"host {host:.0f} us, wall {wall:.0f} us, do_bench {do_bench(f) * 1e3:.0f} us, gpu-busy {gpu_busy_us(f)} us"


for d in (64, 128):
    for causal in (True, False):
        n = 1024; b, h = 16, 2048 // d
        q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(4))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        for det in (True, False):
            out = ta.fa2_forward(*leaves, causal=causal, deterministic=det)[0]
            g = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
            fwd = lambda: ta.fa2_forward(*leaves, causal=causal, deterministic=det)[0]
            hb, wb = host_us(g)
            hf, wf = host_us(fwd)
            print(f"D={d} causal={causal} det={det}: bwd {line(hb, wb, g)} | fwd {line(hf, wf, fwd)}", flush=True)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        g = lambda: torch.autograd.grad(o, (qq, kk, vv), dout, retain_graph=True)
        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        hb, wb = host_us(g); hf, wf = host_us(fwd)
        print(f"D={d} causal={causal} cuDNN: bwd {line(hb, wb, g)} | fwd {line(hf, wf, fwd)}", flush=True)

q, k, v, dout = (torch.randn(16, 32, 1024, 64, device="cuda", dtype=torch.float16) for _ in range(4))
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
out = ta.fa2_forward(*leaves, causal=True)[0]
g = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
for _ in range(5): g()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(300): g()
pr.disable(); torch.cuda.synchronize()
sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(22); print(sio.getvalue()[-5000:])
