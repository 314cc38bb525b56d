"""Summaries of a report directory: read every measurement stream, aggregate, write JSON and Markdown.

Works on a finished run and on one killed half-way: a truncated last line is skipped, not fatal.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from reports.session import _jsonable, write_atomic


def _num(value: Any) -> float:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return math.nan
    return float(value) if value is not None else math.nan


def read_measurements(report_dir: str | Path) -> tuple[list[dict], int]:
    """All measurements of the run and the number of unreadable (truncated) lines."""
    rows, bad = [], 0
    for path in sorted(Path(report_dir).glob("measurements-*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    bad += 1
    return rows, bad


def read_failures(report_dir: str | Path) -> list[dict]:
    out = []
    for path in sorted((Path(report_dir) / "failures").glob("*.json")):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def summarise(report_dir: str | Path, *, outcomes: dict | None = None) -> dict:
    rows, bad = read_measurements(report_dir)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        case = r.get("case") or {}
        groups[(r.get("implementation"), r.get("op"), case.get("dtype"))].append(r)
    table = []
    for (impl, op, dtype), items in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        ratios = sorted(_num(i.get("error_over_bound")) for i in items)
        base = sorted(_num(i.get("error_over_baseline")) for i in items if i.get("error_over_baseline") is not None)
        table.append({
            "implementation": impl, "op": op, "dtype": dtype, "measurements": len(items),
            "failed": sum(1 for i in items if i.get("pass") is False),
            "max_abs": max(_num(i.get("max_abs")) for i in items),
            "median_error_over_bound": ratios[len(ratios) // 2] if ratios else None,
            "max_error_over_bound": ratios[-1] if ratios else None,
            "max_error_over_baseline": base[-1] if base else None,
        })
    return {"measurements": len(rows), "unreadable_lines": bad, "by_implementation_op_dtype": table,
            "failures": read_failures(report_dir), "outcomes": outcomes or {}}


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def markdown(summary: dict) -> str:
    lines = ["# flashverify report", ""]
    outcomes = summary.get("outcomes") or {}
    if outcomes:
        lines += ["Tests: " + ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items())), ""]
    lines += [f"Measurements: {summary['measurements']}"
              + (f" ({summary['unreadable_lines']} unreadable lines skipped)" if summary["unreadable_lines"] else ""),
              "", "| implementation | op | dtype | n | failed | max abs err | median err/bound | max err/bound "
              "| max err/eager |", "|---|---|---|---|---|---|---|---|---|"]
    for row in summary["by_implementation_op_dtype"]:
        lines.append("| " + " | ".join(_fmt(row[k]) for k in (
            "implementation", "op", "dtype", "measurements", "failed", "max_abs", "median_error_over_bound",
            "max_error_over_bound", "max_error_over_baseline")) + " |")
    failures = summary.get("failures") or []
    lines += ["", f"## Failures ({len(failures)})", ""]
    for f in failures:
        lines += [f"### {f.get('test')}", "", "```", str(f.get("message", "")).strip(), "```", ""]
        if f.get("replay"):
            lines += ["Replay:", "", "```", f["replay"], "```", ""]
    return "\n".join(lines) + "\n"


def write_summary(report_dir: str | Path, *, outcomes: dict | None = None) -> dict:
    report_dir = Path(report_dir)
    summary = summarise(report_dir, outcomes=outcomes)
    write_atomic(report_dir / "summary.json", json.dumps(_jsonable(summary), indent=2))
    write_atomic(report_dir / "report.md", markdown(summary))
    return summary
