"""Run the zoo through ``pytest verify`` and fold its report into the soundness margins.

``python -m tests.zoo.run [--profile ci] [--seed N] [--report-dir DIR]`` runs every zoo kernel (one
``pytest verify`` session, ``--impl tests.zoo:NAME`` each) and prints, per property, the largest and the
median error/bound (accuracy checks: ``references/bounds.py``) or difference/tolerance (metamorphic checks)
over every zoo kernel's measurements, with the kernel and dtype of the largest. Exits with pytest's status.
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
    """``pytest verify`` on the zoo in a subprocess (the same environment, one torch thread per process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    return subprocess.run(command(profile, seed, report_dir, workers=workers, names=names), cwd=ROOT,
                          capture_output=True, text=True, env=env)


def _number(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def margins(report_dir: str | os.PathLike) -> list[dict]:
    """Per property (and op, for the accuracy checks): checks, failed, median and largest ratio, and where the
    largest was reached."""
    from reports.margins import read_margins
    from reports.summary import read_measurements

    groups: dict[tuple[str, str], list[tuple[float, str, str, bool]]] = defaultdict(list)
    rows, _ = read_measurements(report_dir)
    for r in rows:
        groups[(str(r.get("property")), f"{r.get('op')} error/bound")].append(
            (_number(r.get("error_over_bound")), str(r.get("implementation")), str((r.get("case") or {}).get("dtype")),
             r.get("pass") is False))
    for r in read_margins(report_dir):
        groups[(str(r.get("property")), "difference/tolerance")].append(
            (_number(r.get("difference_over_tolerance")), str(r.get("implementation")), str(r.get("dtype")),
             r.get("pass") is False))
    table = []
    for (prop, what), items in sorted(groups.items()):
        finite = [x for x in items if not math.isnan(x[0])]
        worst = max(finite, key=lambda x: x[0]) if finite else (math.nan, "-", "-", False)
        table.append({"property": prop, "ratio": what, "checks": len(items), "failed": sum(x[3] for x in items),
                      "median": statistics.median(x[0] for x in finite) if finite else math.nan,
                      "max": worst[0], "max_at": f"{worst[1]} {worst[2]}"})
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| property | ratio | checks | failed | median | largest | largest in |", "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['property']} | {r['ratio']} | {r['checks']} | {r['failed']} | {r['median']:.3g} | "
                     f"{r['max']:.3g} | {r['max_at']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.zoo.run", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--report-dir", default="zoo-report")
    parser.add_argument("-n", "--workers", type=int, default=None, help="pytest-xdist workers")
    args = parser.parse_args(argv)
    proc = run_zoo(args.profile, args.seed, args.report_dir, workers=args.workers)
    print("\n".join(proc.stdout.splitlines()[-15:]))
    table = margins(args.report_dir)
    print(markdown(table))
    print(json.dumps({"profile": args.profile, "seed": args.seed, "returncode": proc.returncode}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
