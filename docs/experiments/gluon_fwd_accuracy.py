"""Output and LSE errors of two versions of kernels/gluon_forward.py against float64 attention, on one GPU of
compute capability 9.0: the suite's cases (strategies.cases.AttentionCase.build) over 5 shapes (GQA, Nq != Nk,
one query row over 3183 keys), six magnitudes (normal, large_logits, dominant_key, sparse_outliers, row_shift,
ties), float16 and bfloat16, causal both, two seeds. Prints, per magnitude and dtype, each version's largest
output error and the worst ratio of the first version's error to the second's (output, LSE).

    PYTHONPATH=. python docs/experiments/gluon_fwd_accuracy.py kernels/gluon_forward.py /tmp/gf_base.py

The figures of docs/benchmarks.md ("Now: the exponent in one fused multiply-add"). A record of an experiment,
not tested code.
"""
import importlib.util, itertools, math, sys, torch
from strategies.cases import AttentionCase
mods = []
for name in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location(name.replace("/", "_").replace(".", "_"), name)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); mods.append(mod)
shapes = [(1, 4, 2, 1, 3183, 64), (2, 4, 4, 1000, 1000, 128), (1, 8, 2, 700, 2100, 64), (1, 4, 4, 2048, 2048, 128),
          (1, 2, 1, 129, 4000, 64)]
worst = {}
tot = [[0.0, 0.0], [0.0, 0.0]]
for (b, hq, hk, nq, nk, d), mag, dt, causal, seed in itertools.product(
        shapes, ("normal", "large_logits", "dominant_key", "sparse_outliers", "row_shift", "ties"),
        ("float16", "bfloat16"), (False, True), (1, 2)):
    case = AttentionCase.from_dict({"batch": b, "heads_q": hq, "heads_kv": hk, "len_q": nq, "len_k": nk, "head_dim": d,
                                    "dtype": dt, "spec": {"causal": causal, "alignment": "bottom_right"},
                                    "magnitude": mag, "seed": seed, "layout": "contiguous", "scale": 1 / math.sqrt(d),
                                    "block_m": 64, "block_n": 64})
    t = case.build("cuda")
    q, k, v = t.q.contiguous(), t.k.contiguous(), t.v.contiguous()
    kk, vv = (x.double().repeat_interleave(hq // hk, 1) for x in (k, v))
    s = (q.double() @ kk.transpose(-1, -2)) * case.scale
    if causal:
        s = s.masked_fill(~torch.ones(nq, nk, device="cuda", dtype=torch.bool).tril(nk - nq), float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref = torch.nan_to_num(torch.softmax(s, -1)) @ vv
    errs = []
    for mod in mods:
        out = torch.empty_like(q); lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        mod.forward(q, k, v, out, lse, causal=causal, scale=case.scale)
        ok = torch.isfinite(ref_lse)
        errs.append(((out.double() - ref).abs().max().item(), (lse.double() - ref_lse)[ok].abs().max().item()))
    for i in range(2):
        for j in range(2):
            tot[i][j] = max(tot[i][j], errs[i][j])
    key = (mag, dt)
    r = (errs[0][0] / max(errs[1][0], 1e-30), errs[0][1] / max(errs[1][1], 1e-30))
    w = worst.get(key)
    worst[key] = (max(w[0], r[0]) if w else r[0], max(w[1], r[1]) if w else r[1], max(w[2], errs[0][0]) if w else errs[0][0],
                  max(w[3], errs[1][0]) if w else errs[1][0])
for key, (ro, rl, eo_new, eo_base) in sorted(worst.items()):
    print(f"{key[0]:16s} {key[1]:9s} max out err new {eo_new:.3e} base {eo_base:.3e}; worst case ratio new/base: out {ro:.3f}, lse {rl:.3f}")
print("overall max (out, lse): new", tot[0], "base", tot[1])
