"""references/spec.py: the one definition of which keys a query sees; its three views agree; a spec is a value."""

import dataclasses
import itertools
import math

import pytest
import torch

from references import attention as reference
from references.spec import ALIGNMENTS, AttentionSpec
from strategies.cases import AttentionCase, CaseError


WINDOWS = [(-1, -1), (0, 0), (1, -1), (-1, 2), (2, 1), (0, 3), (9, 9)]


@pytest.mark.parametrize("causal, alignment", list(itertools.product([False, True], ALIGNMENTS)))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("len_q, len_k", [(1, 1), (3, 7), (7, 3), (5, 5), (4, 0), (1, 9)])
def test_pairs_rows_and_counts_agree(causal, alignment, window, len_q, len_k):
    mask = AttentionSpec(causal, alignment, *window)
    pairs = torch.tensor([[mask.visible(i, j, len_q, len_k) for j in range(len_k)] for i in range(len_q)],
                         dtype=torch.bool).reshape(len_q, len_k)
    assert torch.equal(mask.rows(len_q, len_k), pairs)
    assert torch.equal(torch.cat([mask.rows(len_q, len_k, rows=(r, r + 1)) for r in range(len_q)]), pairs)
    per_row, per_key = mask.counts(len_q, len_k)
    assert per_row.tolist() == pairs.sum(1).tolist() and per_key.tolist() == pairs.sum(0).tolist()
    # each query sees one range of keys, and the ranges' ends never move back
    first, end = mask.key_range(len_q, len_k)
    j = torch.arange(len_k)
    assert torch.equal(pairs, (j[None, :] >= first[:, None]) & (j[None, :] < end[:, None]))
    assert bool((first[1:] >= first[:-1]).all()) and bool((end[1:] >= end[:-1]).all())


def test_alignments_place_the_diagonal():
    assert AttentionSpec(True, "bottom_right").rows(2, 4).tolist() == [[True, True, True, False], [True] * 4]
    assert AttentionSpec(True, "top_left").rows(2, 4).tolist() == [[True, False, False, False],
                                                                   [True, True, False, False]]
    # bottom-right with more queries than keys: the first Nq - Nk queries see nothing
    assert AttentionSpec(True).counts(4, 2)[0].tolist() == [0, 0, 1, 2]


def test_windows_follow_the_flash_attn_convention():
    # query i sees keys i + Nk - Nq - left .. i + Nk - Nq + right (bottom-right diagonal), -1 unbounded
    assert AttentionSpec(False, window_left=1, window_right=0).rows(3, 3).tolist() == [
        [True, False, False], [True, True, False], [False, True, True]]
    assert AttentionSpec(False, window_left=0, window_right=1).rows(2, 4).tolist() == [
        [False, False, True, True], [False, False, False, True]]
    # causal caps the right side at the diagonal whatever window_right says
    assert AttentionSpec(True, window_left=-1, window_right=5).rows(2, 2).tolist() == [[True, False], [True, True]]
    # a window at least N wide is no window
    n = 6
    assert torch.equal(AttentionSpec(True, window_left=n, window_right=n).rows(4, n), AttentionSpec(True).rows(4, n))
    assert AttentionSpec(True, window_left=2).describe() == "causal window (2, -1)"


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="alignment='diagonal', but should be one of"):
        AttentionSpec(True, "diagonal")
    with pytest.raises(ValueError, match=r"window_left=-2, but should be an int >= -1 \(-1: unbounded\)"):
        AttentionSpec(True, window_left=-2)
    with pytest.raises(TypeError, match="causal=1, but should be a bool"):
        AttentionSpec(1)
    with pytest.raises(ValueError, match=r"rows=\(3, 5\), but should satisfy 0 <= r0 <= r1 <= len_q=4"):
        AttentionSpec(True).rows(4, 4, rows=(3, 5))


