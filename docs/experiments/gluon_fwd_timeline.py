"""Where a program of the Gluon forward spends its time: the kernel stamps the SM's cycle counter as it runs
(``gluon_forward.forward(..., timeline=...)``, slots in ``gluon_forward.TIMELINE_SLOTS``), on kernels.bench's
shapes (B * N = 16384, H * D = 2048, float16), and this script prints, per row, medians over the programs:

- ``q``, ``k0``: from a consumer warpgroup's start to its Q tile, then to its first K block;
- ``s0``, ``sm0``: the first scores' product, then their softmax (nothing else runs in the warpgroup);
- ``step``: the loop's time per KV block after the first; ``last``: the last ``P V``; ``epi``: the epilogue
  (normalize, LSE, store O through TMA and wait);
- ``span``: a program from its first instruction to its output stored; ``gap``: on an SM, from a program's
  output stored to the next program's first instruction (its exit, the launch, the barriers' setup);
- ``fixed``: ``span + gap - n * step``, what a tile costs beyond its n steps, in steps too;
- ``sm_end_min``, ``sm_end_median``, ``sm_end_max``: when each SM stored its last output (ns from the first
  program's start, global timer): the spread between median and max is the last wave's tail, the time some
  SMs idle while others finish (the persistent walk: tiles or pairs that do not divide over the SMs).

Cycles are turned into ns with the clock rate fitted between the global timer and the cycle counter at the
programs' starts. The timeline's kernel is compiled apart (``TIMELINE``); its speed beside the shipped
kernel's and cuDNN's (SDPA) is printed (``do_bench``), so that the stamps' own cost is seen.

    PYTHONPATH=. OUT=. python docs/experiments/gluon_fwd_timeline.py

``EXP_WALK``: "per-tile" (default: the kernel as the sixth session measured it) or "persistent" (the
persistent kernel where ``gluon_forward.persistent`` takes the row: a row a tile, its slots 0-3 stamped by the
producer as it takes the tile up, before the previous tile's output is stored, so ``span`` and ``gap`` then
read from the producer's start, the gap negative; the warpgroups' events keep their meaning).
``EXP_DIMS`` (default "128 64"), ``EXP_LENGTHS`` ("1024 4096 16384"), ``EXP_CAUSAL`` ("0 1"). One JSON line
per row to stdout and ``$OUT/timeline.jsonl``; ``$OUT/timeline_<d>_<n>_<causal>.pt`` the raw stamps. A
record of an experiment, not tested code.
"""
import json
import math
import os
import statistics

import torch
import triton
import triton.testing

from kernels import gluon_forward as gf

OUT = os.environ.get("OUT", ".")
DIMS = [int(x) for x in os.environ.get("EXP_DIMS", "128 64").split()]
LENGTHS = [int(x) for x in os.environ.get("EXP_LENGTHS", "1024 4096 16384").split()]
CAUSALS = [bool(int(x)) for x in os.environ.get("EXP_CAUSAL", "0 1").split()]
if os.environ.get("EXP_WALK", "per-tile") == "per-tile":
    gf.persistent = lambda causal, len_k: False
dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)


