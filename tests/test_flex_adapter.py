"""The FlexAttention adapter (flashverify_kernels/pytorch/adapters.py) on CPU, through uncompiled flex_attention: every variant it
declares (bottom-right and top-left causal, windows, chunks, softcap, ALiBi, sinks, packed sequences) gives the
float64 reference's out, natural-log LSE and gradients (the sinks' too); rows that see no key give 0 and -inf;
bad input is refused with the field's name; the declarations say what the adapter takes. The compiled kernel
itself needs a GPU: `pytest verify --impl flex_attention` there (docs/gpu-runs.md)."""

import dataclasses
import functools
import math

import pytest
import torch

from flashverify_kernels.pytorch import adapters
from flashverify_kernels.declaration import sinks_tensor
from flashverify_kernels.registry import FLEX_ATTENTION, FLEX_ATTENTION_UNCOMPILED, default_selection, registry
from references import attention as reference
from references.spec import AttentionSpec

FLEX = FLEX_ATTENTION_UNCOMPILED
TOP_LEFT = dataclasses.replace(
    FLEX, forward=functools.partial(adapters.flex_attention_uncompiled_forward, causal_alignment="top_left"),
    causal_alignment="top_left")
SLOPES = (0.5, 0.25, 1.0, 0.125)  # float32-exact, one per query head, all different
SINKS = (0.5, -1.0, 2.0, 30.0)  # the last one dominates every score of its head
PACKED = dict(sequences="packed", seqlens_q=(3, 0, 5, 2, 1), seqlens_k=(4, 2, 3, 0, 6))

SPECS = [
    AttentionSpec(),
    AttentionSpec(causal=True),
    AttentionSpec(window_left=2, window_right=1),
    AttentionSpec(causal=True, window_left=3),
    AttentionSpec(window_left=0, window_right=0),
    AttentionSpec(attention_chunk=3),
    AttentionSpec(causal=True, attention_chunk=4),
    AttentionSpec(softcap=1.5),
    AttentionSpec(alibi_slopes=SLOPES),
    AttentionSpec(causal=True, softcap=2.0, alibi_slopes=SLOPES),
    AttentionSpec(sinks=SINKS),
    AttentionSpec(causal=True, window_left=1, sinks=(0.5, -1.0, 2.0, 0.0)),
    AttentionSpec(**PACKED),
    AttentionSpec(causal=True, **PACKED),
    AttentionSpec(window_left=1, window_right=2, alibi_slopes=SLOPES, **PACKED),
    AttentionSpec(causal=True, window_left=2, attention_chunk=2, softcap=3.0, alibi_slopes=SLOPES,
                  sinks=(0.5, -1.0, 2.0, 0.0), **PACKED),
]
LENGTHS = [(7, 11), (11, 7)]  # Nq < Nk and Nq > Nk (bottom-right causal: the first 4 rows see no key)
# (rtol, atol) of out, lse and the gradients against the float64 reference.
TOLERANCE = {torch.float64: (1e-12, 1e-13), torch.float32: (1e-5, 2e-5)}


