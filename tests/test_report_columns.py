"""The report's columns are defined everywhere and explained: max ULP where the reference is zero, err/eager
where the eager baseline is exact, and a legend under the table of report.md and report.html."""

from __future__ import annotations

import math

import torch

from kernels.registry import Implementation
from references import criteria
from references.metrics import error_stats
from references.spec import AttentionSpec
from reports import html, summary
from strategies.cases import AttentionCase
from verify.harness import Context, assert_accurate, error_over_eager

from examples.reference_attention import attention


def test_max_ulp_leaves_out_zero_and_subnormal_references():
    expected = torch.tensor([0.0, 1e-40, 1.0, 2.0], dtype=torch.float64)
    actual = torch.tensor([1e-6, 0.0, 1.0 + 2 ** -22, 2.0], dtype=torch.float32)
    stats = error_stats(actual, expected)
    assert stats.max_ulp == 2.0  # at 1.0 only; the 1e-6 error at a zero reference would read 7e38 ULP
    assert stats.max_abs == 1e-6 or math.isclose(stats.max_abs, 1e-6, rel_tol=1e-6)
    assert error_stats(torch.tensor([1e-6]), torch.tensor([0.0], dtype=torch.float64)).max_ulp == 0.0


def test_error_over_eager_uses_the_floor_where_eager_is_exact():
    assert error_over_eager(1e-3, 1e-4, 1e-6) == 10.0
    assert error_over_eager(1e-3, 0.0, 1e-4) == 10.0  # eager exact: the floor stands in
    assert error_over_eager(1e-3, 1e-300, 1e-4) == 10.0  # eager below the floor: no 1e297
    assert error_over_eager(0.0, 0.0, 0.0) == 0.0
    assert error_over_eager(1e-3, 0.0, 0.0) == math.inf


def test_the_record_of_an_exact_eager_and_a_zero_reference_is_finite():
    """A kernel off by 1e-9 where the reference is 0, the eager baseline exact: the record's max ULP
    comes from the normal elements only and err/eager from the floor (before: 7e38 ULP and inf)."""
    records = []
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=1, len_k=2, head_dim=2, dtype="float32",
                         spec=AttentionSpec(causal=False))
    ctx = Context(impl=Implementation(name="k", forward=attention), prop="out_matches_reference", case=case,
                  record=records.append)
    expected = torch.tensor([[[[0.0, 1.0]]]], dtype=torch.float64)
    actual = torch.tensor([[[[1e-9, 1.0]]]], dtype=torch.float32)
    assert_accurate(ctx, op="out", actual=actual, expected=expected, baseline=expected.float(),
                    bound=torch.full_like(expected, 1e-6), input_dtype=torch.float32,
                    magnitude=criteria.Magnitudes(summands=1.0))
    (rec,) = records
    floor = criteria.floor("out", torch.float32, criteria.Magnitudes(summands=1.0))
    assert rec["pass"] and rec["max_ulp"] == 0.0, rec
    assert rec["error_over_baseline"] == rec["max_abs"] / floor and rec["error_over_baseline"] < 1, rec


def test_report_md_and_html_carry_the_legend():
    data = {"status": "complete", "measurements": 1, "failed_measurements": 0, "unreadable_lines": 0,
            "by_implementation_op_dtype": [], "worst_cases": [], "failures": [], "outcomes": {}, "run": {}}
    md = summary.markdown(data)
    page = html.report_html(data, [])
    for name, words in summary.LEGEND:
        assert f"**{name}**: {words}" in md
        assert f"<dt>{html.esc(name)}</dt><dd>{html.esc(words)}</dd>" in page
    assert "elements whose reference is 0 or subnormal" in md and "so it is never inf" in md
