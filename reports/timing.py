"""Time per property and where it goes, from ``timing-*.jsonl``.

The plugin writes one record per test as it ends: its wall time and the seconds of each stage
(``verify/stages.py``: the kernel, Triton's compiles, the float64 reference, the rounding bounds, the eager
baseline) and the Triton kernels it compiled. This
module adds them up per property for ``summary.json`` and ``report.md``; what no stage claims (drawing cases
and building inputs, the comparisons, the report's own writing) is the rest. Under pytest-xdist the seconds
are the workers' added together, not the run's wall time.
"""

from __future__ import annotations

from pathlib import Path

from reports.session import read_stream

STAGES = ("kernel", "compile", "reference", "bounds", "baseline")


def read_timing(report_dir: str | Path) -> list[dict]:
    """Every timing record of a report directory (truncated lines of a killed run are skipped)."""
    rows, _ = read_stream(report_dir, "timing")
    return [r for r in rows if isinstance(r.get("seconds"), (int, float))]


def summary(report_dir: str | Path) -> dict:
    """``{"seconds": all tests' seconds, "stages": {stage: seconds, "rest": seconds}, "compiles": count,
    "by_property": rows}``, the rows longest first; each row: the property, its tests, their seconds, the slowest
    test and its seconds, the seconds of each stage and of the rest, and the Triton kernels its tests compiled."""
    rows: dict[str, dict] = {}
    for r in read_timing(report_dir):
        prop = str(r.get("property"))
        row = rows.setdefault(prop, {"property": prop, "tests": 0, "seconds": 0.0, "slowest_test": None,
                                     "slowest_seconds": 0.0, "stages": dict.fromkeys(STAGES, 0.0), "compiles": 0})
        row["tests"] += 1
        if isinstance(r.get("compiles"), int):
            row["compiles"] += r["compiles"]
        row["seconds"] += r["seconds"]
        if r["seconds"] >= row["slowest_seconds"]:
            row["slowest_test"], row["slowest_seconds"] = r.get("test"), r["seconds"]
        spent = r.get("stages") if isinstance(r.get("stages"), dict) else {}
        for name in STAGES:
            value = spent.get(name)
            if isinstance(value, (int, float)):
                row["stages"][name] += value
    table = sorted(rows.values(), key=lambda row: -row["seconds"])
    total = dict.fromkeys(STAGES, 0.0)
    for row in table:
        row["stages"]["rest"] = max(0.0, row["seconds"] - sum(row["stages"][n] for n in STAGES))
        for name in STAGES:
            total[name] += row["stages"][name]
        row["seconds"] = round(row["seconds"], 3)
        row["stages"] = {name: round(value, 3) for name, value in row["stages"].items()}
    seconds = sum(row["seconds"] for row in table)
    total["rest"] = max(0.0, seconds - sum(total.values()))
    return {"seconds": round(seconds, 3), "stages": {name: round(v, 3) for name, v in total.items()},
            "compiles": sum(row["compiles"] for row in table), "by_property": table}


def _share(part: float, whole: float) -> str:
    return f"{part:.1f} ({100 * part / whole:.0f}%)" if whole > 0 else f"{part:.1f}"


def markdown(timing: dict) -> list[str]:
    """The ``report.md`` section (no lines when no test wrote a timing record)."""
    rows = timing.get("by_property") or []
    if not rows:
        return []
    columns = (*STAGES, "rest")
    lines = ["", "## Time per property", "",
             "Seconds of all the property's tests (pytest-xdist workers' added together), longest first, and "
             "where they went: the kernel under test, Triton's compiles (a kernel new to the worker compiled, or "
             "loaded from Triton's cache), the float64 reference, the rounding-error bounds, the eager baseline, "
             "and the rest (drawing cases, building inputs, the comparisons); and the Triton kernels compiled.", "",
             "| property | tests | seconds | slowest test s | " + " | ".join(columns) + " | compiles |",
             "|---|---|---|---|" + "---|" * (len(columns) + 1)]
    for row in rows:
        spent = row["stages"]
        lines.append(f"| {row['property']} | {row['tests']} | {row['seconds']:.1f} | {row['slowest_seconds']:.1f} | "
                     + " | ".join(_share(spent.get(c, 0.0), row["seconds"]) for c in columns)
                     + f" | {row.get('compiles', 0)} |")
    total, spent = timing.get("seconds", 0.0), timing.get("stages") or {}
    lines.append(f"| all | {sum(r['tests'] for r in rows)} | {total:.1f} | | "
                 + " | ".join(_share(spent.get(c, 0.0), total) for c in columns) + f" | {timing.get('compiles', 0)} |")
    return lines
