"""The shipped kernels pass the accuracy properties of ``pytest verify`` (Triton ones through the
interpreter on CPU) under the ci profile, and the run writes its report.

A selection, not the whole catalogue: the whole of ``pytest verify`` takes minutes, and the README's
command 1 runs it. Here every shipped kernel (blocked FA1/FA2, eager, the Triton kernels and the online
softmax kernels) is held to both criteria against the float64 reference for out, LSE, the gradients and
the softmax: about a minute on one core. The other properties are covered on the blocked FA2 kernel by
the mutation self-check (tests/test_mutants.py: the unchanged kernel passes the whole catalogue, each
broken variant fails it).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ACCURACY = ("test_out_matches_reference or test_lse_matches_reference or test_gradients_match_reference "
            "or test_softmax_matches_reference")


@pytest.mark.slow(seconds=300)
def test_shipped_kernels_pass_the_accuracy_properties(tmp_path):
    report = tmp_path / "report"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify", "--hypothesis-profile=ci", "-q", "-rs",
                           "-p", "no:cacheprovider", "--report-dir", str(report), "-k", ACCURACY],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["measurements"] > 0 and not summary["failures"]
    measured = {(row["implementation"], row["op"]) for row in summary["by_implementation_op_dtype"]}
    for impl in ("fa1_blocked", "fa2_blocked", "eager", "triton_fa1", "triton_fa2"):
        for op in ("out", "lse", "dq", "dk", "dv"):
            assert (impl, op) in measured, f"{impl} {op} was not measured: {sorted(measured)}"
    for impl in ("softmax_streaming", "softmax_blocked", "softmax_batched", "triton_softmax"):
        assert (impl, "softmax") in measured, f"{impl} was not measured: {sorted(measured)}"
