"""Strategies: valid cases, every adversarial class reached and doing what it says, deterministic and
JSON-replayable builds, layouts that really are strided, and failures that shrink to minimal cases."""

import dataclasses
import json
import math
import re

import pytest
import torch
from hypothesis import find, given, settings

from references import attention as reference
from references.spec import AttentionSpec
from strategies.attention import BOUNDARY_CLASSES, SHAPE_CLASSES, Limits, attention_cases, boundary_classes
from verify.profiles import limits_for
from strategies.cases import LAYOUTS, MAGNITUDES, SCALES, AttentionCase, CaseError
from strategies.softmax import SOFTMAX_MAGNITUDES, softmax_cases
from tests.reach import reach

BLOCKS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 32, 64)
LIMITS = Limits(max_len=40, max_head_dim=40)


@settings(max_examples=60)
@given(attention_cases(dtype="float16", limits=LIMITS, gqa=True, block_m=BLOCKS, block_n=BLOCKS))
def test_cases_respect_limits_and_declarations(case):
    assert 1 <= case.len_q <= LIMITS.max_len and 0 <= case.len_k <= LIMITS.max_len
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


# Each target is a (name, predicate) pair built by a factory, so that every predicate keeps its own
# class (a lambda made in a comprehension binds the loop variable late: all of them would test the last).
def _field_is(field, value):
    return f"{field}={value}", lambda c: getattr(c, field) == value


SHAPE_FEATURES = [
    ("Nq=1", lambda c: c.len_q == 1),
    ("Nk one below a block multiple", lambda c: c.len_k % c.block_n == c.block_n - 1 and c.len_k > c.block_n),
    ("Nk one above a block multiple", lambda c: c.len_k % c.block_n == 1 and c.len_k > c.block_n),
    ("causal with Nq > Nk", lambda c: c.len_q > c.len_k and c.causal),
    ("Nq < Nk", lambda c: c.len_q < c.len_k),
    ("grouped-query", lambda c: c.heads_q > c.heads_kv),
    ("head dim not a multiple of 8", lambda c: c.head_dim % 8 != 0),
    ("explicit scale", lambda c: c.scale is not None),
]
TARGETS = ([_field_is("magnitude", m) for m in MAGNITUDES] + [_field_is("layout", lay) for lay in LAYOUTS]
           + [(f"class {name}", (lambda n: lambda c: n in boundary_classes(c))(name)) for name in BOUNDARY_CLASSES]
           + SHAPE_FEATURES)
WIDE = Limits(max_len=136, max_head_dim=136, short_len=40, short_head_dim=40)
MQA = dataclasses.replace(WIDE, max_group=64, max_batch_heads=64)  # the gpu profile's large groups
# The gpu profile's KV caches past max_len (a kernel without declared tiles: no tile cap on the keys).
CONTEXT = dataclasses.replace(MQA, max_len=1024, max_context=2 ** 17, max_tiles=2 ** 20)


def test_targets_are_distinct_predicates():
    # The self-check of the check below: a late-bound predicate list would make these all the same.
    probe = [_case(magnitude=m) for m in MAGNITUDES] + [_case(layout=lay) for lay in LAYOUTS]
    firsts = [[pred(c) for c in probe] for _, pred in TARGETS[:len(probe)]]
    assert len({tuple(f) for f in firsts}) == len(probe)


@pytest.mark.parametrize("target", TARGETS, ids=[name for name, _ in TARGETS])
def test_every_class_and_shape_feature_is_reachable(target):
    name, predicate = target
    long_context = name.startswith("class context_")
    value_dim = name.startswith("class head_dim_v")  # drawn for a kernel that declares head_dim_v only
    blocks = None if long_context else BLOCKS
    # The gpu profile's limits (KV caches of up to 128k keys, head dims up to 256) for the long-context
    # classes and multi-head latent attention's 192/128.
    limits = limits_for("cuda", "gpu") if long_context or name == "class head_dim_v_mla" else MQA
    fp8 = name == "class fp8_descaled"  # drawn for a kernel that declares float8 with descales only
    reach(attention_cases(dtype="float8_e4m3fn" if fp8 else "float16", descale=fp8, limits=limits, gqa=True,
                          block_m=blocks, block_n=blocks, windows=True, softcap=True, alibi=True, chunks=True,
                          sinks=True, splits=True, sequences=("dense", "packed", "padded", "paged"),
                          head_dim_v=value_dim),
          predicate, max_examples=2000)


