"""The report's columns are defined everywhere and explained: max ULP where the reference is zero, err/eager
where the eager baseline is exact, and a legend under the table of report.md and report.html."""

from __future__ import annotations

import math

import torch

from flashverify_kernels.registry import Implementation
from references import criteria
from references.metrics import error_stats
from references.spec import AttentionSpec
from reports import html, summary
from strategies.cases import AttentionCase
from verify.context import Context
from verify.asserts import assert_accurate, error_over_eager

from examples.reference_attention import attention


def test_max_ulp_counts_in_the_units_of_the_rows_scale():
    """An element near zero in a row of ones is rounded in the ones' units: its error counts in those, not in
    its own ULP (1e-6 at a zero reference would read 7e38 ULP); a row that is all zero is left out."""
    expected = torch.tensor([[[[0.0, 1e-40, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0]]]], dtype=torch.float64)
    actual = torch.tensor([[[[1e-6, 0.0, 1.0 + 2 ** -22, 2.0], [1e-3, 0.0, 0.0, 0.0]]]], dtype=torch.float32)
    stats = error_stats(actual, expected)
    assert math.isclose(stats.max_ulp, 1e-6 / 2 ** -22, rel_tol=1e-6)  # 1e-6 in units of 2.0's last place
    assert math.isclose(stats.max_abs, 1e-3, rel_tol=1e-6)  # the all-zero row's error is in max abs
    # An LSE-like result ([B, H, N]): the whole tensor's scale.
    lse = error_stats(torch.tensor([[[3.0, 1e-5]]]), torch.tensor([[[3.0, 0.0]]], dtype=torch.float64))
    assert math.isclose(lse.max_ulp, 1e-5 / 2 ** -22, rel_tol=1e-3)
    assert error_stats(torch.tensor([1e-6]), torch.tensor([0.0], dtype=torch.float64)).max_ulp == 0.0


def test_error_over_eager_uses_the_floor_where_eager_is_exact():
    assert error_over_eager(1e-3, 1e-4, 1e-6) == 10.0
    assert error_over_eager(1e-3, 0.0, 1e-4) == 10.0  # eager exact: the floor stands in
    assert error_over_eager(1e-3, 1e-300, 1e-4) == 10.0  # eager below the floor: no 1e297
    assert error_over_eager(0.0, 0.0, 0.0) == 0.0
    assert error_over_eager(1e-3, 0.0, 0.0) == math.inf


def test_the_record_of_an_exact_eager_and_a_zero_reference_is_finite():
    """A kernel off by 1e-9 where the reference is 0, the eager baseline exact: the record's max ULP counts
    in the row's units (1.0's: a hundredth of one) and err/eager comes from the floor (not 7e38 ULP, not inf)."""
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
    assert rec["pass"] and 0 < rec["max_ulp"] < 0.01, rec
    assert rec["error_over_baseline"] == rec["max_abs"] / floor and rec["error_over_baseline"] < 1, rec


def test_report_md_and_html_carry_the_legend():
    data = {"status": "complete", "measurements": 1, "failed_measurements": 0, "unreadable_lines": 0,
            "by_implementation_op_dtype": [], "worst_cases": [], "failures": [], "outcomes": {}, "run": {}}
    md = summary.markdown(data)
    page = html.report_html(data, [])
    for name, words in summary.LEGEND:
        assert f"**{name}**: {words}" in md
        assert f"<dt>{html.esc(name)}</dt><dd>{html.esc(words)}</dd>" in page
    assert "at the row's scale" in md and "so it is never inf" in md
