"""Float8 inputs (``float8_e4m3fn``, ``float8_e5m2``): the forward properties, for a kernel whose declaration
lists a float8 format in its ``dtypes`` (``references/fp8.py``: with ``descale``, its forward also takes
FlashAttention-3's ``q_descale``, ``k_descale``, ``v_descale`` and the cases draw them).

The reference, the bounds and the box of visible values are those of the dequantised inputs; ``out`` is
bfloat16. The contract takes float8 inputs in the forward only (as FlashAttention-3 does): the backward
properties run on the other dtypes.
"""

import pytest

from verify.runner import FP8_NAMES, check_attention

pytestmark = pytest.mark.parametrize("dtype", FP8_NAMES)


def test_out_matches_reference(impl, dtype, env):
    check_attention("out_matches_reference", impl, dtype, env)


def test_lse_matches_reference(impl, dtype, env):
    check_attention("lse_matches_reference", impl, dtype, env, requires=["lse"])


def test_lse_between_max_and_max_plus_log_n(impl, dtype, env):
    check_attention("lse_between_max_and_max_plus_log_n", impl, dtype, env, requires=["lse"])


def test_out_within_visible_values(impl, dtype, env):
    check_attention("out_within_visible_values", impl, dtype, env)
