"""Metamorphic checks' margins, from ``margins-*.jsonl``.

A metamorphic property compares two results of the kernel (a key permutation, a score shift, another
tiling...) within a tolerance derived from the rounding bounds of both (:mod:`references.bounds`). Each
comparison writes one record: its largest difference over its tolerance (at most 1 to pass). This module
folds them per implementation, property and dtype for ``summary.json`` and ``report.md``, so a report shows
how close each metamorphic check came to its tolerance, as the accuracy table does for the bounds.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from reports.session import read_stream


def _ratio(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def read_margins(report_dir: str | Path) -> list[dict]:
    """Every margin record of a report directory (truncated lines of a killed run are skipped)."""
    rows, _ = read_stream(report_dir, "margins")
    return [r for r in rows if "difference_over_tolerance" in r]


def summary(report_dir: str | Path) -> list[dict]:
    """One row per (implementation, property, dtype): comparisons, failed, median and max difference/tolerance."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in read_margins(report_dir):
        groups[(str(r.get("implementation")), str(r.get("property")), str(r.get("dtype")))].append(r)
    table = []
    for (impl, prop, dtype), items in sorted(groups.items()):
        ratios = [_ratio(i.get("difference_over_tolerance")) for i in items]
        finite = [x for x in ratios if not math.isnan(x)]
        table.append({"implementation": impl, "property": prop, "dtype": dtype, "comparisons": len(items),
                      "failed": sum(1 for i in items if i.get("pass") is False),
                      "median_difference_over_tolerance": statistics.median(finite) if finite else None,
                      "max_difference_over_tolerance": max(ratios, key=lambda x: math.inf if math.isnan(x) else x)
                      if ratios else None})
    return table


def markdown(rows: list[dict]) -> list[str]:
    """The ``report.md`` section (no lines when no metamorphic check ran)."""
    if not rows:
        return []
    lines = ["", "## Metamorphic checks", "",
             "Two results of the kernel that should agree (another tiling, permuted keys, shifted scores, ...), "
             "compared within a tolerance made of both results' rounding bounds: the median and largest "
             "difference/tolerance over the comparisons (at most 1 to pass).", "",
             "| implementation | property | dtype | n | failed | median diff/tol | max diff/tol |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["implementation"], r["property"], r["dtype"], r["comparisons"], r["failed"],
                 r["median_difference_over_tolerance"], r["max_difference_over_tolerance"]]
        lines.append("| " + " | ".join("-" if c is None else (f"{c:.3g}" if isinstance(c, float) else str(c))
                                       for c in cells) + " |")
    return lines
