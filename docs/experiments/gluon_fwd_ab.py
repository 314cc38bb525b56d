"""The Gluon forward of the working tree against another version of kernels/gluon_forward.py
(``EXP_BASE``, e.g. ``git show HEAD~1:kernels/gluon_forward.py > /tmp/gf_base.py``), in one process on one GPU:
outputs and LSEs compared bitwise over edge shapes (tails, Nq != Nk both ways, GQA, float16 and bfloat16) and
against float32 attention, then each (D, N, causal) row of kernels.bench's shapes (B * N = 16384, H * D =
2048, float16) timed with CUDA graphs (``triton.testing.do_bench_cudagraph``), four rounds alternating the
order, medians, beside cuDNN's SDPA.

    EXP_BASE=/tmp/gf_base.py PYTHONPATH=. OUT=. python docs/experiments/gluon_fwd_ab.py

``EXP_DIMS`` (default "128 64"), ``EXP_LENGTHS`` ("1024 4096 16384"), ``EXP_SKIPCHECK=1`` (no correctness
cases). One JSON line per row to stdout and ``$OUT/ab_pp.jsonl``: ``ratio_new_base`` > 1 where the working
tree's kernel is the faster. Used for the three-warpgroup forward, the alternating turns and the 64-key
blocks at head dim 128 (docs/benchmarks.md). A record of an experiment, not tested code.
"""
import importlib.util, json, os, sys, math
import torch, triton, triton.testing
from kernels import gluon_forward as new

spec = importlib.util.spec_from_file_location("gf_base", os.environ["EXP_BASE"])
base = importlib.util.module_from_spec(spec); spec.loader.exec_module(base)
OUT = os.environ.get("OUT", ".")
dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)

def run(mod, q, k, v, causal):
    b, h, n, d = q.shape
    out = torch.empty_like(q); lse = torch.empty((b, h, n), device=dev, dtype=torch.float32)
    mod.forward(q, k, v, out, lse, causal=causal, scale=1 / math.sqrt(d))
    return out, lse

# correctness: bitwise vs base over edge shapes, and vs float32 math
bad = 0
cases = [] if os.environ.get("EXP_SKIPCHECK") else [
         (2, 4, 2, 300, 300, 64), (2, 4, 2, 200, 457, 128), (1, 2, 1, 513, 129, 64), (1, 3, 3, 1, 1000, 128),
         (2, 2, 2, 1000, 1, 64), (1, 4, 1, 777, 777, 128), (3, 2, 2, 128, 256, 64), (1, 2, 2, 256, 128, 128)]
for dt in (torch.float16, torch.bfloat16):
    for (b, hq, hk, nq, nk, d) in cases:
        for causal in (False, True):
            g = torch.Generator(device=dev).manual_seed(1)
            q = torch.randn(b, hq, nq, d, device=dev, dtype=dt, generator=g)
            k = torch.randn(b, hk, nk, d, device=dev, dtype=dt, generator=g) * 3
            v = torch.randn(b, hk, nk, d, device=dev, dtype=dt, generator=g)
            o1, l1 = run(base, q, k, v, causal); o2, l2 = run(new, q, k, v, causal)
            eq = torch.equal(o1, o2) and torch.equal(l1, l2)
            kk = k.repeat_interleave(hq // hk, 1).float(); vv = v.repeat_interleave(hq // hk, 1).float()
            s = q.float() @ kk.transpose(-1, -2) / math.sqrt(d)
            if causal:
                mask = torch.ones(nq, nk, device=dev, dtype=torch.bool).tril(nk - nq)
                s = s.masked_fill(~mask, float("-inf"))
            lse_ref = torch.logsumexp(s, -1)
            o_ref = torch.nan_to_num(torch.softmax(s, -1)) @ vv
            err = (o2.float() - o_ref).abs().max().item()
            seen = torch.isfinite(lse_ref)
            lerr = (l2[seen] - lse_ref[seen]).abs().max().item() if seen.any() else 0.0
            inf_ok = torch.equal(torch.isinf(l2), torch.isinf(lse_ref))
            ok = eq and err < 2e-2 and lerr < 1e-3 and inf_ok
            bad += not ok
            if not ok:
                print("MISMATCH", dt, b, hq, hk, nq, nk, d, causal, eq, err, lerr, inf_ok, flush=True)
torch.cuda.synchronize()
print("correctness cases bad:", bad, flush=True)

rows = []
for d in [int(x) for x in os.environ.get("EXP_DIMS", "128 64").split()]:
    for n in [int(x) for x in os.environ.get("EXP_LENGTHS", "1024 4096 16384").split()]:
        for causal in (False, True):
            b, h = 16384 // n, 2048 // d
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.float16, generator=g) for _ in range(3))
            out = torch.empty_like(q); lse = torch.empty((b, h, n), device=dev, dtype=torch.float32)
            fns = {name: (lambda m=m: m.forward(q, k, v, out, lse, causal=causal, scale=d ** -0.5))
                   for name, m in (("base", base), ("new", new))}
            fns["cudnn"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            times = {name: [] for name in fns}
            for name, fn in fns.items():
                fn()
            torch.cuda.synchronize()
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                for r in range(4):
                    for name in (("base", "new", "cudnn") if r % 2 == 0 else ("new", "base", "cudnn")):
                        times[name].append(triton.testing.do_bench_cudagraph(fns[name], rep=60))
            med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            row = dict(d=d, n=n, causal=causal, **{f"{k}_ms": v for k, v in med.items()},
                       ratio_new_base=med["base"] / med["new"],
                       tflops={k: flops / v / 1e9 for k, v in med.items()},
                       vs_cudnn={"base": med["cudnn"] / med["base"], "new": med["cudnn"] / med["new"]})
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(OUT, "ab_pp.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")