@pytest.mark.parametrize("shape_class", SHAPE_CLASSES)
@pytest.mark.parametrize("blocks", [BLOCKS, None], ids=["declared blocks", "no blocks"])
def test_each_shape_class_builds_what_it_names(shape_class, blocks):
    # Drawn from that class alone, every case reaches the class of the same name (the tile classes
    # are judged with the case's blocks, or 64 x 64 for a kernel that declares none).
    expected = {"decode": "decode", "no_keys": "no_keys", "long": "len_over_64", "wide_head": "head_dim_over_64",
                "kv_tiles_wider": "kv_tiles_wider", "k_aligned_q_ragged": "k_aligned_q_ragged",
                "masked_q_tiles": "masked_q_tiles", "long_context": "decode"}.get(shape_class)
    strategy = attention_cases(dtype="float32", limits=WIDE, gqa=True, block_m=blocks, block_n=blocks,
                               shape_classes=[shape_class])
    seen = []

    # derandomize: the share asserted below is a statistic of 80 draws; with a random seed and 40 draws it
    # fell under a quarter once in a CI run (8 of 40 long cases), so the draws are fixed
    @settings(max_examples=80, database=None, derandomize=True)
    @given(strategy)
    def check(case):
        assert case.len_q >= 1 and case.len_k <= WIDE.max_len + 128 and case.head_dim <= WIDE.max_head_dim
        if blocks:
            tiles = math.ceil(case.len_q / case.block_m) * math.ceil(max(case.len_k, 1) / case.block_n)
            assert tiles <= WIDE.max_tiles, case
        if shape_class == "plain":
            assert max(case.len_q, case.len_k) <= WIDE.short_len and case.head_dim <= WIDE.short_head_dim
        seen.append(expected is None or expected in boundary_classes(case))

    check()
    if expected in ("len_over_64", "head_dim_over_64"):  # long lengths and wide heads are drawn, not forced
        assert sum(seen) >= len(seen) // 4, (shape_class, sum(seen), len(seen))
    else:
        assert all(seen), (shape_class, seen.count(False))


def test_a_property_that_needs_keys_never_gets_none():
    @settings(max_examples=200, database=None)
    @given(attention_cases(dtype="float32", limits=WIDE, block_m=BLOCKS, block_n=BLOCKS, min_len_k=1))
    def check(case):
        assert case.len_k >= 1

    check()


@pytest.mark.parametrize("which", ["len_q", "len_k"])
def test_a_longer_length_is_drawn_not_edited(which):
    other = "len_k" if which == "len_q" else "len_q"

    @settings(max_examples=200, database=None)
    @given(attention_cases(dtype="float32", limits=WIDE, gqa=True, block_m=BLOCKS, block_n=BLOCKS, longer=which,
                           causal=True))
    def check(case):
        assert 1 <= getattr(case, which) - getattr(case, other) <= 8, case

    check()
    # the smallest case of the constraint is one past the other length, in the plain class
    smallest = find(attention_cases(dtype="float32", limits=WIDE, longer=which, causal=True), lambda c: True)
    assert (getattr(smallest, which), getattr(smallest, other)) == (2, 1), smallest


def test_grouped_query_and_query_count_minimums_are_drawn():
    @settings(max_examples=200, database=None)
    @given(attention_cases(dtype="float32", limits=WIDE, gqa=True, min_group=2, min_len_q=2))
    def check(case):
        assert case.heads_q // case.heads_kv >= 2 and case.len_q >= 2, case

    check()


@pytest.mark.parametrize("kwargs, words", [
    (dict(longer="keys"), "longer='keys', but should be None, 'len_q' or 'len_k'"),
    (dict(min_group=2), "min_group=2 needs gqa=True"),
    (dict(min_group=17, gqa=True), "min_group=17, but limits.max_group=16"),
    (dict(min_len_q=0), "min_len_q=0, max_extra=8, but both should be at least 1"),
])
def test_contradictory_constraints_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        find(attention_cases(dtype="float32", limits=WIDE, **kwargs), lambda c: True)


