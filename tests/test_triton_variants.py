"""The Triton FA2/FA1 kernels' variants (sliding windows, chunks, softcap, ALiBi, sinks, packed
variable-length sequences) against the float64 reference, forward, autograd and the declared backward, in
Triton's interpreter on a machine without a GPU (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``); the
interpreter's tanh within the rounding model's 4 u; bad input refused in words. ``pytest verify`` checks
them in depth (``--impl triton_fa2``); these are quick sanity checks."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from flashverify_kernels.triton import attention as ta  # noqa: E402
from flashverify_kernels.declaration import Implementation, sinks_tensor  # noqa: E402
from references import attention as reference  # noqa: E402
from references.spec import AttentionSpec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not ta.INTERPRET else "cpu"
pytestmark = pytest.mark.skipif(DEVICE not in ta.DEVICES, reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")

SPECS = [
    AttentionSpec(causal=True, window_left=5, window_right=3),
    AttentionSpec(window_left=0, window_right=0),
    AttentionSpec(causal=True, attention_chunk=7),
    AttentionSpec(softcap=2.0, causal=True),
    AttentionSpec(alibi_slopes=(0.5, 0.125), causal=True),
    AttentionSpec(sinks=(0.5, 3.0), causal=True),
    AttentionSpec(sinks=(0.5, 3.0), softcap=5.0, alibi_slopes=(0.25, 0.5), window_left=9),
    AttentionSpec(causal=True, sequences="packed", seqlens_q=(5, 0, 20, 12), seqlens_k=(9, 3, 20, 13)),
    AttentionSpec(causal=True, sequences="packed", seqlens_q=(5, 0, 20, 12), seqlens_k=(9, 3, 20, 13), sinks=(1.0, -1.0),
                  alibi_slopes=(0.5, 0.25), window_left=4),
]


def _implementation(forward) -> Implementation:
    return Implementation(name="triton", forward=forward, backward=ta.fa2_backward, dtypes=ta.DTYPES,
                          devices=(DEVICE,), gqa=True, windows=True, chunks=True, softcap=True, alibi=True, sinks=True,
                          sequences=("dense", "packed"))


@pytest.mark.parametrize("forward", [ta.fa2_forward, ta.fa1_forward], ids=["fa2", "fa1"])
@pytest.mark.parametrize("spec", SPECS, ids=[s.describe() for s in SPECS])
def test_variants_equal_the_float64_reference(forward, spec):
    impl = _implementation(forward)
    g = torch.Generator().manual_seed(0)
    nq, nk = (sum(spec.seqlens_q), sum(spec.seqlens_k)) if spec.varlen else (37, 45)
    q, dout = (torch.randn(1, 2, nq, 16, generator=g).to(DEVICE) for _ in range(2))
    k, v = (torch.randn(1, 1, nk, 16, generator=g).to(DEVICE) for _ in range(2))
    ref = reference.attention(q, k, v, spec=spec, dout=dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = sinks_tensor("t", spec, device=DEVICE).requires_grad_() if spec.sinks else None
    out, lse = impl.call(*leaves, spec=spec, block_m=16, block_n=16, sinks=sinks)
    out.backward(dout)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref.lse))
    finite = torch.isfinite(ref.lse)
    got = [out, lse[finite], *(x.grad for x in leaves)] + ([sinks.grad] if sinks is not None else [])
    want = [ref.out, ref.lse[finite], ref.dq, ref.dk, ref.dv] + ([ref.dsinks] if sinks is not None else [])
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max().item() < 5e-6  # float32 on N(0, 1) inputs: about 1e-6 at most
    grads = impl.call_backward(q, k, v, out.detach(), lse, dout, spec=spec, block_m=16, block_n=16)
    for a, b in zip(grads, (ref.dq, ref.dk, ref.dv, ref.delta, ref.dsinks)):
        assert (a.double() - b).abs().max().item() < 5e-6


def test_the_interpreter_s_tanh_is_within_the_rounding_model():
    """The bound assumes tanh within C_TANH = 4 units of roundoff (references/bounds.py, section 13); the
    interpreter's tanh (no libdevice there) is measured against float64 over a dense grid."""
    if not ta.INTERPRET:
        pytest.skip("on the GPU the kernels use CUDA's tanhf (within 2 ulps)")
    import triton.language as tl

    from references.bounds import C_TANH

    @triton.jit
    def tanh_kernel(X, Y, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(Y + o, ta._tanh(tl.load(X + o), False))

    n = 2 ** 14
    x = torch.cat([torch.linspace(-20, 20, n // 2), torch.logspace(-30, 1.5, n // 4), -torch.logspace(-30, 1.5, n // 4)])
    y = torch.empty_like(x)
    tanh_kernel[(1,)](x, y, n)
    exact = torch.tanh(x.double())
    relative = ((y.double() - exact).abs() / exact.abs().clamp(min=1e-300)).max().item()
    assert relative <= C_TANH * 2.0 ** -24, relative


@pytest.mark.parametrize("change, words", [
    (dict(window_size=(-3, 1)), r"window_size=\(-3, 1\), but should be a pair"),
    (dict(softcap=-2.0), "softcap=-2.0, but should be a finite number >= 0"),
    (dict(attention_chunk=-1), "attention_chunk=-1, but should be an int >= 0"),
    (dict(alibi_slopes=torch.zeros(3)), r"alibi_slopes.shape=\(3,\), but should be a float32 torch.Tensor of shape "
                                          r"\[Hq\]=\[2\] or \[B, Hq\]=\[2, 2\]"),
    (dict(sinks=torch.zeros(2, dtype=torch.float64)), "sinks is a float64 tensor"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 4], dtype=torch.int32)), r"cu_seqlens_q=\[0, 5, 4\] decreases at entry 2"),
])
def test_bad_variant_input_is_refused_by_name(change, words):
    if DEVICE != "cpu":
        pytest.skip("the messages name the CPU device")
    q, k = torch.randn(4, 2, 16), torch.randn(6, 1, 16)
    packed = dict(cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32), max_seqlen_q=3, max_seqlen_k=3)
    with pytest.raises(ValueError, match=words):
        ta.fa2_forward(q, k, k, causal=True, **{**packed, **change})


