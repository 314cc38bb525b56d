"""The variants in the shipped PyTorch kernels (fa2_blocked, fa1_blocked, eager): chunks, sinks, split-KV and
variable-length sequences (packed, padded, paged) against the float64 reference, through autograd and the
declared backward, and bad input refused with the field's name and what is allowed."""

import pytest
import torch

from flashverify_kernels.pytorch import blocked
from flashverify_kernels.pytorch.adapters import eager_forward
from flashverify_kernels.declaration import sinks_tensor
from flashverify_kernels.registry import registry
from references import attention as reference
from references.spec import AttentionSpec

SPECS = [
    AttentionSpec(causal=True, sinks=(0.5, -1.0)),
    AttentionSpec(causal=True, num_splits=3, sinks=(0.5, 2.0)),
    AttentionSpec(num_splits=4),
    AttentionSpec(attention_chunk=2, window_left=3),
    AttentionSpec(causal=True, attention_chunk=3, alignment="bottom_right"),
    AttentionSpec(causal=True, sequences="packed", seqlens_q=(2, 0, 3), seqlens_k=(1, 3, 2), sinks=(0.5, 1.0),
                  alibi_slopes=(0.5, 0.25), num_splits=2),
    AttentionSpec(sequences="padded", seqlens_q=(2, 0, 3), seqlens_k=(1, 3, 0), softcap=3.0, window_left=1),
    AttentionSpec(causal=True, sequences="paged", seqlens_q=(2, 2, 2), seqlens_k=(1, 5, 2), page_size=2,
                  page_seed=3),
    AttentionSpec(causal=True, sequences="paged", seqlens_q=(1, 1), seqlens_k=(0, 4), page_size=3, sinks=(1.0, 0.0)),
]


def _case(spec, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    nq, nk = (sum(spec.seqlens_q), sum(spec.seqlens_k)) if spec.varlen else (5, 7)
    q, dout = (torch.randn(1, 2, nq, 4, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, 1, nk, 4, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, dout


@pytest.mark.parametrize("name", ["fa2_blocked", "fa1_blocked", "eager"])
@pytest.mark.parametrize("spec", SPECS, ids=[s.describe() for s in SPECS])
def test_float64_kernels_equal_the_reference(name, spec):
    impl = registry()[name]
    q, k, v, dout = _case(spec)
    ref = reference.attention(q, k, v, spec=spec, dout=dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = sinks_tensor(name, spec, dtype=torch.float64).requires_grad_() if spec.sinks else None
    out, lse = impl.call(*leaves, spec=spec, block_m=2, block_n=3, sinks=sinks)
    out.backward(dout)
    finite = torch.isfinite(ref.lse)
    pairs = [(out, ref.out), (lse[finite], ref.lse[finite]), (leaves[0].grad, ref.dq), (leaves[1].grad, ref.dk),
             (leaves[2].grad, ref.dv)] + ([(sinks.grad, ref.dsinks)] if sinks is not None else [])
    for got, want in pairs:
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-13)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref.lse))
    if impl.backward is not None:  # the declared backward, in the call's own layout
        grads = impl.call_backward(q, k, v, out.detach(), lse, dout, spec=spec, block_m=2, block_n=3)
        for got, want in zip(grads, (ref.dq, ref.dk, ref.dv, ref.delta, ref.dsinks)):
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-13)


def test_split_kv_is_the_same_whatever_the_number_of_splits_in_float32():
    q, k, v, _ = _case(AttentionSpec(), dtype=torch.float32)
    one, lse1 = blocked.fa2_forward(q, k, v, causal=True, block_m=2, block_n=2)
    for splits in (2, 3, 7):
        out, lse = blocked.fa2_forward(q, k, v, causal=True, block_m=2, block_n=2, num_splits=splits)
        assert torch.allclose(out, one, atol=1e-6) and torch.allclose(lse, lse1, atol=1e-6)


def _packed(total_q=5, total_k=6):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(total_q, 2, 4, generator=g), torch.randn(total_k, 1, 4, generator=g),
            torch.randn(total_k, 1, 4, generator=g))


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


