"""The compile pool of the gpu profile (strategies/compile_pool.py): fixed rows that keep every switch alone,
every pair of switches in all four combinations and every option of every choice; drawn through it, the cases
of a kernel and dtype fall into at most as many compile configurations as it has rows, every boundary class
stays reachable, and a failure that needs one variant shrinks to that variant alone."""

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, find, given, seed, settings
from hypothesis import strategies as st

from strategies import attention
from strategies.attention import BOUNDARY_CLASSES, Limits, attention_cases, boundary_classes
from strategies.compile_pool import CHOICES, SWITCHES, compile_pool, head_dim_classes, padded
from tests.reach import reach
from verify.profiles import limits_for

SIZE = limits_for("cuda", "gpu").compile_pool
# The gpu profile's pool on lengths and head dims a CPU draws quickly; every variant the Triton FA2 declares.
POOLED = Limits(max_len=136, max_head_dim=256, short_len=40, short_head_dim=256, max_group=16,
                max_batch_heads=16, compile_pool=SIZE)
DRAWS = dict(dtype="float16", gqa=True, block_m=(16, 32, 64), block_n=(16, 32, 64), head_dim_v=True,
             windows=True, softcap=True, alibi=True, chunks=True, sinks=True, sequences=("dense", "packed"))


def test_the_gpu_profile_draws_through_a_pool():
    assert SIZE >= 19 and limits_for("cpu", "ci").compile_pool == 0


def test_the_pool_is_fixed_and_keeps_every_switch_alone_every_pair_and_every_option():
    rows = compile_pool(SIZE)
    assert rows == compile_pool.__wrapped__(SIZE)  # the same rows, built again
    assert rows[0].on == frozenset() and all(i == 0 for _, i in rows[0].index)
    assert [r.on for r in rows[1:1 + len(SWITCHES)]] == [frozenset({s}) for s in SWITCHES]
    for a, b in itertools.combinations(SWITCHES, 2):
        seen = {(a in r.on, b in r.on) for r in rows}
        assert seen == {(False, False), (False, True), (True, False), (True, True)}, (a, b, seen)
    for choice in CHOICES:
        for n in range(1, SIZE + 1):
            assert {r.pick(choice, range(n)) for r in rows} == set(range(n)), (choice, n)


def test_a_pool_too_small_for_its_guarantees_is_refused():
    with pytest.raises(ValueError, match="compile_pool=5, but should be at least"):
        Limits(compile_pool=5)


def test_head_dims_are_grouped_by_what_a_kernel_compiles_for():
    assert head_dim_classes([1, 15, 16, 17, 32, 33, 64, 100, 128, 192, 256]) == [
        [1, 15], [16], [17], [32], [33], [64], [100], [128], [192], [256]]
    assert [padded(d) for d in (1, 16, 17, 129, 256)] == [16, 16, 32, 256, 256]


def _configuration(case) -> tuple:
    """What a Triton kernel compiles for: tiles, padded head dims and whether they are exact, the causal flag,
    the variants switched on, the sequence convention, float8 descales, the layout."""
    spec = case.spec
    return (case.block_m, case.block_n, padded(case.head_dim), case.head_dim == padded(case.head_dim),
            padded(case.value_dim), case.value_dim == padded(case.value_dim), case.value_dim == case.head_dim,
            case.causal, spec.window_left >= 0 or spec.window_right >= 0, spec.softcap is not None,
            spec.alibi_slopes is not None, spec.attention_chunk > 0, spec.sinks is not None, spec.sequences,
            case.descale, case.layout)


def _configurations(limits: Limits, shape_class: str | None = None, *, properties: int = 1,
                    examples: int = 300) -> set:
    """The compile configurations of ``properties`` tests of ``examples`` examples each (each test its own
    seed, as each property's is)."""
    seen = set()
    for prop in range(properties):
        @seed(prop)
        @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(attention_cases(limits=limits, **({"shape_classes": [shape_class]} if shape_class else {}), **DRAWS))
        def draw(case):
            seen.add(_configuration(case))

        draw()
    return seen


