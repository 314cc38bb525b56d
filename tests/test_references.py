"""The float64 reference (references.attention) against the 50-digit mpmath reference (references.mp).

Tolerance (why these numbers): the float64 reference rounds every operation with unit roundoff
u = 2^-53. To first order each probability it returns is ``P (1 + theta)`` with
``|theta| <= kappa u``, where kappa collects
  * the scores ``scale q.k``: (D + 1) u times ``A = |scale| max_ij sum_t |q_it||k_jt|``, once for the
    score itself and once inside the LSE;
  * the LSE: n + 2 roundings for its sum, log and add, and u |lse| <= u (A + log n);
  * ``exp(s - lse)``: u |s - lse| <= u (2 A + log n) for the subtraction and about u for exp.
Everything downstream is a sum of at most n or D products, which adds (n + D + 4) u relative to the sum
of the absolute values of its terms (the magnitude ``M`` of the quantity: ``|P| @ |V|`` for ``out``,
and so on). So ``|float64 - exact| <= kappa u M`` to first order; the mpmath values are exact to 1e-50
and rounded once to float64 (another u M at most). The checks allow ``SLACK * kappa * u * M`` with
SLACK = 4 for the dropped second-order terms. With |scores| up to 1e4 this is still a relative tolerance
near 1e-10, far below any algorithmic mistake. In gradual underflow the model's relative error becomes
an absolute one: each operation may also add up to the smallest subnormal, ETA64 = 2^-1074 (a dK of
8e-318 from large_logits inputs was off by 7 ETA64 with M itself subnormal), so the checks add
``SLACK * kappa * ETA64``.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from references import attention as ref_attention
from references import mp as ref_mp
from references.spec import ALIGNMENTS, AttentionSpec

F64 = torch.float64
U64 = 2.0 ** -53
ETA64 = 2.0 ** -1074  # the smallest float64 subnormal
SLACK = 4.0
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KINDS = ("normal", "large_logits", "ties", "dominant", "all_negative", "v_offset")
SETTINGS = dict(max_examples=60, deadline=None)


# --- inputs -----------------------------------------------------------------------------------------

def make_inputs(*, seed: int, kind: str, dtype: torch.dtype, batch: int, heads_q: int, heads_kv: int,
                len_q: int, len_k: int, head_dim: int, head_dim_v: int | None = None):
    """``q, k, v, dout`` in ``dtype`` from a seed and a magnitude class (see KINDS); ``head_dim_v``: v's and
    dout's head dim, when not ``head_dim``."""
    dv = head_dim if head_dim_v is None else head_dim_v
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    q = randn(batch, heads_q, len_q, head_dim)
    k = randn(batch, heads_kv, len_k, head_dim)
    v = randn(batch, heads_kv, len_k, dv)
    dout = randn(batch, heads_q, len_q, dv)
    if kind == "large_logits":  # |scale q.k| up to ~1e4
        q, k = q * 100, k * 100
    elif kind == "ties" and len_k > 1:  # duplicated keys: exactly equal scores
        k = k[:, :, torch.arange(len_k) % max(1, len_k // 2)]
    elif kind == "dominant" and len_k:  # one key far above the rest in every row
        q = q.abs()
        k[:, :, int(torch.randint(len_k, (1,), generator=g))] = 30.0
    elif kind == "all_negative":
        q, k = q.abs() * 3, -k.abs() * 3
    elif kind == "v_offset":
        v = 1000 + v
    return tuple(t.to(dtype) for t in (q, k, v, dout))


_window_side = st.one_of(st.just(-1), st.integers(0, 6))  # -1 unbounded (first: failures shrink to no window)


@st.composite
def attention_cases(draw, *, max_len: int = 5, max_dim: int = 5, kinds=KINDS):
    """Return a strategy for small attention cases (dict of keyword arguments for make_inputs, plus
    causal and alignment). Shapes are drawn first, then a seed; cost grows as B*Hq*Nq*Nk*D mpf ops."""
    heads_kv = draw(st.integers(1, 2), label="heads_kv")
    return dict(
        batch=draw(st.integers(1, 2), label="batch"),
        heads_kv=heads_kv,
        heads_q=heads_kv * draw(st.integers(1, 2), label="group"),
        len_q=draw(st.integers(1, max_len), label="len_q"),
        len_k=draw(st.integers(1, max_len), label="len_k"),
        head_dim=draw(st.integers(1, max_dim), label="head_dim"),
        causal=draw(st.booleans(), label="causal"),
        alignment=draw(st.sampled_from(ALIGNMENTS), label="alignment"),
        window=(draw(_window_side, label="window_left"), draw(_window_side, label="window_right")),
        kind=draw(st.sampled_from(kinds), label="kind"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        seed=draw(st.integers(0, 2 ** 31 - 1), label="seed"),
    )


def _spec_of(case: dict) -> AttentionSpec:
    """Take the spec's entries out of a drawn ``case`` (the rest are make_inputs' arguments)."""
    window = case.pop("window")
    return AttentionSpec(case.pop("causal"), case.pop("alignment"), window[0], window[1])


# --- tolerances ---------------------------------------------------------------------------------------

def kappa(q, k, *, scale: float, len_k: int, value_dim: int = 0) -> float:
    """First-order relative error of the float64 reference's P, in units of u (module docstring); the sums
    downstream run over the larger of q's head dim and ``value_dim`` (v's)."""
    d = q.shape[-1]
    ke = ref_attention.expand_kv(k.to(F64), q.shape[1])
    a = float((abs(scale) * (q.to(F64).abs() @ ke.abs().transpose(-1, -2))).max()) if q.numel() and k.numel() else 0.0
    log_n = math.log(len_k + 1)
    return 2 * (d + 1) * a + (len_k + 2) + (a + log_n) + (2 * a + log_n) + (len_k + max(d, value_dim) + 4) + 2


def magnitudes(exact, q, k, v, dout, *, scale: float, p_sink=None):
    """The magnitude M of each quantity: the same computation on absolute values (float64); with sinks
    (``p_sink``, each row's sink probability) also of dsinks, a sum of P_sink Delta over batch and rows."""
    hq, hkv = q.shape[1], k.shape[1]
    aq, ak, av = q.to(F64).abs(), ref_attention.expand_kv(k.to(F64), hq).abs(), ref_attention.expand_kv(v.to(F64), hq).abs()
    p = exact.dense().p if isinstance(exact, ref_attention.Reference) else exact.p
    m = {"p": p, "out": p @ av, "lse": torch.ones_like(exact.lse)}
    if dout is not None:
        ado = dout.to(F64).abs()
        m_dp = ado @ av.transpose(-1, -2)
        m["delta"] = (ado * m["out"]).sum(-1)
        m_ds = p * (m_dp + m["delta"][..., None])
        m["dq"] = abs(scale) * (m_ds @ ak)
        m["dk"] = ref_attention.reduce_group(abs(scale) * (m_ds.transpose(-1, -2) @ aq), hkv)
        m["dv"] = ref_attention.reduce_group(p.transpose(-1, -2) @ ado, hkv)
        if p_sink is not None:
            m["dsinks"] = (p_sink * m["delta"]).sum(dim=(0, 2))
    return m


def assert_close(*, name: str, actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, case: str):
    """|actual - expected| <= tol elementwise; equal infinities count as no error."""
    __tracebackhide__ = True
    same_inf = torch.isinf(expected) & (actual == expected)
    err = torch.where(same_inf, 0.0, (actual.to(F64) - expected).abs())
    err = torch.where(torch.isnan(err), math.inf, err)
    bad = err > tol
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{name}: |float64 - mpmath| = {float(err[idx]):.3e} at {idx}, but should be <= {float(tol[idx]):.3e} "
            f"(float64 {float(actual[idx])!r}, mpmath {float(expected[idx])!r}) [{case}]")


def check_against_mp(*, q, k, v, dout, causal: bool = False, alignment: str = "bottom_right",
                     scale: float | None = None, case: str, window: tuple[int, int] = (-1, -1),
                     spec: AttentionSpec | None = None):
    """The float64 reference against mpmath on ``spec`` (default: built from causal, alignment, window)."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if spec is None:
        spec = AttentionSpec(causal=causal, alignment=alignment, window_left=window[0], window_right=window[1])
    ref = ref_attention.attention(q, k, v, spec=spec, scale=scale, dout=dout)
    exact = ref_mp.attention(q, k, v, spec=spec, scale=scale, dout=dout, probabilities=True)
    # A sink is one more score (no product) and ALiBi's bias adds to them: both count in A.
    extra = max([abs(x) for x in spec.sinks or ()] + [0.0]) + max([abs(x) for x in spec.alibi_slopes or ()] + [0.0]) * (
        q.shape[2] + k.shape[2])
    kap = kappa(q, k, scale=scale, len_k=k.shape[2], value_dim=v.shape[-1]) + 4 * extra
    mags = magnitudes(exact, q, k, v, dout, scale=scale, p_sink=ref.p_sink)
    names = ("p", "out", "lse") + (("delta", "dq", "dk", "dv") if dout is not None else ())
    names += ("dsinks",) if dout is not None and spec.sinks is not None else ()
    for name in names:
        tol = SLACK * kap * (U64 * mags[name] + ETA64)
        actual = ref.dense().p if name == "p" else getattr(ref, name)
        assert_close(name=name, actual=actual, expected=getattr(exact, name), tol=tol, case=case)
    return ref, exact


# --- the mpmath reference itself --------------------------------------------------------------------

def test_mp_softmax_and_logsumexp_basic():
    inf = math.inf
    assert ref_mp.logsumexp([-inf, -inf]) == -inf
    assert ref_mp.logsumexp([]) == -inf
    assert ref_mp.softmax([-inf, -inf]) == [0, 0]
    p = ref_mp.softmax([0.0, -inf, 1.0])
    with mpmath.workdps(60):
        e = mpmath.e
        assert abs(p[0] - 1 / (1 + e)) < mpmath.mpf(10) ** -48  # 50 digits, not 16
        assert abs(p[2] - e / (1 + e)) < mpmath.mpf(10) ** -48
    assert p[1] == 0
    # Ties and huge magnitudes: exp(1e4) overflows float64 but not mpmath.
    assert abs(float(ref_mp.logsumexp([1e4, 1e4])) - (1e4 + math.log(2))) <= 1e4 * U64 * 2
    with pytest.raises(ValueError, match="NaN"):
        ref_mp.softmax([0.0, math.nan])
    with pytest.raises(ValueError, match=r"\+inf"):
        ref_mp.logsumexp([0.0, math.inf])


def test_mp_does_not_touch_global_precision():
    before = mpmath.mp.dps
    ref_mp.logsumexp([1.0, 2.0])
    ref_mp.attention_row([1.0], [[1.0]], [[2.0]], scale=1.0, dout_i=[1.0])
    assert mpmath.mp.dps == before


@pytest.mark.parametrize("dtype", DTYPES)
def test_mp_rows_match_float64_softmax(dtype):
    g = torch.Generator().manual_seed(7)
    rows = (torch.randn(6, 9, generator=g, dtype=F64) * torch.tensor([1, 10, 100, 1e3, 1e4, 1e-3], dtype=F64)[:, None]).to(dtype)
    rows[0, 3] = -math.inf
    rows[1, :] = -math.inf
    ref_p = ref_attention.softmax(rows)
    ref_lse = ref_attention.logsumexp(rows)
    for r in range(rows.shape[0]):
        exact_p = torch.tensor([float(x) for x in ref_mp.softmax(rows[r].tolist())], dtype=F64)
        exact_lse = float(ref_mp.logsumexp(rows[r].tolist()))
        amax = float(rows[r].to(F64).abs().nan_to_num(neginf=0.0).max())
        kap = 2 * amax + rows.shape[1] + 8  # subtraction and log/sum roundings (module docstring)
        assert_close(name="softmax", actual=ref_p[r], expected=exact_p, tol=SLACK * kap * U64 * exact_p,
                     case=f"row {r}, {dtype}")
        assert_close(name="logsumexp", actual=ref_lse[r], expected=torch.tensor(exact_lse, dtype=F64),
                     tol=torch.tensor(SLACK * kap * U64, dtype=F64), case=f"row {r}, {dtype}")


def test_attention_row_matches_whole_tensor_attention():
    q, k, v, dout = make_inputs(seed=3, kind="normal", dtype=F64, batch=1, heads_q=1, heads_kv=1,
                                len_q=3, len_k=4, head_dim=3)
    exact = ref_mp.attention(q, k, v, spec=AttentionSpec(causal=True), scale=0.7, dout=dout)
    # Row 1 sees keys 0..2 (bottom-right: j <= i + Nk - Nq = i + 1).
    row = ref_mp.attention_row(q[0, 0, 1], k[0, 0, :3], v[0, 0, :3], scale=0.7, dout_i=dout[0, 0, 1])
    assert torch.equal(torch.tensor([float(x) for x in row.out], dtype=F64), exact.out[0, 0, 1])
    assert float(row.lse) == float(exact.lse[0, 0, 1])
    assert torch.equal(torch.tensor([float(x) for x in row.dq], dtype=F64), exact.dq[0, 0, 1])
    # A row with no visible key.
    empty = ref_mp.attention_row([1.0, 2.0], [], [], scale=1.0, dout_i=[1.0, 1.0])
    assert empty.lse == -math.inf and all(x == 0 for x in empty.out + empty.dq) and empty.dk == []


# --- float64 reference vs mpmath ------------------------------------------------------------------------

@settings(**SETTINGS)
@given(case=attention_cases())
def test_float64_reference_matches_mpmath(case):
    spec = _spec_of(case)
    q, k, v, dout = make_inputs(**case)
    check_against_mp(q=q, k=k, v=v, dout=dout, causal=spec.causal, alignment=spec.alignment,
                     window=(spec.window_left, spec.window_right), case=f"{case}, {spec}")


@settings(**SETTINGS)
@given(case=attention_cases(), head_dim_v=st.integers(1, 6))
def test_float64_reference_matches_mpmath_with_a_value_head_dim_of_its_own(case, head_dim_v):
    """v (and out, dout, dV) ``head_dim_v`` wide, q and k ``head_dim``: forward and backward against mpmath."""
    spec = _spec_of(case)
    q, k, v, dout = make_inputs(**case, head_dim_v=head_dim_v)
    ref, _ = check_against_mp(q=q, k=k, v=v, dout=dout, spec=spec, case=f"{case}, Dv={head_dim_v}, {spec}")
    assert ref.out.shape[-1] == ref.dv.shape[-1] == head_dim_v and ref.dq.shape[-1] == ref.dk.shape[-1] == q.shape[-1]


ADVERSARIAL = [
    # (kind, dtype, Nq, Nk, D, causal, alignment)
    ("large_logits", torch.float64, 4, 6, 5, False, "bottom_right"),
    ("large_logits", torch.float16, 5, 3, 4, True, "bottom_right"),  # also 2 fully masked rows
    ("ties", torch.bfloat16, 3, 6, 3, False, "bottom_right"),
    ("dominant", torch.float32, 4, 5, 3, True, "top_left"),
    ("all_negative", torch.float64, 4, 4, 2, True, "bottom_right"),
    ("v_offset", torch.float16, 3, 5, 4, False, "bottom_right"),
    ("normal", torch.float64, 6, 2, 3, True, "bottom_right"),  # rows 0..3 see no key
    ("normal", torch.float32, 2, 6, 3, True, "top_left"),  # keys 2..5 seen by no row
]


@pytest.mark.parametrize("kind,dtype,len_q,len_k,head_dim,causal,alignment", ADVERSARIAL)
def test_float64_reference_matches_mpmath_adversarial(kind, dtype, len_q, len_k, head_dim, causal, alignment):
    q, k, v, dout = make_inputs(seed=11, kind=kind, dtype=dtype, batch=1, heads_q=2, heads_kv=1,
                                len_q=len_q, len_k=len_k, head_dim=head_dim)
    ref, exact = check_against_mp(q=q, k=k, v=v, dout=dout, causal=causal, alignment=alignment,
                                  case=f"{kind}, {dtype}, Nq={len_q}, Nk={len_k}, D={head_dim}, {alignment}")
    if kind == "large_logits":
        dense = ref.dense()
        assert float(dense.scores[dense.visible.expand_as(dense.scores)].abs().max()) > 1e3
    empty = ~ref.rows_with_keys
    assert torch.equal(empty, ~exact.p.sum(-1)[0, 0].bool())
    if empty.any():
        assert torch.all(ref.out[:, :, empty] == 0) and torch.all(ref.lse[:, :, empty] == -math.inf)
        assert torch.all(ref.dq[:, :, empty] == 0) and torch.all(ref.delta[:, :, empty] == 0)


WINDOWED = [
    # (kind, dtype, Nq, Nk, D, causal, alignment, (left, right))
    ("large_logits", torch.float16, 5, 7, 4, False, "bottom_right", (1, 0)),
    ("dominant", torch.float32, 6, 4, 3, True, "bottom_right", (0, -1)),  # each row sees its diagonal key alone
    ("ties", torch.bfloat16, 4, 6, 3, False, "top_left", (2, 1)),
    ("normal", torch.float64, 3, 8, 2, False, "bottom_right", (0, 0)),  # keys 0..4 seen by no row
    ("all_negative", torch.float64, 4, 4, 3, True, "bottom_right", (9, 9)),  # wider than N: no window
]


@pytest.mark.parametrize("kind,dtype,len_q,len_k,head_dim,causal,alignment,window", WINDOWED)
def test_float64_reference_matches_mpmath_with_windows(kind, dtype, len_q, len_k, head_dim, causal, alignment,
                                                       window):
    q, k, v, dout = make_inputs(seed=13, kind=kind, dtype=dtype, batch=1, heads_q=2, heads_kv=1,
                                len_q=len_q, len_k=len_k, head_dim=head_dim)
    ref, exact = check_against_mp(q=q, k=k, v=v, dout=dout, causal=causal, alignment=alignment, window=window,
                                  case=f"{kind}, {dtype}, Nq={len_q}, Nk={len_k}, D={head_dim}, window {window}")
    unseen = ~ref.keys_seen
    if unseen.any():  # keys no row sees get exactly zero gradients
        assert torch.all(ref.dk[:, :, unseen] == 0) and torch.all(ref.dv[:, :, unseen] == 0)


def test_float64_reference_scores_far_beyond_float16_range():
    # |scale q.k| ~ 1e5: a float16 or float32 exp overflows; the float64 reference must stay exact.
    q = torch.tensor([[[[300.0, -200.0], [250.0, 100.0]]]], dtype=F64)
    k = torch.tensor([[[[300.0, 10.0], [299.0, 12.0], [-300.0, 0.0]]]], dtype=F64)
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]], dtype=F64)
    check_against_mp(q=q, k=k, v=v, dout=torch.ones_like(q), causal=False, alignment="bottom_right", scale=1.0,
                     case="scores ~ 1e5")


@st.composite
def variant_cases(draw):
    """Small cases with sinks, chunks, softcap, ALiBi and packed variable-length sequences (lengths 0 to 3,
    up to three sequences): ``(make_inputs keywords, spec)``."""
    heads_kv = draw(st.integers(1, 2), label="heads_kv")
    heads_q = heads_kv * draw(st.integers(1, 2), label="group")
    lens = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=3), label="seqlens")
    varlen = draw(st.booleans(), label="varlen")
    lens_q, lens_k = tuple(a for a, _ in lens), tuple(b for _, b in lens)
    sequences = dict(sequences="packed", seqlens_q=lens_q, seqlens_k=lens_k) if varlen else {}
    len_q, len_k = (sum(lens_q), sum(lens_k)) if varlen else (max(1, lens_q[0]), lens_k[0])
    floats = st.floats(-8, 8, width=32)
    spec = AttentionSpec(
        causal=draw(st.booleans(), label="causal"), alignment=draw(st.sampled_from(ALIGNMENTS), label="alignment"),
        window_left=draw(_window_side, label="window_left"),
        attention_chunk=draw(st.sampled_from((0, 1, 2, 3)), label="attention_chunk"),
        softcap=draw(st.sampled_from((None, 0.5, 4.0)), label="softcap"),
        alibi_slopes=draw(st.one_of(st.none(), st.tuples(*[st.floats(0, 2, width=32)] * heads_q)), label="alibi"),
        sinks=draw(st.one_of(st.none(), st.tuples(*[floats] * heads_q)), label="sinks"), **sequences)
    case = dict(batch=1, heads_q=heads_q, heads_kv=heads_kv, len_q=len_q, len_k=len_k,
                head_dim=draw(st.integers(1, 4), label="head_dim"), kind=draw(st.sampled_from(KINDS), label="kind"),
                dtype=draw(st.sampled_from(DTYPES), label="dtype"), seed=draw(st.integers(0, 2 ** 31 - 1), label="seed"))
    return case, spec


@settings(**SETTINGS)
@given(drawn=variant_cases())
def test_float64_reference_matches_mpmath_on_variants(drawn):
    case, spec = drawn
    q, k, v, dout = make_inputs(**case)
    check_against_mp(q=q, k=k, v=v, dout=dout, spec=spec, case=f"{case}, {spec.describe()}")


VARIANTS = [
    # (kind, dtype, spec): a dominant sink over large logits, a sink below every score, empty and length-1
    # sequences, chunks of 1 with ALiBi, a sink on rows that see no key
    ("large_logits", torch.float16, AttentionSpec(causal=True, sinks=(40.0, -40.0)), 4, 5),
    ("all_negative", torch.float64, AttentionSpec(sinks=(0.0, 3.0)), 3, 4),
    ("dominant", torch.float32, AttentionSpec(causal=True, sequences="packed", seqlens_q=(1, 0, 3),
                                              seqlens_k=(0, 2, 3), sinks=(1.0, 2.0)), 4, 5),
    ("normal", torch.float64, AttentionSpec(attention_chunk=1, alibi_slopes=(0.5, 1.0), alignment="top_left"), 3, 5),
    ("v_offset", torch.bfloat16, AttentionSpec(causal=True, sequences="padded", seqlens_q=(3, 1), seqlens_k=(1, 1),
                                               sinks=(0.5, 0.5), softcap=1.0), 4, 2),
]


@pytest.mark.parametrize("kind,dtype,spec,len_q,len_k", VARIANTS)
def test_float64_reference_matches_mpmath_on_adversarial_variants(kind, dtype, spec, len_q, len_k):
    q, k, v, dout = make_inputs(seed=17, kind=kind, dtype=dtype, batch=1, heads_q=2, heads_kv=1, len_q=len_q,
                                len_k=len_k, head_dim=3)
    ref, exact = check_against_mp(q=q, k=k, v=v, dout=dout, spec=spec, case=f"{kind}, {dtype}, {spec.describe()}")
    if spec.sinks is not None:  # rows that see no key: out 0, lse the sink's logit
        empty = ~ref.rows_with_keys
        if empty.any():
            sink = torch.tensor(spec.sinks, dtype=F64)[None, :, None].expand_as(ref.lse)
            assert torch.all(ref.out[:, :, empty] == 0) and torch.equal(ref.lse[:, :, empty], sink[:, :, empty])


# --- identities of the float64 reference ------------------------------------------------------------------

@settings(**SETTINGS)
@given(case=attention_cases(max_len=24, max_dim=16))
def test_delta_identity(case):
    """rowsum(dO * O) = rowsum(P * dP) with dP = dO V^T, to float64 rounding."""
    spec = _spec_of(case)
    q, k, v, dout = make_inputs(**case)
    ref = ref_attention.attention(q, k, v, spec=spec, dout=dout)
    lhs = ref.delta
    dense = ref.dense()
    rhs = (dense.p * dense.dp).sum(-1)
    hq = q.shape[1]
    av = torch.where(dense.visible.any(0)[:, None], ref_attention.expand_kv(v.to(F64), hq).abs(), 0.0)
    mag = (ref.dout.abs() * (dense.p @ av)).sum(-1)
    kap = kappa(q, k, scale=ref.scale, len_k=k.shape[2])
    # Both sides carry the P error (kappa u) and at most n + D roundings of their own sums.
    tol = 2 * SLACK * (kap + k.shape[2] + q.shape[-1]) * U64 * mag
    assert_close(name="delta identity", actual=lhs, expected=rhs, tol=tol, case=str(case))


def naive_attention(q, k, v, *, spec: AttentionSpec, scale: float):
    """Float64 attention written the plain way, for autograd (fully masked rows give zeros)."""
    hq = q.shape[1]
    ke, ve = ref_attention.expand_kv(k, hq), ref_attention.expand_kv(v, hq)
    vis = spec.rows(q.shape[2], k.shape[2])
    s = (q @ ke.transpose(-1, -2)) * scale
    empty = ~vis.any(-1)[:, None]
    s = torch.where(vis & ~empty, s, torch.where(empty, 0.0, -math.inf))  # empty rows: finite dummy scores
    p = torch.where(vis, torch.softmax(s, dim=-1), 0.0)
    return p @ ve


@settings(**SETTINGS)
@given(case=attention_cases(max_len=12, max_dim=8, kinds=("normal", "ties", "dominant", "all_negative",
                                                            "v_offset")))
def test_reference_backward_matches_float64_autograd(case):
    spec = _spec_of(case)
    q, k, v, dout = (t.to(F64) for t in make_inputs(**case))
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv, _ = ref_attention.backward(q, k, v, dout, spec=spec)
    qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = naive_attention(qa, ka, va, spec=spec, scale=scale)
    ga = torch.autograd.grad(out, (qa, ka, va), dout)
    ref = ref_attention.attention(q, k, v, spec=spec, dout=dout)
    kap = kappa(q, k, scale=scale, len_k=k.shape[2])
    mags = magnitudes(ref, q, k, v, dout, scale=scale)
    for name, mine, theirs in zip(("dq", "dk", "dv"), (dq, dk, dv), ga):
        # Two float64 computations of the same gradient, each within kappa u M of the exact one.
        tol = 2 * SLACK * kap * U64 * mags[name]
        assert_close(name=name, actual=mine, expected=theirs, tol=tol, case=str(case))


def test_mp_reference_ignores_values_no_row_reads():
    q, k, v, dout = make_inputs(seed=9, kind="normal", dtype=F64, batch=1, heads_q=1, heads_kv=1,
                                len_q=3, len_k=6, head_dim=4)
    k[:, :, 4:], v[:, :, 4:] = math.nan, math.inf  # top-left: keys 3.. are seen by no row
    exact = ref_mp.attention(q, k, v,
                             spec=AttentionSpec(causal=True, alignment="top_left"), dout=dout, probabilities=True)
    ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=True, alignment="top_left"), dout=dout)
    for name in ("out", "lse", "p", "delta", "dk", "dv"):
        mine = ref.dense().p if name == "p" else getattr(ref, name)
        assert torch.all(torch.isfinite(getattr(exact, name)) | torch.isneginf(getattr(exact, name))), name
        assert torch.allclose(mine, getattr(exact, name), rtol=1e-12, atol=1e-14), name
    assert torch.all(exact.dk[:, :, 3:] == 0) and torch.all(exact.dv[:, :, 3:] == 0)


def test_float64_reference_dq_ignores_keys_no_row_sees():
    q, k, v, dout = make_inputs(seed=9, kind="normal", dtype=F64, batch=1, heads_q=1, heads_kv=1,
                                len_q=3, len_k=6, head_dim=4)
    k[:, :, 4:] = math.nan
    ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=True, alignment="top_left"), dout=dout)
    assert torch.all(torch.isfinite(ref.dq))