def _inputs(spec, dtype, lengths=(7, 11), *, seed=0, batch=2, d=8):
    """``q, k, v, dout`` in the references' frame (float64 values rounded to ``dtype``), Hq = 4, Hkv = 2."""
    g = torch.Generator().manual_seed(seed)
    if spec.varlen:
        batch, lengths = 1, (sum(spec.seqlens_q), sum(spec.seqlens_k))
    len_q, len_k = lengths
    q, dout = (torch.randn(batch, 4, len_q, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    k, v = (torch.randn(batch, 2, len_k, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, dout


def _run(impl, spec, q, k, v, dout, *, scale=None):
    """The implementation through autograd: ``(out, lse, [dq, dk, dv(, dsinks)])`` in the references' frame."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = sinks_tensor(impl.name, spec, dtype=q.dtype).requires_grad_() if spec.sinks is not None else None
    out, lse = impl.call(*leaves, spec=spec, scale=scale, sinks=sinks)
    out.backward(dout)
    return out, lse, [t.grad for t in leaves] + ([sinks.grad] if sinks is not None else [])


def _assert_matches_reference(impl, spec, dtype, lengths, *, scale=None):
    q, k, v, dout = _inputs(spec, dtype, lengths)
    ref = reference.attention(q, k, v, spec=spec, scale=scale, dout=dout)
    out, lse, grads = _run(impl, spec, q, k, v, dout, scale=scale)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rtol, atol = TOLERANCE[dtype]
    seen = torch.isfinite(ref.lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref.lse)), "rows without keys: lse should be -inf there"
    wanted = [ref.dq, ref.dk, ref.dv] + ([ref.dsinks] if spec.sinks is not None else [])
    pairs = [("out", out, ref.out), ("lse", lse[seen], ref.lse[seen])]
    pairs += list(zip(("dq", "dk", "dv", "dsinks"), grads, wanted))
    for what, got, want in pairs:
        err = (got.double() - want).abs().max().item() if want.numel() else 0.0
        assert torch.allclose(got.double(), want, rtol=rtol, atol=atol), f"{what}: max error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["Nq<Nk", "Nq>Nk"])
@pytest.mark.parametrize("spec", SPECS, ids=[s.describe() for s in SPECS])
def test_every_declared_variant_matches_the_float64_reference(spec, lengths, dtype):
    _assert_matches_reference(FLEX, spec, dtype, lengths)


TOP_LEFT_SPECS = [AttentionSpec(causal=True, alignment="top_left"),
                  AttentionSpec(causal=True, alignment="top_left", window_left=2, alibi_slopes=SLOPES),
                  AttentionSpec(causal=True, alignment="top_left", attention_chunk=3, **PACKED)]


@pytest.mark.parametrize("lengths", LENGTHS, ids=["Nq<Nk", "Nq>Nk"])
@pytest.mark.parametrize("spec", TOP_LEFT_SPECS, ids=[s.describe() for s in TOP_LEFT_SPECS])
def test_top_left_alignment_when_asked_for(spec, lengths):
    _assert_matches_reference(TOP_LEFT, spec, torch.float64, lengths)


@pytest.mark.parametrize("lengths", LENGTHS, ids=["Nq<Nk", "Nq>Nk"])
def test_the_alignments_differ_and_the_default_is_bottom_right(lengths):
    q, k, v, _ = _inputs(AttentionSpec(), torch.float64, lengths)
    out = adapters.flex_attention_uncompiled_forward(q, k, v, causal=True)[0]
    for alignment, same in (("bottom_right", True), ("top_left", False)):
        want = reference.forward(q, k, v, spec=AttentionSpec(causal=True, alignment=alignment))[0]
        assert torch.allclose(out, want, atol=1e-12) is same, alignment


@pytest.mark.parametrize("scale", [0.3, 0.0, -1.5])
def test_explicit_scales(scale):
    _assert_matches_reference(FLEX, AttentionSpec(causal=True, softcap=2.0, sinks=SINKS), torch.float64, (7, 11),
                              scale=scale)


def test_the_lse_is_the_natural_log_one():
    """FlexAttention keeps its LSE in base 2 inside and returns it multiplied by ln 2: the adapter returns it
    as the contract's natural-log LSE (a base-2 LSE would be 1/ln 2 = 1.44 times larger here)."""
    q, k, v, _ = _inputs(AttentionSpec(), torch.float64, (5, 9))
    _, lse = adapters.flex_attention_uncompiled_forward(q, k, v)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    natural = torch.logsumexp(scores, dim=-1)
    assert torch.allclose(lse, natural, rtol=1e-13, atol=1e-13)
    assert not torch.allclose(lse, natural / math.log(2), rtol=1e-3)


def test_rows_that_see_no_key_give_zero_and_minus_infinity():
    """Bottom-right causal with Nq > Nk hides every key from the first Nq - Nk rows, and a packed sequence
    with no keys from all its rows: out exactly 0, lse -inf, no NaN anywhere, zero gradients there; with a
    sink they see the sink alone: out 0 and lse the sink's logit."""
    spec = AttentionSpec(causal=True)
    q, k, v, dout = _inputs(spec, torch.float32, (9, 5))
    out, lse, (dq, _, _) = _run(FLEX, spec, q, k, v, dout)
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4])) and torch.isneginf(lse[:, :, :4]).all()
    assert torch.isfinite(lse[:, :, 4:]).all() and not out.isnan().any() and not dq.isnan().any()
    assert torch.equal(dq[:, :, :4], torch.zeros_like(dq[:, :, :4]))

    packed = AttentionSpec(sequences="packed", seqlens_q=(2, 3), seqlens_k=(0, 4))
    q, k, v, dout = _inputs(packed, torch.float32)
    out, lse, _ = _run(FLEX, packed, q, k, v, dout)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2])) and torch.isneginf(lse[:, :, :2]).all()
    assert torch.isfinite(lse[:, :, 2:]).all()

    with_sinks = AttentionSpec(causal=True, sinks=(0.5, -1.0, 2.0, 30.0))
    q, k, v, dout = _inputs(with_sinks, torch.float32, (9, 5))
    out, lse, _ = _run(FLEX, with_sinks, q, k, v, dout)
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    # FlexAttention's LSE goes through base 2 and back (an ulp of rounding)
    assert torch.allclose(lse[:, :, :4], torch.tensor(with_sinks.sinks)[None, :, None].expand(2, 4, 4), rtol=1e-6)


