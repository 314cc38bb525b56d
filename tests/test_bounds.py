"""The rounding-error bounds of references.bounds: correct kernels stay under them, broken ones do not.

Correct kernels: the blocked FA2 and FA1 forwards, the blocked FA2 backward (fed by either forward) and the
eager baseline (forward and backward), in float16, bfloat16, float32 and float64, on random shapes and
block sizes and on every adversarial magnitude class the strategies must reach. Each check is
``max(err / bound) <= 1`` (references.metrics.max_ratio). Broken computations written here (float16
accumulation, a forgotten rescale, a base-2 LSE, a dK without the scale, ...) must exceed their bound.
The last test prints the typical ratio per dtype and operation and asserts the bound is not absurdly loose.
"""

from __future__ import annotations

import collections
import math
import statistics

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flashverify_kernels.pytorch.blocked import fa1_forward_raw, fa2_backward, fa2_forward_raw
from references import attention as ref_attention
from references import baseline, bounds
from references.metrics import abs_error, max_ratio
from references.spec import AttentionSpec

F64 = torch.float64
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BLOCKS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 32, 64)
HEAD_DIMS = (1, 3, 5, 8, 16, 24, 33, 40, 64)
KINDS = ("normal", "large_logits", "outliers", "all_negative", "ties", "dominant", "v_offset", "v_wide",
         "subnormal", "tiny", "spread")
# Python-loop iterations of one blocked kernel call (Q tiles x KV tiles) allowed per example.
MAX_TILES = 240
OPS = ("out", "lse", "dq", "dk", "dv", "delta")

# (dtype name, implementation, op) -> max err/bound of each example; read by the summary test.


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- inputs -----------------------------------------------------------------------------------------

