"""A kernel whose tile loop runs in Python declares ``max_tiles``: drawn cases, the longest case and
block_size_invariance's second tiling all stay within it, and a bad declaration is refused."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashverify_kernels.registry import Implementation, ImplementationError, registry
from strategies.attention import attention_cases
from verify import properties
from verify.profiles import limits_for
from verify.context import Context
from verify.runner import limits_of, longest_case

GPU_LIMITS = limits_for("cuda", "gpu")  # 2**20 tiles: the cap that made Python tile loops run for minutes


def _tiles(case) -> int:
    return math.ceil(case.len_q / case.block_m) * math.ceil(case.len_k / case.block_n)


@pytest.mark.parametrize("value", [0, -4, 2.5, "64"])
def test_a_bad_tile_cap_is_refused(value):
    with pytest.raises(ImplementationError, match=f"max_tiles={value!r}, but should be a positive int or None"):
        Implementation(name="k", forward=lambda q, k, v, *, causal, scale: q, max_tiles=value)


def test_shipped_python_loop_kernels_declare_a_cap_and_triton_ones_do_not():
    shipped = registry()
    assert shipped["fa2_blocked"].max_tiles == shipped["fa1_blocked"].max_tiles == 1024
    assert shipped["triton_fa2"].max_tiles is None


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_drawn_cases_keep_the_declared_cap(data):
    impl = registry()["fa2_blocked"]
    limits = limits_of(impl, GPU_LIMITS)
    assert limits.max_tiles == 1024 and limits.max_len == GPU_LIMITS.max_len
    case = data.draw(attention_cases(dtype="float16", limits=limits, gqa=True, block_m=impl.block_m,
                                     block_n=impl.block_n))
    assert _tiles(case) <= impl.max_tiles, case.describe()


def test_the_longest_case_of_a_capped_kernel_uses_its_largest_tiles_within_the_cap():
    capped = longest_case(registry()["fa2_blocked"], "float16", GPU_LIMITS, causal=True)
    assert (capped.block_m, capped.block_n) == (64, 64)
    assert capped.len_k == capped.len_q == 32 * 64 and _tiles(capped) == 1024
    free = longest_case(registry()["eager"], "float16", GPU_LIMITS, causal=True)
    assert free.len_k == GPU_LIMITS.max_len and free.block_m is None


def test_block_size_invariance_draws_its_second_tiling_within_the_cap(monkeypatch):
    impl = registry()["fa2_blocked"]
    case = longest_case(impl, "float32", GPU_LIMITS, causal=False).replace(len_q=1000, len_k=2048, head_dim=8)
    tilings = []

    def first_tiling_then_stop(ctx, c, q, k, v, **kw):
        tilings.append((c.block_m, c.block_n))
        if len(tilings) == 2:  # the second tiling is all this test needs: stop before running anything
            raise StopIteration
        return torch.zeros_like(q), torch.zeros(q.shape[:3])

    monkeypatch.setattr(properties, "run_forward", first_tiling_then_stop)
    drawn = set()
    for seed in range(16):
        tilings.clear()
        example = case.replace(seed=seed)
        ctx = Context(impl=impl, prop="block_size_invariance", case=example)
        with pytest.raises(StopIteration):
            properties.PROPERTIES["block_size_invariance"](ctx, example)
        bm, bn = tilings[1]
        assert math.ceil(1000 / bm) <= 32 and math.ceil(2048 / bn) <= 32, tilings
        drawn.add((bm, bn))
    assert drawn == {(32, 64), (64, 64)}, drawn  # it still draws, among the tilings that fit
