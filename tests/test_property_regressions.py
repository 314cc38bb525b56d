"""Cases on which a property once failed a correct kernel: the property was wrong, and must stay fixed.

Each replays through ``python -m verify.replay`` (its ``main``) on a shipped CPU kernel.
"""

import json

import pytest

from verify import replay

CASES = [
    # fp16 GQA with v_wide_range: one query head's dK is beyond float16's range (inf when the heads are
    # repeated), while the GQA kernel sums the group before rounding (-42656). Found on an H200 with
    # triton_fa2; eager and the blocked kernels failed it the same way.
    ("gqa_gradients_sum_over_group",
     dict(batch=1, heads_q=3, heads_kv=1, len_q=126, len_k=32, head_dim=72, dtype="float16", causal=False,
          magnitude="v_wide_range", seed=0, layout="bnhd", scale=0.5, block_m=None, block_n=None)),
    # fp16 softcap 30 with sinks of 30: a row's one key has P = 5e-8, so dS_raw = dS (1 - tanh^2) ~ 5e-7 is
    # cast to float16's subnormal range (spacing 6e-8). The bound cast dS before the chain rule and scaled
    # the cast's absolute floor by 1 - tanh^2 (0.8): dQ err/bound 1.04 for fa2_blocked and eager alike. The
    # kernels cast dS_raw: the bound now does (references/bounds.py, section 13).
    ("gradients_match_reference",
     dict(batch=1, heads_q=2, heads_kv=2, len_q=19, len_k=6, head_dim=27, dtype="float16",
          spec={"causal": True, "softcap": 30.0, "sinks": [30.0, 30.0]}, magnitude="row_shift", seed=1,
          layout="contiguous", scale=None, block_m=2, block_n=1)),
    # float64, a row with one visible key beside a sink (paged, chunks of 1): out 26 u from the exact value
    # in fa2_blocked and fa1_blocked (the score, summed in order over D = 34, 1.16 roundings of its magnitude
    # off) and the float64 reference's 12.5 u the other way; criterion 1's floor held one rounding of the
    # score magnitude, for the kernel's alone (error 4.337e-17, allowed 3.324e-17). The reference's float64
    # scores round as much as the kernel's: the floor counts both (references/criteria.py, score_roundings).
    ("out_matches_reference",
     dict(batch=1, heads_q=1, heads_kv=1, len_q=36, len_k=2, head_dim=34, dtype="float64",
          spec={"causal": False, "alignment": "bottom_right", "attention_chunk": 1, "sinks": [0.0],
                "sequences": "paged", "seqlens_q": [12, 12, 12], "seqlens_k": [1, 1, 0], "page_size": 1},
          magnitude="normal", seed=136, layout="contiguous", scale=1.0, block_m=1, block_n=1)),
    # float64, all-negative scores (|s| = 619 at D = 24) beside sinks of 0, a window of one key back: out
    # near 4e-269, the kernel's 834 u and the float64 reference's 1215 u from the exact value, opposite
    # signs (their scores each 1.35 roundings of |s| off: 24 same-sign products summed in order). Two
    # roundings of the score magnitude allowed 6.9e-282 for an error of 9.5e-282; found by the thorough
    # profile (fa2_blocked and fa1_blocked alike).
    ("out_matches_reference",
     dict(batch=2, heads_q=6, heads_kv=2, len_q=70, len_k=31, head_dim=24, dtype="float64",
          spec={"causal": False, "alignment": "bottom_right", "window_left": 1, "window_right": 0,
                "sinks": [0.0] * 6},
          magnitude="all_negative", seed=0, layout="contiguous", scale=0.5, block_m=7, block_n=3)),
    # float64, padded layout: the property poisoned clones of k and v, contiguous where the case's tensors
    # are strided views, and demanded identical bits from a deterministic kernel; the blocked kernels' CPU
    # matmuls round the strided and the contiguous operands differently (5 values of out apart in their
    # last bits). The poisoned inputs are now a fresh build in the case's layout. Found by the thorough
    # profile.
    ("hidden_keys_never_reach_output",
     dict(batch=1, heads_q=1, heads_kv=1, len_q=9, len_k=13, head_dim=5, dtype="float64",
          spec={"causal": True, "alignment": "bottom_right"}, magnitude="normal", seed=1, layout="padded",
          scale=None, block_m=7, block_n=13)),
]


@pytest.mark.parametrize("impl_name", ["eager", "fa2_blocked", "fa1_blocked"])
@pytest.mark.parametrize("prop,case", CASES, ids=[c[0] for c in CASES])
def test_correct_kernel_passes(impl_name, prop, case, capsys):
    rc = replay.main(["--impl", impl_name, "--property", prop, "--device", "cpu", "--case", json.dumps(case)])
    assert rc == 0, capsys.readouterr().out


# fp16, v_wide_range, scale 0.5: the exact dK reaches 8.03e4, past float16's 65504, so eager's correctly
# rounded inf failed gradient_sums on an H100 (and on CPU). The case has no float16 answer: the gradient
# properties now reject it, saying why, instead of failing the kernel.
OVERFLOWING_DK = dict(batch=1, heads_q=2, heads_kv=2, len_q=64, len_k=7, head_dim=36, dtype="float16",
                      spec={"causal": False}, magnitude="v_wide_range", seed=0, layout="contiguous", scale=0.5,
                      block_m=None, block_n=None)


@pytest.mark.parametrize("prop", ["gradient_sums", "gradients_match_reference"])
def test_a_case_whose_exact_gradient_overflows_the_dtype_is_rejected_with_the_reason(prop, capsys):
    rc = replay.main(["--impl", "eager", "--property", prop, "--device", "cpu", "--case", json.dumps(OVERFLOWING_DK)])
    out = capsys.readouterr().out
    assert rc == 0 and "not applicable: the exact dk reaches 8.03e+04, past float16's largest finite value 65504" in out


def test_the_same_case_in_float32_is_checked(capsys):
    case = dict(OVERFLOWING_DK, dtype="float32")
    rc = replay.main(["--impl", "eager", "--property", "gradient_sums", "--device", "cpu", "--case", json.dumps(case)])
    assert rc == 0 and capsys.readouterr().out.strip().endswith("passed")