def make_inputs(*, seed: int, kind: str, dtype: torch.dtype, batch: int, heads_q: int, heads_kv: int,
                len_q: int, len_k: int, head_dim: int, head_dim_v: int | None = None):
    """``q, k, v, dout`` in ``dtype`` from a seed and a magnitude class (``head_dim_v``: v's and dout's head
    dim, when not ``head_dim``):

    normal: N(0, 1); large_logits: q, k scaled so |scale q.k| reaches 1e3..1e4; outliers: 0.1% of the
    entries (at least one) 100x larger; all_negative: every score negative; ties: duplicated keys;
    dominant: one key far above the rest in every row; v_offset: v = 1000 + N(0, 1); v_wide: v scaled by
    10^U(-4, 4) per entry; subnormal: q, k, v, dout near float16's subnormal range; tiny: v and dout
    at 8x the smallest normal of ``dtype`` and q, k at its square root, so that products underflow
    in the accumulator (float32, bfloat16); spread: scores
    with standard deviation ~9, so many probabilities fall below float16's normal range.
    """
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    q = randn(batch, heads_q, len_q, head_dim)
    k = randn(batch, heads_kv, len_k, head_dim)
    dv = head_dim if head_dim_v is None else head_dim_v
    v = randn(batch, heads_kv, len_k, dv)
    dout = randn(batch, heads_q, len_q, dv)
    if kind == "large_logits":
        a = 10 ** (1 + float(torch.rand(1, generator=g)))
        q, k = q * a, k * a
    elif kind == "outliers":
        for t in (q, k, v):
            flat = t.view(-1)
            flat[torch.randint(flat.numel(), (max(1, flat.numel() // 1000),), generator=g)] *= 100
    elif kind == "all_negative":
        q, k = q.abs() * 2, -k.abs() * 2
    elif kind == "ties" and len_k > 1:
        k = k[:, :, torch.randint(max(1, len_k // 3), (len_k,), generator=g)]
    elif kind == "dominant":
        q = q.abs()
        k[:, :, int(torch.randint(len_k, (1,), generator=g))] = 8.0
    elif kind == "v_offset":
        v = 1000 + v
    elif kind == "v_wide":
        v = v * 10 ** (8 * torch.rand(v.shape, generator=g, dtype=F64) - 4)
    elif kind == "subnormal":
        q, k, v, dout = q * 2e-5, k * 2e-5, v * 2e-5, dout * 3e-5
    elif kind == "spread":
        q, k = q * 3, k * 3
    elif kind == "tiny":
        tiny = 8 * torch.finfo(dtype).tiny
        q, k, v, dout = q * math.sqrt(tiny), k * math.sqrt(tiny), v * tiny, dout * tiny
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def _tiles(len_q, len_k, block_m, block_n):
    return -(-len_q // block_m) * -(-len_k // block_n)


@st.composite
def bound_cases(draw, *, max_len: int = 64):
    """Return a strategy for attention cases for the bound checks (a dict): shapes first (Nq, Nk up to
    ``max_len``, GQA groups up to 3, head dims from HEAD_DIMS), then block sizes with at most
    MAX_TILES tiles, the causal flag, the magnitude class and a seed."""
    heads_kv = draw(st.integers(1, 2), label="heads_kv")
    len_q = draw(st.integers(1, max_len), label="len_q")
    len_k = draw(st.integers(1, max_len), label="len_k")
    block_m = draw(st.sampled_from(BLOCKS), label="block_m")
    block_n = draw(st.sampled_from(BLOCKS).filter(lambda bn: _tiles(len_q, len_k, block_m, bn) <= MAX_TILES),
                   label="block_n")
    return dict(
        batch=draw(st.integers(1, 2), label="batch"),
        heads_kv=heads_kv,
        heads_q=heads_kv * draw(st.integers(1, 3), label="group"),
        len_q=len_q,
        len_k=len_k,
        head_dim=draw(st.sampled_from(HEAD_DIMS), label="head_dim"),
        block_m=block_m,
        block_n=block_n,
        causal=draw(st.booleans(), label="causal"),
        kind=draw(st.sampled_from(KINDS), label="kind"),
        seed=draw(st.integers(0, 2 ** 31 - 1), label="seed"),
    )


# --- running the correct kernels --------------------------------------------------------------------

def correct_kernel_ratios(q, k, v, dout, *, causal: bool, block_m: int, block_n: int):
    """``{(implementation, op): max err/bound}`` for the blocked FA2/FA1 and the eager baseline."""
    dtype = q.dtype
    ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=causal), dout=dout)
    out_bound, lse_bound = bounds.forward_bounds(ref, q, k, v, dtype=dtype)
    ratios = {}
    forwards = {
        "fa2": fa2_forward_raw(q, k, v, causal=causal, block_m=block_m, block_n=block_n),
        "fa1": fa1_forward_raw(q, k, v, causal=causal, block_m=block_m, block_n=block_n),
        "eager": baseline.forward(q, k, v, spec=AttentionSpec(causal=causal)),
    }
    for impl, (out, lse) in forwards.items():
        ratios[impl, "out"] = max_ratio(abs_error(out, ref.out), out_bound)
        ratios[impl, "lse"] = max_ratio(abs_error(lse, ref.lse), lse_bound)
        if impl == "eager":
            grads = baseline.backward(q, k, v, dout, spec=AttentionSpec(causal=causal), out=out)
        else:  # the blocked backward, fed by this forward's own output and LSE
            grads = fa2_backward(q, k, v, out, lse, dout, causal=causal, block_m=block_m, block_n=block_n)
        grad_bounds = bounds.backward_bounds(ref, q, k, v, dtype=dtype, out=out)
        for op, got, want, bound in zip(("dq", "dk", "dv", "delta"), grads,
                                        (ref.dq, ref.dk, ref.dv, ref.delta), grad_bounds):
            ratios[impl, op] = max_ratio(abs_error(got, want), bound)
    return ratios


def assert_within_bounds(ratios, *, dtype, case: str):
    __tracebackhide__ = True
    bad = {key: r for key, r in ratios.items() if not r[0] <= 1.0}
    if bad:
        lines = [f"{impl}.{op}: max err/bound = {r:.3g} at {idx}, but should be <= 1"
                 for (impl, op), (r, idx) in bad.items()]
        raise AssertionError(f"{_name(dtype)} [{case}]:\n  " + "\n  ".join(lines))


# --- correct kernels never exceed the bound --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@settings(max_examples=150, deadline=None)
@given(case=bound_cases())
def test_correct_kernels_within_bound(dtype, case):
    shape = {k: case[k] for k in ("batch", "heads_q", "heads_kv", "len_q", "len_k", "head_dim")}
    q, k, v, dout = make_inputs(seed=case["seed"], kind=case["kind"], dtype=dtype, **shape)
    ratios = correct_kernel_ratios(q, k, v, dout, causal=case["causal"], block_m=case["block_m"],
                                   block_n=case["block_n"])
    assert_within_bounds(ratios, dtype=dtype, case=str(case))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@settings(max_examples=40, deadline=None)
@given(case=bound_cases(max_len=32), head_dim_v=st.sampled_from(HEAD_DIMS))
def test_correct_kernels_within_bound_with_a_value_head_dim_of_its_own(dtype, case, head_dim_v):
    """v, out and dout ``head_dim_v`` wide, q and k ``head_dim``: the dP and Delta sums run over v's head dim."""
    shape = {k: case[k] for k in ("batch", "heads_q", "heads_kv", "len_q", "len_k", "head_dim")}
    q, k, v, dout = make_inputs(seed=case["seed"], kind=case["kind"], dtype=dtype, head_dim_v=head_dim_v, **shape)
    ratios = correct_kernel_ratios(q, k, v, dout, causal=case["causal"], block_m=case["block_m"],
                                   block_n=case["block_n"])
    assert_within_bounds(ratios, dtype=dtype, case=f"{case}, Dv={head_dim_v}")


# Every magnitude class at least once per dtype, with shapes that stress it: causal Nq > Nk (fully masked
# rows) and Nq < Nk, GQA, head dims that are not powers of two, blocks of 1 and one off a block.
ADVERSARIAL_SHAPES = {
    "normal": dict(batch=1, heads_q=4, heads_kv=2, len_q=33, len_k=17, head_dim=24, block_m=16, block_n=1,
                   causal=True),
    "large_logits": dict(batch=1, heads_q=2, heads_kv=1, len_q=20, len_k=40, head_dim=33, block_m=8, block_n=5,
                         causal=True),
    "outliers": dict(batch=2, heads_q=3, heads_kv=1, len_q=40, len_k=40, head_dim=40, block_m=13, block_n=7,
                     causal=False),
    "all_negative": dict(batch=1, heads_q=2, heads_kv=2, len_q=9, len_k=31, head_dim=5, block_m=4, block_n=3,
                         causal=True),
    "ties": dict(batch=1, heads_q=2, heads_kv=1, len_q=17, len_k=33, head_dim=16, block_m=16, block_n=2,
                 causal=False),
    "dominant": dict(batch=1, heads_q=3, heads_kv=3, len_q=24, len_k=24, head_dim=3, block_m=5, block_n=4,
                     causal=True),
    "v_offset": dict(batch=1, heads_q=4, heads_kv=1, len_q=31, len_k=63, head_dim=8, block_m=32, block_n=16,
                     causal=False),
    "v_wide": dict(batch=1, heads_q=2, heads_kv=1, len_q=25, len_k=40, head_dim=64, block_m=64, block_n=8,
                   causal=True),
    "subnormal": dict(batch=1, heads_q=2, heads_kv=2, len_q=40, len_k=36, head_dim=33, block_m=7, block_n=13,
                      causal=False),
    "spread": dict(batch=1, heads_q=2, heads_kv=1, len_q=12, len_k=64, head_dim=16, block_m=4, block_n=64,
                   causal=False),
    "tiny": dict(batch=1, heads_q=2, heads_kv=1, len_q=3, len_k=9, head_dim=5, block_m=1, block_n=2,
                 causal=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_correct_kernels_within_bound_adversarial(kind, dtype):
    case = dict(ADVERSARIAL_SHAPES[kind])
    causal, block_m, block_n = case.pop("causal"), case.pop("block_m"), case.pop("block_n")
    for seed in (0, 1):
        q, k, v, dout = make_inputs(seed=seed, kind=kind, dtype=dtype, **case)
        ratios = correct_kernel_ratios(q, k, v, dout, causal=causal, block_m=block_m, block_n=block_n)
        assert_within_bounds(ratios, dtype=dtype, case=f"{kind}, seed={seed}, {case}")


def test_fully_masked_rows_and_unseen_keys_have_zero_bound():
    q, k, v, dout = make_inputs(seed=5, kind="normal", dtype=torch.float16, batch=1, heads_q=2, heads_kv=1,
                                len_q=7, len_k=4, head_dim=8)
    ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=True), dout=dout)
    out_b, lse_b = bounds.forward_bounds(ref, q, k, v, dtype=torch.float16)
    out, _ = fa2_forward_raw(q, k, v, causal=True)
    dq_b, dk_b, dv_b, delta_b = bounds.backward_bounds(ref, q, k, v, dtype=torch.float16, out=out)
    empty = ~ref.rows_with_keys  # rows 0..2 see no key (bottom-right, Nq - Nk = 3)
    assert empty.tolist() == [True] * 3 + [False] * 4
    for name, b in (("out", out_b), ("lse", lse_b[..., None]), ("dq", dq_b), ("delta", delta_b[..., None])):
        assert torch.all(b[:, :, empty] == 0), f"{name} bound should be 0 on fully masked rows"
        assert torch.all(b[:, :, ~empty] > 0), f"{name} bound should be > 0 on rows with keys"
    assert torch.all(dk_b > 0) and torch.all(dv_b > 0)
    # top-left alignment with Nk > Nq: keys 3.. are seen by no row, their dK and dV are exactly 0.
    q2, k2, v2, do2 = make_inputs(seed=6, kind="normal", dtype=torch.float32, batch=1, heads_q=1, heads_kv=1,
                                  len_q=3, len_k=6, head_dim=4)
    ref2 = ref_attention.attention(q2, k2, v2, spec=AttentionSpec(causal=True, alignment="top_left"), dout=do2)
    _, dk2, dv2, _ = bounds.backward_bounds(ref2, q2, k2, v2, dtype=torch.float32, out=ref2.out.float())
    assert torch.all(dk2[:, :, 3:] == 0) and torch.all(dv2[:, :, 3:] == 0)
    assert torch.all(dk2[:, :, :3] > 0) and torch.all(dv2[:, :, :3] > 0)


def test_bounds_are_finite_and_nonnegative_with_nan_at_unseen_keys():
    q, k, v, dout = make_inputs(seed=8, kind="normal", dtype=torch.bfloat16, batch=1, heads_q=2, heads_kv=1,
                                len_q=3, len_k=6, head_dim=4)
    k[:, :, 4:], v[:, :, 4:] = math.nan, math.inf  # seen by no row under top-left alignment
    ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=True, alignment="top_left"), dout=dout)
    out_b, lse_b = bounds.forward_bounds(ref, q, k, v, dtype=torch.bfloat16)
    for b in (out_b, lse_b):
        assert torch.all(torch.isfinite(b)) and torch.all(b >= 0)


def test_cheap_centred_term_is_valid_and_not_tighter(monkeypatch):
    """Above EXACT_CENTRED_LIMIT the centred term is bounded with matmuls; that bound is >= the exact sum."""
    q, k, v, dout = make_inputs(seed=2, kind="v_offset", dtype=torch.float32, batch=1, heads_q=2, heads_kv=1,
                                len_q=24, len_k=40, head_dim=16)
    ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=True), dout=dout)
    exact_out, exact_lse = bounds.forward_bounds(ref, q, k, v, dtype=torch.float32)
    monkeypatch.setattr(bounds, "EXACT_CENTRED_LIMIT", 0)
    cheap_out, cheap_lse = bounds.forward_bounds(ref, q, k, v, dtype=torch.float32)
    assert torch.equal(cheap_lse, exact_lse)
    assert torch.all(cheap_out >= exact_out)
    out, _ = fa2_forward_raw(q, k, v, causal=True, block_m=8, block_n=1)
    assert max_ratio(abs_error(out, ref.out), cheap_out)[0] <= 1


def test_truncating_dots_model_only_widens_the_bounds():
    q, k, v, dout = make_inputs(seed=4, kind="normal", dtype=torch.float16, batch=1, heads_q=2, heads_kv=1,
                                len_q=9, len_k=12, head_dim=16)
    ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=True), dout=dout)
    plain = bounds.forward_bounds(ref, q, k, v, dtype=torch.float16)
    wide = bounds.forward_bounds(ref, q, k, v, dtype=torch.float16,
                                 model=bounds.kernel_model(torch.float16, truncating_dots=True))
    for a, b in zip(plain, wide):
        assert torch.all(b >= a) and torch.any(b > a)
    out, _ = fa2_forward_raw(q, k, v, causal=True)
    plain_b = bounds.backward_bounds(ref, q, k, v, dtype=torch.float16, out=out)
    wide_b = bounds.backward_bounds(ref, q, k, v, dtype=torch.float16, out=out,
                                    model=bounds.kernel_model(torch.float16, truncating_dots=True))
    for a, b in zip(plain_b, wide_b):
        assert torch.all(b >= a)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@settings(max_examples=40, deadline=None)
