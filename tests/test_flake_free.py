"""The suite is not flaky: three ``pytest verify`` runs under the derandomized ``ci`` profile give the
same verdicts and the same measurements (every error, bound and ratio, for the same cases in the same
order), timing aside.

The selection (forward accuracy, gradients and block-size invariance of ``fa2_blocked`` in every dtype,
the longest cases included) takes about 8 s a run on a 2-core machine."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SELECTION = "out_matches_reference or gradients_match_reference or block_size_invariance"
RUNS = 3
TIMING_FIELDS = ("t",)  # seconds since the run started: the one field a measurement may change by


def _run(report_dir: Path) -> tuple[dict[str, str], list[dict]]:
    """One run: its verdict per test id (from the JUnit XML) and its measurements, timing dropped."""
    junit = report_dir.with_suffix(".xml")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "verify", "--impl", "fa2_blocked", "--hypothesis-profile=ci", "-k", SELECTION,
         "-p", "no:cacheprovider", "-q", "--report-dir", str(report_dir), "--junitxml", str(junit)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        verdicts[f"{case.get('classname')}::{case.get('name')}"] = outcome
    measurements = []
    for path in sorted(report_dir.glob("measurements-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            for field in TIMING_FIELDS:
                row.pop(field, None)
            measurements.append(row)
    return verdicts, measurements


@pytest.mark.slow(seconds=110)
def test_three_ci_runs_give_the_same_verdicts_and_measurements(tmp_path):
    runs = [_run(tmp_path / f"report-{i}") for i in range(RUNS)]
    verdicts, measurements = runs[0]
    assert len(verdicts) >= 20 and measurements, (verdicts, len(measurements))
    for i, (other_verdicts, other_measurements) in enumerate(runs[1:], start=1):
        changed = {t: (verdicts.get(t), other_verdicts.get(t)) for t in set(verdicts) | set(other_verdicts)
                   if verdicts.get(t) != other_verdicts.get(t)}
        assert not changed, f"run {i} gave other verdicts than run 0: {changed}"
        as_text = [json.dumps(m, sort_keys=True) for m in measurements]
        other_text = [json.dumps(m, sort_keys=True) for m in other_measurements]
        only_first, only_other = sorted(set(as_text) - set(other_text)), sorted(set(other_text) - set(as_text))
        assert sorted(as_text) == sorted(other_text), (
            f"run {i} measured differently from run 0: {len(only_first)} measurements only in run 0, "
            f"{len(only_other)} only in run {i}; first of each:\n  {only_first[:1]}\n  {only_other[:1]}")
        assert as_text == other_text, f"run {i} took the same measurements as run 0, but in another order"