def test_boundary_classes_of_hand_made_cases():
    assert set(boundary_classes(_case(len_q=1, heads_q=2, causal=True))) >= {"decode", "decode_causal_gqa", "gqa"}
    assert "no_keys" in boundary_classes(_case(len_k=0))
    assert "fully_masked_rows" in boundary_classes(_case(len_q=9, len_k=6, causal=True))
    assert "kv_tiles_wider" in boundary_classes(_case(len_k=64, causal=True, block_m=16, block_n=32))
    assert "kv_tiles_wider" not in boundary_classes(_case(len_k=63, causal=True, block_m=16, block_n=32))
    assert "k_aligned_q_ragged" in boundary_classes(_case(len_q=17, len_k=32, causal=True, block_m=16, block_n=16))
    assert "masked_q_tiles" in boundary_classes(_case(len_q=40, len_k=8, causal=True, block_m=32, block_n=16))
    assert "masked_q_tiles" not in boundary_classes(_case(len_q=39, len_k=8, causal=True, block_m=32, block_n=16))
    assert "storage_offset" in boundary_classes(_case(layout="packed"))
    assert {"scale_negative", "scale_not_float16"} <= set(boundary_classes(_case(scale=-1 / 3)))
    assert {"scale_tiny", "scale_not_float16"} <= set(boundary_classes(_case(scale=1e-8)))
    assert "scale_not_float16" in boundary_classes(_case(scale=0.1))
    assert "scale_not_float16" not in boundary_classes(_case(scale=0.125))
    assert {"len_over_128", "len_at_power_of_two_edge"} <= set(boundary_classes(_case(len_k=129)))
    assert "head_dim_over_128" in boundary_classes(_case(head_dim=130))
    assert boundary_classes(_case(heads_q=1)) == []  # Nq=6 Nk=9 D=16, not causal, default scale: nothing rare


def test_scales_cover_the_contract():
    assert 0.0 in SCALES and any(s < 0 for s in SCALES) and any(0 < s < 1e-4 for s in SCALES)
    assert any(s > 1 for s in SCALES)


def test_unknown_shape_class_is_refused():
    with pytest.raises(ValueError, match="shape_classes \\['huge'\\] are unknown"):
        find(attention_cases(dtype="float16", shape_classes=["huge"]), lambda c: True)


def _case(causal: bool = False, **kw):
    base = dict(batch=1, heads_q=2, heads_kv=1, len_q=6, len_k=9, head_dim=16, dtype="float16",
                spec=AttentionSpec(causal=causal))
    return AttentionCase(**{**base, **kw})


def test_build_is_deterministic_and_seed_dependent():
    a, b = _case(seed=3).build(), _case(seed=3).build()
    assert all(torch.equal(x, y) for x, y in zip((a.q, a.k, a.v, a.dout), (b.q, b.k, b.v, b.dout)))
    assert not torch.equal(a.q, _case(seed=4).build().q)


