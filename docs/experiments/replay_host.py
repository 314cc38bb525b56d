"""Launch plans (kernels/replay.py) at N = 1024: the host time per call and do_bench, plans off and on.

    PYTHONPATH=. python docs/experiments/replay_host.py      # an H100/H200

For D = 64 and 128, causal and not, float16, kernels.bench's shapes (B * N = 16384 tokens, H * D = 2048):
the forward and the backward through autograd (deterministic and ``deterministic=False``), each timed with
``FLASHVERIFY_REPLAY=0`` (the full path on every call) and with plans on, the two alternated in three
rounds, medians printed; cuDNN's through SDPA beside them. ``host``: 200 calls launched back to back
without synchronising, microseconds per call; ``bench``: ``triton.testing.do_bench``, microseconds.
Figures: docs/benchmarks.md ("Launch plans"). A record of an experiment, not tested code.
"""
import os
import statistics
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from kernels import replay
from kernels import triton_attention as ta

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)


def host_us(f, calls=200):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def measure(f, plans: bool):
    os.environ[replay.ENV_OFF] = "1" if plans else "0"
    try:
        return host_us(f), do_bench(f) * 1e3
    finally:
        os.environ.pop(replay.ENV_OFF, None)


print("| D | causal | call | host off / on | bench off / on | cuDNN host / bench |")
print("| ---: | :---: | :--- | ---: | ---: | ---: |")
n = 1024
for d in (64, 128):
    h, b = 2048 // d, 16384 // n
    for causal in (True, False):
        q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(4))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)

        def cudnn_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)

        cudnn = {"forward": cudnn_fwd,
                 "backward": lambda: torch.autograd.grad(o, (qq, kk, vv), dout, retain_graph=True)}
        calls = {"forward": lambda: ta.fa2_forward(*leaves, causal=causal)[0]}
        for det in (True, False):
            out = ta.fa2_forward(*leaves, causal=causal, deterministic=det)[0]
            calls[f"backward det={det}"] = (
                lambda out=out: torch.autograd.grad(out, leaves, dout, retain_graph=True))
        for name, f in calls.items():
            rounds = {False: [], True: []}
            for r in range(3):
                for plans in ((False, True) if r % 2 == 0 else (True, False)):
                    rounds[plans].append(measure(f, plans))
            med = {p: [statistics.median(x[i] for x in rounds[p]) for i in range(2)] for p in rounds}
            ref = cudnn["forward" if name == "forward" else "backward"]
            ch, cb = host_us(ref), do_bench(ref) * 1e3
            print(f"| {d} | {'yes' if causal else 'no'} | {name} | {med[False][0]:.0f} / {med[True][0]:.0f} | "
                  f"{med[False][1]:.0f} / {med[True][1]:.0f} | {ch:.0f} / {cb:.0f} |", flush=True)
print(f"plans kept: {len(replay.PLANS)}")
