"""The assertion helpers: they fail on NaN, on swapped arguments, on wrong dtypes and shapes, on
outputs that are the inputs, and their messages name the implementation, case, metric, limit and replay."""

import math

import pytest
import torch

from flashverify_kernels.registry import Implementation
from references import attention as reference, baseline, bounds, criteria
from references.spec import AttentionSpec
from strategies.cases import AttentionCase
from verify.context import Context, PropertyFailure
from verify.asserts import assert_accurate, assert_close
from verify.calls import check_tensor, run_forward

CASE = AttentionCase(batch=1, heads_q=2, heads_kv=1, len_q=5, len_k=7, head_dim=8, dtype="float16",
                     spec=AttentionSpec(causal=True))


def _ctx(forward=None):
    impl = Implementation(name="toy", forward=forward or (lambda q, k, v, causal, scale: (q, None)), gqa=True)
    return Context(impl=impl, prop="out_matches_reference", case=CASE)


def _setup():
    t = CASE.build()
    ref = reference.attention(t.q, t.k, t.v, spec=AttentionSpec(causal=True))
    base, _ = baseline.forward(t.q, t.k, t.v, spec=AttentionSpec(causal=True))
    bound, _ = bounds.forward_bounds(ref, t.q, t.k, t.v, dtype=t.q.dtype)
    mag = criteria.magnitudes("out", ref)
    return t, ref, base, bound, mag


def _accurate(ctx, actual, ref, base, bound, mag):
    return assert_accurate(ctx, op="out", actual=actual, expected=ref.out, baseline=base, bound=bound,
                           input_dtype=torch.float16, magnitude=mag)


def test_accurate_result_passes_and_is_recorded():
    records = []
    ctx = _ctx()
    ctx.record = records.append
    t, ref, base, bound, mag = _setup()
    stats = _accurate(ctx, base, ref, base, bound, mag)  # the baseline itself meets both criteria
    assert stats.nan_count == 0 and records and records[0]["pass"] is True
    assert {"max_abs", "max_rel", "rmse", "max_ulp", "error_over_bound", "error_over_baseline"} <= set(records[0])


def test_nan_fails_even_where_the_rest_is_exact():
    t, ref, base, bound, mag = _setup()
    bad = ref.out.to(torch.float16).clone()
    bad[0, 1, 3, 2] = math.nan
    with pytest.raises(PropertyFailure, match="1 of 80 out values are NaN"):
        _accurate(_ctx(), bad, ref, base, bound, mag)


def test_wrong_value_fails_with_a_message_that_reads_alone():
    t, ref, base, bound, mag = _setup()
    bad = ref.out.to(torch.float16).clone()
    bad[0, 0, 4, 0] += 0.25
    with pytest.raises(PropertyFailure) as info:
        _accurate(_ctx(), bad, ref, base, bound, mag)
    msg = str(info.value)
    for words in ("toy: out differs from the float64 reference", "at [0, 0, 4, 0]", "criterion 1 FAILED",
                  "criterion 2 FAILED", "property: out_matches_reference", "case: B=1 Hq=2 Hkv=1 Nq=5 Nk=7 D=8",
                  "replay: python -m verify.replay --impl toy --property out_matches_reference"):
        assert words in msg, f"{words!r} missing from:\n{msg}"


def test_swapped_actual_and_expected_is_refused():
    t, ref, base, bound, mag = _setup()
    with pytest.raises(TypeError, match="are actual and expected swapped"):
        assert_accurate(_ctx(), op="out", actual=ref.out, expected=base, baseline=base, bound=bound,
                        input_dtype=torch.float16, magnitude=mag)


def test_wrong_dtype_fails():
    t, ref, base, bound, mag = _setup()
    with pytest.raises(PropertyFailure, match="out.dtype=float32, but should be float16"):
        _accurate(_ctx(), ref.out.to(torch.float32), ref, base, bound, mag)


@pytest.mark.parametrize("make, words", [
    (lambda q: q.float(), "out.dtype=float32, but should be float16"),
    (lambda q: q[:, :, :-1].clone(), "out.shape=(1, 2, 4, 8), but should be (1, 2, 5, 8)"),
    (lambda q: q, "is (a view of) one of the input tensors"),
    (lambda q: q.tolist(), "out is a list, but should be a torch.Tensor"),
])
def test_run_forward_checks_the_contract(make, words):
    ctx = _ctx(lambda q, k, v, causal, scale: make(q))
    t = CASE.build()
    with pytest.raises((PropertyFailure, TypeError), match=words.replace("(", r"\(").replace(")", r"\)")):
        run_forward(ctx, CASE, t.q, t.k, t.v)


def test_run_forward_checks_lse_dtype_and_shape():
    t = CASE.build()
    ctx = _ctx(lambda q, k, v, causal, scale: (q.clone(), torch.zeros(1, 2, 5, dtype=torch.float16)))
    with pytest.raises(PropertyFailure, match="lse.dtype=float16, but should be float32"):
        run_forward(ctx, CASE, t.q, t.k, t.v)
    ctx = _ctx(lambda q, k, v, causal, scale: (q.clone(), torch.zeros(1, 2, 4)))
    with pytest.raises(PropertyFailure, match=r"lse.shape=\(1, 2, 4\), but should be \(1, 2, 5\)"):
        run_forward(ctx, CASE, t.q, t.k, t.v)


def test_check_tensor_refuses_wrong_device_name():
    ctx = _ctx()
    x = torch.zeros(2)
    with pytest.raises(PropertyFailure, match="should be on meta"):
        check_tensor(ctx, label="out", actual=x, shape=(2,), dtype=torch.float32, device=torch.device("meta"))


def test_assert_close_exact_and_tolerance():
    ctx = _ctx()
    a = torch.tensor([1.0, 2.0, math.nan])
    assert_close(ctx, what="same", actual=a, expected=a.clone(), tolerance=0.0, exact=True)
    with pytest.raises(PropertyFailure, match="1 values differ"):
        assert_close(ctx, what="x", actual=a, expected=torch.tensor([1.0, 2.5, math.nan]), tolerance=0, exact=True)
    with pytest.raises(PropertyFailure, match="exceeds the tolerance"):
        assert_close(ctx, what="x", actual=torch.tensor([1.0, 2.0]), expected=torch.tensor([1.0, 2.1]), tolerance=0.05)
    with pytest.raises(PropertyFailure, match="exceeds the tolerance"):
        assert_close(ctx, what="x", actual=torch.tensor([1.0, math.nan]), expected=torch.tensor([1.0, 2.0]),
                     tolerance=1e9)


def test_assert_close_records_each_comparisons_margin_and_aims_at_it():
    margins = []
    ctx = Context(impl=_ctx().impl, prop="key_permutation_invariance", case=CASE, margin=margins.append)
    assert_close(ctx, what="out after permuting keys", actual=torch.tensor([1.0, 2.0]),
                 expected=torch.tensor([1.0, 2.01]), tolerance=0.02)
    with pytest.raises(PropertyFailure):
        assert_close(ctx, what="lse after permuting keys", actual=torch.tensor([1.0]), expected=torch.tensor([1.5]),
                     tolerance=0.25)
    assert [(m["check"], m["pass"]) for m in margins] == [("out after permuting keys", True),
                                                           ("lse after permuting keys", False)]
    assert margins[0]["difference_over_tolerance"] == pytest.approx(0.5, rel=1e-5)
    assert margins[1]["difference_over_tolerance"] == pytest.approx(2.0)
    assert margins[0]["dtype"] == "float16" and margins[0]["case"]["len_k"] == 7
    assert ctx.observations["difference/tolerance"] == pytest.approx(2.0)