@pytest.mark.parametrize("shape_class", ["plain", "kv_tiles_wider", "decode"])
def test_pooled_cases_of_one_class_fall_into_one_configuration_per_row(shape_class, monkeypatch):
    monkeypatch.setattr(attention, "_KEPT", st.just(True))  # every switch a row turns on kept
    pooled = _configurations(POOLED, shape_class)
    assert len(pooled) <= SIZE, f"{len(pooled)} compile configurations from a pool of {SIZE}"
    # the check can fail: drawn on their own, the same examples make far more
    assert len(_configurations(dataclasses.replace(POOLED, compile_pool=0), shape_class)) > 2 * SIZE


def test_the_properties_of_a_kernel_share_their_compile_configurations():
    """As a gpu run draws them (15 examples for each of 30 properties, every class, the switches the shrinker
    may drop as drawn): a quarter of the configurations or fewer."""
    pooled = _configurations(POOLED, properties=30, examples=15)
    alone = _configurations(dataclasses.replace(POOLED, compile_pool=0), properties=30, examples=15)
    assert 4 * len(pooled) < len(alone) + 2 * SIZE, (len(pooled), len(alone))


@pytest.mark.parametrize("name", [c for c in BOUNDARY_CLASSES if c not in ("context_over_8k", "context_over_64k",
                                                                           "fp8_descaled", "group_over_16")])
def test_every_boundary_class_stays_reachable_through_the_pool(name):
    reach(attention_cases(limits=dataclasses.replace(POOLED, max_splits=128), splits=True,
                          **{**DRAWS, "sequences": ("dense", "packed", "padded", "paged")}),
          lambda c: name in boundary_classes(c), max_examples=10000)


def test_float8_descales_and_long_contexts_stay_reachable_through_the_pool():
    gpu = limits_for("cuda", "gpu")
    assert gpu.compile_pool
    reach(attention_cases(limits=POOLED, descale=True, **{**DRAWS, "dtype": "float8_e4m3fn"}),
          lambda c: c.descale, max_examples=10000)
    for name in ("context_over_8k", "context_over_64k", "group_over_16"):
        # (no declared tiles: 128k keys are more tiles than the gpu profile's cap on tiles holds)
        reach(attention_cases(limits=gpu, **{**DRAWS, "block_m": None, "block_n": None}),
              lambda c: name in boundary_classes(c), max_examples=10000)


@pytest.mark.parametrize("variant", ["window", "softcap", "alibi", "chunk", "sinks", "varlen"])
def test_a_failure_that_needs_one_variant_shrinks_to_that_variant_alone(variant):
    needs = {"window": lambda s: s.window_left >= 0 or s.window_right >= 0, "softcap": lambda s: s.softcap is not None,
             "alibi": lambda s: s.alibi_slopes is not None, "chunk": lambda s: s.attention_chunk > 0,
             "sinks": lambda s: s.sinks is not None, "varlen": lambda s: s.varlen}
    case = find(attention_cases(limits=POOLED, **DRAWS), lambda c: needs[variant](c.spec),
                settings=settings(max_examples=2000, database=None, derandomize=True))
    assert [v for v, holds in needs.items() if holds(case.spec)] == [variant] and not case.causal, case


@settings(max_examples=50, database=None, deadline=None)
@given(st.data())
def test_pooled_cases_respect_the_declaration(data):
    case = data.draw(attention_cases(limits=POOLED, **{**DRAWS, "head_dims": (16, 32, 40, 64, 96, 128, 192, 256)}))
    assert case.head_dim in (16, 32, 40, 64, 96, 128, 192, 256) and case.value_dim in (16, 32, 40, 64, 96, 128, 192, 256)
    assert case.block_m in (16, 32, 64) and case.block_n in (16, 32, 64)