def test_a_spec_is_a_value():
    assert AttentionSpec(True) == AttentionSpec(True, "bottom_right")
    assert len({AttentionSpec(True), AttentionSpec(True), AttentionSpec(False)}) == 2
    spec = AttentionSpec(True, "top_left")
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=2, len_k=3, head_dim=4, dtype="float32", spec=spec)
    # the JSON holds causal and alignment, and the other fields only where they are not their defaults
    assert AttentionCase.from_json(case.to_json()) == case and '"spec":{"causal":true,"alignment":"top_left"}' in (
        case.to_json())
    wide = AttentionSpec(True, window_left=3, sinks=(0.5,), sequences="packed", seqlens_q=(2, 0), seqlens_k=(1, 2))
    assert wide.to_dict() == {"causal": True, "alignment": "bottom_right", "window_left": 3, "sinks": [0.5],
                              "sequences": "packed", "seqlens_q": [2, 0], "seqlens_k": [1, 2]}
    assert AttentionSpec(**wide.to_dict()) == wide
    # A case written before cases carried a spec: its causal flag, bottom-right.
    old = {k: v for k, v in case.to_dict().items() if k != "spec"}
    assert AttentionCase.from_dict({**old, "causal": True}).spec == AttentionSpec(True)
    with pytest.raises(CaseError, match=r"unknown attention spec fields \['window'\]"):
        AttentionCase.from_dict({**old, "spec": {"causal": True, "window": 3}})
    with pytest.raises(CaseError, match="an attention spec should be a JSON object"):
        AttentionCase.from_dict({**old, "spec": [True]})
    with pytest.raises(CaseError, match="invalid attention spec: alignment='middle'"):
        AttentionCase.from_dict({**old, "spec": {"causal": True, "alignment": "middle"}})
    assert [AttentionSpec(False).describe(), AttentionSpec(True).describe(), spec.describe()] == [
        "non-causal", "causal", "causal top_left"]


# ---------------------------------------------------------------- score modifications: softcap, ALiBi
def test_score_modifications_are_validated_and_read_back_from_json():
    spec = AttentionSpec(causal=True, softcap=30.0, alibi_slopes=[0.5, 0.25])
    assert spec.alibi_slopes == (0.5, 0.25) and spec.modified
    assert len({spec, AttentionSpec(causal=True, softcap=30.0, alibi_slopes=(0.5, 0.25))}) == 1  # a value
    case = AttentionCase(batch=1, heads_q=2, heads_kv=1, len_q=2, len_k=3, head_dim=4, dtype="float32", spec=spec)
    assert AttentionCase.from_json(case.to_json()) == case
    assert '"softcap":30.0,"alibi_slopes":[0.5,0.25]' in case.to_json()
    assert spec.describe() == "causal softcap=30 alibi=(0.5, 0.25)"
    for bad in (0, -1.0, math.inf, math.nan, True, "3"):
        with pytest.raises(ValueError, match="softcap=.*should be a finite number > 0"):
            AttentionSpec(softcap=bad)
    for bad in ((), (math.nan,), ("a",), 0.5, (True,)):
        with pytest.raises(ValueError, match="alibi_slopes=.*one per query head"):
            AttentionSpec(alibi_slopes=bad)
    with pytest.raises(ValueError, match="alibi_slopes has 2 slopes, but the attention has 3 query heads"):
        spec.modify(torch.zeros(1, 3, 2, 3, dtype=torch.float64), 2, 3)


