"""Softcap and ALiBi in the strategies: drawn only when asked (a kernel's declaration), each float32-exact
(the kernel gets float32 slopes and caps: the case holds exactly what it runs), one slope per query
head, and shrinking to none."""

import torch
from hypothesis import find, given, settings

from strategies.attention import Limits, attention_cases, boundary_classes
from tests.reach import reach

LIMITS = Limits(max_len=64, max_head_dim=32, max_batch=2, max_heads_kv=3, max_group=3)


def _exact32(x: float) -> bool:
    return float(torch.tensor(x, dtype=torch.float32)) == x


@settings(max_examples=300, database=None, deadline=None)
@given(attention_cases(dtype="float32", limits=LIMITS, gqa=True, softcap=True, alibi=True))
def test_drawn_modifications_fit_the_case(case):
    spec = case.spec
    if spec.softcap is not None:
        assert spec.softcap > 0 and _exact32(spec.softcap)
    if spec.alibi_slopes is not None:
        assert len(spec.alibi_slopes) == case.heads_q
        assert all(_exact32(x) and 0 <= x <= 2 for x in spec.alibi_slopes)


@settings(max_examples=200, database=None, deadline=None)
@given(attention_cases(dtype="float32", limits=LIMITS, gqa=True))
def test_undeclared_modifications_are_never_drawn(case):
    assert case.spec.softcap is None and case.spec.alibi_slopes is None


def test_failures_shrink_to_no_modification_and_reach_the_modified_classes():
    strategy = attention_cases(dtype="float32", limits=LIMITS, gqa=True, softcap=True, alibi=True)
    quick = settings(max_examples=2000, database=None)
    assert find(strategy, lambda c: True, settings=quick).spec.softcap is None
    assert find(strategy, lambda c: True, settings=quick).spec.alibi_slopes is None
    small_cap = find(strategy, lambda c: c.spec.softcap is not None and c.spec.softcap < 1, settings=quick)
    # the rest of the case shrinks away: one row, one key, no ALiBi
    assert (small_cap.len_q, small_cap.len_k, small_cap.spec.alibi_slopes) == (1, 1, None)
    geometric = find(strategy, lambda c: c.spec.alibi_slopes is not None and c.heads_q == 2
                     and c.spec.alibi_slopes[0] == 0.0625, settings=quick)
    assert geometric.spec.alibi_slopes == (0.0625, 0.00390625)  # 2^(-8 (h + 1) / Hq), Hq = 2
    for name in ("softcap", "softcap_below_one", "alibi", "alibi_causal_gqa"):
        reach(strategy, lambda c, name=name: name in boundary_classes(c), max_examples=2000)


def test_softcap_backward_keeps_a_hidden_nan_key_out_of_the_gradients():
    from flashverify_kernels.pytorch import blocked

    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 1, 2, 4, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 1, 5, 4, generator=g) for _ in range(2))
    k[:, :, 0] = float("nan")  # window (1, -1) causal: rows see keys 2..3 and 3..4; key 0 is hidden from both
    out, lse = blocked.fa2_forward_raw(q, k, v, causal=True, window_size=(1, -1), softcap=2.0)
    dq, dk, dv, _ = blocked.fa2_backward(q, k, v, out, lse, dout, causal=True, window_size=(1, -1), softcap=2.0)
    # dK of the hidden key is exactly 0 as without a softcap (dS = 0 there, its 1 - tanh^2 is NaN);
    # dQ = dS K reads the NaN key through the product in both, which the contract leaves open.
    plain = blocked.fa2_backward(q, k, v, *blocked.fa2_forward_raw(q, k, v, causal=True, window_size=(1, -1)),
                                 dout, causal=True, window_size=(1, -1))
    assert (dk[:, :, 0] == 0).all() and (plain[1][:, :, 0] == 0).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