@given(case=bound_cases())
def test_autograd_eager_within_its_model(dtype, case):
    """Autograd through the eager forward follows the autograd_eager variant (bounds.py, section 11)."""
    shape = {k: case[k] for k in ("batch", "heads_q", "heads_kv", "len_q", "len_k", "head_dim")}
    q, k, v, dout = make_inputs(seed=case["seed"], kind=case["kind"], dtype=dtype, **shape)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = baseline.forward(*leaves, spec=AttentionSpec(causal=case["causal"]))
    out.backward(dout)
    grads = [t.grad for t in leaves]
    # float16 autograd overflows when |dO . v| passes 65504 (v_wide): a real failure, not the bound's.
    assume(all(torch.isfinite(g).all() for g in grads))
    ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=case["causal"]), dout=dout)
    model = bounds.kernel_model(dtype, autograd_eager=True)
    grad_bounds = bounds.backward_bounds(ref, q, k, v, dtype=dtype, out=out.detach(), model=model)
    ratios = {("autograd_eager", op): max_ratio(abs_error(got, want), bound)
              for op, got, want, bound in zip(("dq", "dk", "dv"), grads, (ref.dq, ref.dk, ref.dv), grad_bounds)}
    assert_within_bounds(ratios, dtype=dtype, case=str(case))


