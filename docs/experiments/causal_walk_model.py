"""A model of the causal persistent walks of kernels/gluon_forward.py: when the last SM finishes, over the mean,
for the fixed walk (pairs of Q tiles, program p the pairs p, p + P, ...) and for dynamic walks (each program
takes the next unit as it frees up, one unit taken ahead, as the producer warp does), with every SM at the same
speed and with speeds drawn around 1 (standard deviation ``EXP_SD``, 0.03; the H200's timeline read 1.5-2.4%
among SMs given the same pairs, docs/benchmarks.md). A tile of ``m + 1`` KV blocks costs ``m + 1 + 0.8`` block
steps (0.8: a tile's fixed cost, the timeline's 0.8-1.1). Kernels.bench's shapes (B * N = 16384, H * D = 2048)
on 132 SMs, two warpgroups (128-row tiles: head dim 64 causal from 4096 keys on runs three, not modelled).

    python docs/experiments/causal_walk_model.py

Prints, per row, the ratio of the last SM's end to the mean for each walk: "fixed pairs", "dynamic pairs",
"groups" (dynamic single tiles, heads in groups of ceil(P / tiles_m), longest first in a group: the first
dynamic walk tried), "pairs + tail k" (dynamic pairs, then the last ceil(k P / tiles_m) heads' tiles one at a
time, longest first: the shipped walk, k = gluon_forward.TAIL_UNITS_PER_PROGRAM = 3). A record of an experiment,
not tested code.
"""
import heapq
import os
import random

P, FIXED, SD = 132, 0.8, float(os.environ.get("EXP_SD", "0.03"))


def cost(unit):
    return sum(m + 1 + FIXED for _, m in unit)


def pairs(heads, tiles_m, first=0):
    return [[(h, tiles_m - 1 - k)] + ([(h, k)] if k != tiles_m - 1 - k else [])
            for h in range(first, heads) for k in range((tiles_m + 1) // 2)]


def longest_first(heads, tiles_m):
    return [[(h, tiles_m - 1 - r)] for r in range(tiles_m) for h in heads]


def groups(heads, tiles_m):
    g = -(-P // tiles_m)
    return [u for s in range(0, heads, g) for u in longest_first(range(s, min(heads, s + g)), tiles_m)]


def pairs_tail(heads, tiles_m, k):
    tail = min(heads, -(-k * P // tiles_m))
    return pairs(heads - tail, tiles_m) + longest_first(range(heads - tail, heads), tiles_m)


def end_over_mean(units, speeds, fixed_walk=False):
    mean = sum(cost(u) for u in units) / P
    if fixed_walk:
        load = [0.0] * P
        for i, u in enumerate(units):
            load[i % P] += cost(u) * speeds[i % P]
        return max(load) / mean
    queue, ahead, ends, it = [(0.0, p) for p in range(P)], {}, [0.0] * P, iter(units)
    for p in range(P):
        ahead[p] = next(it, None)
    while queue:
        t, p = heapq.heappop(queue)
        unit, ahead[p] = ahead[p], next(it, None)
        if unit is None:
            ends[p] = t
        else:
            heapq.heappush(queue, (t + cost(unit) * speeds[p], p))
    return max(ends) / mean


for d, n in [(128, 1024), (64, 1024), (128, 2048), (64, 2048), (128, 4096), (128, 8192), (128, 16384)]:
    heads, tiles_m = 16384 // n * 2048 // d, n // 128
    walks = {"fixed pairs": (pairs(heads, tiles_m), True), "dynamic pairs": (pairs(heads, tiles_m), False),
             "groups": (groups(heads, tiles_m), False),
             **{f"pairs + tail {k}": (pairs_tail(heads, tiles_m, k), False) for k in (1, 2, 3, 4)}}
    cells = []
    for name, (units, fixed_walk) in walks.items():
        same = end_over_mean(units, [1.0] * P, fixed_walk)
        draws = [random.Random(seed) for seed in range(5)]
        drawn = sum(end_over_mean(units, [1 + rng.gauss(0, SD) for _ in range(P)], fixed_walk) for rng in draws) / 5
        cells.append(f"{name} {same:.3f} / {drawn:.3f}")
    print(f"D = {d}, N = {n}: " + " | ".join(cells))
