"""Output canaries: ``outputs_stay_in_bounds`` hands a forward ``out=``/``lse=`` views into buffers of NaN
canaries and checks that nothing outside the views changed, bit for bit. Kernels that write one row past
the end, one head-dim column too many, one LSE row before the start, a plain NaN over a canary, or that
ignore the buffers fail with the position named; the shipped kernels pass; bad buffers are refused with
clear errors."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashverify_kernels.pytorch import blocked
from flashverify_kernels.registry import Implementation, ImplementationError, registry
from references.spec import AttentionSpec
from strategies.cases import AttentionCase
from verify.context import Context, PropertyFailure
from verify.properties import NotForThisKernel, outputs_stay_in_bounds

PROP = "outputs_stay_in_bounds"
CASE = AttentionCase(batch=1, heads_q=2, heads_kv=1, len_q=5, len_k=7, head_dim=8, dtype="float16",
                     spec=AttentionSpec(causal=True))
# Seeds drawing both buffer layouts ([B, H, N, D] storage and transposed [B, N, H, D] storage).
SEEDS = (0, 1, 2, 3, 4, 5)


def _result(q, k, v, causal, scale):
    """A correct result computed elsewhere, for the broken fixtures to write (or not) into the buffers."""
    return blocked.fa2_forward_raw(q, k, v, causal=causal, scale=scale)


def _row_past_the_end(q, k, v, *, causal=False, scale=None, out=None, lse=None):
    """Broken: writes one row past the end of out (through out's own strides)."""
    o, l = _result(q, k, v, causal, scale)
    if out is None:
        return o, l
    b, h, n, d = out.shape
    wide = torch.as_strided(out, (b, h, n + 1, d), out.stride(), out.storage_offset())
    wide[:, :, :n] = o
    wide[:, :, n] = o[:, :, n - 1]
    if lse is not None:
        lse.copy_(l)
    return out, lse if lse is not None else l


def _column_past_the_end(q, k, v, *, causal=False, scale=None, out=None, lse=None):
    """Broken: writes head-dim column D (a padded tile stored without the column mask)."""
    o, l = _result(q, k, v, causal, scale)
    if out is None:
        return o, l
    b, h, n, d = out.shape
    wide = torch.as_strided(out, (b, h, n, d + 1), out.stride(), out.storage_offset())
    wide[..., :d] = o
    wide[..., d] = 0.0
    if lse is not None:
        lse.copy_(l)
    return out, lse if lse is not None else l


def _lse_row_before_the_start(q, k, v, *, causal=False, scale=None, out=None, lse=None):
    """Broken: an off-by-one LSE store, one row early."""
    o, l = _result(q, k, v, causal, scale)
    if out is not None:
        out.copy_(o)
    if lse is None:
        return out if out is not None else o, l
    b, h, n = lse.shape
    early = torch.as_strided(lse, (b, h, n), lse.stride(), lse.storage_offset() - lse.stride(2))
    early.copy_(l)
    return out if out is not None else o, lse


def _plain_nan_past_the_end(q, k, v, *, causal=False, scale=None, out=None, lse=None):
    """Broken: writes a NaN (the standard one) one row past the end: only a bitwise check sees it."""
    o, l = _result(q, k, v, causal, scale)
    if out is None:
        return o, l
    b, h, n, d = out.shape
    out.copy_(o)
    torch.as_strided(out, (b, h, n + 1, d), out.stride(), out.storage_offset())[:, :, n] = float("nan")
    if lse is not None:
        lse.copy_(l)
    return out, lse if lse is not None else l


def _ignores_buffers(q, k, v, *, causal=False, scale=None, out=None, lse=None):
    """Broken: accepts out=/lse= and returns fresh tensors, never writing the buffers."""
    return _result(q, k, v, causal, scale)


def _returns_something_else(q, k, v, *, causal=False, scale=None, out=None, lse=None):
    """Broken: writes the buffers, then returns other values."""
    o, l = _result(q, k, v, causal, scale)
    if out is not None:
        out.copy_(o)
    if lse is not None:
        lse.copy_(l)
    return o * 2, l


def _declare(fn, **changes):
    return Implementation(name=fn.__name__.strip("_"), forward=fn, gqa=True, autograd=False, out_buffers=True,
                          **changes)


def _check(impl, case=CASE):
    records = []
    ctx = Context(impl=impl, prop=PROP, case=case, record=records.append)
    outputs_stay_in_bounds(ctx, case)
    return records


def _failure(impl, seed):
    with pytest.raises(PropertyFailure) as info:
        _check(impl, CASE.replace(seed=seed))
    return str(info.value)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_row_past_the_end_fails_and_is_named(seed):
    msg = _failure(_declare(_row_past_the_end), seed)
    assert "the kernel wrote outside the given out= view" in msg, msg
    assert "row 5 of 5 (past the end)" in msg, msg
    assert f"replay: python -m verify.replay --impl row_past_the_end --property {PROP}" in msg, msg


@pytest.mark.parametrize("seed", SEEDS)
def test_a_head_dim_column_past_the_end_fails_and_is_named(seed):
    msg = _failure(_declare(_column_past_the_end), seed)
    assert "head-dim column 8 of 8 (past the end)" in msg, msg
    assert "became 0.0 (0x0000)" in msg, msg


@pytest.mark.parametrize("seed", SEEDS)
def test_an_lse_row_before_the_start_fails_and_is_named(seed):
    msg = _failure(_declare(_lse_row_before_the_start), seed)
    assert "lse: the kernel wrote outside the given lse= view" in msg, msg
    assert "row -1 of 5 (before the start)" in msg, msg


def test_a_plain_nan_over_a_canary_is_seen_bitwise():
    msg = _failure(_declare(_plain_nan_past_the_end), 0)
    assert "row 5 of 5 (past the end)" in msg, msg
    assert re.search(r"the canary nan \(0x7e5a\) became nan \(0x7e00\)", msg), msg


def test_a_kernel_ignoring_the_buffers_fails():
    msg = _failure(_declare(_ignores_buffers), 0)
    assert "were never written (they still hold the canary)" in msg, msg


def test_returning_other_values_than_the_buffers_hold_fails():
    msg = _failure(_declare(_returns_something_else), 0)
    assert "the returned out is not the given out= view and holds other values" in msg, msg


CASES = [CASE.replace(seed=s) for s in SEEDS] + [
    AttentionCase(batch=2, heads_q=3, heads_kv=3, len_q=9, len_k=4, head_dim=5, dtype="float32",
                  spec=AttentionSpec(causal=True),
                  block_m=4, block_n=3, layout="bnhd", seed=7),
    AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=1, len_k=3, head_dim=3, dtype="float64",
                  spec=AttentionSpec(causal=False),
                  layout="padded", seed=8),
    AttentionCase(batch=1, heads_q=4, heads_kv=2, len_q=6, len_k=6, head_dim=4, dtype="bfloat16",
                  spec=AttentionSpec(causal=False),
                  block_m=2, block_n=5, seed=9),
]


