"""What a run reached: the boundary classes of the cases each property ran, from ``coverage-*.jsonl``.

The runner writes one record per test (implementation, property, dtype, examples run, and how many of
them reached each boundary class of :func:`strategies.attention.boundary_classes`). This module reads
them back and folds them per property, for the coverage table of ``report.md`` / ``report.html`` and
for the check that a ``ci`` run on the shipped kernels reaches every class in :data:`REQUIRED`.
"""

from __future__ import annotations

import collections
from pathlib import Path

from reports.session import read_runs, read_stream
from strategies.attention import BOUNDARY_CLASSES

# Classes a `ci` run on the shipped kernels must reach (tests/test_coverage.py): each is allowed by the
# contract and is where real kernels have had bugs. A value names the property that must reach it
# (None: any property).
REQUIRED: dict[str, str | None] = {
    "decode_causal_gqa": None,
    # the groups production models use (strategies/attention.py, GROUPS), in decode and prefill
    "group_4": None,
    "group_5_or_7": None,
    "group_8": None,
    "group_16": None,
    "decode_causal_group_over_4": None,
    "prefill_group_over_4": None,
    "no_keys": None,
    "kv_tiles_wider": None,
    "k_aligned_q_ragged": None,
    "masked_q_tiles": "outputs_stay_in_bounds",  # out=/lse= buffers with whole query tiles masked
    "storage_offset": None,
    "len_over_128": None,
    "len_at_power_of_two_edge": None,
    "head_dim_over_128": None,
    # a value head dim of its own (the blocked kernels, eager and the Triton kernels declare it); multi-head
    # latent attention's 192/128 where the profile reaches head dim 192 (on a GPU)
    "head_dim_v_wider": None,
    "head_dim_v_narrower": None,
    "head_dim_v_mla": None,
    "scale_zero": None,
    "scale_negative": None,
    "scale_above_one": None,
    "scale_tiny": None,
    "scale_not_float16": None,
    "window_zero": None,  # drawn for the kernels that declare sliding windows (eager among the shipped)
    "window_narrow": None,
    "window_at_least_n": None,
    "softcap": None,  # drawn for the kernels that declare a softcap / ALiBi (eager and the blocked kernels)
    "softcap_below_one": None,
    "alibi": None,
    "alibi_causal_gqa": None,
    # drawn for the kernels that declare them (the blocked kernels and eager among the shipped)
    "chunks": None,
    "chunks_narrower_than_n": None,
    "sinks": None,
    "sinks_on_rows_without_keys": None,
    "split_kv": None,
    "split_kv_more_splits_than_keys": None,
    "split_kv_more_splits_than_key_tiles": None,
    "split_kv_over_64": None,
    "varlen_packed": None,
    "varlen_padded": None,
    "varlen_empty_sequence": None,
    "varlen_length_one": None,
    "varlen_nq_differs_from_nk": None,
    "varlen_total_below_sequences_gqa": None,
    "paged": None,
    "paged_page_size_1": None,
    "paged_page_not_power_of_two": None,
    "paged_pages_permuted": None,
    "paged_decode": None,
    "paged_speculative": None,
    # float8 inputs with FlashAttention-3's descales (the blocked FA2 declares them; Triton's FA2 on a GPU)
    "fp8_descaled": None,
}


def read_coverage(report_dir: str | Path) -> list[dict]:
    """Every coverage record of a report directory (truncated lines of a killed run are skipped)."""
    rows, _ = read_stream(report_dir, "coverage")
    return [r for r in rows if isinstance(r.get("classes"), dict)]