def test_backward_bounds_need_the_backward():
    q, k, v, _ = make_inputs(seed=1, kind="normal", dtype=torch.float32, batch=1, heads_q=1, heads_kv=1,
                             len_q=2, len_k=2, head_dim=2)
    ref = ref_attention.attention(q, k, v)
    with pytest.raises(ValueError, match="dout"):
        bounds.backward_bounds(ref, q, k, v, dtype=torch.float32, out=q)


# --- broken computations exceed the bound -----------------------------------------------------------------

def fp16_accumulated_forward(q, k, v):
    """Broken: FA2 with block_n = 1 whose P @ V accumulator is float16 (l stays float32)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    m = s.amax(-1)
    p = torch.exp(s - m[..., None])
    l = p.sum(-1)
    acc = torch.zeros(q.shape, dtype=torch.float16)
    for j in range(k.shape[2]):
        acc = acc + p[..., j:j + 1].half() * v[:, :, j:j + 1]  # float16 + float16 -> float16
    return (acc.float() / l[..., None]).half(), m + torch.log(l)


def forgotten_rescale_forward(q, k, v, *, block_n: int):
    """Broken: FA2 that rescales l but forgets to rescale acc when the running max grows."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    acc_dtype = torch.float64 if q.dtype == F64 else torch.float32
    m = torch.full(q.shape[:3], -math.inf, dtype=acc_dtype)
    l = torch.zeros(q.shape[:3], dtype=acc_dtype)
    acc = torch.zeros(q.shape, dtype=acc_dtype)
    for n0 in range(0, k.shape[2], block_n):
        s = (q.to(acc_dtype) @ k[:, :, n0:n0 + block_n].to(acc_dtype).transpose(-1, -2)) * scale
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc + p.to(q.dtype).to(acc_dtype) @ v[:, :, n0:n0 + block_n].to(acc_dtype)  # missing alpha *
        m = m_new
    return (acc / l[..., None]).to(q.dtype), m + torch.log(l)


