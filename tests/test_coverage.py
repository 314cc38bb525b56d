"""Coverage, not repetition: every property draws its own cases, a `ci` run reaches every required
boundary class, and the report shows which classes each property reached."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from reports import coverage
from reports.summary import markdown, summarise
from strategies.attention import BOUNDARY_CLASSES
from verify.runner import seed_for

ROOT = Path(__file__).resolve().parent.parent


def test_every_required_class_is_a_known_class():
    assert set(coverage.REQUIRED) <= set(BOUNDARY_CLASSES)


def test_missing_names_what_was_not_reached():
    records = [{"property": "out_matches_reference", "examples": 3, "classes": {"decode": 1}},
               {"property": "outputs_stay_in_bounds", "examples": 2, "classes": {"masked_q_tiles": 0}}]
    required = {"decode": None, "no_keys": None, "masked_q_tiles": "outputs_stay_in_bounds"}
    assert coverage.missing(records, required) == ["no_keys: reached by no property",
                                                   "masked_q_tiles: not reached by outputs_stay_in_bounds"]
    records[1]["classes"]["masked_q_tiles"] = 1
    records.append({"property": "x", "examples": 1, "classes": {"no_keys": 2}})
    assert coverage.missing(records, required) == []


def test_only_classes_a_declaration_allows_and_properties_that_ran_are_owed():
    """A plain callable (no GQA, no windows, no variants) owes none of their classes, and a class owed by a
    property that never ran (its kernel declares no out= buffers) is not listed either."""
    from flashverify_kernels.registry import from_callable
    from strategies.attention import Limits, allowed_classes
    from verify.runner import declared_draws, limits_of

    from examples.reference_attention import attention

    plain = from_callable(attention, "kernel.py:attention", device="cpu")
    allowed = set(allowed_classes(limits_of(plain, Limits(max_len=136, max_head_dim=136)),
                                  **declared_draws(plain, None, {})))
    assert {"gqa", "decode_causal_gqa", "window_zero", "softcap", "paged", "varlen_packed", "split_kv"}.isdisjoint(allowed)
    assert {"decode", "no_keys", "len_over_128", "head_dim_over_128", "scale_negative", "storage_offset"} <= allowed
    records = [{"property": "out_matches_reference", "examples": 3, "classes": {"decode": 1}}]
    required = {"decode": None, "gqa": None, "masked_q_tiles": "outputs_stay_in_bounds", "no_keys": None}
    assert coverage.missing(records, required, allowed=allowed) == ["no_keys: reached by no property"]
    # Without the declarations every class is owed, but still only by properties that ran.
    assert coverage.missing(records, required) == ["gqa: reached by no property", "no_keys: reached by no property"]


def test_seeds_differ_between_properties_and_dtypes_and_are_stable():
    a = seed_for("attention", "out_matches_reference", "float16", None)
    assert a == seed_for("attention", "out_matches_reference", "float16", None)
    assert len({a, seed_for("attention", "lse_matches_reference", "float16", None),
                seed_for("attention", "out_matches_reference", "float32", None),
                seed_for("attention", "out_matches_reference", "float16", 7)}) == 4


def _run_ci(tmp_path, *args):
    report = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify", "--hypothesis-profile=ci", "-q",
                           "-p", "no:cacheprovider", "--report-dir", str(report), *args],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    return report


@pytest.mark.slow
def test_a_ci_run_reaches_every_required_class_and_draws_distinct_cases(tmp_path):
    # One shipped kernel in one dtype (the whole catalogue, ~10 s of CPU) and float8's own properties in
    # e4m3: every required class is reached by construction, not by luck of a long run.
    report = _run_ci(tmp_path, "--impl", "fa2_blocked", "-k", "float32 or float8_e4m3fn")
    records = coverage.read_coverage(report)
    # Owed is what the declaration and the profile allow: all the required classes but multi-head latent
    # attention's 192/128, which needs head dim 192 (the cpu profiles stop at 136; a GPU run owes it).
    assert set(coverage.REQUIRED) - coverage.allowed(report) == {"head_dim_v_mla"}
    assert coverage.missing(records, allowed=coverage.allowed(report)) == []
    # Distinct seeds: the properties of one kernel and dtype measure mostly different cases.
    rows = [json.loads(line) for path in report.glob("measurements-*.jsonl") for line in path.open()]
    per_prop = {}
    for r in rows:
        if r["implementation"] == "fa2_blocked" and r["case"]["dtype"] == "float32":
            per_prop.setdefault(r["property"], set()).add(json.dumps(r["case"], sort_keys=True))
    a, b = per_prop["out_matches_reference"], per_prop["gradients_match_reference"]
    assert len(a & b) <= len(a) // 4, (len(a & b), len(a))
    # The report shows the table.
    summary = summarise(report)
    assert summary["coverage"]["required_missing"] == []
    text = markdown(summary)
    assert "## Coverage: boundary classes reached" in text and "| outputs_stay_in_bounds |" in text
    # The extremes of the drawn shapes, per property: the long class, the groups of 16, the 128 splits.
    rows = {r["property"]: r for r in summary["coverage"]["by_property"]}
    assert max(r["longest"]["len_k"] for r in rows.values() if r["longest"]) > 64
    assert max(r["max_group"] for r in rows.values()) == 16 and max(r["max_splits"] for r in rows.values()) == 128
    shapes = rows["out_matches_reference"]
    assert (f"| Nk={shapes['longest']['len_k']} Nq={shapes['longest']['len_q']}, group {shapes['max_group']}, "
            f"{shapes['max_splits']} split(s) |") in text
    assert "masked_q_tiles" in (report / "report.md").read_text()


def test_derandomized_profiles_are_what_the_seeds_rely_on():
    # The runner gives each test its own seed only under derandomize (ci, gpu): check the profiles.
    assert settings.get_profile("ci").derandomize and settings.get_profile("gpu").derandomize


def test_classes_not_reached_on_a_partial_run_say_the_run_was_cut_short():
    # A run cut short (a signal, a crash) did not run every property: the report must not read as if the
    # properties that ran had missed the classes.
    from reports.html import _coverage_section

    cov = {"by_property": [{"property": "out_matches_reference", "tests": 1, "examples": 1, "classes": {}}],
           "required_missing": ["no_keys: reached by no property"]}
    complete, partial = coverage.markdown(cov, partial=False), coverage.markdown(cov, partial=True)
    assert complete[-1] == "Required classes not reached: no_keys: reached by no property."
    assert partial[-1] == complete[-1] + " " + coverage.PARTIAL_NOTE
    assert coverage.PARTIAL_NOTE in "".join(_coverage_section(cov, partial=True))
    assert coverage.PARTIAL_NOTE not in "".join(_coverage_section(cov, partial=False))
