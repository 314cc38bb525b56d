"""Score modifications in the shipped PyTorch kernels: a logit softcap and ALiBi (flash_attn's keywords
``softcap`` and ``alibi_slopes``) in the blocked FA1/FA2 forwards, the blocked FA2 backward and the eager
adapter, against the float64 reference; the keywords' input checks; and the declarations that carry a
spec's modifications to a kernel (``softcap``, ``alibi``, :meth:`Implementation.kernel_keywords`)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from flashverify_kernels.pytorch import adapters, blocked
from flashverify_kernels.declaration import Implementation, ImplementationError
from flashverify_kernels.registry import load
from references.attention import attention
from references.spec import AttentionSpec

F64 = torch.float64
SLOPES = (1.0, 0.5, 0.25, 0.375)  # float32-exact, one per query head, all different (GQA: the query head's)
HQ, HKV = 4, 2

# (label, causal, window, softcap, alibi)
MODS = [
    ("softcap", False, (-1, -1), 1.0, False),
    ("softcap causal", True, (-1, -1), 1.0, False),
    ("alibi", False, (-1, -1), None, True),
    ("alibi causal", True, (-1, -1), None, True),
    ("both", False, (-1, -1), 2.0, True),
    ("both causal", True, (-1, -1), 2.0, True),
    ("both window", False, (2, 1), 1.5, True),
    ("both causal window", True, (3, -1), 0.75, True),
]
SHAPES = [(5, 7), (7, 5), (6, 6)]  # (Nq, Nk): causal with Nq > Nk has rows that see no key


def _spec(causal, window, softcap, alibi) -> AttentionSpec:
    return AttentionSpec(causal, window_left=window[0], window_right=window[1], softcap=softcap,
                         alibi_slopes=SLOPES if alibi else None)


def _keywords(causal, window, softcap, alibi, **extra) -> dict:
    kw = {"causal": causal, "window_size": window, "softcap": softcap or 0.0, **extra}
    if alibi:
        kw["alibi_slopes"] = torch.tensor(SLOPES, dtype=torch.float32)
    return kw


def _inputs(dtype, len_q, len_k, *, seed=0, b=2, d=8, magnitude=2.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, HQ, len_q, d, generator=g, dtype=F64) * magnitude).to(dtype)
    k = (torch.randn(b, HKV, len_k, d, generator=g, dtype=F64) * magnitude).to(dtype)
    v = torch.randn(b, HKV, len_k, d, generator=g, dtype=F64).to(dtype)
    dout = torch.randn(b, HQ, len_q, d, generator=g, dtype=F64).to(dtype)
    return q, k, v, dout


def _close(got, want, tol, what):
    """``|got - want| <= tol * max(1, max|want|)`` over the finite entries; -inf where ``want`` has it."""
    got, want = got.detach().to(F64), want.detach().to(F64)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{what}: -inf entries differ"
    finite = torch.isfinite(want)
    assert torch.isfinite(got[finite]).all(), f"{what}: non-finite values"
    if finite.any():
        err = (got[finite] - want[finite]).abs().max().item()
        ref = max(1.0, want[finite].abs().max().item())
        assert err <= tol * ref, f"{what}: max error {err:.3g} > {tol:g} * {ref:.3g}"


FORWARDS = {"fa2_blocked": blocked.fa2_forward_raw, "fa1_blocked": blocked.fa1_forward_raw}


# --------------------------------------------------------------------------- float64: tight agreement
@pytest.mark.parametrize("len_q,len_k", SHAPES)
@pytest.mark.parametrize("label,causal,window,softcap,alibi", MODS, ids=[m[0] for m in MODS])
@pytest.mark.parametrize("kernel", sorted(FORWARDS))
def test_blocked_forward_matches_the_reference_in_float64(kernel, label, causal, window, softcap, alibi,
                                                          len_q, len_k):
    q, k, v, _ = _inputs(F64, len_q, len_k)
    ref = attention(q, k, v, spec=_spec(causal, window, softcap, alibi))
    out, lse = FORWARDS[kernel](q, k, v, block_m=2, block_n=3, **_keywords(causal, window, softcap, alibi))
    _close(out, ref.out, 1e-10, f"{kernel} out")
    _close(lse, ref.lse, 1e-10, f"{kernel} lse")


@pytest.mark.parametrize("len_q,len_k", SHAPES)
@pytest.mark.parametrize("label,causal,window,softcap,alibi", MODS, ids=[m[0] for m in MODS])
def test_fa2_backward_matches_the_reference_in_float64(label, causal, window, softcap, alibi, len_q, len_k):
    q, k, v, dout = _inputs(F64, len_q, len_k)
    ref = attention(q, k, v, spec=_spec(causal, window, softcap, alibi), dout=dout)
    kw = _keywords(causal, window, softcap, alibi, block_m=3, block_n=2)
    out, lse = blocked.fa2_forward_raw(q, k, v, **kw)
    dq, dk, dv, delta = blocked.fa2_backward(q, k, v, out, lse, dout, **kw)
    for name, got, want in (("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv),
                            ("delta", delta, ref.delta)):
        _close(got, want, 1e-10, name)


AUTOGRAD_FORWARDS = {
    "fa2": functools.partial(blocked.fa2_forward, block_m=2, block_n=4),
    "fa1": functools.partial(blocked.fa1_forward, block_m=2, block_n=4),
    "eager": adapters.eager_forward,
}


@pytest.mark.parametrize("label,causal,window,softcap,alibi", MODS, ids=[m[0] for m in MODS])
@pytest.mark.parametrize("lengths", [(5, 7), (7, 5)], ids=["Nq<Nk", "Nq>Nk"])
@pytest.mark.parametrize("forward", list(AUTOGRAD_FORWARDS))
def test_autograd_through_the_forward_matches_the_reference(forward, lengths, label, causal, window, softcap,
                                                            alibi):
    q, k, v, dout = _inputs(F64, *lengths)
    ref = attention(q, k, v, spec=_spec(causal, window, softcap, alibi), dout=dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = AUTOGRAD_FORWARDS[forward](*leaves, **_keywords(causal, window, softcap, alibi))
    out.backward(dout)
    _close(out, ref.out, 1e-10, "out")
    _close(lse, ref.lse, 1e-10, "lse")
    for name, t, want in zip(("dq", "dk", "dv"), leaves, (ref.dq, ref.dk, ref.dv)):
        _close(t.grad, want, 1e-10, name)


def test_autograd_with_out_buffers_and_both_modifications():
    q, k, v, dout = _inputs(F64, 6, 6)
    spec = _spec(True, (-1, -1), 1.0, True)
    ref = attention(q, k, v, spec=spec, dout=dout)
    out_buf, lse_buf = torch.empty_like(q), torch.empty(q.shape[:3], dtype=F64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = blocked.fa2_forward(*leaves, block_m=4, block_n=4, out=out_buf, lse=lse_buf,
                                   **_keywords(True, (-1, -1), 1.0, True))
    out.backward(dout)
    _close(lse_buf, ref.lse, 1e-10, "lse buffer")
    for name, t, want in zip(("dq", "dk", "dv"), leaves, (ref.dq, ref.dk, ref.dv)):
        _close(t.grad, want, 1e-10, name)


def test_per_batch_slopes_give_each_batch_its_own_alibi():
    """``alibi_slopes`` of shape [B, Hq] (flash_attn's per-batch form): batch ``b`` computes the
    attention with the slopes of row ``b``."""
    q, k, v, dout = _inputs(F64, 5, 6)
    per_batch = (SLOPES, (0.0625, 2.0, 0.125, 0.5))
    slopes = torch.tensor(per_batch, dtype=torch.float32)
    kw = {"causal": True, "softcap": 1.5, "alibi_slopes": slopes, "block_m": 2, "block_n": 2}
    for forward in FORWARDS.values():
        out, lse = forward(q, k, v, **kw)
        dq, dk, dv, delta = blocked.fa2_backward(q, k, v, out, lse, dout, **kw)
        for i, row in enumerate(per_batch):
            one = slice(i, i + 1)
            ref = attention(q[one], k[one], v[one], spec=AttentionSpec(True, softcap=1.5, alibi_slopes=row),
                            dout=dout[one])
            for name, got, want in (("out", out, ref.out), ("lse", lse, ref.lse), ("dq", dq, ref.dq),
                                    ("dk", dk, ref.dk), ("dv", dv, ref.dv)):
                _close(got[one], want, 1e-10, f"batch {i} {name}")


def test_the_softcap_chain_rule_matters_and_fa2_backward_applies_it():
    """With softcap=1.0 and raw scores of size ~3, ``1 - tanh(s / c)^2`` is far from 1: a backward that
    drops it misses the reference by far more than the tolerance; fa2_backward agrees to ~1e-10."""
    q, k, v, dout = _inputs(F64, 6, 6, magnitude=1.0)
    q = q * (3.0 / (q @ expand(k).transpose(-1, -2) / math.sqrt(8)).abs().mean())  # scaled scores of size ~3
    spec = AttentionSpec(False, softcap=1.0)
    ref = attention(q, k, v, spec=spec, dout=dout)
    out, lse = blocked.fa2_forward_raw(q, k, v, softcap=1.0, block_m=4, block_n=4)
    dq, dk, _, _ = blocked.fa2_backward(q, k, v, out, lse, dout, softcap=1.0, block_m=4, block_n=4)
    _close(dq, ref.dq, 1e-10, "dq")
    _close(dk, ref.dk, 1e-10, "dk")
    # The same gradient without the chain rule, dense, in float64:
    scale = 1 / math.sqrt(8)
    raw = (q @ expand(k).transpose(-1, -2)) * scale
    assert raw.abs().mean() > 2.0
    p = torch.softmax(spec.modify(raw, 6, 6), dim=-1)
    ds = p * (dout @ expand(v).transpose(-1, -2) - (dout * ref.out).sum(-1, keepdim=True))
    dq_no_chain = (ds @ expand(k)) * scale
    assert (dq_no_chain - ref.dq).abs().max() > 1e-2 * max(1.0, ref.dq.abs().max().item())


def expand(t):
    return t.repeat_interleave(HQ // t.shape[1], dim=1)


# --------------------------------------------------------------------------- float32: loose sanity
@pytest.mark.parametrize("label,causal,window,softcap,alibi", MODS, ids=[m[0] for m in MODS])
@pytest.mark.parametrize("kernel", sorted(FORWARDS))
def test_float32_inputs_agree_with_the_float64_reference(kernel, label, causal, window, softcap, alibi):
    q, k, v, dout = _inputs(torch.float32, 7, 5)
    ref = attention(q, k, v, spec=_spec(causal, window, softcap, alibi), dout=dout)
    kw = _keywords(causal, window, softcap, alibi, block_m=3, block_n=2)
    out, lse = FORWARDS[kernel](q, k, v, **kw)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    _close(out, ref.out, 1e-4, "out")
    _close(lse, ref.lse, 1e-4, "lse")
    dq, dk, dv, delta = blocked.fa2_backward(q, k, v, out, lse, dout, **kw)
    for name, got, want in (("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv),
                            ("delta", delta, ref.delta)):
        _close(got, want, 1e-4, name)


# --------------------------------------------------------------------------- eager adapter
def test_eager_takes_per_head_slopes_only():
    q, k, v, _ = _inputs(F64, 3, 3)
    with pytest.raises(ValueError, match=r"eager: alibi_slopes\.shape=\(2, 4\).*per-head slopes only"):
        adapters.eager_forward(q, k, v, alibi_slopes=torch.ones(2, HQ))


# --------------------------------------------------------------------------- bad inputs
def _call_each(q, k, v, dout, **kw):
    """Every kernel entry point with the keywords ``kw`` (each must raise)."""
    out, lse = blocked.fa2_forward_raw(q, k, v)
    return [
        ("fa2_forward_raw", lambda: blocked.fa2_forward_raw(q, k, v, **kw)),
        ("fa1_forward_raw", lambda: blocked.fa1_forward_raw(q, k, v, **kw)),
        ("fa2_backward", lambda: blocked.fa2_backward(q, k, v, out, lse, dout, **kw)),
        ("fa2_forward", lambda: blocked.fa2_forward(q, k, v, **kw)),
        ("fa1_forward", lambda: blocked.fa1_forward(q, k, v, **kw)),
        ("eager_forward", lambda: adapters.eager_forward(q, k, v, **kw)),
    ]


@pytest.mark.parametrize("value", [-1.0, -0.0 - 1e-9, float("nan"), float("inf"), float("-inf"), "1.0", True,
                                   None, torch.tensor(1.0)],
                         ids=["negative", "tiny negative", "nan", "inf", "-inf", "str", "bool", "None", "tensor"])
def test_a_bad_softcap_is_refused_naming_it(value):
    q, k, v, dout = _inputs(F64, 3, 3)
    for name, call in _call_each(q, k, v, dout, softcap=value):
        with pytest.raises(ValueError, match=r"softcap=.*but should be a finite number >= 0 \(0\.0: no softcap"):
            call()


def test_softcap_zero_means_none():
    q, k, v, _ = _inputs(F64, 4, 4)
    plain = blocked.fa2_forward_raw(q, k, v, causal=True)
    for forward in FORWARDS.values():
        for got, want in zip(forward(q, k, v, causal=True, softcap=0.0), plain):
            _close(got, want, 1e-12, "softcap=0.0")
        for got, want in zip(forward(q, k, v, causal=True, softcap=0), plain):
            _close(got, want, 1e-12, "softcap=0")


BAD_SLOPES = {
    "list": ([1.0] * HQ, r"alibi_slopes is a list"),
    "float64": (torch.ones(HQ, dtype=F64), r"alibi_slopes\.dtype=float64"),
    "float16": (torch.ones(HQ, dtype=torch.float16), r"alibi_slopes\.dtype=float16"),
    "too few heads": (torch.ones(HQ - 1), r"alibi_slopes\.shape=\(3,\)"),
    "key/value heads": (torch.ones(HKV), r"alibi_slopes\.shape=\(2,\)"),
    "3-D": (torch.ones(2, HQ, 1), r"alibi_slopes\.shape=\(2, 4, 1\)"),
    "wrong batch": (torch.ones(3, HQ), r"alibi_slopes\.shape=\(3, 4\)"),
    "other device": (torch.ones(HQ, device="meta"), r"alibi_slopes is on meta"),
    "nan": (torch.tensor([1.0, float("nan"), 1.0, 1.0]), r"alibi_slopes holds non-finite values"),
}


@pytest.mark.parametrize("bad", sorted(BAD_SLOPES))
def test_bad_alibi_slopes_are_refused_naming_them(bad):
    value, given = BAD_SLOPES[bad]
    q, k, v, dout = _inputs(F64, 3, 3)
    allowed = r"float32 torch\.Tensor of shape \[Hq\]=\[4\] or \[B, Hq\]=\[2, 4\] on q's device cpu"
    for name, call in _call_each(q, k, v, dout, alibi_slopes=value):
        with pytest.raises(ValueError, match=given + ".*" + allowed):
            call()


# --------------------------------------------------------------------------- declarations
def test_a_declaration_without_the_modifications_refuses_them_and_the_report_says_so():
    impl = load("sdpa_math", device="cpu")
    assert not impl.softcap and not impl.alibi
    assert impl.unsupported_spec(AttentionSpec(softcap=1.0)) == "sdpa_math declares no logit softcap"
    assert impl.unsupported_spec(AttentionSpec(alibi_slopes=SLOPES)) == "sdpa_math declares no ALiBi"
    with pytest.raises(ImplementationError, match="sdpa_math declares no ALiBi"):
        impl.kernel_keywords(AttentionSpec(alibi_slopes=SLOPES), None, None, None)
    left_out = impl.not_covered()
    assert "logit softcap: not covered, declared unsupported" in left_out
    assert "ALiBi: not covered, declared unsupported" in left_out


@pytest.mark.parametrize("name", ["fa2_blocked", "fa1_blocked", "eager"])
def test_the_shipped_pytorch_kernels_declare_both(name):
    impl = load(name, device="cpu")
    assert impl.softcap and impl.alibi
    spec = AttentionSpec(True, softcap=1.0, alibi_slopes=SLOPES)
    assert impl.unsupported_spec(spec) is None
    assert not any(w.startswith(("logit softcap", "ALiBi")) for w in impl.not_covered())


def test_kernel_keywords_carries_the_modifications_as_flash_attn_keywords():
    impl = load("fa2_blocked", device="cpu")
    kw = impl.kernel_keywords(AttentionSpec(True, window_left=2, softcap=1.5, alibi_slopes=SLOPES), None, 4, 8,
                              device="cpu")
    slopes = kw.pop("alibi_slopes")
    assert kw == {"causal": True, "scale": None, "window_size": (2, -1), "softcap": 1.5, "block_m": 4, "block_n": 8}
    assert slopes.dtype == torch.float32 and slopes.device.type == "cpu" and slopes.tolist() == list(SLOPES)
    plain = impl.kernel_keywords(AttentionSpec(), None, None, None)
    assert "softcap" not in plain and "alibi_slopes" not in plain
    meta = impl.kernel_keywords(AttentionSpec(alibi_slopes=SLOPES), None, None, None, device="meta")
    assert meta["alibi_slopes"].device.type == "meta"


def test_a_slope_float32_cannot_hold_is_refused():
    impl = load("fa2_blocked", device="cpu")
    with pytest.raises(ImplementationError, match=r"fa2_blocked: alibi_slopes=\(0\.5, 0\.1, 0\.25, 1\.0\) holds "
                                                  r"\[0\.1\], which float32 cannot hold exactly"):
        impl.kernel_keywords(AttentionSpec(alibi_slopes=(0.5, 0.1, 0.25, 1.0)), None, None, None)


@pytest.mark.parametrize("field", ["softcap", "alibi"])
def test_the_declaration_fields_are_bools(field):
    with pytest.raises(ImplementationError, match=rf"x: {field}=1, but should be a bool"):
        Implementation(name="x", forward=lambda q, k, v, **kw: q, **{field: 1})


@pytest.mark.parametrize("name", ["fa2_blocked", "fa1_blocked", "eager"])
def test_call_and_call_backward_run_the_spec_on_the_inputs_device(name):
    impl = load(name, device="cpu")
    q, k, v, dout = _inputs(F64, 5, 7)
    spec = AttentionSpec(True, window_left=4, softcap=1.0, alibi_slopes=SLOPES)
    ref = attention(q, k, v, spec=spec, dout=dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = impl.call(*leaves, spec=spec, block_m=2, block_n=3)
    out.backward(dout)
    _close(out, ref.out, 1e-10, "out")
    _close(lse, ref.lse, 1e-10, "lse")
    for label, t, want in zip(("dq", "dk", "dv"), leaves, (ref.dq, ref.dk, ref.dv)):
        _close(t.grad, want, 1e-10, label)
    if impl.backward is not None:
        dq, dk, dv, delta = impl.call_backward(q, k, v, out.detach(), lse, dout, spec=spec, block_m=3, block_n=2)
        for label, got, want in (("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv),
                                 ("delta", delta, ref.delta)):
            _close(got, want, 1e-10, label)