def _broken_inputs(dtype, *, len_k=64, kind="normal", seed=3, head_dim=16, len_q=16):
    return make_inputs(seed=seed, kind=kind, dtype=dtype, batch=1, heads_q=2, heads_kv=1, len_q=len_q,
                       len_k=len_k, head_dim=head_dim)


def test_broken_float16_accumulation_exceeds_bound():
    q, k, v, _ = _broken_inputs(torch.float16, len_k=4096, len_q=2, head_dim=8)
    v = (1 + 0.1 * v.float()).half()  # a positive mean: the float16 accumulator grows past its spacing
    ref = ref_attention.attention(q, k, v)
    out_b, _ = bounds.forward_bounds(ref, q, k, v, dtype=torch.float16)
    out, _ = fp16_accumulated_forward(q, k, v)
    assert max_ratio(abs_error(out, ref.out), out_b)[0] > 1
    good, _ = fa2_forward_raw(q, k, v, block_n=1)  # same loop, float32 accumulator: within the bound
    assert max_ratio(abs_error(good, ref.out), out_b)[0] <= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_broken_forgotten_rescale_exceeds_bound(dtype):
    q, k, v, _ = _broken_inputs(dtype)
    ref = ref_attention.attention(q, k, v)
    out_b, lse_b = bounds.forward_bounds(ref, q, k, v, dtype=dtype)
    out, lse = forgotten_rescale_forward(q, k, v, block_n=8)
    assert max_ratio(abs_error(out, ref.out), out_b)[0] > 1
    assert max_ratio(abs_error(lse, ref.lse), lse_b)[0] <= 1  # l is rescaled: only the output is wrong


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_broken_lse_exceeds_bound(dtype):
    q, k, v, _ = _broken_inputs(dtype)
    ref = ref_attention.attention(q, k, v)
    _, lse_b = bounds.forward_bounds(ref, q, k, v, dtype=dtype)
    _, lse = fa2_forward_raw(q, k, v, block_m=16, block_n=16)
    assert max_ratio(abs_error(lse, ref.lse), lse_b)[0] <= 1
    assert max_ratio(abs_error(lse / math.log(2), ref.lse), lse_b)[0] > 1  # base-2 LSE
    # LSE stored in bfloat16 instead of float32: off by up to 2^-9 |lse|.
    assert max_ratio(abs_error(lse.bfloat16(), ref.lse), lse_b)[0] > 1


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_broken_backward_exceeds_bound(dtype):
    q, k, v, dout = _broken_inputs(dtype)
    ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=True), dout=dout)
    out, lse = fa2_forward_raw(q, k, v, causal=True, block_m=16, block_n=16)
    dq, dk, dv, delta = fa2_backward(q, k, v, out, lse, dout, causal=True, block_m=16, block_n=16)
    dq_b, dk_b, dv_b, delta_b = bounds.backward_bounds(ref, q, k, v, dtype=dtype, out=out)
    assert max_ratio(abs_error(dk, ref.dk), dk_b)[0] <= 1
    scale = 1.0 / math.sqrt(q.shape[-1])
    assert max_ratio(abs_error((dk.to(F64) / scale).to(dtype), ref.dk), dk_b)[0] > 1  # dK missing the scale
    # A backward fed an LSE stored in bfloat16: P = exp(s - lse) is off by ~2^-9 |lse| relative.
    dq_bad, _, _, _ = fa2_backward(q, k, v, out, lse.bfloat16().to(lse.dtype), dout, causal=True,
                                   block_m=16, block_n=16)
    assert max_ratio(abs_error(dq, ref.dq), dq_b)[0] <= 1
    if dtype != torch.bfloat16:  # in bfloat16 the dS cast is as coarse as the bad LSE
        assert max_ratio(abs_error(dq_bad, ref.dq), dq_b)[0] > 1
    # Delta from the wrong output (the un-normalised accumulator's scale): far off.
    assert max_ratio(abs_error(delta * 2, ref.delta), delta_b)[0] > 1
    # Top-left instead of bottom-right causal mask with Nk > Nq: the wrong keys are visible.
    q2, k2, v2, do2 = _broken_inputs(dtype, len_q=8, len_k=24)
    ref2 = ref_attention.attention(q2, k2, v2, spec=AttentionSpec(causal=True), dout=do2)
    out2, _ = baseline.forward(q2, k2, v2, spec=AttentionSpec(causal=True, alignment="top_left"))
    out_b2, _ = bounds.forward_bounds(ref2, q2, k2, v2, dtype=dtype)
    assert max_ratio(abs_error(out2, ref2.out), out_b2)[0] > 1


