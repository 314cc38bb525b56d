"""Strategies: valid cases, every adversarial class reached and doing what it says, deterministic and
JSON-replayable builds, layouts that really are strided, and failures that shrink to minimal cases."""

import json
import math

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

from references import attention as reference
from strategies.attention import Limits, attention_cases
from strategies.cases import LAYOUTS, MAGNITUDES, AttentionCase, CaseError
from strategies.softmax import SOFTMAX_MAGNITUDES, softmax_cases

BLOCKS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 32, 64)
LIMITS = Limits(max_len=40, max_head_dim=40)


@settings(max_examples=60)
@given(attention_cases(dtype="float16", limits=LIMITS, gqa=True, block_m=BLOCKS, block_n=BLOCKS))
def test_cases_respect_limits_and_declarations(case):
    assert 1 <= case.len_q <= LIMITS.max_len and 1 <= case.len_k <= LIMITS.max_len
    assert 1 <= case.head_dim <= LIMITS.max_head_dim
    assert case.heads_q % case.heads_kv == 0 and case.heads_q // case.heads_kv <= LIMITS.max_group
    assert case.block_m in BLOCKS and case.block_n in BLOCKS
    tiles = math.ceil(case.len_q / case.block_m) * math.ceil(case.len_k / case.block_n)
    assert tiles <= LIMITS.max_tiles
    assert AttentionCase.from_json(case.to_json()) == case


def test_declared_head_dims_are_respected():
    found = find(attention_cases(dtype="float32", head_dims=range(16, 257, 8), limits=LIMITS),
                 lambda c: c.head_dim > 16)
    assert found.head_dim == 24


@pytest.mark.parametrize("target", [
    lambda c: c.magnitude == m for m in MAGNITUDES] + [lambda c: c.layout == lay for lay in LAYOUTS] + [
    lambda c: c.len_q == 1, lambda c: c.len_k % c.block_n == c.block_n - 1 and c.len_k > c.block_n,
    lambda c: c.len_k % c.block_n == 1 and c.len_k > c.block_n, lambda c: c.len_q > c.len_k and c.causal,
    lambda c: c.len_q < c.len_k, lambda c: c.heads_q > c.heads_kv, lambda c: c.head_dim % 8 not in (0,),
    lambda c: c.scale is not None])
def test_every_class_and_shape_feature_is_reachable(target):
    find(attention_cases(dtype="float16", limits=LIMITS, gqa=True, block_m=BLOCKS, block_n=BLOCKS), target,
         settings=settings(max_examples=2000))


def _case(**kw):
    base = dict(batch=1, heads_q=2, heads_kv=1, len_q=6, len_k=9, head_dim=16, dtype="float16", causal=False)
    return AttentionCase(**{**base, **kw})


def test_build_is_deterministic_and_seed_dependent():
    a, b = _case(seed=3).build(), _case(seed=3).build()
    assert all(torch.equal(x, y) for x, y in zip((a.q, a.k, a.v, a.dout), (b.q, b.k, b.v, b.dout)))
    assert not torch.equal(a.q, _case(seed=4).build().q)


def test_layouts():
    bnhd, padded = _case(layout="bnhd").build(), _case(layout="padded").build()
    plain = _case().build()
    assert plain.q.is_contiguous() and not bnhd.q.is_contiguous() and not padded.q.is_contiguous()
    assert torch.equal(bnhd.q, plain.q) and torch.equal(padded.k, plain.k)
    storage = torch.as_strided(padded.k, (padded.k.untyped_storage().nbytes() // 2,), (1,), 0)
    assert bool(torch.isnan(storage).any()), "the padding of a padded view should be NaN canaries"


def _scores(case):
    t = case.build()
    return reference.attention(t.q, t.k, t.v).dense().scores


def test_magnitude_classes_do_what_they_say():
    assert float(_scores(_case(magnitude="large_logits")).abs().max()) > 1e3
    s = _scores(_case(magnitude="all_negative"))
    assert float(s.max()) < -104  # below float32 exp underflow: exp(s) without the max subtraction is 0
    ties = _case(magnitude="ties", len_k=12).build().k
    assert len({tuple(r) for r in ties[0, 0].tolist()}) <= 2
    p = reference.attention(*(lambda t: (t.q, t.k, t.v))(_case(magnitude="dominant_key").build())).dense().p
    assert float(p.amax(dim=-1).min()) > 0.99
    assert float(_case(magnitude="v_offset").build().v.float().mean()) > 900
    v = _case(magnitude="v_wide_range", len_k=30).build().v.float().abs()
    assert float(v.max() / v[v > 0].min()) > 1e3
    assert float(_case(magnitude="near_subnormal").build().v.float().abs().max()) < 64 * torch.finfo(torch.float16).tiny
    o = _case(magnitude="outliers").build()
    assert float(o.q.float().abs().max()) > 10


@pytest.mark.parametrize("bad, words", [
    (dict(heads_q=3, heads_kv=2), "heads_q=3 is not a multiple of heads_kv=2"),
    (dict(dtype="float8"), "dtype='float8'"),
    (dict(magnitude="huge"), "magnitude='huge'"),
    (dict(len_q=-1), "len_q=-1"),
    (dict(block_m=0), "block_m=0"),
    (dict(scale=math.inf), "scale=inf"),
])
def test_invalid_cases_are_refused(bad, words):
    with pytest.raises(CaseError, match=words):
        _case(**bad)


def test_from_json_refuses_unknown_fields_and_non_objects():
    with pytest.raises(CaseError, match="unknown case fields"):
        AttentionCase.from_dict({**_case().to_dict(), "__import__": "os"})
    with pytest.raises(CaseError, match="should be a JSON object"):
        AttentionCase.from_json(json.dumps([1, 2]))
    with pytest.raises(CaseError, match="not valid JSON"):
        AttentionCase.from_json("{")


def test_failures_shrink_to_minimal_cases():
    # A bug that needs a partial last key block: shrinks to one query, one key, block 2.
    found = find(attention_cases(dtype="float16", limits=LIMITS, gqa=True, block_m=BLOCKS, block_n=BLOCKS),
                 lambda c: c.len_k % c.block_n != 0, settings=settings(derandomize=True, database=None))
    assert (found.batch, found.heads_q, found.len_q, found.len_k, found.block_n) == (1, 1, 1, 1, 2)
    assert (found.magnitude, found.layout, found.seed, found.head_dim) == ("normal", "contiguous", 0, 1)


@given(softmax_cases(dtype="float32", block_n=(1, 3, 8)))
def test_softmax_cases(case):
    x = case.build()
    assert x.shape == (case.rows, case.n) and x.dtype == torch.float32
    if case.magnitude == "all_neg_inf_rows":
        assert bool(torch.isneginf(x[0]).all())


def test_softmax_classes_reachable():
    for m in SOFTMAX_MAGNITUDES:
        find(softmax_cases(dtype="float16"), lambda c, m=m: c.magnitude == m)
