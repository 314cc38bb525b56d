"""Versions of kernels/gluon_forward.py against each other in one process on one GPU, every kernel compiled
first in parallel processes (``EXP_JOBS``, 14): kernels.bench's rows (B * N = 16384, H * D = 2048, float16)
timed with CUDA graphs (``triton.testing.do_bench_cudagraph``), ``EXP_ROUNDS`` rounds (4) rotating the order,
medians (``EXP_TIMING=interleaved``: as kernels.bench times calls, :func:`kernels.bench.timed_interleaved`),
beside cuDNN's SDPA; then every version's outputs and LSEs compared bitwise with the first one's over
edge cases (GQA, Nq != Nk both ways, several tiles a program, float16 and bfloat16) and against float32
attention, in parallel processes. One JSON line per row in ``$OUT/ab_parallel.jsonl``.

    EXP_BASE=/tmp/gf_base.py PYTHONPATH=. OUT=. python docs/experiments/gluon_fwd_ab_parallel.py

compares the working tree's module ("new") with ``EXP_BASE`` ("base"; e.g. ``git show HEAD~1:kernels/
gluon_forward.py > /tmp/gf_base.py``); ``EXP_OTHERS="name=path ..."`` adds more versions. ``EXP_DIMS``
("128 64"), ``EXP_ROWS`` ("1024 4096 16384 1024c 4096c": N, "c" causal). docs/experiments/gluon_fwd_patches.py
runs it over text patches of the module. A record of experiments, not tested code.
"""
import concurrent.futures as cf
import hashlib
import importlib.util
import json
import math
import multiprocessing as mp
import os
import time

import torch

CASES = [(2, 4, 2, 200, 457, 128), (1, 2, 1, 513, 129, 64), (4, 16, 16, 1000, 1000, 128), (4, 16, 8, 1500, 1500, 64),
         (2, 16, 4, 1500, 300, 64), (2, 16, 4, 1500, 300, 128), (3, 40, 40, 700, 2100, 64), (1, 9, 3, 4033, 4033, 64)]


def load(name, path):
    spec = importlib.util.spec_from_file_location(f"gf_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shape(d, n):
    return 16384 // n, 2048 // d


def rows():
    dims = [int(x) for x in os.environ.get("EXP_DIMS", "128 64").split()]
    spec = os.environ.get("EXP_ROWS", "1024 4096 16384 1024c 4096c").split()
    return [(d, int(r.rstrip("c")), r.endswith("c")) for d in dims for r in spec]


def warm(job):
    name, path, d, n, causal = job
    module = load(name, path)
    b, h = shape(d, n)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty((b, h, n), device="cuda", dtype=torch.float32)
    module.forward(q, k, v, out, lse, causal=causal, scale=d ** -0.5)
    torch.cuda.synchronize()
    return name


def check(job):
    name, path, case, dt, causal = job
    b, hq, hk, nq, nk, d = case
    module = load(name, path)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(b, hk, nk, d, device="cuda", dtype=dt, generator=g) * 3
    v = torch.randn(b, hk, nk, d, device="cuda", dtype=dt, generator=g)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, nq), float("nan"), device="cuda")
    module.forward(q, k, v, out, lse, causal=causal, scale=1 / math.sqrt(d))
    kk = k.repeat_interleave(hq // hk, 1).float()
    vv = v.repeat_interleave(hq // hk, 1).float()
    s = q.float() @ kk.transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(~torch.ones(nq, nk, device="cuda", dtype=torch.bool).tril(nk - nq), float("-inf"))
    err = (out.float() - torch.nan_to_num(torch.softmax(s, -1)) @ vv).abs().max().item()
    digest = hashlib.sha256(out.cpu().view(torch.int16).numpy().tobytes() + lse.cpu().numpy().tobytes()).hexdigest()
    return name, case, str(dt), causal, digest, err


def pool():
    return cf.ProcessPoolExecutor(max_workers=int(os.environ.get("EXP_JOBS", "14")), mp_context=mp.get_context("spawn"))


def main(versions: dict) -> None:
    """``versions``: name -> module file, the first the one the others are compared with."""
    import triton
    import triton.testing
    out_dir = os.environ.get("OUT", ".")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, list(versions), flush=True)
    t0 = time.time()
    with pool() as ex:
        list(ex.map(warm, [(nm, path, d, n, c) for nm, path in versions.items() for (d, n, c) in rows()], timeout=240))
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    modules = {nm: load(nm, path) for nm, path in versions.items()}
    first = next(iter(versions))
    for (d, n, causal) in rows():
        b, h = shape(d, n)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty((b, h, n), device="cuda", dtype=torch.float32)
        fns = {nm: (lambda m=m: m.forward(q, k, v, out, lse, causal=causal, scale=d ** -0.5))
               for nm, m in modules.items()}
        fns["cudnn"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        order = list(fns)
        times = {nm: [] for nm in fns}
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            for nm in order:
                fns[nm]()
            torch.cuda.synchronize()
            if os.environ.get("EXP_TIMING") == "interleaved":  # as kernels.bench times calls
                from kernels import bench
                got = bench.timed_interleaved(fns, int(os.environ.get("EXP_ROUNDS", "4")))
                times = {nm: [got[nm]] for nm in fns}
            else:
                for r in range(int(os.environ.get("EXP_ROUNDS", "4"))):
                    rot = order[r % len(order):] + order[:r % len(order)]
                    for nm in (rot[::-1] if r % 2 else rot):
                        times[nm].append(triton.testing.do_bench_cudagraph(fns[nm], rep=60))
        med = {nm: sorted(t)[len(t) // 2] for nm, t in times.items()}
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        row = {"d": d, "n": n, "causal": causal, "ms": med,
               "tflops": {nm: flops / t * 1e-9 for nm, t in med.items()},
               f"over_{first}": {nm: med[first] / med[nm] for nm in med},
               "vs_cudnn": {nm: med["cudnn"] / med[nm] for nm in med}}
        print(d, n, "causal" if causal else "full", f"over_{first}",
              {k: round(x, 3) for k, x in row[f"over_{first}"].items()},
              "TFLOP/s", {k: round(x) for k, x in row["tflops"].items()}, flush=True)
        with open(os.path.join(out_dir, "ab_parallel.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")
    t0 = time.time()
    jobs = [(nm, path, case, dt, c) for nm, path in versions.items() for case in CASES
            for dt in (torch.float16, torch.bfloat16) for c in (False, True)]
    res = {}
    with pool() as ex:
        for nm, case, dt, c, digest, err in ex.map(check, jobs, timeout=240):
            res[(nm, case, dt, c)] = (digest, err)
    bad = 0
    for (nm, case, dt, c), (digest, err) in res.items():
        if digest != res[(first, case, dt, c)][0] or not err < 2e-2:
            bad += 1
            print("MISMATCH", nm, case, dt, c, err, flush=True)
    print(f"bitwise check: {len(jobs)} runs, {bad} differ from {first}'s or from float32 attention, "
          f"{time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    others = dict(item.split("=", 1) for item in os.environ.get("EXP_OTHERS", "").split())
    main({"base": os.environ["EXP_BASE"], "new": "kernels/gluon_forward.py", **others})
