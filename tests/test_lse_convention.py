"""A kernel whose LSE fails because it stores another convention (base 2, the running max left out) is told
so in the failure message; an LSE that is simply wrong is not given a convention it does not have."""

import pytest

from references.spec import AttentionSpec
from strategies.cases import AttentionCase
from tests import mutants
from verify import properties
from verify.context import Context, PropertyFailure

CASE = AttentionCase(batch=1, heads_q=2, heads_kv=1, len_q=5, len_k=9, head_dim=8, dtype="float32",
                     spec=AttentionSpec(True), block_m=4, block_n=4, magnitude="large_logits")


def _failure(name: str) -> str:
    impl = mutants.VARIANTS[name]
    with pytest.raises(PropertyFailure) as info:
        properties.lse_matches_reference(Context(impl=impl, prop="lse_matches_reference", case=CASE), CASE)
    return str(info.value)


@pytest.mark.parametrize("name, words", [
    ("lse_base2", "it looks like a base-2 logarithm (log2 of the row sum, as kernels that use exp2 store it): "
                  "multiply by ln 2"),
    ("lse_without_max", "it looks like log(sum_j exp(s_ij - m_i)), the running max m_i left out: add the row max"),
])
def test_another_lse_convention_is_named(name, words):
    message = _failure(name)
    assert "lse differs from the float64 reference" in message and words in message, message


@pytest.mark.parametrize("name", ["no_l_rescale", "causal_off_by_one"])
def test_a_wrong_lse_is_not_given_a_convention(name):
    assert "another convention" not in _failure(name)


def _sink_left_out(q, k, v, *, sinks=None, **kw):
    """fa2_blocked, its LSE returned without the sink: log(exp(lse) - exp(t_h)), the keys' LSE alone."""
    from flashverify_kernels.pytorch.blocked import fa2_forward
    import torch

    out, lse = fa2_forward(q, k, v, sinks=sinks, **kw)
    return out, lse + torch.log1p(-torch.exp(sinks[None, :, None] - lse))


def test_an_lse_without_the_sink_is_named():
    import dataclasses

    from flashverify_kernels.registry import registry

    impl = dataclasses.replace(registry()["fa2_blocked"], name="sink_left_out", forward=_sink_left_out)
    case = CASE.replace(magnitude="normal", spec=AttentionSpec(False, sinks=(1.0, -0.5)))
    with pytest.raises(PropertyFailure) as info:
        properties.lse_matches_reference(Context(impl=impl, prop="lse_matches_reference", case=case), case)
    assert "it looks like the LSE of the keys alone, the sink left out" in str(info.value), str(info.value)
    # and the kernel's out is right: only the LSE's convention differs
    properties.out_matches_reference(Context(impl=impl, prop="out_matches_reference", case=case), case)