PACKED = dict(cu_seqlens_q=_i32(0, 2, 5), cu_seqlens_k=_i32(0, 4, 6), max_seqlen_q=3, max_seqlen_k=4)


@pytest.mark.parametrize("forward", [blocked.fa2_forward, blocked.fa1_forward, eager_forward],
                         ids=["fa2_blocked", "fa1_blocked", "eager"])
@pytest.mark.parametrize("change, words", [
    (dict(cu_seqlens_q=_i32(0, 3, 2, 5)), r"cu_seqlens_q=\[0, 3, 2, 5\] decreases at entry 2 \(3 -> 2\), but should "
                                           "be non-decreasing"),
    (dict(cu_seqlens_k=_i32(1, 4, 6)), r"cu_seqlens_k=\[1, 4, 6\], but should start at 0"),
    (dict(cu_seqlens_q=_i32(0, 2, 4)), r"cu_seqlens_q=\[0, 2, 4\] ends at 4, but the packed tensor holds 5 rows"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 5])), r"cu_seqlens_q is a int64 tensor .* but should be an int32"),
    (dict(cu_seqlens_k=_i32(0, 6)), "cu_seqlens_q has 2 sequences and cu_seqlens_k 1"),
    (dict(max_seqlen_q=2), r"max_seqlen_q=2, but should be an int >= the longest sequence, 3"),
    (dict(window_size=(-2, 0)), r"window_size=\(-2, 0\), but should be a pair \(left, right\) of ints >= -1"),
    (dict(softcap=-1.0), r"softcap=-1.0, but should be a finite number >= 0"),
    (dict(attention_chunk=-1), "attention_chunk=-1, but should be an int >= 0"),
    (dict(num_splits=0), "num_splits=0, but should be an int >= 1"),
    (dict(sinks=torch.zeros(3)), r"sinks is a float32 tensor of shape \(3,\) on cpu, but should be a float32 "
                                 r"torch.Tensor of shape \[Hq\]=\[2\]"),
    (dict(sinks=torch.zeros(2, dtype=torch.float16)), "sinks is a float16 tensor"),
])
def test_bad_variable_length_input_is_refused_by_name(forward, change, words):
    q, k, v = _packed()
    with pytest.raises(ValueError, match=words):
        forward(q, k, v, causal=True, **{**PACKED, **change})


@pytest.mark.parametrize("forward", [blocked.fa2_forward, eager_forward], ids=["fa2_blocked", "eager"])
@pytest.mark.parametrize("change, words", [
    (dict(block_table=_i32(0, 9)[None].expand(2, 2).contiguous()), r"block_table\[0, 1\]=9 points past the cache: "
                                                                     r"pages are 0..3"),
    (dict(block_table=_i32(0)[None].expand(2, 1).contiguous()), r"seqlens_k\[0\]=3 needs 2 pages of 2, but "
                                                                 "block_table has 1 entries per sequence"),
    (dict(seqlens_k=_i32(3, 9)), r"seqlens_k\[1\]=9, but every length should be in 0..8"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), "block_table is a int64 tensor"),
])
def test_bad_paged_input_is_refused_by_name(forward, change, words):
    g = torch.Generator().manual_seed(0)
    q, pages = torch.randn(2, 2, 1, 4, generator=g), torch.randn(4, 2, 1, 4, generator=g)
    good = dict(block_table=_i32(0, 1, 2, 3).view(2, 2), seqlens_k=_i32(3, 4))
    forward(q, pages, pages, causal=True, **good)  # the good call runs
    with pytest.raises(ValueError, match=words):
        forward(q, pages, pages, causal=True, **{**good, **change})


def test_padded_lengths_past_the_tensor_are_refused():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 1, 5, 4, generator=g)
    with pytest.raises(ValueError, match=r"seqlens_q\[1\]=4, but every length should be in 0..3"):
        blocked.fa2_forward(q, k, k, seqlens_q=_i32(3, 4), seqlens_k=_i32(5, 0))
    with pytest.raises(ValueError, match="out=/lse= buffers are taken for a dense batch only"):
        blocked.fa2_forward(q, k, k, seqlens_q=_i32(3, 3), seqlens_k=_i32(5, 0), out=torch.empty_like(q))
