"""The main job: ``pytest verify`` on every shipped kernel (Triton ones through the interpreter)
passes under the ci profile and writes its report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_shipped_kernels_pass_the_catalogue(tmp_path):
    report = tmp_path / "report"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify", "--hypothesis-profile=ci", "-q", "-rs",
                           "-p", "no:cacheprovider", "--report-dir", str(report)],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["measurements"] > 0 and not summary["failures"]
    impls = {row["implementation"] for row in summary["by_implementation_op_dtype"]}
    assert {"fa1_blocked", "fa2_blocked", "eager"} <= impls, impls
