"""Online-softmax properties: kernels vs float64/mpmath, and the laws of merging (m, l) states."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashverify_kernels.pytorch import online_softmax as osm
from references import attention as reference
from references.softmax_bounds import softmax_bounds
from strategies.softmax import SOFTMAX_MAGNITUDES, SoftmaxCase, partitions
from verify.runner import DTYPE_NAMES, check_softmax


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_softmax_matches_reference(softmax_impl, dtype, env):
    check_softmax("softmax_matches_reference", softmax_impl, dtype, env)


def _states(x, cuts):
    return [osm.state(x[:, a:b]) for a, b in zip(cuts, cuts[1:])]


def _fold(states):
    acc = osm.identity_state(states[0][0].shape[0], dtype=states[0][0].dtype)
    for s in states:
        acc = osm.merge(acc, s)
    return acc


def _lse_tolerance(x):
    """Float64 merges of any partition agree to the softmax bound of the float64 LSE (twice)."""
    _, lse_bound = softmax_bounds(x, dtype=torch.float64)
    return 2 * lse_bound


@st.composite
def rows_and_partitions(draw):
    case = SoftmaxCase(rows=draw(st.integers(1, 3), label="rows"), n=draw(st.integers(1, 24), label="n"),
                       dtype="float64", magnitude=draw(st.sampled_from(SOFTMAX_MAGNITUDES), label="magnitude"),
                       seed=draw(st.integers(0, 2 ** 16), label="seed"))
    return case, draw(partitions(case.n), label="cuts"), draw(partitions(case.n), label="other cuts")


def _assert_same_state(a, b, tol, what):
    __tracebackhide__ = True
    m_a, l_a = a
    m_b, l_b = b
    assert torch.equal(m_a, m_b), f"{what}: running max differs: {m_a.tolist()} vs {m_b.tolist()}"
    lse_a, lse_b = osm.lse_of(a), osm.lse_of(b)
    both_empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    diff = torch.where(both_empty, 0.0, (lse_a - lse_b).abs())
    assert not bool(torch.isnan(diff).any()), f"{what}: NaN in lse {lse_a.tolist()} vs {lse_b.tolist()}"
    assert bool((diff <= tol).all()), (f"{what}: lse {lse_a.tolist()} vs {lse_b.tolist()} "
                                       f"differ by {diff.tolist()} > tolerance {tol.tolist()}")


@given(rows_and_partitions())
def test_any_partition_gives_the_same_state(drawn):
    case, cuts, other = drawn
    x = case.build()
    tol = _lse_tolerance(x)
    whole = osm.state(x)
    _assert_same_state(_fold(_states(x, cuts)), whole, tol, f"partition {cuts} vs whole row [{case.describe()}]")
    _assert_same_state(_fold(_states(x, other)), whole, tol, f"partition {other} vs whole row [{case.describe()}]")


@given(rows_and_partitions())
def test_merge_is_commutative_and_associative(drawn):
    case, cuts, _ = drawn
    x = case.build()
    tol = _lse_tolerance(x)
    parts = _states(x, cuts)
    forward, backward = _fold(parts), _fold(parts[::-1])
    _assert_same_state(forward, backward, tol, f"merge order reversed, cuts {cuts} [{case.describe()}]")
    if len(parts) >= 3:
        a, b, c = parts[0], parts[1], _fold(parts[2:])
        _assert_same_state(osm.merge(osm.merge(a, b), c), osm.merge(a, osm.merge(b, c)), tol,
                           f"(a+b)+c vs a+(b+c), cuts {cuts} [{case.describe()}]")


@given(rows_and_partitions())
def test_identity_state(drawn):
    case, _, _ = drawn
    x = case.build()
    s = osm.state(x)
    ident = osm.identity_state(x.shape[0], dtype=x.dtype)
    for merged, what in ((osm.merge(s, ident), "s + identity"), (osm.merge(ident, s), "identity + s")):
        assert torch.equal(merged[0], s[0]) and torch.equal(merged[1], s[1]), (
            f"{what} should equal s exactly: {merged} vs {s} [{case.describe()}]")
    m, l = osm.merge(ident, ident)
    assert bool(torch.isneginf(m).all()) and bool((l == 0).all()), f"identity + identity = ({m}, {l})"


@given(rows_and_partitions())
def test_lse_is_m_plus_log_l(drawn):
    case, _, _ = drawn
    x = case.build()
    expected = reference.logsumexp(x)
    got = osm.lse_of(osm.state(x))
    _, lse_bound = softmax_bounds(x, dtype=torch.float64)
    both_inf = torch.isneginf(expected) & torch.isneginf(got)
    err = torch.where(both_inf, 0.0, (got - expected).abs())
    assert bool((err <= lse_bound).all()), (
        f"m + log(l) = {got.tolist()} vs float64 logsumexp {expected.tolist()} [{case.describe()}]")


def test_all_neg_inf_row_gives_zeros_and_neg_inf_lse():
    x = torch.full((2, 5), -math.inf, dtype=torch.float32)
    x[1, 2] = 0.5
    for fn in (osm.streaming_softmax, osm.batched_softmax, lambda t: osm.blocked_softmax(t, block_n=2)):
        y, lse = fn(x)
        assert torch.equal(y[0], torch.zeros(5)), f"{fn}: all -inf row gave {y[0].tolist()}"
        assert math.isinf(float(lse[0])) and float(lse[0]) < 0, f"{fn}: lse of an all -inf row is {lse[0]}"
        assert torch.equal(y[1], torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])), f"{fn}: one finite entry gave {y[1]}"
        assert float(lse[1]) == 0.5


@settings(max_examples=10)
@given(st.integers(1, 8), st.integers(0, 2 ** 16))
def test_neg_inf_entries_get_zero_weight(n_inf, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 8 + n_inf, generator=g, dtype=torch.float64)
    hidden = torch.randperm(8 + n_inf, generator=g)[:n_inf]
    x[0, hidden] = -math.inf
    for fn in (osm.streaming_softmax, osm.batched_softmax, lambda t: osm.blocked_softmax(t, block_n=3)):
        y, _ = fn(x)
        assert bool((y[0, hidden] == 0).all()), f"-inf entries {hidden.tolist()} got weight {y[0, hidden].tolist()}"
        assert abs(float(y.sum()) - 1.0) < 1e-13