def test_layouts():
    bnhd, padded, packed = (_case(layout=lay).build() for lay in ("bnhd", "padded", "packed"))
    plain = _case().build()
    assert plain.q.is_contiguous() and not bnhd.q.is_contiguous() and not padded.q.is_contiguous()
    assert torch.equal(bnhd.q, plain.q) and torch.equal(padded.k, plain.k)
    storage = torch.as_strided(padded.k, (padded.k.untyped_storage().nbytes() // 2,), (1,), 0)
    assert bool(torch.isnan(storage).any()), "the padding of a padded view should be NaN canaries"
    # packed: q, k, v, dout share one storage, each at its own non-zero offset, NaN between them
    views = (packed.q, packed.k, packed.v, packed.dout)
    assert all(torch.equal(a, b) for a, b in zip(views, (plain.q, plain.k, plain.v, plain.dout)))
    assert len({t.untyped_storage().data_ptr() for t in views}) == 1
    assert all(t.storage_offset() > 0 for t in views) and len({t.storage_offset() for t in views}) == 4
    assert not packed.q.is_contiguous()
    flat = torch.as_strided(packed.q, (packed.q.untyped_storage().nbytes() // 2,), (1,), 0)
    assert bool(torch.isnan(flat[:packed.q.storage_offset()]).all())


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
    o = _case(magnitude="sparse_outliers").build()
    assert float(o.q.float().abs().max()) > 10


def test_fa3_outliers_follow_the_papers_protocol():
    """N(0, 1) + N(0, 100) x Bernoulli(0.001) per entry of q, k, v (dout stays N(0, 1)): about 0.1% of the
    entries carry the std-10 term; N(0, 1) alone passes 6 about twice in a billion, the extra term about
    55% of the time, so ~55 of 10^5 entries pass 6, and the variance is 1 + 100 * 0.001 = 1.1."""
    t = _case(magnitude="fa3_outliers", dtype="float32", heads_q=1, len_q=1000, len_k=1000, head_dim=100).build()
    for name in ("q", "k", "v"):
        x = getattr(t, name).to(torch.float64)
        assert 25 <= int((x.abs() > 6).sum()) <= 95, name
        assert 1.0 < float(x.var()) < 1.25, name
    assert int((t.dout.abs() > 6).sum()) == 0


def test_cases_written_with_the_old_outliers_name_still_read():
    data = {**_case().to_dict(), "magnitude": "outliers"}
    assert AttentionCase.from_dict(data).magnitude == "sparse_outliers"


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
        reach(softmax_cases(dtype="float16"), lambda c, m=m: c.magnitude == m, max_examples=100)


@pytest.mark.parametrize("blocks", [BLOCKS, None], ids=["declared blocks", "no blocks"])
def test_long_context_cases_pass_max_len_within_the_rows_and_tiles(blocks):
    """One query against more keys than max_len, as far as the rows of ROW_HEADS heads at max_len and
    the largest head dim hold, and (with declared blocks) the key tiles' cap."""
    from strategies.attention import ROW_HEADS

    seen = []

    @settings(max_examples=80, database=None, derandomize=True)
    @given(attention_cases(dtype="float32", limits=CONTEXT, gqa=True, block_m=blocks, block_n=blocks,
                           shape_classes=["long_context"]))
    def check(case):
        rows = case.batch * case.heads_q * (case.len_q + case.len_k) * case.head_dim
        assert case.len_q == 1 and rows <= ROW_HEADS * 2 * CONTEXT.max_len * CONTEXT.max_head_dim, case
        if blocks:
            assert math.ceil(case.len_k / case.block_n) <= CONTEXT.tiles_per_axis, case
        seen.append(case.len_k > CONTEXT.max_len)

    check()
    assert sum(seen) >= len(seen) // 2, (sum(seen), len(seen))


@pytest.mark.parametrize("pool", [0, limits_for("cuda", "gpu").compile_pool], ids=["no pool", "compile pool"])
def test_split_kv_partial_outputs_stay_within_the_rows_budget_and_decode_keeps_every_split_count(pool):
    """A split-KV kernel holds one partial output ([B, Hq, Nq, D]) per split until it merges them
    (FlashAttention-2's out_accum): the drawn split count keeps them within ``max_rows`` elements, which the
    gpu profile's budget holds (64 splits of a 1698-query, 64-head case were 13 GB against a worker's
    7.7 GiB); one query keeps split counts up to 128."""
    from hypothesis import HealthCheck

    limits = dataclasses.replace(limits_for("cuda", "gpu"), max_len=4096, max_scores=2 ** 23, compile_pool=pool)
    drawn = []

    @settings(max_examples=400, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(attention_cases(dtype="float16", limits=limits, gqa=True, min_group=16, splits=True,
                           shape_classes=("plain", "decode", "long"), sequences=("dense", "packed", "padded")))
    def collect(case):
        drawn.append(case)

    collect()
    rows = [(c.spec.num_splits, c.heads_q * c.head_dim * (len(c.spec.seqlens_q) * max(c.spec.seqlens_q)
                                                        if c.spec.sequences == "padded" else c.batch * c.len_q))
            for c in drawn if c.spec.num_splits > 1]
    over = [(n, r) for n, r in rows if n > 2 and n * r > limits.max_rows]  # 2 splits of any drawn case fit
    assert not over, over[:3]
    if pool:  # the compile pool reaches them too (tests/test_compile_pool.py), in fewer of 400 examples
        return
    assert max(n * r for n, r in rows) > limits.max_rows // 8  # the cap is met, not far below
    assert any(c.len_q == 1 and c.spec.num_splits == 128 for c in drawn)


def test_a_value_head_dim_is_drawn_only_when_declared_and_within_the_head_dims():
    """Without ``head_dim_v`` every case has v as wide as q and k; with it, v's head dim differs in both
    directions, every one within the declared head dims, and a case keeps it through its JSON."""
    plain = find(attention_cases(dtype="float32", limits=WIDE), lambda c: c.head_dim > 8)
    assert plain.head_dim_v is None and "head_dim_v" not in plain.to_dict()
    dims = range(16, 257, 8)
    strategy = attention_cases(dtype="float32", limits=WIDE, head_dims=dims, head_dim_v=True)
    wider = find(strategy, lambda c: c.value_dim > c.head_dim)
    narrower = find(strategy, lambda c: c.value_dim < c.head_dim)
    for case in (wider, narrower):
        assert case.head_dim in dims and case.value_dim in dims, case
        assert AttentionCase.from_json(case.to_json()) == case
        t = case.build()
        assert t.v.shape[-1] == t.dout.shape[-1] == case.value_dim and t.k.shape[-1] == case.head_dim


def test_a_case_stores_an_equal_value_head_dim_as_none_and_refuses_a_bad_one():
    same = _case(head_dim=8, head_dim_v=8)
    assert same.head_dim_v is None and same == _case(head_dim=8)
    assert "Dv=" not in same.describe() and "Dv=3" in _case(head_dim=8, head_dim_v=3).describe()
    for bad in (0, -2, 2.5, True):
        with pytest.raises(CaseError, match="head_dim_v="):
            _case(head_dim_v=bad)