def test_a_packed_call_returns_the_packed_layout():
    spec = AttentionSpec(causal=True, **PACKED)
    q, k, v, _ = _inputs(spec, torch.float32)
    qp, kp, vp = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (spec.cu_seqlens_q, spec.cu_seqlens_k))
    out, lse = adapters.flex_attention_uncompiled_forward(qp, kp, vp, causal=True, cu_seqlens_q=cu_q,
                                                          cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6)
    assert out.shape == qp.shape and lse.shape == (4, qp.shape[0]) and lse.dtype == torch.float32
    ref = reference.forward(q, k, v, spec=spec)
    assert torch.allclose(out, ref[0][0].transpose(0, 1).float(), atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_keep_their_dtype_and_a_float32_lse(dtype):
    spec = AttentionSpec(causal=True, softcap=2.0, sinks=SINKS)
    q, k, v, dout = _inputs(spec, dtype)
    out, lse, grads = _run(FLEX, spec, q, k, v, dout)
    assert out.dtype == dtype and lse.dtype == torch.float32 and [g.dtype for g in grads[:3]] == [dtype] * 3
    ref = reference.attention(q, k, v, spec=spec)
    assert torch.allclose(out.double(), ref.out, atol=2e-2) and torch.allclose(lse.double(), ref.lse, atol=1e-4)


def test_strided_inputs():
    """[B, N, H, D] storage passed as a transposed view, as the suite's layouts do."""
    spec = AttentionSpec(causal=True, window_left=2, alibi_slopes=SLOPES)
    q, k, v, dout = _inputs(spec, torch.float64)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not views[0].is_contiguous()
    out, lse = FLEX.call(*views, spec=spec)
    ref = reference.forward(q, k, v, spec=spec)
    assert torch.allclose(out, ref[0], atol=1e-13) and torch.allclose(lse, ref[1], atol=1e-13)


def test_block_masks_are_reused_only_for_the_same_geometry():
    """A call reuses the block mask of an earlier call with the same lengths and mask, never another's: two
    windows on the same shapes each give their own reference."""
    adapters._flex_masks.clear()
    q, k, v, _ = _inputs(AttentionSpec(), torch.float64)
    for window in ((1, 0), (3, 2), (1, 0)):
        spec = AttentionSpec(window_left=window[0], window_right=window[1])
        out = adapters.flex_attention_uncompiled_forward(q, k, v, window_size=window)[0]
        assert torch.allclose(out, reference.forward(q, k, v, spec=spec)[0], atol=1e-13), window
    assert len(adapters._flex_masks) == 2


def test_the_sinks_gradient_flows_to_the_tensor_passed():
    spec = AttentionSpec(causal=True, sinks=(0.5, -1.0, 2.0, 0.0))
    q, k, v, dout = _inputs(spec, torch.float64)
    sinks = sinks_tensor("flex", spec, dtype=torch.float64).requires_grad_()
    out, _ = FLEX.call(q, k, v, spec=spec, sinks=sinks)
    (dsinks,) = torch.autograd.grad(out, [sinks], dout)
    ref = reference.attention(q, k, v, spec=spec, dout=dout)
    assert dsinks.abs().min() > 0 and torch.allclose(dsinks, ref.dsinks, rtol=1e-12, atol=1e-13)


# --------------------------------------------------------------------------------- bad input, in words
def _dense(**extra):
    q, k, v, _ = _inputs(AttentionSpec(), torch.float32)
    return (q, k, v), extra


def _packed(q_rows=6, k_rows=7, **extra):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_rows, 4, 8, generator=g)
    k = torch.randn(k_rows, 2, 8, generator=g)
    keywords = dict(cu_seqlens_q=torch.tensor([0, 2, q_rows], dtype=torch.int32),
                    cu_seqlens_k=torch.tensor([0, 3, k_rows], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=4)
    return (q, k, k.clone()), {**keywords, **extra}


BAD = {
    "window": (_dense(window_size=(-2, 1)), r"window_size=\(-2, 1\), but should be a pair \(left, right\) of ints >= -1"),
    "softcap": (_dense(softcap=-1.0), r"softcap=-1.0, but should be a finite number >= 0"),
    "chunk": (_dense(attention_chunk=-3), r"attention_chunk=-3, but should be an int >= 0"),
    "slopes dtype": (_dense(alibi_slopes=torch.ones(4, dtype=torch.float64)),
                     r"alibi_slopes.dtype=float64, but should be a float32 torch.Tensor"),
    "slopes per batch": (_dense(alibi_slopes=torch.ones(2, 4)), r"takes per-head slopes only"),
    "sinks shape": (_dense(sinks=torch.zeros(3)), r"sinks is a float32 tensor of shape \(3,\) on cpu, but should be"),
    "sinks dtype": (_dense(sinks=torch.zeros(4, dtype=torch.float64)), r"sinks is a float64 tensor"),
    "alignment": (_dense(causal_alignment="centre"), r"causal_alignment='centre', but should be one of"),
    "causal": (_dense(causal=1), r"causal=1, but should be a bool"),
    "cu_seqlens alone": (_packed(cu_seqlens_k=None), r"take both cu_seqlens_q and cu_seqlens_k"),
    "cu_seqlens int64": (_packed(cu_seqlens_q=torch.tensor([0, 2, 6])),
                         r"cu_seqlens_q is a int64 tensor of shape \(3,\) on cpu, but should be an int32"),
    "cu_seqlens end": (_packed(cu_seqlens_k=torch.tensor([0, 3, 5], dtype=torch.int32)),
                       r"cu_seqlens_k=\[0, 3, 5\] ends at 5, but the packed tensor holds 7 rows"),
    "cu_seqlens count": (_packed(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)),
                         r"cu_seqlens_q has 2 sequences and cu_seqlens_k 1"),
    "max_seqlen": (_packed(max_seqlen_q=3), r"max_seqlen_q=3, but should be an int >= the longest sequence, 4"),
    "packed without cu_seqlens": (_packed(cu_seqlens_q=None, cu_seqlens_k=None),
                                  r"is packed \[total_q, Hq, D\], but no cu_seqlens_q and cu_seqlens_k were given"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_refused_naming_the_field(name):
    (tensors, keywords), words = BAD[name]
    with pytest.raises(ValueError, match=words) as refused:
        adapters.flex_attention_uncompiled_forward(*tensors, **keywords)
    assert str(refused.value).startswith("flex_attention_uncompiled: ")


@pytest.mark.parametrize("spec", [AttentionSpec(), AttentionSpec(causal=True, window_left=1, softcap=2.0),
                                  AttentionSpec(sinks=SINKS), AttentionSpec(sequences="packed", seqlens_q=(2, 3),
                                                                            seqlens_k=(0, 0))],
                         ids=lambda s: s.describe())
def test_no_keys_at_all(spec):
    """Nk = 0, which FlexAttention cannot reduce over: the adapter adds a key the mask hides from every row (or
    the sink's key is the only one), and FlexAttention gives out 0 and lse -inf (the sink's logit), gradients 0."""
    q, k, v, dout = _inputs(spec, torch.float32, (5, 0))
    out, lse, grads = _run(FLEX, spec, q, k, v, dout)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(grads[0], torch.zeros_like(q))
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    if spec.sinks is None:
        assert torch.isneginf(lse).all()
    else:  # FlexAttention's LSE goes through base 2 and back (an ulp of rounding)
        assert torch.allclose(lse, torch.tensor(SINKS)[None, :, None].expand_as(lse), rtol=1e-6)
        assert torch.equal(grads[3], torch.zeros(4))


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_no_queries_give_empty_results(packed):
    spec = AttentionSpec(causal=True, sequences="packed", seqlens_q=(0,), seqlens_k=(3,)) if packed else \
        AttentionSpec(causal=True)
    q, k, v, _ = _inputs(spec, torch.float32, (0, 3))
    out, lse = FLEX.call(q, k, v, spec=spec)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32


@pytest.mark.parametrize("tensors, words", [
    ((torch.zeros(1, 1, 4, 16, dtype=torch.float16),) * 3, "q is on cpu, but this kernel runs on cuda"),
    ((torch.zeros(1, 1, 4, 16, dtype=torch.float64),) * 3, "q.dtype=float64, but should be one of float16, bfloat16, "
                                                           "float32"),
    ((torch.zeros(3, 1, 16, dtype=torch.float16),) * 3, r"q.shape=\(3, 1, 16\) is packed"),
])
def test_the_compiled_adapter_refuses_what_its_kernel_cannot_run(tensors, words):
    with pytest.raises(ValueError, match=r"^flex_attention: " + words):
        adapters.flex_attention_forward(*tensors, causal=True)


# --------------------------------------------------------------------------------- the declarations
def test_flex_attention_declares_what_the_adapter_takes():
    impl = registry()["flex_attention"]
    assert impl is FLEX_ATTENTION and impl.forward is adapters.flex_attention_forward
    assert impl.causal_alignment == "bottom_right" and impl.returns_lse and impl.gqa
    assert impl.windows and impl.chunks and impl.softcap and impl.alibi and impl.sinks and not impl.splits
    assert impl.sequences == ("dense", "packed") and impl.min_len == 0
    assert impl.devices == ("cuda",) and not impl.in_default and not impl.deterministic
    assert impl.dtypes == adapters.FLEX_DTYPES and impl.head_dims == adapters.FLEX_HEAD_DIMS
    assert impl not in default_selection(device="cuda") and impl not in default_selection(device="cpu")
    for spec, words in ((AttentionSpec(sequences="padded", seqlens_q=(1,), seqlens_k=(1,)), "sequences"),
                        (AttentionSpec(sequences="paged", seqlens_q=(1,), seqlens_k=(1,), page_size=2), "sequences"),
                        (AttentionSpec(num_splits=2), "split-KV"),
                        (AttentionSpec(causal=True, alignment="top_left"), "aligns causal masks bottom_right")):
        assert words in impl.unsupported_spec(spec)
    assert impl.unsupported_spec(SPECS[-1]) is None


def test_the_uncompiled_declaration_is_the_same_adapter_on_any_device_and_not_shipped():
    fields = ("causal_alignment", "returns_lse", "gqa", "windows", "chunks", "softcap", "alibi", "sinks", "splits",
              "sequences", "min_len", "in_default")
    assert all(getattr(FLEX, f) == getattr(FLEX_ATTENTION, f) for f in fields)
    assert FLEX.devices == ("cpu", "cuda") and torch.float64 in FLEX.dtypes and FLEX.head_dims is None
    assert FLEX.name not in registry()


def test_compiled_calls_of_one_geometry_make_one_graph(monkeypatch):
    """The compiled path's Dynamo guards (checked with Dynamo's eager backend, which needs no GPU): calls of one
    shape and one variant make one graph, the later ones reusing the first call's block mask with their own
    mask and score functions. Had the score_mod read a tensor the mask_mod also reads, the first call (a new
    block mask) would share it and the next (a reused one) would not, and each alternation recompiled (Dynamo
    guards on that sharing; a Hypothesis run of value_linearity made 24 graphs in 43 calls, now 16)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    adapters._flex_compiled_function()  # the recompilation settings of the real compiled function
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(adapters, "_flex_compiled", torch.compile(flex_attention, backend="eager"))
    monkeypatch.setattr(adapters, "_flex_masks", {})
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25])
    results = [adapters._flex(q, k, v * (i + 1), kernel="flex_attention", compiled=True, devices=("cpu",),
                              dtypes=(torch.float32,), head_dims=adapters.FLEX_HEAD_DIMS, causal=True, scale=None,
                              window_size=(2, -1), attention_chunk=0, softcap=3.0, alibi_slopes=slopes, sinks=None,
                              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                              causal_alignment="bottom_right")
               for i in range(3)]
    assert len(adapters._flex_masks) == 1, "the three calls should share one block mask"
    assert counters["stats"]["unique_graphs"] == 1, (
        f"three calls of one geometry made {counters['stats']['unique_graphs']} graphs (TORCH_LOGS=recompiles says why)")
    assert torch.allclose(results[2][0], 3 * results[0][0], atol=1e-5) and torch.equal(results[2][1], results[0][1])
