"""Two changes to the persistent Gluon forward, tried and not adopted (docs/benchmarks.md, "Tried, not adopted:
the output store waited for a tile later, and warpgroups started apart"), as copies of kernels/gluon_forward.py
patched in text and timed against the unpatched file in one process on one GPU:

- ``defer``: a consumer warpgroup issues its tile's output store and goes on; it waits for the store (and
  releases the tile's Q buffer, which staged the output) only after issuing the next tile's first scores.
- ``lag3000``: consumer warpgroup W > 0 spins W x 3000 cycles before its first tile, so that the warpgroups
  run their tiles' fixed phases (first scores and softmax, last ``P V``, epilogue) apart rather than together;
  the K/V ring (3 K, 2 V stages) lets one run up to about a block ahead of the other.
- ``deferlag3000``: both.

The variants compile for sm_90 without C7514 and without spills at head dim 128 (Triton 3.6's ptxas).
Each kernel is compiled first in parallel processes (``EXP_JOBS``), then kernels.bench's rows (B * N = 16384,
H * D = 2048, float16) are timed with CUDA graphs (``triton.testing.do_bench_cudagraph``), ``EXP_ROUNDS``
rounds (4) rotating the order, medians, beside cuDNN's SDPA; then outputs and LSEs of every variant compared
bitwise with the unpatched kernel's over edge cases (GQA, Nq != Nk both ways, several tiles a program, float16
and bfloat16) and against float32 attention. One JSON line per row in ``$OUT/ab_multi.jsonl``.

    PYTHONPATH=. OUT=. python docs/experiments/gluon_fwd_defer_lag.py

A record of an experiment, not tested code.
"""
import concurrent.futures as cf
import importlib.util
import json
import math
import multiprocessing as mp
import os
import pathlib
import tempfile
import time

import torch
import triton
import triton.testing

src = pathlib.Path("kernels/gluon_forward.py").read_text()
DIR = os.environ.setdefault("EXP_DIR", tempfile.mkdtemp(prefix="gf_variants_"))
VARIANTS = {"defer": (0, True), "lag3000": (3000, False), "deferlag3000": (3000, True)}


def sub(text, old, new, count=1):
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)

