"""Energy and clock of each kernel timed alone: our forward and backward and cuDNN's, each called back to
back for about half a second (after 0.15 s of warm-up and a 0.1 s pause), with NVML's energy counter read
before and after and the SM clock sampled a few times, twice over.

    PYTHONPATH=. ROWS="128:16384 128:4096 64:1024c" python docs/experiments/power_clock.py

Needs ``pynvml`` (``nvidia-ml-py``). Prints ms a call, J a call, mean W and the lowest and highest SM clock
seen. Written to find why ``do_bench`` of one kernel alone and calls interleaved with other kernels rank
the backwards differently on an H200 at its power limit (docs/benchmarks.md, thirteenth session). A record
of an experiment, not tested code.
"""
import os, time, torch
from kernels import triton_attention as ta
from torch.nn.attention import SDPBackend, sdpa_kernel
F = torch.nn.functional
try:
    import pynvml
    pynvml.nvmlInit(); hdl = pynvml.nvmlDeviceGetHandleByIndex(0)
    energy = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(hdl) / 1e3  # J
    clock = lambda: pynvml.nvmlDeviceGetClockInfo(hdl, pynvml.NVML_CLOCK_SM)
except Exception as e:
    print("no pynvml", e); energy = None
for spec in os.environ.get("ROWS", "128:16384 128:4096 64:1024c").split():
    causal = spec.endswith("c"); d, n = (int(x) for x in spec.rstrip("c").split(":"))
    b, h = 16384 // n, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ot = ta.fa2_forward(q, k, v, causal=causal)[0]; oc = cud()
    fns = {"tf": lambda: ta.fa2_forward(q, k, v, causal=causal)[0], "cf": cud,
           "tb": lambda: torch.autograd.grad(ot, (q, k, v), dout, retain_graph=True),
           "cb": lambda: torch.autograd.grad(oc, (q, k, v), dout, retain_graph=True)}
    for rep in range(2):
        for key, fn in fns.items():
            fn(); torch.cuda.synchronize(); torch.cuda._sleep(100_000_000); torch.cuda.synchronize()
            t0 = time.perf_counter(); calls = 0
            while time.perf_counter() - t0 < 0.15:
                fn(); calls += 1
            torch.cuda.synchronize()
            e0 = energy() if energy else 0; t0 = time.perf_counter(); clocks = []
            for i in range(calls * 3):
                fn()
                if i % max(1, calls // 4) == 0: clocks.append(clock() if energy else 0)
            torch.cuda.synchronize(); t1 = time.perf_counter(); e1 = energy() if energy else 0
            per = (t1 - t0) / (calls * 3)
            print(f"{spec} {key}: {per*1e3:.2f} ms/call, {(e1-e0)/(calls*3):.3f} J/call, {(e1-e0)/(t1-t0):.0f} W, "
                  f"SM clocks {min(clocks)}-{max(clocks)} MHz", flush=True)
    del q, k, v, dout, ot, oc
    torch.cuda.empty_cache()
