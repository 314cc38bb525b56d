"""flashverify_kernels/conventions.py: a case's packed problem laid out as a kernel takes it (packed, padded, paged) and
back, canaries where a kernel must not read, and results of the wrong shape refused in words."""

import dataclasses
import math

import pytest
import torch

from flashverify_kernels import conventions
from flashverify_kernels.declaration import Implementation
from flashverify_kernels.registry import registry
from references.spec import AttentionSpec

LENS_Q, LENS_K = (2, 0, 3), (1, 4, 2)
SPECS = {
    "packed": AttentionSpec(sequences="packed", seqlens_q=LENS_Q, seqlens_k=LENS_K),
    "padded": AttentionSpec(sequences="padded", seqlens_q=LENS_Q, seqlens_k=LENS_K),
    "paged": AttentionSpec(sequences="paged", seqlens_q=(2, 2, 2), seqlens_k=LENS_K, page_size=3, page_seed=5),
    "paged in order": AttentionSpec(sequences="paged", seqlens_q=(2, 2, 2), seqlens_k=LENS_K, page_size=2),
}


def _tensors(spec, heads=2, d=3):
    g = torch.Generator().manual_seed(0)
    nq, nk = sum(spec.seqlens_q), sum(spec.seqlens_k)
    return (torch.randn(1, heads, nq, d, generator=g), torch.randn(1, 1, nk, d, generator=g),
            torch.randn(1, 1, nk, d, generator=g))


@pytest.mark.parametrize("name", SPECS)
def test_every_tensor_comes_back_as_it_went(name):
    spec = SPECS[name]
    lay = conventions.layout(spec)
    q, k, v = _tensors(spec)
    qk, kk, vk, _ = lay.inputs(q, k, v)
    assert torch.equal(lay.queries_out(qk, what="q", heads=2, head_dim=3), q)
    assert torch.equal(lay.keys_out(kk, what="k", heads=1, head_dim=3), k)
    assert torch.equal(lay.keys_out(vk, what="v", heads=1, head_dim=3), v)
    lse = q[..., 0]
    assert torch.equal(lay.rows_out(lay.rows_in(lse), what="lse", heads=2), lse)