def test_modify_is_softcap_then_alibi_around_the_alignments_diagonal():
    s = torch.tensor([[[[1.0, -2.0, 40.0], [0.5, 0.0, -3.0]]]], dtype=torch.float64)  # [1, 1, 2, 3]
    cap = AttentionSpec(softcap=2.0)
    assert torch.equal(cap.modify(s, 2, 3), 2.0 * torch.tanh(s / 2.0))
    assert torch.equal(cap.modify_grad(s), 1 - torch.tanh(s / 2.0) ** 2) and AttentionSpec().modify_grad(s) is None
    # bottom-right: row i's diagonal is key i + 1; top-left: key i
    br = AttentionSpec(alibi_slopes=(0.5,)).modify(torch.zeros_like(s), 2, 3)
    tl = AttentionSpec(alibi_slopes=(0.5,), alignment="top_left").modify(torch.zeros_like(s), 2, 3)
    assert br.tolist() == [[[[-0.5, -0.0, -0.5], [-1.0, -0.5, -0.0]]]]
    assert tl.tolist() == [[[[-0.0, -0.5, -1.0], [-0.5, -0.0, -0.5]]]]
    both = AttentionSpec(softcap=2.0, alibi_slopes=(0.5,)).modify(s[:, :, 1:], 2, 3, rows=(1, 2))
    assert torch.equal(both, 2.0 * torch.tanh(s[:, :, 1:] / 2.0) + br[:, :, 1:])
    assert AttentionSpec().modify(s, 2, 3) is s


@pytest.mark.parametrize("spec", [
    AttentionSpec(causal=True, softcap=1.5),
    AttentionSpec(alibi_slopes=(0.5, 0.125, 1.0, 0.0), window_left=2),
    AttentionSpec(causal=True, softcap=0.75, alibi_slopes=(0.25, 1.0, 2.0, 0.5), alignment="top_left"),
    AttentionSpec(causal=True, sinks=(0.5, -1.0, 2.0, 9.0)),
    AttentionSpec(sinks=(-30.0, 0.0, 40.0, 1.0), window_left=0, window_right=0),
    AttentionSpec(causal=True, attention_chunk=2, alibi_slopes=(0.5, 0.125, 1.0, 0.0)),
    AttentionSpec(causal=True, sequences="packed", seqlens_q=(2, 0, 3), seqlens_k=(1, 3, 2),
                  alibi_slopes=(0.5, 0.125, 1.0, 0.0), sinks=(0.5, -1.0, 2.0, 0.0)),
    AttentionSpec(sequences="padded", seqlens_q=(4, 1), seqlens_k=(3, 3), window_left=1, softcap=2.0,
                  alignment="top_left"),
    AttentionSpec(causal=True, sequences="paged", seqlens_q=(1, 1, 1, 1, 1), seqlens_k=(0, 2, 1, 3, 0),
                  page_size=2, num_splits=3),
], ids=["softcap", "alibi_window", "both_top_left", "sinks", "sinks_window_0", "chunks_alibi",
        "packed_alibi_sinks", "padded_window_softcap", "paged_decode_splits"])
