"""One run split over N machines: ``pytest verify --shard K/N`` runs the K-th of N disjoint slices of the tests.

A CI matrix of N runners, each with ``--shard K/N``, runs every test exactly once; ``python -m reports merge
OUT DIR1 ... DIRN`` then writes one report from the N report folders. The slices are decided from the
collected test ids alone (every runner and every pytest-xdist worker of a runner computes the same ones):
longest first, each test to the slice with the least time so far. The times come from ``--shard-times``, a
report folder of an earlier run (its ``timing-*.jsonl``); without it, or for a test it did not time, every
test counts the median time (the slices then hold equal numbers of tests).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from reports.timing import read_timing

_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def parse(spec: str) -> tuple[int, int]:
    """``"K/N"`` as ``(K, N)`` with ``1 <= K <= N``; a ValueError naming what is allowed otherwise."""
    match = _SPEC.match(spec or "")
    if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise ValueError(f"--shard {spec!r}: should be K/N with 1 <= K <= N, e.g. --shard 1/2 and --shard 2/2")
    return int(match.group(1)), int(match.group(2))


def recorded_times(report_dir: str | Path | None) -> dict[str, float]:
    """Each test's seconds in an earlier run's report folder (``{}`` without one)."""
    if report_dir is None:
        return {}
    if not Path(report_dir).is_dir():
        raise ValueError(f"--shard-times {report_dir}: not a directory (give an earlier run's --report-dir)")
    return {str(r["test"]): float(r["seconds"]) for r in read_timing(report_dir) if r.get("test")}


def assign(test_ids: Sequence[str], count: int, times: dict[str, float]) -> dict[str, int]:
    """Each test id's slice, 1 to ``count``: longest first (ties by id), each to the slice with the least time
    so far (the lowest-numbered on a tie)."""
    known = [times[t] for t in test_ids if t in times]
    default = statistics.median(known) if known else 1.0
    load = [0.0] * count
    slice_of = {}
    for test in sorted(test_ids, key=lambda t: (-times.get(t, default), t)):
        k = min(range(count), key=lambda i: (load[i], i))
        slice_of[test] = k + 1
        load[k] += times.get(test, default)
    return slice_of