@pytest.mark.parametrize("name", ["fa2_blocked", "fa1_blocked"])
def test_shipped_blocked_kernels_stay_in_bounds(name):
    impl = registry()[name]
    assert impl.out_buffers
    for case in CASES:
        _check(impl, case)


def test_undeclared_implementations_are_skipped_with_the_reason():
    with pytest.raises(NotForThisKernel, match="eager declares no out_buffers"):
        _check(registry()["eager"])
    with pytest.raises(ImplementationError, match="declares no out_buffers"):
        t = CASE.build()
        registry()["eager"].call(t.q, t.k, t.v, spec=CASE.spec, out=torch.empty_like(t.q))


def test_a_nondeterministic_declaration_is_compared_within_the_bounds():
    # Not declared deterministic: the buffers' values are held to the bounds, not to the bits.
    _check(dataclasses.replace(registry()["fa2_blocked"], name="fa2_nondet", deterministic=False))


# ------------------------------------------------------------------------------ the kernels' own checks
def _forwards():
    forwards = {"fa2_blocked": blocked.fa2_forward, "fa1_blocked": blocked.fa1_forward,
                "fa2_blocked raw": blocked.fa2_forward_raw}
    try:
        from flashverify_kernels.triton import attention as ta
    except ImportError:
        return forwards
    if "cpu" in ta.DEVICES:  # the interpreter (TRITON_INTERPRET=1 set before triton was imported)
        forwards.update({"triton_fa2": ta.fa2_forward, "triton_fa1": ta.fa1_forward})
    return forwards