def blocks(start_m, len_q, len_k, causal):
    """KV blocks a warpgroup of rows [start_m, start_m + 64) reads (gluon_forward._blocks)."""
    if start_m >= len_q:
        return 0
    if causal:
        return max(-(-min(start_m + gf.BLOCK_M + len_k - len_q, len_k) // gf.BLOCK_N), 0)
    return -(-len_k // gf.BLOCK_N)


def q(xs, f=0.5):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else float("nan")


def analyse(t, grid, groups, len_q, len_k, causal):
    t = t.cpu().tolist()
    sm, gtimer, start = [r[0] for r in t], [r[1] for r in t], [r[2] for r in t]
    # cycles per ns: fit the cycle counter against the global timer over the programs of the busiest SM
    by_sm = {}
    for i, s in enumerate(sm):
        by_sm.setdefault(s, []).append(i)
    ghz = []
    for ids in by_sm.values():
        ids = sorted(ids, key=lambda i: start[i])
        if len(ids) > 1 and gtimer[ids[-1]] > gtimer[ids[0]]:
            ghz.append((start[ids[-1]] - start[ids[0]]) / (gtimer[ids[-1]] - gtimer[ids[0]]))
    ghz = statistics.median(ghz) if ghz else float("nan")
    ph = {name: [] for name in ("q", "k0", "s0", "sm0", "step", "last", "epi")}
    spans, ends, ns = [], {}, {}
    for i, r in enumerate(t):
        pid_m, pid_bh = i % grid[0], i // grid[0]
        if causal and not gf.persistent(causal, len_k):  # the per-tile kernel: the longest rows first
            pid_m = grid[0] - 1 - pid_m
        end = 0
        n_prog = 0
        for w in range(groups):
            ev = r[4 + 8 * w: 12 + 8 * w]
            n = blocks((pid_m * groups + w) * gf.BLOCK_M, len_q, len_k, causal)
            n_prog = max(n_prog, n)
            end = max(end, ev[7])
            if n == 0:
                continue
            ph["q"].append(ev[1] - ev[0]); ph["k0"].append(ev[2] - ev[1]); ph["s0"].append(ev[3] - ev[2])
            ph["sm0"].append(ev[4] - ev[3]); ph["last"].append(ev[6] - ev[5]); ph["epi"].append(ev[7] - ev[6])
            if n > 1:
                ph["step"].append((ev[5] - ev[4]) / (n - 1))
        spans.append(end - start[i]); ends[i] = end; ns[i] = n_prog
    gaps = []
    for ids in by_sm.values():
        ids = sorted(ids, key=lambda i: start[i])
        gaps += [start[b] - ends[a] for a, b in zip(ids, ids[1:])]
    step = q(ph["step"])
    fixed = [spans[i] + q(gaps) - ns[i] * step for i in range(len(t)) if ns[i] > 0]
    # each SM's last output stored, on the global timer (its cycle counter is its own): the last tile's start
    # on the global timer plus its span in cycles; the spread of those ends is the last wave's tail
    sm_end = sorted(max(gtimer[i] + (ends[i] - start[i]) / ghz for i in ids) for ids in by_sm.values())
    first = min(gtimer)
    row = {name: round(q(v) / ghz, 1) for name, v in ph.items()}
    row.update(span=round(q(spans) / ghz, 1), gap=round(q(gaps) / ghz, 1), gap_p10=round(q(gaps, 0.1) / ghz, 1),
               gap_p90=round(q(gaps, 0.9) / ghz, 1), fixed=round(q(fixed) / ghz, 1),
               fixed_steps=round(q(fixed) / step, 2) if step == step and step else None,
               ghz=round(ghz, 3), programs=len(t), sms=len(by_sm), n_max=max(ns.values()),
               sm_end_max=round(sm_end[-1] - first, 1), sm_end_median=round(q(sm_end) - first, 1),
               sm_end_min=round(sm_end[0] - first, 1))
    return row


rows = []
for d in DIMS:
    for n in LENGTHS:
        for causal in CAUSALS:
            b, h = max(1, 16384 // n), max(1, 2048 // d)
            g = torch.Generator(device=dev).manual_seed(0)
            qq, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.float16, generator=g) for _ in range(3))
            out = torch.empty_like(qq)
            lse = torch.empty(b, h, n, device=dev, dtype=torch.float32)
            grid = gf.programs(qq, k, causal)
            groups = gf.warpgroups(d, causal, n, n)
            timeline = torch.zeros(grid[0] * grid[1], gf.TIMELINE_SLOTS, dtype=torch.int64, device=dev)
            scale = 1 / math.sqrt(d)
            plain = lambda: gf.forward(qq, k, v, out, lse, causal=causal, scale=scale)
            stamped = lambda: gf.forward(qq, k, v, out, lse, causal=causal, scale=scale, timeline=timeline)
            plain(); stamped(); torch.cuda.synchronize()
            ms_plain = triton.testing.do_bench(plain, rep=200)
            ms_stamped = triton.testing.do_bench(stamped, rep=200)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = lambda: torch.nn.functional.scaled_dot_product_attention(qq, k, v, is_causal=causal)
                cudnn()
                ms_cudnn = triton.testing.do_bench(cudnn, rep=200)
            timeline.zero_(); stamped(); torch.cuda.synchronize()
            torch.save(timeline.cpu(), os.path.join(OUT, f"timeline_{d}_{n}_{int(causal)}.pt"))
            flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
            row = {"d": d, "n": n, "causal": causal, "tflops": round(flops / ms_plain * 1e-9, 1),
                   "tflops_stamped": round(flops / ms_stamped * 1e-9, 1),
                   "tflops_cudnn": round(flops / ms_cudnn * 1e-9, 1),
                   **analyse(timeline, grid, groups, n, n, causal)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(OUT, "timeline.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")

cols = ["d", "n", "causal", "tflops", "tflops_stamped", "tflops_cudnn", "q", "k0", "s0", "sm0", "step", "last", "epi",
        "span", "gap", "fixed", "fixed_steps", "sm_end_median", "sm_end_max"]
print("| " + " | ".join(cols) + " |")
for r in rows:
    print("| " + " | ".join(str(r[c]) for c in cols) + " |")
