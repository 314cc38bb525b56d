"""Float8 inputs (references/fp8.py): the quantisation the cases use, the eager float8 baseline and the blocked
kernel against the bound, the declaration's and the kernels' refusals, and the draws."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashverify_kernels import _validate
from flashverify_kernels.declaration import Implementation, ImplementationError
from flashverify_kernels.pytorch import blocked
from flashverify_kernels.registry import registry
from references import baseline, bounds
from references import attention as reference
from references.fp8 import FP8_DTYPES, dequantise, quantise
from references.metrics import abs_error
from references.spec import AttentionSpec
from strategies.attention import attention_cases, boundary_classes
from strategies.cases import AttentionCase, CaseError
from verify.measure import Truth

F64 = torch.float64
FP8 = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in FP8_DTYPES]
MAGNITUDES = ("normal", "large_logits", "fa3_outliers", "all_negative", "dominant_key", "v_wide_range",
              "near_subnormal", "ties")


def _case(dtype: torch.dtype, **fields) -> AttentionCase:
    base = dict(batch=2, heads_q=4, heads_kv=2, len_q=9, len_k=70, head_dim=16,
                dtype=str(dtype).removeprefix("torch."))
    return AttentionCase(**{**base, **fields})


# --- quantisation --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FP8)
def test_descaled_blocks_reach_the_format_s_largest_value_and_dequantise_exactly(dtype):
    """Each (batch, KV head) block of q (its group's query heads together), k and v is scaled so its largest
    entry lands at the format's largest finite value; the dequantised values are the float8 values times
    the float32 descale, held exactly in float64."""
    x = torch.randn(2, 4, 5, 8, dtype=F64) * torch.tensor([1.0, 30.0, 1e-3, 7.0], dtype=F64)[None, :, None, None]
    q8, descale = quantise(x, dtype, heads_kv=2, descaled=True)
    assert q8.dtype == dtype and descale.shape == (2, 2) and descale.dtype == torch.float32
    top = torch.finfo(dtype).max
    per_block = q8.to(F64).abs().reshape(2, 2, -1).amax(dim=-1)
    assert torch.equal(per_block, torch.full((2, 2), top, dtype=F64))
    deq = dequantise(q8, descale)
    assert torch.equal(deq, q8.to(F64) * descale.to(F64).repeat_interleave(2, dim=1)[:, :, None, None])
    # the quantisation error is that of the format: at most u |x| or half the smallest subnormal spacing, scaled
    u = torch.finfo(dtype).eps / 2
    scale = descale.to(F64).repeat_interleave(2, dim=1)[:, :, None, None]
    slack = u * x.abs() + torch.finfo(dtype).smallest_normal * u * scale
    assert bool(((deq - x).abs() <= slack * (1 + 1e-12)).all())


@pytest.mark.parametrize("dtype", FP8)
def test_without_descales_values_are_clamped_to_the_finite_range(dtype):
    x = torch.tensor([[[[1e6, -1e6, 0.3, 0.0]]]], dtype=F64)
    q8, descale = quantise(x, dtype, heads_kv=None, descaled=False)
    assert descale is None
    top = torch.finfo(dtype).max
    assert q8.to(F64).flatten().tolist()[:2] == [top, -top]


def test_dequantise_refuses_a_descale_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"descale.shape=\(3, 2\), but should be \[B, Hkv\] = \[2, Hkv\]"):
        dequantise(torch.zeros(2, 4, 1, 1, dtype=torch.float8_e4m3fn), torch.ones(3, 2))


# --- cases ---------------------------------------------------------------------------------------------

def test_a_descaled_case_round_trips_through_json_and_says_so():
    case = _case(torch.float8_e4m3fn, descale=True)
    assert AttentionCase.from_json(case.to_json()) == case
    assert " float8_e4m3fn descaled " in case.describe()
    plain = _case(torch.float8_e5m2)
    assert "descale" not in plain.to_dict()  # earlier replay commands' JSON stays as it was
    t = case.build()
    assert t.q.dtype == torch.float8_e4m3fn and t.dout.dtype == torch.bfloat16 and case.out_dtype == torch.bfloat16
    assert [tuple(d.shape) for d in t.descales] == [(2, 2)] * 3
    assert plain.build().descales is None


def test_descales_come_with_float8_cases_only():
    with pytest.raises(CaseError, match=r"descale=true with dtype='float16': descales come with float8 inputs only"):
        AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=1, len_k=1, head_dim=1, dtype="float16", descale=True)


@pytest.mark.parametrize("layout", ["contiguous", "bnhd", "padded", "packed"])
def test_every_layout_holds_the_same_float8_values(layout):
    case = _case(torch.float8_e4m3fn, descale=True)
    want = case.build()
    got = case.replace(layout=layout).build()
    for a, b in ((want.q, got.q), (want.k, got.k), (want.v, got.v)):
        assert torch.equal(a.to(F64), b.to(F64))


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(data=st.data())
def test_float8_draws_descale_dense_batches_and_reach_the_class(data):
    case = data.draw(attention_cases(dtype="float8_e5m2", descale=True, sequences=("dense", "packed", "paged")))
    assert case.dtype == "float8_e5m2"
    if case.descale:
        assert case.spec.sequences == "dense" and "fp8_descaled" in boundary_classes(case)


def test_descales_are_drawn_for_float8_only():
    seen = []

    @settings(max_examples=40, deadline=None, database=None, derandomize=True)
    @given(attention_cases(dtype="bfloat16", descale=True))
    def draw(case):
        seen.append(case.descale)

    draw()
    assert seen and not any(seen)


# --- the eager baseline and the blocked kernel against the bound --------------------------------------

@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("descale", [False, True], ids=["unit", "descaled"])
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_float8_eager_and_blocked_fa2_stay_within_the_bound(dtype, descale, magnitude):
    """The eager float8 baseline (P's numerator cast to float8) and the blocked FA2 (in tiles, splits, sinks,
    a softcap) stay under the float8 bound of the dequantised inputs; out is bfloat16."""
    worst = 0.0
    for causal, blocks, spec in ((False, (16, 16), {}), (True, (3, 7), {}), (False, (8, 5), {"num_splits": 3}),
                                 (True, (4, 16), {"sinks": (2.0, -1.0, 30.0, 0.0), "softcap": 5.0})):
        case = _case(dtype, descale=descale, magnitude=magnitude, spec=AttentionSpec(causal=causal, **spec))
        t = case.build()
        truth = Truth(case, t.q, t.k, t.v, descales=t.descales)
        bound = truth.forward_bounds
        descales = t.descales or (None, None, None)
        sinks = None if case.spec.sinks is None else torch.tensor(case.spec.sinks, dtype=torch.float32)
        kernel = blocked.fa2_forward_raw(t.q, t.k, t.v, causal=causal, block_m=blocks[0], block_n=blocks[1],
                                         descales=descales, num_splits=case.spec.num_splits, sinks=sinks,
                                         softcap=case.spec.softcap or 0.0)
        for name, (out, lse) in (("eager", (truth.eager["out"], truth.eager["lse"])), ("fa2_blocked", kernel)):
            assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
            for op, got in (("out", out), ("lse", lse)):
                ratio = (abs_error(got, getattr(truth.ref, op)) / bound[op]).nan_to_num(0.0, posinf=float("inf"))
                worst = max(worst, float(ratio.max()))
                assert float(ratio.max()) <= 1.0, (name, op, case.describe(), float(ratio.max()))
    assert worst > 1e-3  # the bound is no wall a hundred times away: it sees the float8 roundings


@pytest.mark.parametrize("dtype", FP8)
def test_a_float8_kernel_that_forgets_v_s_descale_exceeds_the_bound(dtype):
    case = _case(dtype, descale=True, magnitude="v_wide_range")
    t = case.build()
    truth = Truth(case, t.q, t.k, t.v, descales=t.descales)
    out, _ = blocked.fa2_forward_raw(t.q, t.k, t.v, descales=(t.descales[0], t.descales[1], None))
    assert float((abs_error(out, truth.ref.out) / truth.forward_bounds["out"]).max()) > 1.0


def test_the_float8_backward_bound_is_refused():
    case = _case(torch.float8_e4m3fn)
    t = case.build()
    ref = reference.attention(t.q.to(F64), t.k.to(F64), t.v.to(F64), dout=t.dout.to(F64))
    with pytest.raises(ValueError, match="float8 format, which the contract takes in the forward only"):
        bounds.backward_bounds(ref, t.q, t.k, t.v, dtype=torch.float8_e4m3fn, out=t.dout)


def test_the_float8_baseline_takes_the_descales_it_is_given():
    case = _case(torch.float8_e4m3fn, descale=True)
    t = case.build()
    with_d, _ = baseline.forward(t.q, t.k, t.v, descales=t.descales)
    without, _ = baseline.forward(t.q, t.k, t.v)
    assert not torch.equal(with_d, without)


# --- refusals ------------------------------------------------------------------------------------------

def test_a_declaration_with_descale_needs_a_float8_dtype():
    with pytest.raises(ImplementationError, match=r"descale=True, but dtypes=float16 holds no float8 format"):
        Implementation(name="k", forward=lambda *a, **k: None, dtypes=(torch.float16,), descale=True)
    fp8_only = Implementation(name="k", forward=lambda *a, **k: None, dtypes=(torch.float8_e4m3fn,))
    words = " | ".join(fp8_only.not_covered())
    assert "float8 inputs with descales" in words and "float8_e5m2" in words


def test_every_other_declaration_lists_float8_as_not_covered():
    assert any(line.startswith("float8 inputs (float8_e4m3fn, float8_e5m2): not covered")
               for line in registry()["eager"].not_covered())
    assert not any("float8" in line for line in registry()["fa2_blocked"].not_covered())


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d[:1], r"q_descale.shape=\(1, 2\), but should be \[batch, kv_heads\] = \[2, 2\]"),
    (lambda d: d.double(), r"q_descale.dtype=float64, but should be float32"),
    (lambda d: d * 0, r"q_descale holds 0.0, but should hold finite positive factors"),
    (lambda d: d * float("nan"), r"q_descale holds nan, but should hold finite positive factors"),
])
def test_bad_descales_are_refused_in_words(change, words):
    case = _case(torch.float8_e4m3fn, descale=True)
    t = case.build()
    with pytest.raises(ValueError, match=words):
        blocked.fa2_forward(t.q, t.k, t.v, q_descale=change(t.descales[0]), k_descale=t.descales[1])


def test_descales_with_16_bit_inputs_are_refused():
    q = torch.zeros(2, 4, 3, 8, dtype=torch.float16)
    k = torch.zeros(2, 2, 3, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"k_descale given with float16 inputs; descales come with float8"):
        _validate.check_descales(q, k, (None, torch.ones(2, 2), None), kernel="k")


def test_the_blocked_kernel_takes_float8_sequences_without_descales_and_refuses_them_with():
    q = torch.randn(5, 2, 8).to(torch.float8_e4m3fn)
    k = torch.randn(7, 2, 8).to(torch.float8_e4m3fn)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    out, lse = blocked.fa2_forward(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=4)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 2, 8) and lse.shape == (2, 5)
    with pytest.raises(ValueError, match="descales are taken in a dense batch only, not with cu_seqlens_q"):
        blocked.fa2_forward(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=4,
                            v_descale=torch.ones(2, 2))


def test_fa1_refuses_float8_in_words():
    q = torch.randn(1, 1, 2, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"fa1_blocked: q.dtype=float8_e4m3fn, but should be one of float16"):
        blocked.fa1_forward(q, q, q)
