"""references/spec.py: the one definition of which keys a query sees; its three views agree; a spec is a value."""

import itertools

import pytest
import torch

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
    assert AttentionCase.from_json(case.to_json()) == case and '"spec":{"causal":true,"alignment":"top_left","window_left":-1,"window_right":-1}' \
        in case.to_json()
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
