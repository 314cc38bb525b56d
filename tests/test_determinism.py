"""Determinism: ``run_to_run_identical`` repeats forward and backward on the same inputs. A kernel whose
results change from call to call fails when it declares itself deterministic, and is skipped with the
measured difference in the reason (and in the report) when it does not; the shipped kernels are
bitwise reproducible.

The nudged fixture below is that kernel: the blocked FA2 forward with the output's first element moved
up by one unit in the last place on every other call (what a reordered atomic sum does to a result).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashverify_kernels.pytorch import blocked
from flashverify_kernels.registry import Implementation, registry
from references.spec import AttentionSpec
from strategies.cases import AttentionCase
from verify.context import Context, PropertyFailure
from verify.properties import RUNS, NotForThisKernel, run_to_run_identical

ROOT = Path(__file__).resolve().parent.parent
PROP = "run_to_run_identical"
CASE = AttentionCase(batch=1, heads_q=2, heads_kv=1, len_q=5, len_k=7, head_dim=8, dtype="float16",
                     spec=AttentionSpec(causal=True))

_calls = itertools.count()


def _nudge(out: torch.Tensor, ulps: float) -> torch.Tensor:
    """``out`` with its first element moved up by ``ulps`` units in the last place, on odd calls."""
    if next(_calls) % 2 == 0 or out.numel() == 0:
        return out
    first = out.detach().reshape(-1)[:1]
    step = (torch.nextafter(first, torch.full_like(first, float("inf"))) - first) * ulps
    delta = torch.zeros(out.numel(), dtype=out.dtype, device=out.device)
    delta[:1] = step
    return out + delta.view(out.shape)  # gradients flow through out unchanged


def nudged_forward(q, k, v, *, causal=False, scale=None):
    out, lse = blocked.fa2_forward(q, k, v, causal=causal, scale=scale)
    return _nudge(out, 1.0), lse


def shaken_forward(q, k, v, *, causal=False, scale=None):
    """Like nudged_forward, but by 2**12 ulps: more than any rounding bound allows."""
    out, lse = blocked.fa2_forward(q, k, v, causal=causal, scale=scale)
    return _nudge(out, 4096.0), lse


NUDGED = Implementation(name="nudged", forward=nudged_forward, gqa=True, deterministic=True,
                        description="blocked FA2, first output element +1 ulp on every other call")
NUDGED_NONDET = dataclasses.replace(NUDGED, name="nudged_nondet", deterministic=False)
SHAKEN_NONDET = Implementation(name="shaken_nondet", forward=shaken_forward, gqa=True, deterministic=False)


def _check(impl, case=CASE):
    records = []
    ctx = Context(impl=impl, prop=PROP, case=case, record=records.append)
    run_to_run_identical(ctx, case)
    return records


def test_declared_deterministic_kernel_that_is_not_fails_with_op_index_and_values():
    records = []
    ctx = Context(impl=NUDGED, prop=PROP, case=CASE, record=records.append)
    with pytest.raises(PropertyFailure) as info:
        run_to_run_identical(ctx, CASE)
    msg = str(info.value)
    assert re.search(rf"nudged: out differs between run 1 and run [23] of {RUNS} on the same inputs although "
                     r"nudged declares deterministic=True: 1 of 80 values differ, first at \[0, 0, 0, 0\]: ", msg), msg
    # Both values, with their bits: one unit in the last place apart.
    values = re.findall(r"(-?[\d.e+-]+) \(0x([0-9a-f]{4})\) in run \d", msg)
    assert len(values) == 2 and abs(int(values[0][1], 16) - int(values[1][1], 16)) == 1, msg
    assert "replay: python -m verify.replay --impl nudged --property run_to_run_identical" in msg, msg
    by_op = {r["op"]: r for r in records}
    assert by_op["out run-to-run"]["pass"] is False and by_op["out run-to-run"]["max_abs"] > 0
    assert by_op["dq run-to-run"]["pass"] is True and by_op["dq run-to-run"]["max_abs"] == 0


def test_undeclared_kernel_is_skipped_with_the_measured_difference_and_recorded():
    records = []
    ctx = Context(impl=NUDGED_NONDET, prop=PROP, case=CASE, record=records.append)
    with pytest.raises(NotForThisKernel) as info:
        run_to_run_identical(ctx, CASE)
    reason = str(info.value)
    measured = re.search(rf"nudged_nondet is not declared deterministic; measured run-to-run max \|difference\| "
                         rf"over {RUNS} runs: out (\S+), lse 0, dq 0, dk 0, dv 0$", reason)
    assert measured and float(measured.group(1)) > 0, reason
    by_op = {r["op"]: r for r in records}
    assert set(by_op) == {f"{op} run-to-run" for op in ("out", "lse", "dq", "dk", "dv")}
    out = by_op["out run-to-run"]
    assert out["max_abs"] == pytest.approx(float(measured.group(1)), rel=1e-2)
    # One ulp is within twice the rounding bound: a measurement, not a failure.
    assert out["pass"] is True and 0 < out["error_over_bound"] <= 1
    assert out["implementation"] == "nudged_nondet" and out["property"] == PROP and out["case"] == CASE.to_dict()
    assert out["declared_deterministic"] is False and out["runs"] == RUNS


def test_undeclared_kernel_whose_runs_differ_beyond_the_bounds_still_fails():
    with pytest.raises(PropertyFailure, match=r"out differs between runs by more than two results within their "
                                              r"rounding bounds can"):
        _check(SHAKEN_NONDET)


CASES = [CASE, CASE.replace(spec=AttentionSpec(causal=False), dtype="float32", seed=3, block_m=2, block_n=3),
         AttentionCase(batch=2, heads_q=3, heads_kv=3, len_q=9, len_k=4, head_dim=5, dtype="bfloat16",
                       spec=AttentionSpec(causal=True), layout="bnhd", seed=7, block_m=4, block_n=1),
         AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=3, len_k=3, head_dim=3, dtype="float64",
                       spec=AttentionSpec(causal=False), layout="padded", magnitude="large_logits", seed=8)]


@pytest.mark.parametrize("name", ["fa2_blocked", "fa1_blocked", "eager"])
def test_shipped_kernels_are_bitwise_reproducible(name):
    impl = registry()[name]
    assert impl.deterministic
    for case in CASES:
        assert _check(impl, case) == []  # identical runs: nothing to record


def test_forward_only_kernels_are_compared_on_out_and_lse():
    forward_only = dataclasses.replace(NUDGED_NONDET, name="nudged_forward_only", autograd=False)
    with pytest.raises(NotForThisKernel, match=r"over \d runs: out \S+, lse 0$"):
        _check(forward_only)


def test_the_suite_reports_both_the_failure_and_the_measurement(tmp_path):
    """End to end: ``pytest verify --impl file.py:attr`` fails the declared-deterministic kernel, skips the
    undeclared one with the measured values in the skip reason, and writes the measurement into the report."""
    report = tmp_path / "report"
    this = Path(__file__).relative_to(ROOT)
    cmd = [sys.executable, "-m", "pytest", "verify", "--impl", f"{this}:NUDGED", "--impl", f"{this}:NUDGED_NONDET",
           "-k", "run_to_run and float32", "--hypothesis-profile=ci", "-q", "-rs", "-p", "no:cacheprovider",
           "--report-dir", str(report)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:] + proc.stderr[-2000:]
    assert "1 failed" in out and "1 skipped" in out, out[-4000:]
    assert "nudged declares deterministic=True" in out, out[-4000:]
    assert re.search(r"SKIPPED .*nudged_nondet is not declared deterministic; measured run-to-run max "
                     r"\|difference\| over \d runs: out [^0]\S*, lse 0, dq 0, dk 0, dv 0", out), out[-4000:]
    summary = json.loads((report / "summary.json").read_text())
    rows = {(r["implementation"], r["op"]) for r in summary["by_implementation_op_dtype"]}
    assert {("nudged_nondet", "out run-to-run"), ("nudged", "out run-to-run")} <= rows, rows