def by_property(records: list[dict]) -> list[dict]:
    """One row per property: tests, examples run, and the count of examples reaching each class."""
    rows: dict[str, dict] = {}
    for r in records:
        row = rows.setdefault(str(r.get("property")), {"property": str(r.get("property")), "tests": 0,
                                                       "examples": 0, "classes": collections.Counter(),
                                                       "longest": None, "max_group": 0, "max_splits": 0})
        row["tests"] += 1
        row["examples"] += int(r.get("examples") or 0)
        row["classes"].update({str(k): int(v) for k, v in r["classes"].items()})
        longest = r.get("longest")
        if isinstance(longest, dict) and (row["longest"] is None or (longest["len_k"], longest["len_q"]) > (
                row["longest"]["len_k"], row["longest"]["len_q"])):
            row["longest"] = {"len_k": int(longest["len_k"]), "len_q": int(longest["len_q"])}
        row["max_group"] = max(row["max_group"], int(r.get("max_group") or 0))
        row["max_splits"] = max(row["max_splits"], int(r.get("max_splits") or 0))
    return [{**row, "classes": dict(sorted(row["classes"].items(), key=lambda kv: BOUNDARY_CLASSES.index(kv[0])
                                          if kv[0] in BOUNDARY_CLASSES else len(BOUNDARY_CLASSES)))}
            for _, row in sorted(rows.items())]


def missing(records: list[dict], required: dict[str, str | None] | None = None,
            allowed: set[str] | None = None) -> list[str]:
    """The required classes the run never reached, each worded as what is missing. Only classes some
    implementation of the run allows (``allowed``: their declarations' classes; None: every class) and, for a
    class owed by one property, only where that property ran are owed."""
    required = REQUIRED if required is None else required
    reached: dict[str, set[str]] = collections.defaultdict(set)
    ran = {str(r.get("property")) for r in records}
    for r in records:
        for name, count in r["classes"].items():
            if count:
                reached[name].add(str(r.get("property")))
    out = []
    for name, prop in required.items():
        if (allowed is not None and name not in allowed) or (prop is not None and prop not in ran):
            continue
        if prop is None and not reached[name]:
            out.append(f"{name}: reached by no property")
        elif prop is not None and prop not in reached[name]:
            out.append(f"{name}: not reached by {prop}")
    return out


def summary(report_dir: str | Path) -> dict:
    """The coverage part of ``summary.json``: per-property rows and the required classes not reached
    (only judged when the run wrote coverage records at all)."""
    records = read_coverage(report_dir)
    return {"by_property": by_property(records),
            "required_missing": missing(records, allowed=allowed(report_dir)) if records else []}


def allowed(report_dir: str | Path) -> set[str] | None:
    """The classes some implementation of the run allows, from the run headers (None when no header says)."""
    impls = [i for run in read_runs(report_dir) for i in run.get("implementations") or [] if isinstance(i, dict)]
    if not impls or any("allowed_classes" not in i for i in impls):
        return None
    return {name for i in impls for name in i["allowed_classes"]}


PARTIAL_NOTE = "The run is PARTIAL: the tests it did not run reached nothing."


def missing_line(cov: dict, *, partial: bool) -> str:
    """The report's line on the required classes not reached ("" where none is missing); on a PARTIAL run
    it says so, since the tests that never ran may be what would have reached them."""
    if not cov.get("required_missing"):
        return ""
    return "Required classes not reached: " + "; ".join(cov["required_missing"]) + "." + (
        f" {PARTIAL_NOTE}" if partial else "")


def shapes_cell(row: dict) -> str:
    """The extremes of a property's drawn shapes: its longest sequence, largest group and most splits."""
    longest = row.get("longest")
    if not longest:
        return "-"
    return (f"Nk={longest['len_k']} Nq={longest['len_q']}, group {row.get('max_group') or 1}, "
            f"{row.get('max_splits') or 1} split(s)")


def markdown(cov: dict, *, partial: bool = False) -> list[str]:
    """The report's coverage section (Markdown lines); ``partial``: the run did not finish."""
    rows = cov.get("by_property") or []
    if not rows:
        return []
    lines = ["", "## Coverage: boundary classes reached", "",
             "Examples each property ran, and how many of them reached each boundary class (classes are "
             "facts of the case: `strategies/attention.py`, `boundary_classes`); the longest sequence drawn "
             "(by its keys), the largest group (query heads per KV head) and the most KV splits.", "",
             "| property | tests | examples | longest, group, splits | classes reached (examples) |",
             "|---|---|---|---|---|"]
    for row in rows:
        classes = ", ".join(f"{k} {v}" for k, v in row["classes"].items()) or "none"
        lines.append(f"| {row['property']} | {row['tests']} | {row['examples']} | {shapes_cell(row)} | {classes} |")
    if cov.get("required_missing"):
        lines += ["", missing_line(cov, partial=partial)]
    return lines