FORWARDS = _forwards()


def _qkv(dtype=torch.float32, d=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, d, generator=g, dtype=dtype)
    k = torch.randn(1, 1, 7, d, generator=g, dtype=dtype)
    return q, k, torch.randn(1, 1, 7, d, generator=g, dtype=dtype)


@pytest.mark.parametrize("name", list(FORWARDS))
@pytest.mark.parametrize("given, error, words", [
    ({"out": torch.empty(1, 2, 5, 15)}, ValueError, "out.shape=(1, 2, 5, 15), but should be (1, 2, 5, 16)"),
    ({"out": torch.empty(1, 2, 5, 16, dtype=torch.float16)}, ValueError,
     "out.dtype=float16, but should be float32 for float32 inputs"),
    ({"lse": torch.empty(1, 2, 6)}, ValueError, "lse.shape=(1, 2, 6), but should be (1, 2, 5)"),
    ({"lse": torch.empty(1, 2, 5, dtype=torch.float16)}, ValueError, "lse.dtype=float16, but should be float32"),
    ({"out": [[0.0]]}, TypeError, "out= is a list, but should be a torch.Tensor or None"),
    ({"out": torch.empty(1, 2, 1, 16).expand(1, 2, 5, 16)}, ValueError, "out has stride 0 in dim 2 (size 5)"),
    ({"out": torch.empty(1, 2, 5, 16, requires_grad=True)}, ValueError, "out requires grad"),
])
def test_bad_buffers_are_refused_with_clear_errors(name, given, error, words):
    q, k, v = _qkv()
    with pytest.raises(error, match=re.escape(words)) as info:
        FORWARDS[name](q, k, v, causal=True, **given)
    assert name.split()[0] in str(info.value)


@pytest.mark.parametrize("name", list(FORWARDS))
def test_a_buffer_overlapping_an_input_is_refused(name):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="out overlaps q in memory"):
        FORWARDS[name](q, k, v, causal=False, out=q)


@pytest.mark.parametrize("name", [n for n in FORWARDS if "raw" not in n])
def test_gradients_flow_through_a_given_out(name):
    """out= views (transposed storage, padded) give the same out, lse and gradients as a normal call."""
    q, k, v = (x.requires_grad_(True) for x in _qkv())
    fwd = FORWARDS[name]
    out0, lse0 = fwd(q, k, v, causal=True)
    dout = torch.randn_like(out0)
    grads0 = torch.autograd.grad(out0, (q, k, v), dout)
    buf = torch.full((1, 7, 3, 17), float("nan"))   # [B, N, H, D] storage with padding
    lbuf = torch.full((1, 8, 2), float("nan"))
    out_view, lse_view = buf[:, 1:6, :2, :16].transpose(1, 2), lbuf[:, 2:7].transpose(1, 2)
    out1, lse1 = fwd(q, k, v, causal=True, out=out_view, lse=lse_view)
    assert out1.data_ptr() == out_view.data_ptr() and lse1 is lse_view
    assert torch.equal(out1, out0) and torch.equal(lse1, lse0)
    grads1 = torch.autograd.grad(out1, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert int(torch.isnan(buf).sum()) == buf.numel() - out0.numel()


def test_the_seeds_draw_both_buffer_layouts():
    """Some of SEEDS put out in [B, H, N, D] storage, some in transposed [B, N, H, D] storage."""
    transposed = set()
    for seed in SEEDS:
        strides = re.search(r"view \(1, 2, 5, 8\) with strides \((\d+), (\d+), (\d+), (\d+)\)",
                            _failure(_declare(_row_past_the_end), seed))
        transposed.add(int(strides.group(2)) < int(strides.group(3)))
    assert transposed == {False, True}
