"""The longest case the profile allows, as one fixed example per implementation, dtype and causal flag.

Drawn cases rarely reach the largest lengths (Hypothesis draws lengths across the whole range), so
this module makes sure Nk = the profile's ``max_len`` (8192 with ``--hypothesis-profile=gpu`` on a GPU)
is checked every run: out, LSE and the gradients against the float64 reference, both criteria. Where
the profile draws KV caches past ``max_len`` (128k keys under the gpu profile, as the worker's budget
allows), out and LSE are also checked on one query against the longest of them.
"""

import pytest

from verify.runner import DTYPE_NAMES, check_longest

pytestmark = [pytest.mark.parametrize("dtype", DTYPE_NAMES),
              pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])]


def test_longest_out_matches_reference(impl, dtype, causal, env):
    check_longest("out_matches_reference", impl, dtype, env, causal=causal, context=True)


def test_longest_lse_matches_reference(impl, dtype, causal, env):
    check_longest("lse_matches_reference", impl, dtype, env, causal=causal, requires=["lse"], context=True)


def test_longest_gradients_match_reference(impl, dtype, causal, env):
    check_longest("gradients_match_reference", impl, dtype, env, causal=causal, requires=["autograd"])
