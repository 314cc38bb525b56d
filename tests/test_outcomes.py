"""Honest exits (verify/outcomes.py): a run that verified nothing for a selected kernel exits 1 and says
so, laws that call no kernel are counted apart, and forward properties run before backward ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashverify_kernels.registry import registry
from verify import outcomes

ROOT = Path(__file__).resolve().parent.parent


def _pytest_verify(tmp_path, *args):
    cmd = [sys.executable, "-m", "pytest", "verify", "-p", "no:cacheprovider", "-q", "--hypothesis-profile=ci",
           "--report-dir", str(tmp_path / "report"), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


class _Report:
    def __init__(self, when, props):
        self.when, self.user_properties = when, props


def test_tally_counts_kernels_and_laws_apart():
    fa2, law = outcomes.tags({"impl": registry()["fa2_blocked"], "dtype": "float32"}), outcomes.tags({})
    assert fa2 == [("flashverify_impl", "fa2_blocked")] and law == [("flashverify_law", True)]
    assert outcomes.tags({"softmax_impl": object()}) == []  # pytest's placeholder for an empty selection
    t = outcomes.tally({"passed": [_Report("call", fa2), _Report("call", law), _Report("call", law)],
                        "skipped": [_Report("call", fa2), _Report("setup", fa2)],
                        "failed": [_Report("teardown", fa2)]})
    assert t.by_impl == {"fa2_blocked": {"passed": 1, "skipped": 2}} and t.laws == {"passed": 2}
    assert t.exercised("fa2_blocked") == 1 and t.exercised("eager") == 0
    assert t.unverified(["fa2_blocked", "eager"], explicit=True) == ["eager"]
    assert t.unverified(["fa2_blocked", "eager"], explicit=False) == []  # the default selection: one is enough
    assert t.unverified(["eager"], explicit=False) == ["eager"]
    assert t.lines() == ["flashverify: fa2_blocked: 1 passed, 2 skipped",
                         "flashverify: laws that call no kernel (counted for none): 2 passed"]


def test_forward_modules_rank_before_backward():
    ranks = [outcomes.module_rank(f"verify/{name}") for name in
             ("test_forward.py", "test_backward.py", "test_longest.py", "test_online_softmax.py", "test_other.py")]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)


def test_collection_puts_forward_first(tmp_path):
    proc = _pytest_verify(tmp_path, "--impl", "fa2_blocked", "--collect-only", "--no-report")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    modules = [line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line]
    assert modules[0] == "verify/test_forward.py", modules[:3]
    assert modules.index("verify/test_backward.py") > max(i for i, m in enumerate(modules) if m == "verify/test_forward.py")


def test_a_run_that_calls_no_kernel_exits_1(tmp_path):
    """SDPA's flash backend runs on no CPU: every test of it skips, and the six softmax laws that pass
    call no kernel. That is no verdict on sdpa_flash."""
    proc = _pytest_verify(tmp_path, "--impl", "sdpa_flash")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nothing was verified for sdpa_flash: no property called it" in proc.stdout, proc.stdout[-3000:]
    assert "flashverify: laws that call no kernel (counted for none): 6 passed" in proc.stdout
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["outcomes"].get("passed") is None and summary["outcomes"]["passed (laws, no kernel)"] == 6


@pytest.mark.parametrize("selection", [["--impl", "fa2_blocked"], []], ids=["named", "default"])
def test_a_run_that_verified_a_kernel_exits_0(tmp_path, selection):
    proc = _pytest_verify(tmp_path, *selection, "-k", "test_out_matches_reference and float64")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nothing was verified" not in proc.stdout
    assert "flashverify: fa2_blocked: 1 passed" in proc.stdout, proc.stdout[-3000:]