def variant(lag: int, defer: bool) -> str:
    t = src
    t = sub(t, "    _TIMELINE_SLOTS = gl.constexpr(TIMELINE_SLOTS)\n",
            "    _TIMELINE_SLOTS = gl.constexpr(TIMELINE_SLOTS)\n"
            f"    _LAG = gl.constexpr({lag})\n    _DEFER = gl.constexpr({defer})\n\n"
            "    @gluon.jit\n    def _clock():\n"
            "        return gl.inline_asm_elementwise(\"mov.u64 $0, %clock64;\", \"=l\", [], dtype=gl.int64,\n"
            "                                         is_pure=False, pack=1)\n")
    # _attend: the previous tile's Q buffer barrier and whether there is one
    t = sub(t, "                n_full, n_loaded, stamps, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,\n"
               "                D: gl.constexpr, TIMELINE: gl.constexpr):\n",
               "                n_full, n_loaded, stamps, prev_empty, has_prev, DEFER: gl.constexpr, CAUSAL: gl.constexpr,\n"
               "                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, TIMELINE: gl.constexpr):\n")
    t = sub(t, "                              use_acc=False, is_async=True)\n            s = warpgroup_mma_wait(0, deps=(s, ))\n",
               "                              use_acc=False, is_async=True)\n"
               "            if DEFER:\n                tma.store_wait(pendings=0)\n                if has_prev:\n"
               "                    mbarrier.arrive(prev_empty, count=1)\n"
               "            s = warpgroup_mma_wait(0, deps=(s, ))\n")
    t = sub(t, "        # Rows with no visible key: l = 0, acc = 0 -> out = 0, lse = -inf.\n",
               "        if DEFER:\n            if n_blocks <= 0:\n                tma.store_wait(pendings=0)\n"
               "                if has_prev:\n                    mbarrier.arrive(prev_empty, count=1)\n"
               "        # Rows with no visible key: l = 0, acc = 0 -> out = 0, lse = -inf.\n")
    t = sub(t, "            _tma_store(o_desc, [off_b, off_h, start_m, 0], q_smem)\n            tma.store_wait(pendings=0)\n",
               "            _tma_store(o_desc, [off_b, off_h, start_m, 0], q_smem)\n            if not DEFER:\n"
               "                tma.store_wait(pendings=0)\n")
    # per-tile consumer: no deferral
    t = sub(t, "                n_loaded, stamps, CAUSAL, BLOCK_M, BLOCK_N, D, TIMELINE)\n",
               "                n_loaded, stamps, q_bar, False, False, CAUSAL, BLOCK_M, BLOCK_N, D, TIMELINE)\n")
    # persistent consumer
    t = sub(t, "        ring = 0\n        i_t = 0\n        for it in range(_rounds(tiles_m, n_tiles, CAUSAL)):\n"
               "            valid, off_b, off_h, start_m, n_loaded = _walk(it, tiles_m, n_tiles, heads_q, len_q, len_k, CAUSAL,\n"
               "                                                           BLOCK_M, BLOCK_N, WARPGROUPS)\n            if valid:\n"
               "                n_blocks, n_full",
               "        if _LAG > 0:\n            if W > 0:\n                t0 = _clock()\n                t = t0\n"
               "                while t - t0 < _LAG * W:\n                    t = _clock()\n"
               "        ring = 0\n        i_t = 0\n        for it in range(_rounds(tiles_m, n_tiles, CAUSAL)):\n"
               "            valid, off_b, off_h, start_m, n_loaded = _walk(it, tiles_m, n_tiles, heads_q, len_q, len_k, CAUSAL,\n"
               "                                                           BLOCK_M, BLOCK_N, WARPGROUPS)\n            if valid:\n"
               "                n_blocks, n_full")
    t = sub(t, "                        n_full, n_loaded, stamps, CAUSAL, BLOCK_M, BLOCK_N, D, TIMELINE)\n"
               "                mbarrier.arrive(q_empty.index(buf), count=1)\n",
               "                        n_full, n_loaded, stamps, q_empty.index(1 - buf), i_t > 0, _DEFER, CAUSAL, BLOCK_M, BLOCK_N,\n"
               "                        D, TIMELINE)\n"
               "                if not _DEFER:\n                    mbarrier.arrive(q_empty.index(buf), count=1)\n")
    t = sub(t, "                ring += n_loaded\n                i_t += 1\n\n    @gluon.jit\n    def _producer_persistent(",
               "                ring += n_loaded\n                i_t += 1\n        if _DEFER:\n            tma.store_wait(pendings=0)\n\n"
               "    @gluon.jit\n    def _producer_persistent(")
    return t


NAMES = os.environ.get("EXP_VARIANTS", " ".join(VARIANTS)).split()
ROWS = [(d, n, c) for d in (128, 64) for (n, c) in ((1024, False), (4096, False), (16384, False),
                                                    (1024, True), (4096, True))]
ROWS = [r for r in ROWS if str(r[0]) in os.environ.get("EXP_DIMS", "128 64").split()]
OUT = os.environ.get("OUT", ".")

def load(name):
    spec = importlib.util.spec_from_file_location(f"gf_{name}", os.path.join(DIR, f"gf_{name}.py"))
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m

def shape(d, n):
    return 16384 // n, 2048 // d

def warm(job):
    name, d, n, causal, dt = job
    m = load(name)
    b, h = shape(d, n)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dt) for _ in range(3))
    out = torch.empty_like(q); lse = torch.empty((b, h, n), device="cuda", dtype=torch.float32)
    t = time.time()
    m.forward(q, k, v, out, lse, causal=causal, scale=d ** -0.5); torch.cuda.synchronize()
    return name, d, n, causal, time.time() - t

CASES = [(2, 4, 2, 200, 457, 128), (1, 2, 1, 513, 129, 64), (4, 16, 16, 1000, 1000, 128), (4, 16, 8, 1500, 1500, 64),
         (2, 16, 4, 1500, 300, 64), (2, 16, 4, 1500, 300, 128), (3, 40, 40, 700, 2100, 64), (1, 9, 3, 4033, 4033, 64)]

