"""Criterion 1's floor: what two correct kernels that only sum in different orders may differ by."""

import math

import pytest
import torch

from references import attention as reference
from references import criteria
from references.spec import AttentionSpec
from strategies.cases import AttentionCase

# The case on which a GPU Triton FA2 kernel first failed criterion 1 in float32 (its FMA-chain dot
# sums the head dimension in another order than cuBLAS; 1.17e-6 against eager's 1.65e-7).
CASE = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=32, len_k=91, head_dim=120, dtype="float32",
                     spec=AttentionSpec(causal=False), magnitude="normal", seed=0, layout="contiguous", block_m=16,
                     block_n=16)


def _sequential_scores(q, k, scale):
    """Scores summed over the head dimension one term at a time (an FMA chain's order)."""
    acc = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float32)
    for d in range(q.shape[1]):
        acc = acc + q[:, d:d + 1] * k[:, d][None, :]
    return acc * scale


def test_floor_covers_scores_summed_in_another_order():
    t = CASE.build()
    ref = reference.attention(t.q, t.k, t.v)
    q, k, v = t.q[0, 0], t.k[0, 0], t.v[0, 0]
    s = _sequential_scores(q, k, 1 / math.sqrt(CASE.head_dim))
    p = torch.exp(s - s.max(-1, keepdim=True).values)
    # Everything after the scores exact: only the order of the score sums differs from a good kernel.
    out = (p.double() @ v.double() / p.double().sum(-1, keepdim=True)).float()
    err = float((out.double() - ref.out[0, 0]).abs().max())
    mags = criteria.magnitudes("out", ref)
    assert mags.scores > 5.0  # ~ sqrt(2/pi) * sqrt(D) for N(0, 1) inputs
    with_scores = criteria.floor("out", torch.float32, mags)
    without = criteria.floor("out", torch.float32, criteria.Magnitudes(summands=mags.summands))
    assert without < err <= with_scores, (without, err, with_scores)


def test_floor_terms_by_op():
    m = criteria.Magnitudes(summands=2.0, scores=10.0, lse=5.0)
    u32 = 2.0 ** -24
    for op in ("out", "dq", "dk", "dv"):
        assert criteria.floor(op, torch.float16, m) > criteria.floor(op, torch.float16, criteria.Magnitudes(2.0, 0.0, 5.0))
    # The LSE gets the score roundings as an absolute term (float16: two per 16-deep tensor-core step,
    # which may truncate; float32: one); Delta (from the kernel's own O) gets none.
    lse = criteria.floor("lse", torch.float16, m) - criteria.floor("lse", torch.float16, criteria.Magnitudes(2.0))
    assert lse == pytest.approx(2 * 10.0 * u32, rel=1e-12)
    lse32 = criteria.floor("lse", torch.float32, m) - criteria.floor("lse", torch.float32, criteria.Magnitudes(2.0))
    assert lse32 == pytest.approx(10.0 * u32, rel=1e-12)
    assert criteria.floor("delta", torch.float16, m) == criteria.floor("delta", torch.float16, criteria.Magnitudes(2.0))
    t = CASE.build()
    assert criteria.magnitudes("delta", reference.attention(t.q, t.k, t.v, dout=t.dout)).scores == 0.0


def test_floor_refuses_a_bare_number():
    with pytest.raises(TypeError, match="should be a references.criteria.Magnitudes"):
        criteria.floor("out", torch.float16, 1.0)
    with pytest.raises(ValueError, match="op='o', but should be one of"):
        criteria.allowed_error("o", torch.float16, baseline_error=0.0, magnitude=criteria.Magnitudes(1.0))


