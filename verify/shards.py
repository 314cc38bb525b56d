"""One run split over N machines: ``pytest verify --shard K/N`` runs the K-th of N disjoint slices of the tests.

A CI matrix of N runners, each with ``--shard K/N``, runs every test exactly once; ``python -m reports merge
OUT DIR1 ... DIRN`` then writes one report from the N report folders. The slices are decided from the
collected test ids alone (every runner and every pytest-xdist worker of a runner computes the same ones):
longest first, each test to the slice with the least time so far.

The same estimates order a pytest-xdist run longest first, so that no worker starts a long test while the
others have nothing left to do. A test's estimate is, in this order: its time in ``--shard-times`` (a report
folder of an earlier run: its ``timing-*.jsonl``); its time in :data:`TYPICAL_TIMES`, the shipped kernels'
tests timed on each kind of device; the median of that property and dtype there (a kernel of your own);
the median of every estimate found. ``python -m verify.shards DIR ...`` writes the table from report
folders of whole runs (the gpu profile on a GPU, the ci profile on the CPU).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from reports.session import write_atomic
from reports.timing import read_timing

_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
TYPICAL_TIMES = Path(__file__).with_name("typical_times.json")
_DTYPE = re.compile(r"\[(?:.*-)?(float16|bfloat16|float32|float64|float8_e4m3fn|float8_e5m2)\]$")


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


def kernel_key(test_id: str) -> str | None:
    """The kernel and dtype a test runs, as its parameters name them (``triton_fa2-float16``), or None for a
    test without parameters (a law that calls no kernel)."""
    _, bracket, params = test_id.partition("[")
    return params.removesuffix("]") if bracket else None


def one_test_at_a_time(config, log, *, estimate: Callable[[list[str]], dict[str, float]] | None = None):
    """pytest-xdist's ``--dist load`` scheduler handing out one test at a time (``--maxschedchunk 1``), the
    first tests dealt round-robin, or None (xdist's own) when another ``--dist`` or a ``--maxschedchunk`` was
    given. With the longest tests first, a worker that finishes takes the next one, whatever the others are
    running; xdist would otherwise give each worker a run of consecutive tests.

    With ``estimate`` (the collected test ids to each one's estimated seconds, :func:`estimates`) the scheduler
    is also kernel-affine: a worker takes a test of a kernel and dtype (:func:`kernel_key`) it has run before where
    one is among the longest pending tests, those estimated at least half the longest one, otherwise one whose
    kernel and dtype no other worker is running, and otherwise the longest. A worker then compiles (or loads from
    Triton's cache) the kernels of fewer kernels and dtypes, and two workers seldom compile the same kernel at once,
    while every test still starts before any test shorter than half of it, so that the run does not end on a long
    test started late."""
    if config.getvalue("dist") != "load" or config.getoption("maxschedchunk") is not None:
        return None
    from xdist.scheduler import LoadScheduling

    class RoundRobinFirst(LoadScheduling):
        """xdist starts every worker with two tests (a worker runs one only once it knows the next) and gives
        each the next two in the queue: the two longest tests went to the first worker, back to back. The
        first two rounds are dealt one test per worker instead (worker k gets tests k and k + workers)."""

        def schedule(self) -> None:
            ready = (self.collection is None and self.collection_is_completed
                     and self._check_nodes_have_same_collection())
            collection = next(iter(self.node2collection.values()), None) if ready else None
            if not collection or len(collection) < 2 * len(self.nodes):
                return super().schedule()  # later calls, and too few tests for two rounds: xdist's own
            self.collection = collection
            self.pending[:] = range(len(collection))
            for _ in range(2):
                for node in self.nodes:
                    self._send_tests(node, 1)

    class KernelAffine(RoundRobinFirst):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self._seen: dict = {}  # node: the kernel keys sent to it
            self._seconds: list[float] = []  # per collected test: its estimate, its kernel key
            self._keys: list[str | None] = []

        def _send_tests(self, node, num: int) -> None:
            for _ in range(num):
                if not self.pending:
                    return
                index = self._pick(node)
                self.pending.remove(index)
                self.node2pending[node].append(index)
                self._seen.setdefault(node, set()).add(self._keys[index])
                node.send_runtest_some([index])

        def _pick(self, node) -> int:
            """The test ``node`` runs next (see :func:`one_test_at_a_time`)."""
            if not self._keys:
                estimated = estimate(list(self.collection))
                self._seconds = [estimated.get(t, 0.0) for t in self.collection]
                self._keys = [kernel_key(t) for t in self.collection]
            # Not pending[0]: the tests of a worker that crashed join the queue at its end.
            longest = max(self._seconds[i] for i in self.pending)
            near = [i for i in self.pending if self._seconds[i] >= longest / 2]
            seen = self._seen.get(node, set())
            busy = {self._keys[i] for other, items in self.node2pending.items() if other is not node for i in items}
            for wanted in (lambda key: key in seen, lambda key: key is None or key not in busy):
                for index in near:
                    if wanted(self._keys[index]):
                        return index
            return max(near, key=self._seconds.__getitem__)

    scheduler = (RoundRobinFirst if estimate is None else KernelAffine)(config, log)
    scheduler.maxschedchunk = 1
    return scheduler


def short_id(test_id: str) -> str:
    """A test id without its folder: ``test_backward.py::test_x[fa2_blocked-float16]`` whether the suite was
    collected from the repository or with ``--pyargs verify``."""
    path, sep, rest = test_id.partition("::")
    return Path(path).name + sep + rest


def property_key(test_id: str) -> str:
    """The property and dtype of a test id, without the implementation: ``test_backward.py::test_x[float16]``."""
    key = short_id(test_id)
    base = key.split("[", 1)[0]
    dtype = _DTYPE.search(key)
    return f"{base}[{dtype.group(1)}]" if dtype else base


def typical_times(device_type: str) -> dict[str, dict[str, float]]:
    """The committed table for ``"cuda"`` or ``"cpu"``: ``{"tests": {test key: s}, "properties": {property
    key: s}}`` (empty dictionaries for another device or without the file)."""
    try:
        table = json.loads(TYPICAL_TIMES.read_text(encoding="utf-8")).get(device_type) or {}
    except (OSError, ValueError):
        table = {}
    return {"tests": dict(table.get("tests") or {}), "properties": dict(table.get("properties") or {})}


def estimates(test_ids: Sequence[str], recorded: dict[str, float], device_type: str) -> dict[str, float]:
    """Each test id's estimated seconds (the order of sources is in the module's docstring)."""
    typical = typical_times(device_type)
    found: dict[str, float] = {}
    for test in test_ids:
        for value in (recorded.get(test), typical["tests"].get(short_id(test)),
                      typical["properties"].get(property_key(test))):
            if isinstance(value, (int, float)):
                found[test] = float(value)
                break
    default = statistics.median(found.values()) if found else 1.0
    return {test: found.get(test, default) for test in test_ids}


def table(report_dirs: Sequence[str | Path]) -> dict[str, dict[str, float]]:
    """The typical-times entry of one device from report folders of whole runs: each test's seconds (the
    largest where a test ran more than once) and the median per property and dtype, to 0.1 s."""
    tests: dict[str, float] = {}
    for report_dir in report_dirs:
        for test, seconds in recorded_times(report_dir).items():
            key = short_id(test)
            tests[key] = max(tests.get(key, 0.0), seconds)
    by_property: dict[str, list[float]] = defaultdict(list)
    for key, seconds in tests.items():
        by_property[property_key(key)].append(seconds)
    return {"tests": {k: round(v, 1) for k, v in sorted(tests.items())},
            "properties": {k: round(statistics.median(v), 1) for k, v in sorted(by_property.items())}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verify.shards",
                                     description="Write the typical test times of one device from report folders "
                                                 "of whole runs of the shipped kernels.")
    parser.add_argument("report_dirs", nargs="+", metavar="DIR")
    parser.add_argument("--device", required=True, choices=("cuda", "cpu"), help="the device those runs used")
    parser.add_argument("--out", default=str(TYPICAL_TIMES), help=f"the table to update (default: {TYPICAL_TIMES})")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        current = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}
        current[args.device] = table(args.report_dirs)
    except (OSError, ValueError) as exc:
        print(f"python -m verify.shards: {exc}", file=sys.stderr)
        return 2
    write_atomic(out, json.dumps(current, indent=0, sort_keys=True) + "\n")
    print(f"{out}: {len(current[args.device]['tests'])} tests on {args.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
