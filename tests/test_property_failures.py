"""Properties fail with a message that says why, about the kernel: a gradcheck that fails for real, NaN
and infinities named as such, a fully masked row explained, a zero tolerance explained."""

from __future__ import annotations

import math
import re

import pytest
import torch

from flashverify_kernels.registry import Implementation
from references.spec import AttentionSpec
from strategies.cases import AttentionCase
from verify import properties
from verify.context import Context, PropertyFailure
from verify.asserts import assert_close

from examples.reference_attention import attention


class _WrongGradient(torch.autograd.Function):
    """The correct forward, and a backward whose dQ, dK, dV are 1% too large."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.scale = causal, scale
        with torch.no_grad():
            return attention(q, k, v, causal=causal, scale=scale)[0]

    @staticmethod
    def backward(ctx, dout):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = attention(q, k, v, causal=ctx.causal, scale=ctx.scale)[0]
            grads = torch.autograd.grad(out, (q, k, v), dout)
        return (*(1.01 * g for g in grads), None, None)


def _wrong_gradient(q, k, v, *, causal=False, scale=None):
    return _WrongGradient.apply(q, k, v, causal, scale)


CASE = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=3, len_k=4, head_dim=2, dtype="float64",
                     spec=AttentionSpec(causal=False), magnitude="normal", seed=1, layout="contiguous")


def _ctx(forward, prop, case=CASE, **declared):
    impl = Implementation(name="kernel_under_test", forward=forward, **declared)
    return Context(impl=impl, prop=prop, device="cpu", case=case)


def test_gradcheck_passes_a_correct_kernel():
    properties.gradcheck_float64(_ctx(attention, "gradcheck_float64"), CASE)


def test_gradcheck_fails_a_wrong_backward_with_its_reason():
    with pytest.raises(PropertyFailure, match="finite-difference gradcheck failed: Jacobian mismatch"):
        properties.gradcheck_float64(_ctx(_wrong_gradient, "gradcheck_float64"), CASE)


def _one_nan(q, k, v, *, causal=False, scale=None):
    out, lse = attention(q, k, v, causal=causal, scale=scale)
    out = out.clone()
    out[0, 0, -1, 0] = math.nan
    return out, lse


def _one_inf(q, k, v, *, causal=False, scale=None):
    out, lse = attention(q, k, v, causal=causal, scale=scale)
    out = out.clone()
    out[0, 0, 1, 1] = -math.inf
    return out, lse


@pytest.mark.parametrize("forward, words", [
    (_one_nan, "1 of 6 out values are NaN, first at [0, 0, 2, 0] (expected "),
    (_one_inf, "1 of 6 out values are -inf, first at [0, 0, 1, 1] (expected "),
])
def test_nan_and_inf_are_named(forward, words):
    case = CASE.replace(dtype="float32")
    with pytest.raises(PropertyFailure) as info:
        properties.out_matches_reference(_ctx(forward, "out_matches_reference", case), case)
    assert words in str(info.value), str(info.value)


def _top_left(q, k, v, *, causal=False, scale=None):
    """Causal masks aligned top-left (key j visible to query i iff j <= i), declared as bottom-right."""
    acc = torch.float32
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(), -math.inf)
    return (torch.softmax(s, -1) @ v.to(acc)).to(q.dtype), torch.logsumexp(s, -1)


MASKED = CASE.replace(dtype="float32", spec=AttentionSpec(causal=True), len_q=5, len_k=3)


def test_a_top_left_kernel_is_told_its_rows_are_fully_masked():
    with pytest.raises(PropertyFailure) as info:
        properties.out_matches_reference(_ctx(_top_left, "out_matches_reference", MASKED), MASKED)
    message = str(info.value)
    assert re.search(r"row [01] sees no key: causal masks are aligned bottom-right", message), message
    assert "Nq=5 > Nk=3 leaves rows 0..1 without keys), so out should be 0 and lse -inf" in message
    assert "causal_alignment='top_left'" in message


def test_a_zero_tolerance_says_why():
    ctx = _ctx(attention, "score_shift_invariance")
    a = torch.tensor([1.0, 1.4240601])
    b = torch.tensor([1.0, 1.4240602])
    with pytest.raises(PropertyFailure) as info:
        assert_close(ctx, what="out after a shift", actual=a, expected=b, tolerance=torch.zeros(2))
    message = str(info.value)
    assert "(1.42406011 vs 1.42406023) exceeds the tolerance 0.000e+00" in message, message
    assert "infx" not in message
    assert "the tolerance there is 0: the rounding-error bounds of both results are 0" in message


def test_a_zero_tolerance_in_a_masked_row_names_the_row():
    ctx = _ctx(attention, "score_shift_invariance", MASKED)
    a = torch.zeros(1, 1, 5, 2)
    a[0, 0, 1, 0] = 0.5
    with pytest.raises(PropertyFailure) as info:
        assert_close(ctx, what="out after a shift", actual=a, expected=torch.zeros(1, 1, 5, 2),
                     tolerance=torch.zeros(1, 1, 5, 2))
    assert "row 1 sees no key: causal masks are aligned bottom-right" in str(info.value)


class _ZeroDk(torch.autograd.Function):
    """The correct forward and backward, but dK of one key zeroed."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, key):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.scale, ctx.key = causal, scale, key
        with torch.no_grad():
            return attention(q, k, v, causal=causal, scale=scale)[0]

    @staticmethod
    def backward(ctx, dout):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = attention(q, k, v, causal=ctx.causal, scale=ctx.scale)[0]
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        dk = dk.clone()
        dk[:, :, ctx.key] = 0
        return dq, dk, dv, None, None, None