@pytest.mark.parametrize("op", ["dq", "dk", "dv", "out", "lse", "delta"])
def test_floor_of_a_negative_scale_equals_that_of_the_same_scores(op):
    # scale -0.5 with keys -k is the same attention as 0.5 with k (same scores, same P, same sizes):
    # the floor must be the same (a signed scale once made the dq/dk floors negative, below 3 x eager).
    t = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=3, len_k=5, head_dim=4, dtype="float16",
                      spec=AttentionSpec(causal=False), seed=1).build()
    floors = []
    for scale, k in ((0.5, t.k), (-0.5, -t.k)):
        ref = reference.attention(t.q, k, t.v, scale=scale, dout=t.dout)
        floors.append(criteria.floor(op, torch.float16, criteria.magnitudes(op, ref)))
    assert floors[0] > 0 and floors[1] == pytest.approx(floors[0], rel=1e-12), floors


def test_floor_covers_tensor_core_scores_with_same_sign_products():
    # H100, triton_fa2 and triton_fa1, float16, D = 184, all-negative scores (every q_d k_jd < 0):
    # LSE error 1.052e-3 (14 u |s|), eager's 8.840e-5. Twelve 16-deep tensor-core steps that may
    # truncate; one rounding of the score magnitude (the floor before) allowed 9.9e-4.
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=4, len_k=64, head_dim=184, dtype="float16",
                         spec=AttentionSpec(causal=True), magnitude="all_negative", seed=0, layout="contiguous",
                         block_m=16, block_n=32)
    t = case.build()
    mags = criteria.magnitudes("lse", reference.attention(t.q, t.k, t.v, spec=AttentionSpec(causal=True)))
    assert criteria.allowed_error("lse", torch.float16, baseline_error=8.840e-5, magnitude=mags) >= 1.052e-3
    without = criteria.allowed_error("lse", torch.float16, baseline_error=8.840e-5, magnitude=mags)
    without -= (criteria.score_roundings(torch.float16, 184) - 1) * 2.0 ** -24 * mags.scores  # one rounding
    assert without < 1.052e-3
    assert criteria.score_roundings(torch.float16, 184) == 24 and criteria.score_roundings(torch.float32, 184) == 1
    # float64: the reference's scores round as much as the kernel's, each about sqrt(D) roundings
    assert criteria.score_roundings(torch.float64, 184) == pytest.approx(2 * 184 ** 0.5)


# Seen on an H200: the Triton FA1 and FA2 backward's dV of a multi-query case (64 query heads on one KV head),
# float32, 4.616e-05 from the float64 reference (within 0.3% of its rounding-error bound) where eager's was
# 3.045e-06; criterion 1 then allowed 2.779e-05, its floor scaled by the terms of one query head's rows alone.
# A dV entry of a KV head sums the terms of every row of every query head of its group, each P carrying its
# relative error (the recomputed score, the stored LSE, exp2): the floor scales with all of them.
MQA = AttentionCase.from_dict({"batch": 1, "heads_q": 64, "heads_kv": 1, "len_q": 32, "len_k": 16, "head_dim": 16,
                               "dtype": "float32", "spec": {"causal": True, "alignment": "bottom_right"},
                               "magnitude": "normal", "seed": 0, "layout": "contiguous", "scale": None,
                               "block_m": 16, "block_n": 16})


@pytest.mark.parametrize("op", ["dk", "dv"])
def test_the_floor_of_a_grouped_gradient_scales_with_every_head_of_the_group(op):
    t = MQA.build()
    ref = reference.attention(t.q, t.k, t.v, spec=MQA.spec, dout=t.dout)
    one = MQA.build()  # the first query head alone on its KV head: its terms only
    q1, dout1 = one.q[:, :1], one.dout[:, :1]
    ref1 = reference.attention(q1, one.k, one.v, spec=MQA.spec, dout=dout1)
    whole, alone = criteria.summand_magnitude(op, ref), criteria.summand_magnitude(op, ref1)
    assert whole > 16 * alone, (whole, alone)  # 64 heads' terms of like size
    if op == "dv":
        allowed = criteria.allowed_error("dv", torch.float32, baseline_error=3.045e-06,
                                         magnitude=criteria.magnitudes("dv", ref, lse_error=0.0))
        assert allowed > 4.616e-05, allowed
