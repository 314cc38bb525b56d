"""Long contexts: under the gpu profile one query meets KV caches of up to 128k keys (the ``long_context``
class, and the longest-case tests), within each worker's memory budget, and a kernel whose bug shows only
past 65536 keys fails the suite with the smallest such case."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings

from strategies.attention import Limits, attention_cases, boundary_classes
from verify import gpu
from verify.profiles import limits_for

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/long_context_kernels.py"
GIB = 2 ** 30


def _fitted(total_gib: float, workers: int, limits: Limits | None = None) -> tuple[Limits, int]:
    budget = gpu.plan_budget(device=0, total_bytes=int(total_gib * GIB), free_bytes=int(total_gib * GIB),
                             workers=workers)
    limits = limits or limits_for("cuda", "gpu")
    return gpu.limits_within(limits, budget, from_budget=True), budget.worker_bytes


def _draws(limits: Limits, n: int = 300, **kwargs):
    cases = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None)
    @given(attention_cases(dtype="float16", limits=limits, gqa=True, **kwargs))
    def collect(case):
        cases.append(case)

    collect()
    return cases


@pytest.mark.parametrize(("total_gib", "workers", "past"), [(141, 16, 2 ** 16), (80, 16, 2 ** 14), (16, 4, 2 ** 13)])
def test_the_gpu_profile_draws_kv_caches_past_max_len_within_the_worker_budget(total_gib, workers, past):
    """An H200's 16 workers reach past 64k keys; smaller budgets hold fewer rows, and so shorter caches
    (a KV cache's rows within half of them: 32k keys on an 80 GB card's 16 workers, 16k on a 16 GB card's 4)."""
    limits, worker_bytes = _fitted(total_gib, workers)
    assert limits.context_len == 2 ** 17
    contexts = _draws(limits, 100, shape_classes=["long_context"])
    longest = max(c.len_k for c in contexts)
    assert all(c.len_q == 1 for c in contexts) and longest > max(past, limits.max_len), (longest, limits.max_len)
    if past == 2 ** 16:
        assert any("context_over_64k" in boundary_classes(c) for c in contexts)
    cases = contexts + _draws(limits)  # and every class beside it
    for c in cases:
        peak = gpu.suite_peak_bytes(batch=c.batch, heads_q=c.heads_q, len_q=c.len_q, len_k=c.len_k,
                                    head_dim=c.head_dim)
        assert peak <= worker_bytes, (c.describe(), peak, worker_bytes)


def test_without_max_context_no_case_passes_max_len():
    limits, _ = _fitted(141, 16, dataclasses.replace(limits_for("cuda", "gpu"), max_context=0))
    cases = _draws(limits)
    assert max(c.len_k for c in cases) <= limits.max_len <= 8192
    assert not any(name.startswith("context_") for c in cases for name in boundary_classes(c))


def test_the_cpu_ci_draws_are_unchanged_by_the_long_context_class():
    """The class is left out where ``max_context`` is not above ``max_len``: the ci draws stay as they were."""
    assert limits_for("cpu", "ci").context_len == limits_for("cpu", "ci").max_len
    assert all(c.len_k <= 136 for c in _draws(limits_for("cpu", "ci"), 100))


def _suite(tmp_path, name):
    report = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify", "--impl", f"{FIXTURE}:{name}",
                           "--hypothesis-profile=gpu", "--device", "cpu", "-q", "-p", "no:cacheprovider",
                           "--report-dir", str(report)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=900)
    return proc, report


@pytest.mark.slow(seconds=40)
def test_a_kv_cache_indexed_by_16_bits_fails_the_suite_past_65536_keys(tmp_path):
    """Up to 65536 keys the kernel is the correct one bit for bit, so no draw of the old limits
    (``max_len`` 8192 under the gpu profile) can catch it; the long contexts do, and the drawn failure
    shrinks to one query against 65537 keys."""
    proc, report = _suite(tmp_path, "uint16_positions")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    cases = [json.loads(p.read_text())["case"] for p in (report / "failures").glob("*.json")]
    assert cases and all(c["len_q"] == 1 and c["len_k"] > 2 ** 16 for c in cases), cases
    drawn = [c for c in cases if c["len_k"] < 2 ** 17]
    assert drawn and min(c["len_k"] for c in drawn) == 2 ** 16 + 1, cases
    assert "Nk=65537" in out and "replay: python -m verify.replay" in out


@pytest.mark.slow(seconds=40)
def test_the_same_kernel_without_the_bug_passes_the_long_contexts(tmp_path):
    proc, report = _suite(tmp_path, "correct")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    longest = json.loads((report / "summary.json").read_text())
    assert "131072" in (report / "report.md").read_text(), longest
