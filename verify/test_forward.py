"""Forward properties (FA1 inner-scaled, FA2 outer-scaled, every selected implementation).

Each test checks one property of the catalogue (README.md, "What is checked") over Hypothesis-drawn
cases; the property itself is in ``verify/properties.py`` under the same name.
"""

import pytest

from verify.runner import DTYPE_NAMES, check_attention

pytestmark = pytest.mark.parametrize("dtype", DTYPE_NAMES)


def test_out_matches_reference(impl, dtype, env):
    check_attention("out_matches_reference", impl, dtype, env)


def test_lse_matches_reference(impl, dtype, env):
    check_attention("lse_matches_reference", impl, dtype, env, requires=["lse"])


def test_lse_between_max_and_max_plus_log_n(impl, dtype, env):
    check_attention("lse_between_max_and_max_plus_log_n", impl, dtype, env, requires=["lse"])


def test_out_within_visible_values(impl, dtype, env):
    check_attention("out_within_visible_values", impl, dtype, env)


def test_inputs_untouched(impl, dtype, env):
    """The forward, and the backward through autograd, leave q, k, v, dout and the memory around them as
    they were (bitwise), and in a variable-length convention the tensors laid out for the kernel (a paged
    cache whole) and its index tensors. Before the metamorphic properties: a kernel that writes into its
    inputs (one that centres K in place gets the right out) fails those, which call it again on the tensors
    it changed, with messages about shifts and permutations; this one names the cause, and runs first
    under -x."""
    check_attention("inputs_untouched", impl, dtype, env)


def test_block_size_invariance(impl, dtype, env):
    check_attention("block_size_invariance", impl, dtype, env, requires=["tunable"])


def test_key_permutation_invariance(impl, dtype, env):
    # ALiBi's bias and chunks depend on the key's position: permuting keys changes the attention. Keys are
    # permuted within each sequence.
    check_attention("key_permutation_invariance", impl, dtype, env, causal=False, windows=False, alibi=False,
                    chunks=False)


def test_score_shift_invariance(impl, dtype, env):
    # A softcap does not commute with the shift (c tanh((s + w) / c) is not c tanh(s / c) + w), and a sink's
    # logit does not shift with the scores.
    check_attention("score_shift_invariance", impl, dtype, env, softcap=False, sinks=False)


def test_value_linearity(impl, dtype, env):
    # With sinks the keys' weights sum to 1 - P_sink: out(v + b) = out(v) + (1 - P_sink) b, not + b.
    check_attention("value_linearity", impl, dtype, env, sinks=False)


def test_hidden_keys_never_reach_output(impl, dtype, env):
    check_attention("hidden_keys_never_reach_output", impl, dtype, env, requires=["causal"], causal=True,
                    min_len_q=2)


def test_layouts_agree(impl, dtype, env):
    check_attention("layouts_agree", impl, dtype, env, requires=["strided"], layouts=["contiguous"],
                    sequences=["dense"])


def test_fully_masked_rows(impl, dtype, env):
    if impl.causal_alignment == "top_left":
        pytest.skip(f"{impl.name} aligns causal masks top-left: no row is ever fully masked")
    check_attention("fully_masked_rows", impl, dtype, env, requires=["causal"], causal=True,
                    longer="len_q")


def test_gqa_equals_repeated_heads(impl, dtype, env):
    check_attention("gqa_equals_repeated_heads", impl, dtype, env, requires=["gqa"], min_group=2)


def test_wide_window_equals_no_window(impl, dtype, env):
    check_attention("wide_window_equals_no_window", impl, dtype, env, requires=["windows"])


def test_huge_softcap_equals_no_softcap(impl, dtype, env):
    check_attention("huge_softcap_equals_no_softcap", impl, dtype, env, requires=["softcap"], softcap=False)


def test_zero_alibi_equals_no_alibi(impl, dtype, env):
    check_attention("zero_alibi_equals_no_alibi", impl, dtype, env, requires=["alibi"], alibi=False)


def test_wide_chunks_equal_no_chunks(impl, dtype, env):
    check_attention("wide_chunks_equal_no_chunks", impl, dtype, env, requires=["chunks"], chunks=False)


def test_sinks_rescale_the_output(impl, dtype, env):
    check_attention("sinks_rescale_the_output", impl, dtype, env, requires=["sinks"], sinks=False)


def test_split_count_invariance(impl, dtype, env):
    check_attention("split_count_invariance", impl, dtype, env, requires=["splits"], splits=False)


def test_sequences_equal_each_alone(impl, dtype, env):
    check_attention("sequences_equal_each_alone", impl, dtype, env, requires=["varlen"],
                    sequences=["packed", "padded", "paged"])


def test_paged_equals_contiguous(impl, dtype, env):
    check_attention("paged_equals_contiguous", impl, dtype, env, requires=["paged"], sequences=["paged"])


def test_outputs_stay_in_bounds(impl, dtype, env):
    check_attention("outputs_stay_in_bounds", impl, dtype, env, requires=["out_buffers"], sequences=["dense"])


def test_siblings_agree(impl, dtype, env):
    """FA1 and FA2 (declared siblings) compute the same function."""
    if impl.sibling is None:
        pytest.skip(f"{impl.name} declares no sibling implementation")
    check_attention("siblings_agree", impl, dtype, env)
