"""Run the zoo through ``pytest verify`` and fold its report into the soundness margins.

``python -m tests.zoo.run [--profile ci] [--seed N] [--report-dir DIR]`` runs every zoo kernel (one
``pytest verify`` session, ``--impl tests.zoo:NAME`` each) and prints, per property, the largest and the
median error/bound (accuracy checks: ``references/bounds.py``) or difference/tolerance (metamorphic checks)
over every zoo kernel's measurements, per dtype. Exits with pytest's status.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def command(profile: str, seed: int | None, report_dir: str | os.PathLike, *, workers: int | None = None,
            names=None) -> list[str]:
    from tests.zoo import ZOO

    impls = [arg for name in (names or ZOO) for arg in ("--impl", f"tests.zoo:{name}")]
    cmd = [sys.executable, "-m", "pytest", "verify", *impls, "-q", "-p", "no:cacheprovider",
           f"--hypothesis-profile={profile}", "--report-dir", str(report_dir)]
    if seed is not None:
        cmd.append(f"--hypothesis-seed={seed}")
    if workers:
        cmd += ["-n", str(workers)]
    return cmd


def run_zoo(profile: str, seed: int | None, report_dir: str | os.PathLike, *, workers: int | None = None,
            names=None) -> subprocess.CompletedProcess:
    """``pytest verify`` on the zoo in a subprocess (the same environment, one torch thread per process).
    Hypothesis's example database lives in ``report_dir``, empty at the start: the dev profile's replayed
    failures from earlier runs on this machine would change the examples a seed draws."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
           "HYPOTHESIS_STORAGE_DIRECTORY": str(Path(report_dir) / ".hypothesis")}
    return subprocess.run(command(profile, seed, report_dir, workers=workers, names=names), cwd=ROOT,
                          capture_output=True, text=True, env=env)


def _number(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


DTYPES = ("float16", "bfloat16", "float32", "float64")


def margins(report_dir: str | os.PathLike) -> list[dict]:
    """Per property (and op, for the accuracy checks) and dtype: checks, failed, median and largest ratio, and
    the kernel that reached the largest."""
    from reports.margins import read_margins
    from reports.summary import read_measurements

    groups: dict[tuple[str, str, str], list[tuple[float, str, bool]]] = defaultdict(list)
    rows, _ = read_measurements(report_dir)
    # run_to_run_identical records a nondeterministic kernel's run-to-run spread, not a margin of correctness.
    for r in (r for r in rows if r.get("property") != "run_to_run_identical"):
        dtype = str((r.get("case") or {}).get("dtype"))
        groups[(str(r.get("property")), f"{r.get('op')} error/bound", dtype)].append(
            (_number(r.get("error_over_bound")), str(r.get("implementation")), r.get("pass") is False))
    for r in read_margins(report_dir):
        groups[(str(r.get("property")), "difference/tolerance", str(r.get("dtype")))].append(
            (_number(r.get("difference_over_tolerance")), str(r.get("implementation")), r.get("pass") is False))
    table = []
    for (prop, what, dtype), items in sorted(groups.items()):
        finite = [x for x in items if not math.isnan(x[0])]
        worst = max(finite, key=lambda x: x[0]) if finite else (math.nan, "-", False)
        table.append({"property": prop, "ratio": what, "dtype": dtype, "checks": len(items),
                      "failed": sum(x[2] for x in items),
                      "median": statistics.median(x[0] for x in finite) if finite else math.nan,
                      "max": worst[0], "max_in": worst[1]})
    return table


def markdown(table: list[dict]) -> str:
    """One row per property and ratio: the median and the largest in each dtype (largest in parentheses)."""
    cells: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for r in table:
        cells[(r["property"], r["ratio"])][r["dtype"]] = r
    lines = ["| property | ratio | " + " | ".join(DTYPES) + " |", "|---|---|" + "---|" * len(DTYPES)]
    for (prop, what), by_dtype in cells.items():
        row = [f"{by_dtype[d]['median']:.2g} ({by_dtype[d]['max']:.2g})" if d in by_dtype else "-" for d in DTYPES]
        lines.append(f"| {prop} | {what} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.zoo.run", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--report-dir", default="zoo-report")
    parser.add_argument("-n", "--workers", type=int, default=None, help="pytest-xdist workers")
    parser.add_argument("--summarise", action="store_true", help="only fold the report already in --report-dir")
    args = parser.parse_args(argv)
    if args.summarise:
        print(markdown(margins(args.report_dir)))
        return 0
    proc = run_zoo(args.profile, args.seed, args.report_dir, workers=args.workers)
    print("\n".join(proc.stdout.splitlines()[-15:]))
    table = margins(args.report_dir)
    print(markdown(table))
    print(json.dumps({"profile": args.profile, "seed": args.seed, "returncode": proc.returncode}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