def test_modified_float64_reference_equals_mpmath_and_autograd(spec):
    from references import mp

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 5, 3, generator=g, dtype=torch.float64) * 3
    k = torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64) * 3
    v = torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64)
    dout = torch.randn(1, 4, 5, 3, generator=g, dtype=torch.float64)
    ref = reference.attention(q, k, v, spec=spec, dout=dout)
    exact = mp.attention(q, k, v, spec=spec, dout=dout)
    names = ("out", "lse", "delta", "dq", "dk", "dv") + (("dsinks",) if spec.sinks else ())
    for name in names:
        a, b = getattr(ref, name), getattr(exact, name)
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), name
    # and the gradients equal autograd through a dense float64 forward built from the spec: the mask
    # from spec.rows, the sinks as one more column of the softmax, with no value
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink = torch.tensor(spec.sinks or (0.0,) * 4, dtype=torch.float64, requires_grad=True)
    ke, ve = (reference.expand_kv(t, 4) for t in leaves[1:])
    s = torch.where(spec.rows(5, 6), spec.modify(leaves[0] @ ke.transpose(-1, -2) / math.sqrt(3), 5, 6), -math.inf)
    if spec.sinks is not None:
        s = torch.cat([s, sink[None, :, None, None].expand(1, 4, 5, 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num()[..., :6]
    ((p @ ve) * dout).sum().backward()
    for leaf, mine in zip([*leaves, sink], (ref.dq, ref.dk, ref.dv, ref.dsinks)):
        if mine is not None:
            assert torch.allclose(leaf.grad, mine, rtol=1e-12, atol=1e-12)
    # the softcap's chain rule matters here: without it dQ is visibly different
    if spec.softcap is not None:
        plain = reference.attention(q, k, v, spec=dataclasses.replace(spec, softcap=None), dout=dout)
        assert not torch.allclose(plain.dq, ref.dq, atol=1e-3)


# ---------------------------------------------------------------- sequences, chunks, sinks, splits
SEQUENCE_SETS = [((2, 0, 3), (1, 3, 2)), ((1,), (4,)), ((0, 0), (2, 0)), ((3, 1, 2), (3, 1, 2)), ((4, 2), (1, 5))]


@pytest.mark.parametrize("causal, alignment", list(itertools.product([False, True], ALIGNMENTS)))
@pytest.mark.parametrize("window, chunk", [((-1, -1), 0), ((1, 0), 0), ((0, 2), 0), ((-1, -1), 2), ((2, -1), 3)])
@pytest.mark.parametrize("lens_q, lens_k", SEQUENCE_SETS)
def test_variable_length_masks_are_each_sequence_s_mask_on_the_diagonal(causal, alignment, window, chunk, lens_q,
                                                                         lens_k):
    """Packed sequences see only their own keys, each with the dense mask of its own lengths (diagonal,
    window and chunks placed per sequence); the ranges still only move forward, so counts hold."""
    spec = AttentionSpec(causal, alignment, *window, attention_chunk=chunk, sequences="packed", seqlens_q=lens_q,
                         seqlens_k=lens_k)
    dense = AttentionSpec(causal, alignment, *window, attention_chunk=chunk)
    nq, nk = sum(lens_q), sum(lens_k)
    expected = torch.zeros(nq, nk, dtype=torch.bool)
    for (q0, q1, k0, k1), a, b in zip(spec.sequence_spans(), lens_q, lens_k):
        expected[q0:q1, k0:k1] = dense.rows(a, b)
    assert torch.equal(spec.rows(nq, nk), expected)
    first, end = spec.key_range(nq, nk)
    assert bool((first[1:] >= first[:-1]).all()) and bool((end[1:] >= end[:-1]).all())
    per_row, per_key = spec.counts(nq, nk)
    assert per_row.tolist() == expected.sum(1).tolist() and per_key.tolist() == expected.sum(0).tolist()
    pairs = [[spec.visible(i, j, nq, nk) for j in range(nk)] for i in range(nq)]
    assert torch.equal(torch.tensor(pairs, dtype=torch.bool).reshape(nq, nk), expected)
    for s in range(len(lens_q)):  # a sequence alone is the dense mask of its lengths
        one = spec.one_sequence(s)
        assert torch.equal(one.rows(lens_q[s], lens_k[s]), dense.rows(lens_q[s], lens_k[s]))


def test_chunks_follow_local_attention():
    # chunks of 2 positions, bottom-right: 3 queries at positions 1, 2, 3 of 4 keys
    assert AttentionSpec(False, attention_chunk=2).rows(3, 4).tolist() == [
        [True, True, False, False], [False, False, True, True], [False, False, True, True]]
    assert AttentionSpec(True, attention_chunk=2).rows(3, 4).tolist() == [
        [True, True, False, False], [False, False, True, False], [False, False, True, True]]
    # chunks at least N wide are no chunks
    assert torch.equal(AttentionSpec(True, attention_chunk=9).rows(4, 6), AttentionSpec(True).rows(4, 6))
    assert AttentionSpec(True, attention_chunk=2).describe() == "causal chunks of 2"


def test_alibi_distances_are_measured_per_sequence():
    spec = AttentionSpec(alibi_slopes=(1.0,), sequences="packed", seqlens_q=(1, 2), seqlens_k=(2, 2))
    # sequence 0: its one query's diagonal is key 1; sequence 1: queries at keys 2 and 3 (bottom-right)
    assert spec.diagonal(3, 4).tolist() == [1, 2, 3]
    bias = spec.modify(torch.zeros(1, 1, 3, 4, dtype=torch.float64), 3, 4)
    assert bias[0, 0, 1].tolist() == [-2.0, -1.0, -0.0, -1.0]


def test_sinks_join_the_denominator_and_empty_rows_get_the_sink():
    q = torch.zeros(1, 1, 2, 1, dtype=torch.float64)
    k, v = torch.zeros(1, 1, 1, 1, dtype=torch.float64), torch.ones(1, 1, 1, 1, dtype=torch.float64)
    ref = reference.attention(q, k, v, spec=AttentionSpec(True, sinks=(0.0,)), dout=torch.ones_like(q))
    # row 0 sees no key (bottom-right, Nq > Nk): out 0, lse = the sink; row 1: one key and the sink, e^0 each
    assert ref.out.flatten().tolist() == [0.0, 0.5] and ref.lse.flatten().tolist() == [0.0, math.log(2.0)]
    assert ref.p_sink.flatten().tolist() == [1.0, 0.5]
    assert ref.dsinks.tolist() == [-0.25]  # -(1 * Delta_0 + 0.5 * Delta_1), Delta = dO . out = (0, 0.5)


def test_key_splits_cut_each_sequence_evenly():
    assert AttentionSpec(num_splits=3).key_splits(7).tolist() == [0, 0, 0, 1, 1, 1, 2]
    spec = AttentionSpec(num_splits=2, sequences="packed", seqlens_q=(1, 1, 1), seqlens_k=(3, 0, 4))
    assert spec.key_splits(7).tolist() == [0, 0, 1, 0, 0, 1, 1]
    assert AttentionSpec(num_splits=4).key_splits(2).tolist() == [0, 1]


@pytest.mark.parametrize("fields, words", [
    (dict(sequences="ragged"), "sequences='ragged', but should be one of"),
    (dict(seqlens_q=(1,)), r"seqlens_q=\(1,\), but a dense batch has none"),
    (dict(sequences="packed", seqlens_q=(1, -1), seqlens_k=(1, 1)), r"seqlens_q=\(1, -1\), but should be"),
    (dict(sequences="packed", seqlens_q=(1,), seqlens_k=(1, 2)), "seqlens_q has 1 sequences and seqlens_k 2"),
    (dict(sequences="paged", seqlens_q=(1, 2), seqlens_k=(1, 2), page_size=4), "every sequence has the same"),
    (dict(sequences="paged", seqlens_q=(1,), seqlens_k=(1,)), "page_size=None, but should be an int >= 1"),
    (dict(sequences="packed", seqlens_q=(1,), seqlens_k=(1,), page_size=4), "only a paged KV cache"),
    (dict(attention_chunk=-1), "attention_chunk=-1, but should be an int >= 0"),
    (dict(sinks=(math.inf,)), "sinks=.*one per query head"),
    (dict(num_splits=0), "num_splits=0, but should be an int >= 1"),
])
def test_bad_variant_fields_are_refused_by_name(fields, words):
    with pytest.raises(ValueError, match=words):
        AttentionSpec(**fields)


def test_a_case_of_sequences_is_their_packed_problem():
    spec = AttentionSpec(True, sequences="padded", seqlens_q=(2, 3), seqlens_k=(4, 1), sinks=(1.0,))
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=5, len_k=5, head_dim=2, dtype="float32", spec=spec)
    assert AttentionCase.from_json(case.to_json()) == case
    assert case.describe().startswith("2 sequences Hq=1 Hkv=1 Nq=5 Nk=5 ")
    assert "causal sinks=(1) padded sequences (Nq x Nk: 2x4, 3x1)" in case.describe()
    with pytest.raises(CaseError, match="pack into 5 queries and 5 keys"):
        case.replace(len_k=6)
    with pytest.raises(CaseError, match="batch=2, but a case of padded sequences is one packed batch"):
        case.replace(batch=2)
