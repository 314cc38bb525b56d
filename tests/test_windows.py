"""Sliding windows (flash_attn's convention) end to end: a correct windowed kernel passes with window
cases drawn, the common window bugs fail with a small case, and a kernel that declares no window is
never given one (the report says it is not covered)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashverify_kernels.registry import load
from references.spec import AttentionSpec

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/window_kernels.py"


def _verify(tmp_path, *args):
    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify", "--hypothesis-profile=ci", "-q",
                           "-p", "no:cacheprovider", "--report-dir", str(report), *args],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, report


def test_a_spec_with_a_window_reaches_only_a_kernel_that_declares_windows():
    impl = load("sdpa_math", device="cpu")  # declares no window
    assert impl.unsupported_spec(AttentionSpec(True, "top_left", window_left=3)) == \
        "sdpa_math declares no sliding window"
    assert "sliding windows: not covered, declared unsupported" in impl.not_covered()
    assert load("fa2_blocked", device="cpu").unsupported_spec(AttentionSpec(True, window_left=3)) is None
    windowed = load(f"{FIXTURE}:windowed", device="cpu")
    assert windowed.unsupported_spec(AttentionSpec(True, window_left=3)) is None
    assert windowed.kernel_keywords(AttentionSpec(False, window_left=2, window_right=0), None, None, None) == {
        "causal": False, "scale": None, "window_size": (2, 0)}


@pytest.mark.slow
def test_a_correct_windowed_kernel_passes_and_window_cases_are_drawn(tmp_path):
    proc, report = _verify(tmp_path, "--impl", f"{FIXTURE}:windowed", "-k", "float32 and not longest")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    reached = {}
    for path in report.glob("coverage-*.jsonl"):
        for line in path.open():
            for name, n in json.loads(line)["classes"].items():
                reached[name] = reached.get(name, 0) + n
    assert all(reached.get(c, 0) > 0 for c in ("window_zero", "window_narrow", "window_at_least_n")), reached


@pytest.mark.slow
@pytest.mark.parametrize("name", ["window_one_too_wide", "window_top_left"])
def test_window_bugs_fail_with_a_small_windowed_case(tmp_path, name):
    proc, report = _verify(tmp_path, "--impl", f"{FIXTURE}:{name}", "-k",
                           "test_out_matches_reference and float32")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    (failure,) = [json.loads(p.read_text()) for p in (report / "failures").glob("*.json")]
    spec, case = failure["case"]["spec"], failure["case"]
    # the bug needs a window to show (a spec's JSON leaves out the fields at their defaults, -1 here)
    assert spec.get("window_left", -1) >= 0 or spec.get("window_right", -1) >= 0, case
    assert case["len_q"] + case["len_k"] <= 6 and case["head_dim"] == 1, case  # and it shrinks
    assert failure["replay"] and "window" in failure["message"]


def test_the_visible_value_box_is_the_min_and_max_over_each_row_s_window():
    """out_within_visible_values' box without an Nq x Nk mask (a sparse table with a left window) equals
    the brute-force min and max of the v rows each query sees."""
    import torch

    from references import attention as reference
    from verify.properties import _visible_value_box

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        nq, nk = (int(x) for x in torch.randint(1, 9, (2,), generator=g))
        nk -= 1  # Nk = 0 too
        left, right = (int(x) for x in torch.randint(-1, 5, (2,), generator=g))
        spec = AttentionSpec(bool(torch.randint(0, 2, (1,), generator=g)), "bottom_right", left, right)
        q, k, v = (torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
        lo, hi = _visible_value_box(reference.attention(q, k, v, spec=spec))
        visible = spec.rows(nq, nk)
        for i in range(nq):
            seen = v[:, :, visible[i]]
            want_lo = seen.amin(dim=2) if seen.shape[2] else torch.zeros(1, 2, 3, dtype=torch.float64)
            want_hi = seen.amax(dim=2) if seen.shape[2] else torch.zeros(1, 2, 3, dtype=torch.float64)
            assert torch.equal(lo[:, :, i], want_lo) and torch.equal(hi[:, :, i], want_hi), (spec, nq, nk, i)