def check(job):
    import hashlib
    nm, case, dt, causal = job
    b, hq, hk, nq, nk, d = case
    m = load(nm)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(b, hk, nk, d, device="cuda", dtype=dt, generator=g) * 3
    v = torch.randn(b, hk, nk, d, device="cuda", dtype=dt, generator=g)
    out = torch.full_like(q, float("nan")); lse = torch.full((b, hq, nq), float("nan"), device="cuda")
    m.forward(q, k, v, out, lse, causal=causal, scale=1 / math.sqrt(d))
    kk = k.repeat_interleave(hq // hk, 1).float(); vv = v.repeat_interleave(hq // hk, 1).float()
    s = q.float() @ kk.transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(~torch.ones(nq, nk, device="cuda", dtype=torch.bool).tril(nk - nq), float("-inf"))
    err = (out.float() - torch.nan_to_num(torch.softmax(s, -1)) @ vv).abs().max().item()
    h = hashlib.sha256(out.cpu().view(torch.int16).numpy().tobytes() + lse.cpu().numpy().tobytes()).hexdigest()
    return nm, case, str(dt), causal, h, err

if __name__ == "__main__":
    pathlib.Path(DIR, "gf_base.py").write_text(src)
    for name, (lag, defer) in VARIANTS.items():
        pathlib.Path(DIR, f"gf_{name}.py").write_text(variant(lag, defer))
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "variants in", DIR, flush=True)
    names = ["base"] + NAMES
    jobs = [(nm, d, n, c, torch.float16) for nm in names for (d, n, c) in ROWS]
    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=int(os.environ.get("EXP_JOBS", "14")), mp_context=mp.get_context("spawn")) as ex:
        for r in ex.map(warm, jobs, timeout=240):
            pass
    print(f"warmed {len(jobs)} in {time.time() - t0:.0f} s", flush=True)
    mods = {nm: load(nm) for nm in names}
    dev = "cuda"
    rounds = int(os.environ.get("EXP_ROUNDS", "4"))
    for (d, n, causal) in ROWS:
        b, h = shape(d, n)
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.float16, generator=g) for _ in range(3))
        out = torch.empty_like(q); lse = torch.empty((b, h, n), device=dev, dtype=torch.float32)
        fns = {nm: (lambda m=m: m.forward(q, k, v, out, lse, causal=causal, scale=d ** -0.5)) for nm, m in mods.items()}
        fns["cudnn"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        order = list(fns)
        times = {nm: [] for nm in fns}
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            for nm in order:
                fns[nm]()
            torch.cuda.synchronize()
            for r in range(rounds):
                rot = order[r % len(order):] + order[:r % len(order)]
                if r % 2:
                    rot = rot[::-1]
                for nm in rot:
                    times[nm].append(triton.testing.do_bench_cudagraph(fns[nm], rep=60))
        med = {nm: sorted(t)[len(t) // 2] for nm, t in times.items()}
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        row = {"d": d, "n": n, "causal": causal, "ms": med, "tflops": {nm: flops / t * 1e-9 for nm, t in med.items()},
               "over_base": {nm: med["base"] / med[nm] for nm in med}, "vs_cudnn": {nm: med["cudnn"] / med[nm] for nm in med}}
        print(d, n, 'causal' if causal else 'full', 'over_base', {k: round(x, 3) for k, x in row['over_base'].items()},
              'vs_cudnn', {k: round(x, 3) for k, x in row['vs_cudnn'].items()}, flush=True)
        with open(os.path.join(OUT, "ab_multi.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")
    cjobs = [(nm, case, dt, c) for nm in names for case in CASES for dt in (torch.float16, torch.bfloat16)
             for c in (False, True)]
    t0 = time.time()
    res = {}
    with cf.ProcessPoolExecutor(max_workers=int(os.environ.get("EXP_JOBS", "14")), mp_context=mp.get_context("spawn")) as ex:
        for nm, case, dt, c, h, err in ex.map(check, cjobs, timeout=240):
            res[(nm, case, dt, c)] = (h, err)
    bad = 0
    for (nm, case, dt, c), (h, err) in res.items():
        if h != res[("base", case, dt, c)][0] or not err < 2e-2:
            bad += 1
            print("MISMATCH", nm, case, dt, c, err, flush=True)
    print(f"correctness: {len(cjobs)} runs, bad {bad}, {time.time() - t0:.0f} s", flush=True)