def test_packed_is_flash_attn_s_varlen_layout_with_nan_after_the_last_sequence():
    spec = SPECS["packed"]
    q, k, v = _tensors(spec)
    qk, kk, _, kw = conventions.layout(spec).inputs(q, k, v)
    assert qk.shape == (5, 2, 3) and kk.shape == (7, 1, 3) and qk.is_contiguous()
    assert kw["cu_seqlens_q"].tolist() == [0, 2, 2, 5] and kw["cu_seqlens_k"].tolist() == [0, 1, 5, 7]
    assert kw["cu_seqlens_q"].dtype == torch.int32 and (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (3, 4)
    assert torch.equal(qk[3], q[0, :, 3])  # row 3 is sequence 2's second query
    after = torch.empty(0).set_(qk.untyped_storage())[qk.numel():].view(-1)  # the buffer past the view
    assert after.numel() == conventions.PACKED_SLACK * 2 * 3 and bool(after.isnan().all())


def test_padded_rows_past_each_length_hold_nan():
    spec = SPECS["padded"]
    q, k, v = _tensors(spec)
    qk, kk, _, kw = conventions.layout(spec).inputs(q, k, v)
    assert qk.shape == (3, 2, 3, 3) and kk.shape == (3, 1, 4, 3)
    assert kw["seqlens_q"].tolist() == list(LENS_Q) and kw["seqlens_k"].tolist() == list(LENS_K)
    assert torch.equal(qk[2, :, :3], q[0, :, 2:5]) and bool(qk[0, :, 2:].isnan().all())
    assert bool(qk[1].isnan().all()) and bool(kk[0, :, 1:].isnan().all())


def test_pages_hold_each_sequence_s_keys_where_the_block_table_says_and_nan_elsewhere():
    spec = SPECS["paged"]
    lay = conventions.layout(spec)
    q, k, v = _tensors(spec)
    qk, kk, _, kw = lay.inputs(q, k, v)
    table, seqlens = kw["block_table"], kw["seqlens_k"]
    assert qk.shape == (3, 2, 2, 3) and torch.equal(qk[1], q[0, :, 2:4])
    assert table.dtype == torch.int32 and seqlens.tolist() == list(LENS_K)
    _, _, pages = lay.pages()
    assert kk.shape == (pages, 3, 1, 3)
    used = set()
    for s, n in enumerate(LENS_K):  # each key where the table puts it
        start = sum(LENS_K[:s])
        for j in range(n):
            page = int(table[s, j // 3])
            used.add(page)
            assert torch.equal(kk[page, j % 3], k[0, :, start + j])
    unused = [p for p in range(pages) if p not in used]
    assert unused and all(bool(kk[p].isnan().all()) for p in unused)  # pages no sequence reads
    assert bool(kk[int(table[0, 0]), 1:].isnan().all())  # the slots after sequence 0's one key
    assert int(table[0, 1]) in unused  # an unused entry of the table points at a page of NaN
    # page_seed 0 keeps the pages in the sequences' order; another seed permutes them
    in_order, _, _ = conventions.layout(SPECS["paged in order"]).pages()
    assert in_order[:, 0].tolist() == [0, 1, 3] and in_order[1].tolist() == [1, 2]
    assert table.flatten().tolist() != sorted(table.flatten().tolist())


def test_dense_cases_pass_unchanged():
    lay = conventions.layout(AttentionSpec(causal=True))
    q, k, v = _tensors(SPECS["packed"])
    qk, kk, vk, kw = lay.inputs(q, k, v)
    assert qk is q and kk is k and vk is v and kw == {}


def test_gradients_reach_the_references_frame_through_every_layout():
    for spec in SPECS.values():
        q, k, v = (t.requires_grad_() for t in _tensors(spec))
        lay = conventions.layout(spec)
        qk, kk, vk, _ = lay.inputs(q, k, v)
        total = (torch.nan_to_num(qk) * 2).sum() + (torch.nan_to_num(kk) * 3).sum() + torch.nan_to_num(vk).sum()
        total.backward()
        assert bool((q.grad == 2).all()) and bool((k.grad == 3).all()) and bool((v.grad == 1).all())


def _returning(shape_of):
    def forward(q, k, v, **kw):
        return torch.zeros(shape_of(q)), None
    return Implementation(name="wrong_shapes", forward=forward, sequences=("dense", "packed", "paged"))


@pytest.mark.parametrize("name, shape_of, words", [
    ("packed", lambda q: (q.shape[0], q.shape[1] + 1, q.shape[2]),
     r"out.shape=\(5, 3, 3\), but should be \(5, 2, 3\) \(packed sequences\)"),
    ("paged", lambda q: (q.shape[0], q.shape[1] + 1, q.shape[2], q.shape[3]),
     r"out.shape=\(3, 3, 2, 3\), but should be \(3, 2, 2, 3\) \(paged sequences\)"),
])
def test_a_result_of_the_wrong_shape_is_refused_in_words(name, shape_of, words):
    spec = SPECS[name]
    q, k, v = _tensors(spec)
    with pytest.raises(conventions.ContractError, match=words):
        _returning(shape_of).call(q, k, v, spec=spec)


def test_a_convention_the_kernel_does_not_declare_is_refused():
    q, k, v = _tensors(SPECS["padded"])
    with pytest.raises(ValueError, match=r"declares sequences \('dense', 'packed', 'paged'\); the case's are padded"):
        _returning(lambda q: q.shape).call(q, k, v, spec=SPECS["padded"])


def test_out_buffers_are_for_a_dense_batch():
    spec = SPECS["packed"]
    q, k, v = _tensors(spec)
    impl = dataclasses.replace(registry()["fa2_blocked"], name="x")
    with pytest.raises(ValueError, match="out=/lse= buffers are passed for a dense batch only"):
        impl.call(q, k, v, spec=spec, out=torch.empty_like(q))


def test_sinks_are_passed_as_float32_or_float64_and_must_be_exact():
    impl = registry()["fa2_blocked"]
    kw = impl.kernel_keywords(AttentionSpec(sinks=(0.5, -2.0)), None, None, None, dtype=torch.float16)
    assert kw["sinks"].dtype == torch.float32 and kw["sinks"].tolist() == [0.5, -2.0]
    assert impl.kernel_keywords(AttentionSpec(sinks=(0.1,)), None, None, None,
                                dtype=torch.float64)["sinks"].dtype == torch.float64
    with pytest.raises(ValueError, match=r"sinks=\(0.1,\) holds \[0.1\], which float32 cannot hold exactly"):
        impl.kernel_keywords(AttentionSpec(sinks=(0.1,)), None, None, None, dtype=torch.float16)
    assert math.isclose(kw["sinks"][0].item(), 0.5)