# --- the bound is not absurdly loose -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=_name)
def test_bound_is_tight_for_low_precision_forward(dtype):
    """Median over normal examples of max(err/bound) of the forward output is above 1/100 (the bound
    is meant to be within a small factor of what correct kernels reach)."""
    out_ratios, lse_ratios = [], []
    for seed in range(8):
        q, k, v, dout = make_inputs(seed=100 + seed, kind="normal", dtype=dtype, batch=1, heads_q=2, heads_kv=1,
                                    len_q=64, len_k=128, head_dim=64)
        ratios = correct_kernel_ratios(q, k, v, dout, causal=bool(seed % 2), block_m=64, block_n=32)
        out_ratios.append(ratios["fa2", "out"][0])
        lse_ratios.append(ratios["fa2", "lse"][0])
    assert statistics.median(out_ratios) > 1 / 100, out_ratios
    # The LSE is a float32 quantity whatever the input dtype; its bound adds D score roundings and n
    # summation roundings of one sign, where a correct kernel's errors grow like sqrt(D n) and average
    # over keys (references/bounds.py, section 9). At D = 64, Nk = 128 that leaves it near 1/100.
    assert statistics.median(lse_ratios) > 1 / 300, lse_ratios


def test_ratio_summary():
    """The median and max of max(err/bound) per dtype, implementation and op over a fixed set of examples
    (every dtype and magnitude class, both masks; run with -s to see the table); all of them <= 1."""
    ratios = collections.defaultdict(list)
    for i, (dtype, kind) in enumerate((d, k) for d in DTYPES for k in KINDS):
        q, k, v, dout = make_inputs(seed=500 + i, kind=kind, dtype=dtype, batch=1, heads_q=2, heads_kv=1,
                                    len_q=24, len_k=40, head_dim=32)
        for (impl, op), (r, _) in correct_kernel_ratios(q, k, v, dout, causal=bool(i % 2), block_m=16,
                                                        block_n=8).items():
            ratios[_name(dtype), impl, op].append(r)
    lines = [f"{'dtype':9} {'impl':6} {'op':6} {'n':>4} {'median':>9} {'max':>9}"]
    for (dtype, impl, op), rs in sorted(ratios.items()):
        lines.append(f"{dtype:9} {impl:6} {op:6} {len(rs):4d} {statistics.median(rs):9.3g} {max(rs):9.3g}")
    print("\nerr/bound per example (max over elements)\n" + "\n".join(lines))
    assert len(ratios) == len(DTYPES) * 3 * 6, sorted(ratios)  # 3 implementations x out, lse, dq, dk, dv, delta
    assert all(max(rs) <= 1 for rs in ratios.values()), "\n".join(lines)


def test_forward_bounds_stay_finite_where_p_underflows_and_the_exponent_is_large():
    # scale 7e4 on logits ~1e4: scores ~1e9 apart, P = 0 for all but the top key, and the bound's
    # exponents ~700: p * exp(phi) was 0 * inf = NaN (a NaN bound fails every kernel).
    from strategies.cases import AttentionCase

    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=1, len_k=2, head_dim=1, dtype="float16",
                         spec=AttentionSpec(causal=False), magnitude="large_logits", scale=70000.0)
    t = case.build()
    ref = ref_attention.attention(t.q, t.k, t.v, scale=case.scale)
    out_b, lse_b = bounds.forward_bounds(ref, t.q, t.k, t.v, dtype=torch.float16)
    assert bool(torch.isfinite(out_b).all()) and bool(torch.isfinite(lse_b).all()), (out_b, lse_b)
