"""Output and LSE errors of two versions of kernels/gluon_forward.py against float64 attention, on one GPU of
compute capability 9.0: the suite's cases (strategies.cases.AttentionCase.build) over 5 shapes (GQA, Nq != Nk,
one query row over 3183 keys), six magnitudes (normal, large_logits, dominant_key, sparse_outliers, row_shift,
ties), float16 and bfloat16, causal both, two seeds. Prints, per magnitude and dtype, each version's largest
output error and the worst ratio of the first version's error to the second's (output, LSE).

    PYTHONPATH=. python docs/experiments/gluon_fwd_accuracy.py kernels/gluon_forward.py /tmp/gf_base.py

The figures of docs/benchmarks.md ("Now: the exponent in one fused multiply-add"). A record of an experiment,
not tested code.
"""
import importlib.util
import itertools
import math
import sys

import torch

from strategies.cases import AttentionCase

MAGNITUDES = ("normal", "large_logits", "dominant_key", "sparse_outliers", "row_shift", "ties")
SHAPES = [(1, 4, 2, 1, 3183, 64), (2, 4, 4, 1000, 1000, 128), (1, 8, 2, 700, 2100, 64), (1, 4, 4, 2048, 2048, 128),
          (1, 2, 1, 129, 4000, 64)]


def load(path):
    spec = importlib.util.spec_from_file_location(path.replace("/", "_").replace(".", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def errors(module, q, k, v, causal, scale, ref, ref_lse):
    """(largest |out error|, largest |LSE error| over rows that see a key) of one module's forward."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    module.forward(q, k, v, out, lse, causal=causal, scale=scale)
    seen = torch.isfinite(ref_lse)
    return (out.double() - ref).abs().max().item(), (lse.double() - ref_lse)[seen].abs().max().item()


def main(new_path, base_path):
    new, base = load(new_path), load(base_path)
    worst = {}  # (magnitude, dtype) -> [out ratio, lse ratio, new's largest out error, base's]
    largest = {"new": [0.0, 0.0], "base": [0.0, 0.0]}
    for (b, hq, hk, nq, nk, d), mag, dt, causal, seed in itertools.product(
            SHAPES, MAGNITUDES, ("float16", "bfloat16"), (False, True), (1, 2)):
        case = AttentionCase.from_dict({
            "batch": b, "heads_q": hq, "heads_kv": hk, "len_q": nq, "len_k": nk, "head_dim": d, "dtype": dt,
            "spec": {"causal": causal, "alignment": "bottom_right"}, "magnitude": mag, "seed": seed,
            "layout": "contiguous", "scale": 1 / math.sqrt(d), "block_m": 64, "block_n": 64})
        t = case.build("cuda")
        q, k, v = t.q.contiguous(), t.k.contiguous(), t.v.contiguous()
        kk, vv = (x.double().repeat_interleave(hq // hk, 1) for x in (k, v))
        s = (q.double() @ kk.transpose(-1, -2)) * case.scale
        if causal:
            s = s.masked_fill(~torch.ones(nq, nk, device="cuda", dtype=torch.bool).tril(nk - nq), float("-inf"))
        ref_lse = torch.logsumexp(s, -1)
        ref = torch.nan_to_num(torch.softmax(s, -1)) @ vv
        e_new = errors(new, q, k, v, causal, case.scale, ref, ref_lse)
        e_base = errors(base, q, k, v, causal, case.scale, ref, ref_lse)
        for name, e in (("new", e_new), ("base", e_base)):
            largest[name] = [max(a, x) for a, x in zip(largest[name], e)]
        row = [e_new[0] / max(e_base[0], 1e-30), e_new[1] / max(e_base[1], 1e-30), e_new[0], e_base[0]]
        key = (mag, dt)
        worst[key] = [max(a, x) for a, x in zip(worst[key], row)] if key in worst else row
    for (mag, dt), (ro, rl, eo_new, eo_base) in sorted(worst.items()):
        print(f"{mag:16s} {dt:9s} max out err new {eo_new:.3e} base {eo_base:.3e}; "
              f"worst case ratio new/base: out {ro:.3f}, lse {rl:.3f}")
    print("overall max (out, lse): new", largest["new"], "base", largest["base"])


if __name__ == "__main__":
    main(*sys.argv[1:3])
