"""Peak device memory and time per property, from ``memory-*.jsonl``.

On a GPU the plugin writes one record per test as it ends: the peak bytes allocated while it ran
(``torch.cuda.max_memory_allocated``, reset before each test), the worker's budget
(``verify/gpu.py``) and the test's wall time. This module folds them per property for ``summary.json`` and ``report.md``. A CPU
run writes none, and the section is left out.
"""

from __future__ import annotations

from pathlib import Path

from reports.session import read_stream

MIB = 2 ** 20


def read_memory(report_dir: str | Path) -> list[dict]:
    """Every peak-memory record of a report directory (truncated lines of a killed run are skipped)."""
    rows, _ = read_stream(report_dir, "memory")
    return [r for r in rows if isinstance(r.get("peak_bytes"), int)]


def summary(report_dir: str | Path) -> dict:
    """``{"budget_bytes": the smallest worker budget, "by_property": [one row per property]}``; each row:
    tests, the largest peak and the test it was reached in, the median peak, the tests' seconds in all
    and the slowest test's."""
    records = read_memory(report_dir)
    rows: dict[str, dict] = {}
    for r in records:
        prop = str(r.get("property"))
        row = rows.setdefault(prop, {"property": prop, "tests": 0, "peaks": [], "max_peak_bytes": -1,
                                     "max_peak_test": None, "seconds": 0.0,
                                     "max_seconds": 0.0})
        row["tests"] += 1
        seconds = r.get("seconds")
        if isinstance(seconds, (int, float)):
            row["seconds"] = round(row["seconds"] + seconds, 3)
            row["max_seconds"] = max(row["max_seconds"], seconds)
        row["peaks"].append(r["peak_bytes"])
        if r["peak_bytes"] > row["max_peak_bytes"]:
            row["max_peak_bytes"], row["max_peak_test"] = r["peak_bytes"], r.get("test")
    table = []
    for prop in sorted(rows):
        row = rows[prop]
        peaks = sorted(row.pop("peaks"))
        table.append({**row, "median_peak_bytes": peaks[len(peaks) // 2]})
    budgets = [r["budget_bytes"] for r in records if isinstance(r.get("budget_bytes"), int)]
    return {"budget_bytes": min(budgets) if budgets else None, "by_property": table}


def markdown(mem: dict) -> list[str]:
    """The ``report.md`` section (no lines when no test ran on a GPU)."""
    rows = mem.get("by_property") or []
    if not rows:
        return []
    budget = mem.get("budget_bytes")
    lines = ["", "## Peak device memory and time per property", "",
             "The most device memory one test of the property allocated (kernel and suite together, "
             "torch.cuda.max_memory_allocated, reset per test), and the wall time of its tests"
             + (f"; each worker's budget: {budget / MIB:.0f} MiB" if budget else "") + ".", "",
             "| property | tests | max peak MiB | median peak MiB | max in test | seconds | slowest test s |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        test = str(row.get("max_peak_test") or "-").replace("|", "\\|")
        lines.append(f"| {row['property']} | {row['tests']} | {row['max_peak_bytes'] / MIB:.1f} | "
                     f"{row['median_peak_bytes'] / MIB:.1f} | {test} | {row['seconds']:.1f} | {row['max_seconds']:.1f} |")
    return lines
