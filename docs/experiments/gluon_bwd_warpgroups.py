"""The deterministic backward at head dim 64 with the Gluon dK/dV kernel's programs of three consumer
warpgroups (192 keys) against two (128 keys), in one process on one GPU (``gluon_backward.warpgroups``
replaced, launch plans cleared at each switch): dQ, dK and dV compared bitwise over edge shapes (tails,
Nq != Nk both ways, GQA, causal and not, float16 and bfloat16), then kernels.bench's shapes (B * N = 16384,
H = 32, float16) timed with CUDA graphs, four rounds alternating the order, medians.

    PYTHONPATH=. OUT=. python docs/experiments/gluon_bwd_warpgroups.py

``EXP_LENGTHS`` (default "1024 4096 16384"). One JSON line per row to stdout and ``$OUT/ab_bwd.jsonl``
(``speedup``: two's time over three's). A record of an experiment, not tested code.
"""
import json, os, math
import torch, triton, triton.testing
from kernels import gluon_backward as gb, triton_attention as ta, replay
OUT = os.environ.get("OUT", ".")
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)

def bwd(q, k, v, out, lse, do, causal, three):
    gb.warpgroups = (lambda d, a: 3 if d == 64 and not a else 2) if three else (lambda d, a: 2)
    replay.clear()
    return ta.fa2_backward(q, k, v, out, lse, do, causal=causal)

bad = 0
cases = [(2, 4, 2, 300, 300), (2, 4, 2, 200, 457), (1, 2, 1, 513, 129), (1, 3, 3, 1, 1000), (2, 2, 2, 1000, 1),
         (1, 4, 1, 777, 777), (3, 2, 2, 128, 256), (1, 2, 2, 256, 128), (1, 2, 2, 4100, 333), (1, 2, 2, 333, 4100)]
for dt in (torch.float16, torch.bfloat16):
    for (b, hq, hk, nq, nk) in cases:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(1)
            q = torch.randn(b, hq, nq, 64, device="cuda", dtype=dt, generator=g)
            k = torch.randn(b, hk, nk, 64, device="cuda", dtype=dt, generator=g)
            v = torch.randn(b, hk, nk, 64, device="cuda", dtype=dt, generator=g)
            do = torch.randn(b, hq, nq, 64, device="cuda", dtype=dt, generator=g)
            out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
            r2 = bwd(q, k, v, out, lse, do, causal, False)
            r3 = bwd(q, k, v, out, lse, do, causal, True)
            eq = all(torch.equal(a, c) for a, c in zip(r2[:3], r3[:3]))
            if not eq:
                bad += 1
                diffs = [(a.float() - c.float()).abs().max().item() for a, c in zip(r2[:3], r3[:3])]
                print("MISMATCH", dt, b, hq, hk, nq, nk, causal, diffs, flush=True)
torch.cuda.synchronize()
print("bitwise cases bad:", bad, flush=True)

for n in [int(x) for x in os.environ.get("EXP_LENGTHS", "1024 4096 16384").split()]:
    for causal in (False, True):
        d = 64; b, h = 16384 // n, 2048 // d
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
        out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
        times = {"two": [], "three": []}
        for r in range(4):
            for name in (("two", "three") if r % 2 == 0 else ("three", "two")):
                three = name == "three"
                bwd(q, k, v, out, lse, do, causal, three)
                torch.cuda.synchronize()
                times[name].append(triton.testing.do_bench_cudagraph(
                    lambda: ta.fa2_backward(q, k, v, out, lse, do, causal=causal), rep=60))
        med = {k_: sorted(t)[len(t) // 2] for k_, t in times.items()}
        flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        row = dict(n=n, causal=causal, two_ms=med["two"], three_ms=med["three"], speedup=med["two"] / med["three"],
                   tflops_two=flops / med["two"] / 1e9, tflops_three=flops / med["three"] / 1e9)
        print(json.dumps(row), flush=True)
        with open(os.path.join(OUT, "ab_bwd.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")
