"""dQ added inside the Gluon dK/dV kernel in a fixed order (deterministic) against the deterministic backward
with the Triton dQ kernel and the dQ-added form whose reduces land in any order, in one process on one GPU
(``gluon_backward.dkdv`` wrapped and ``gluon_backward.ordered_dq`` replaced, launch plans cleared at each
switch).

Modes: ``det`` (``deterministic=True`` with the dQ kernel: the backward before ``ordered_dq``), ``atomic``
(``deterministic=False``, every program walking the Q tiles from the first), ``rot`` (that, each program
from its own start: not causal only; ``deterministic=False`` since), ``ordered`` (each tile's reduces in
the fixed order of ``gluon_backward.dq_order``, rotated where not causal: the deterministic backward at
head dim 128 since), ``asc`` (ordered, not rotated: each program waits on the one before it; not causal).

First, edge shapes (tails, Nq != Nk both ways, GQA, causal and not, float16 and bfloat16): each mode's dQ,
dK, dV against ``det``'s (max abs difference; dK/dV bitwise where the walk is the same), and ``ordered``
run three times, dQ compared bitwise. Then kernels.bench's shapes (B * N = 16384 tokens, H * D = 2048,
float16), ``triton.testing.do_bench`` medians in three rounds alternating the order, with cuDNN's backward
(through autograd) beside them.

    PYTHONPATH=. OUT=. python docs/experiments/gluon_bwd_ordered.py

``EXP_DIMS`` (default "128 64"), ``EXP_LENGTHS`` (default "1024 4096 16384"), ``EXP_MODES`` (default all),
``EXP_DET=1`` (time ``det`` too: it read 0.56-0.89 of cuDNN in one run, below kernels.bench's figures for
the same kernels; not explained), ``EXP_SKIPCHECK=1``. One JSON line per row to stdout and
``$OUT/ordered.jsonl``. A record of an experiment, not tested code; docs/benchmarks.md has its figures
(the first version, where each consumer warpgroup waited for its turn and counted up itself, ran 0.78-0.81
of cuDNN's backward; the writer warp's 0.93-0.97).
"""
import functools
import json
import os

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import gluon_backward as gb, replay, triton_attention as ta

OUT = os.environ.get("OUT", ".")
REAL = gb.dkdv
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)


def bwd(mode, q, k, v, out, lse, do, causal):
    opts = {"det": None, "atomic": {"rotate": False}, "rot": {"rotate": True},
            "ordered": {"ordered": True, "rotate": True}, "asc": {"ordered": True, "rotate": False}}[mode]
    gb.dkdv = REAL if opts is None else functools.partial(REAL, **opts)
    gb.ordered_dq = lambda *a: False  # det: the dQ kernel
    replay.clear()
    return ta.fa2_backward(q, k, v, out, lse, do, causal=causal, deterministic=opts is None)


def modes(causal):
    names = ("det", "atomic", "ordered") if causal else ("det", "atomic", "rot", "ordered", "asc")
    return [m for m in names if m in os.environ.get("EXP_MODES", "det atomic rot ordered asc").split()]


if not os.environ.get("EXP_SKIPCHECK"):
    cases = [(2, 4, 2, 300, 300), (2, 4, 2, 200, 457), (1, 2, 1, 513, 129), (1, 3, 3, 1, 1000), (2, 2, 2, 1000, 1),
             (1, 4, 1, 777, 777), (3, 2, 2, 128, 256), (1, 2, 2, 256, 128), (1, 2, 2, 4100, 333),
             (1, 2, 2, 333, 4100), (1, 1, 1, 64, 16384), (1, 2, 2, 2048, 2048)]
    worst = {}
    for d in [int(x) for x in os.environ.get("EXP_DIMS", "128 64").split()]:
        for dt in (torch.float16, torch.bfloat16):
            for (b, hq, hk, nq, nk) in cases:
                for causal in (False, True):
                    g = torch.Generator(device="cuda").manual_seed(1)
                    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dt, generator=g)
                    k = torch.randn(b, hk, nk, d, device="cuda", dtype=dt, generator=g)
                    v = torch.randn(b, hk, nk, d, device="cuda", dtype=dt, generator=g)
                    do = torch.randn(b, hq, nq, d, device="cuda", dtype=dt, generator=g)
                    out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
                    ref = bwd("det", q, k, v, out, lse, do, causal)
                    for mode in modes(causal)[1:]:
                        got = bwd(mode, q, k, v, out, lse, do, causal)
                        diffs = [(a.float() - c.float()).abs().max().item() if a.numel() else 0.0
                                 for a, c in zip(ref[:3], got[:3])]
                        same = [torch.equal(a, c) for a, c in zip(ref[:3], got[:3])]
                        key = (d, str(dt), causal, mode)
                        worst[key] = [max(x, y) for x, y in zip(worst.get(key, [0, 0, 0]), diffs)]
                        if mode in ("ordered", "asc"):
                            again = [bwd(mode, q, k, v, out, lse, do, causal)[0] for _ in range(2)]
                            if not all(torch.equal(got[0], a) for a in again):
                                print("NOT DETERMINISTIC", key, (b, hq, hk, nq, nk), flush=True)
                        if not all(torch.isfinite(t).all() for t in got[:3]):
                            print("NONFINITE", key, (b, hq, hk, nq, nk), flush=True)
                        if not same[1] or not same[2]:
                            if not (mode in ("rot", "ordered") and not causal):
                                print("dK/dV differ", key, (b, hq, hk, nq, nk), diffs, flush=True)
                torch.cuda.synchronize()
            print("checked", d, dt, flush=True)
    for key, w in sorted(worst.items(), key=str):
        print("max|diff| vs det (dq, dk, dv)", key, w, flush=True)


def cudnn_bwd(q, k, v, do, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)


for d in [int(x) for x in os.environ.get("EXP_DIMS", "128 64").split()]:
    for n in [int(x) for x in os.environ.get("EXP_LENGTHS", "1024 4096 16384").split()]:
        for causal in (False, True):
            b, h = 16384 // n, 2048 // d
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g)
                           for _ in range(4))
            out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
            for mode in modes(causal):
                bwd(mode, q, k, v, out, lse, do, causal)  # compiled before timing
            times = {m: [] for m in (*[m for m in modes(causal) if m != "det" or os.environ.get("EXP_DET")], "cudnn")}
            for r in range(3):
                order = list(times) if r % 2 == 0 else list(reversed(times))
                for mode in order:
                    if mode == "cudnn":
                        fn = cudnn_bwd(q, k, v, do, causal)
                    else:
                        bwd(mode, q, k, v, out, lse, do, causal)  # this mode's plan
                        fn = (lambda m=mode: ta.fa2_backward(q, k, v, out, lse, do, causal=causal,
                                                             deterministic=m == "det"))
                    torch.cuda.synchronize()
                    times[mode].append(triton.testing.do_bench(fn, rep=60))
            med = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
            flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            row = dict(d=d, n=n, causal=causal, ms=med, tflops={m: round(flops / t / 1e9, 1) for m, t in med.items()},
                       ratio_cudnn={m: round(med["cudnn"] / t, 3) for m, t in med.items()})
            print(json.dumps(row), flush=True)
            with open(os.path.join(OUT, "ordered.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")