@pytest.mark.parametrize(("len_q", "key"), [(1, -1), (3, 0)], ids=["last key, one row", "first key, rows without keys"])
def test_a_dk_error_is_not_read_as_a_query_row(len_q, key):
    """dK is indexed by key, not by query row: the message neither crashes on a key index past the rows nor
    blames the causal alignment of a row for a dK error."""
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=len_q, len_k=2, head_dim=4, dtype="float32",
                         spec=AttentionSpec(causal=True), magnitude="normal", seed=0, layout="contiguous")

    def zero_dk(q, k, v, *, causal=False, scale=None):
        return _ZeroDk.apply(q, k, v, causal, scale, key)

    with pytest.raises(PropertyFailure, match=r"dk differs from the float64 reference") as failed:
        properties.gradients_match_reference(_ctx(zero_dk, "gradients_match_reference", case), case)
    assert "sees no key" not in str(failed.value) and "causal_alignment" not in str(failed.value)


def test_a_key_no_row_sees_is_named_for_dk_and_dv_only():
    from verify.asserts import masked_row_note

    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=1, len_k=3, head_dim=4, dtype="float32",
                         spec=AttentionSpec(window_left=0, window_right=0))  # row 0 sees key 2 alone
    ctx = _ctx(attention, "gradients_match_reference", case)
    assert "key 0 is seen by no query row, so dK should be exactly 0" in masked_row_note(ctx, (0, 0, 0, 1), "dk")
    assert masked_row_note(ctx, (0, 0, 2, 1), "dv") is None  # key 2 is seen
    assert masked_row_note(ctx, (0, 0, 0, 1), None) is None  # not a result indexed by row or key


def _returns_early_without_keys(q, k, v, *, causal=False, scale=None):
    """Correct, and with no keys returns out = 0, lse = -inf without touching k and v (their .grad stays None)."""
    if k.shape[2] == 0:
        return (q * 0).to(q.dtype), torch.full(q.shape[:3], -math.inf, dtype=torch.float32 if q.dtype != torch.float64
                                               else torch.float64)
    return attention(q, k, v, causal=causal, scale=scale)


@pytest.mark.parametrize("prop", ["inputs_untouched", "gradients_match_reference"])
def test_a_kernel_that_returns_early_without_keys_passes(prop):
    """An empty k or v that the kernel never read has no gradient: that is the empty gradient, not a failure."""
    case = AttentionCase(batch=1, heads_q=2, heads_kv=2, len_q=3, len_k=0, head_dim=4, dtype="float32",
                         spec=AttentionSpec(causal=False), magnitude="normal", seed=0, layout="contiguous")
    properties.PROPERTIES[prop](_ctx(_returns_early_without_keys, prop, case), case)