DECODE_SPECS = [
    AttentionSpec(causal=True, sequences="paged", seqlens_q=(1, 1, 1), seqlens_k=(40, 0, 17), page_size=16, page_seed=3),
    AttentionSpec(causal=True, sequences="paged", seqlens_q=(5, 5), seqlens_k=(70, 3), page_size=5, page_seed=9,
                  num_splits=3),
    AttentionSpec(causal=True, sequences="paged", seqlens_q=(2, 2), seqlens_k=(33, 1), page_size=1, num_splits=4,
                  sinks=(1.0, 0.5, -2.0, 9.0)),
    AttentionSpec(sequences="paged", seqlens_q=(3, 3), seqlens_k=(50, 20), page_size=16, num_splits=2, softcap=3.0,
                  alibi_slopes=(0.5, 0.25, 0.125, 1.0), window_left=10),
]


@pytest.mark.parametrize("spec", DECODE_SPECS, ids=[s.describe() for s in DECODE_SPECS])
def test_split_kv_decoding_from_pages_equals_the_float64_reference(spec):
    from flashverify_kernels.registry import registry

    impl = registry()["triton_decode"]
    g = torch.Generator().manual_seed(1)
    nq, nk = sum(spec.seqlens_q), sum(spec.seqlens_k)
    q = torch.randn(1, 4, nq, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(1, 2, nk, 16, generator=g).to(DEVICE) for _ in range(2))
    ref = reference.attention(q, k, v, spec=spec)
    out, lse = impl.call(q, k, v, spec=spec)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref.lse))
    finite = torch.isfinite(ref.lse)
    assert (out.double() - ref.out).abs().max().item() < 2e-6
    assert (lse.double()[finite] - ref.lse[finite]).abs().max().item() < 2e-6


def test_decoding_refuses_more_queries_than_it_takes_and_bad_tables():
    from flashverify_kernels.triton.decode import decode_forward

    if DEVICE != "cpu":
        pytest.skip("the messages name the CPU device")
    q, pages = torch.randn(2, 2, 17, 16), torch.randn(4, 4, 1, 16)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="q has 17 queries per sequence, but should have 1..16"):
        decode_forward(q, pages, pages, block_table=table, seqlens_k=lens)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]=7 points past the cache: pages are 0..3"):
        decode_forward(q[:, :, :2], pages, pages, block_table=torch.tensor([[0, 1], [2, 7]], dtype=torch.int32),
                       seqlens_k=lens)
    with pytest.raises(ValueError, match="num_splits=0, but should be an int >= 1"):
        decode_forward(q[:, :, :2], pages, pages, block_table=table, seqlens_k=lens, num_splits=0)
