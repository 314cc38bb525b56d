"""A run split with ``pytest verify --shard K/N`` runs every test once, and ``python -m reports merge`` makes one
report of the shards' folders with the same content as the run made whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from reports import merge
from verify import shards

ROOT = Path(__file__).resolve().parent.parent
BROKEN = "tests/fixtures/outside_kernels.py:attention_broken_drops_last_key"


def test_a_shard_is_k_of_n():
    assert shards.parse("2/3") == (2, 3) and shards.parse(" 1 / 1 ") == (1, 1)
    for bad in ("0/2", "3/2", "2", "a/b", "", "1/0"):
        with pytest.raises(ValueError, match="should be K/N with 1 <= K <= N"):
            shards.parse(bad)


def test_the_slices_are_disjoint_cover_everything_and_balance_the_recorded_times():
    tests = [f"t{i}" for i in range(10)]
    times = {"t0": 10.0, "t1": 6.0, "t2": 4.0, "t3": 3.0, "t4": 3.0, "t5": 2.0}  # t6..t9: the median, 3.5
    slices = shards.assign(tests, 3, times)
    assert set(slices) == set(tests) and set(slices.values()) == {1, 2, 3}
    load = {k: sum(times.get(t, 3.5) for t in tests if slices[t] == k) for k in (1, 2, 3)}
    assert max(load.values()) - min(load.values()) <= 3.5, load  # longest first: within one test of even
    assert slices == shards.assign(list(reversed(tests)), 3, times)  # the order of collection does not matter
    plain = shards.assign(tests, 2, {})
    assert sorted(plain.values()) == [1] * 5 + [2] * 5  # no times: equal numbers of tests


def test_estimates_take_the_recorded_time_then_the_typical_one_then_the_property_median(tmp_path, monkeypatch):
    table = tmp_path / "typical.json"
    table.write_text(json.dumps({"cuda": {
        "tests": {"test_backward.py::test_g[fa2_blocked-float16]": 200.0},
        "properties": {"test_backward.py::test_g[float16]": 50.0, "test_forward.py::test_f[float16]": 5.0}}}))
    monkeypatch.setattr(shards, "TYPICAL_TIMES", table)
    ids = ["verify/test_backward.py::test_g[fa2_blocked-float16]", "verify/test_backward.py::test_g[mine-float16]",
           "site-packages/verify/test_forward.py::test_f[mine-float16]", "verify/test_forward.py::test_new[mine]",
           "verify/test_forward.py::test_f[eager-float16]"]
    got = shards.estimates(ids, {"verify/test_forward.py::test_f[eager-float16]": 9.0}, "cuda")
    assert got == {ids[0]: 200.0, ids[1]: 50.0, ids[2]: 5.0, ids[3]: 29.5, ids[4]: 9.0}  # ids[3]: the median found
    assert set(shards.estimates(ids, {}, "cpu").values()) == {1.0}  # no table for the device: all equal
    assert shards.property_key(ids[2]) == "test_forward.py::test_f[float16]"


def test_the_typical_times_table_is_written_from_a_report_folder(tmp_path):
    report = tmp_path / "report"
    report.mkdir()
    rows = [{"test": "verify/test_forward.py::test_f[a-float16]", "seconds": 3.0},
            {"test": "verify/test_forward.py::test_f[b-float16]", "seconds": 5.0},
            {"test": "verify/test_forward.py::test_f[c-float16]", "seconds": 10.0}]
    (report / "timing-gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "typical.json"
    out.write_text(json.dumps({"cpu": {"tests": {"kept": 1.0}, "properties": {}}}))
    assert shards.main([str(report), "--device", "cuda", "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["cpu"]["tests"] == {"kept": 1.0}  # the other device's entry is kept
    assert table["cuda"]["properties"] == {"test_forward.py::test_f[float16]": 5.0}
    assert table["cuda"]["tests"]["test_forward.py::test_f[c-float16]"] == 10.0


def test_the_shipped_table_times_the_shipped_kernels_on_both_devices():
    for device in ("cuda", "cpu"):
        typical = shards.typical_times(device)
        assert len(typical["tests"]) > 500 and typical["properties"], device
        assert any(key.startswith("test_backward.py::") for key in typical["tests"])


def _verify(report: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "verify", "--impl", "fa2_blocked", "--impl", BROKEN,
                           "-k", "float32 and (reference or invariance)", "--hypothesis-profile=ci", "-q",
                           "-p", "no:cacheprovider", "--report-dir", str(report), *extra],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow(seconds=40)
def test_two_shards_merge_into_the_report_of_one_run(tmp_path):
    whole = _verify(tmp_path / "whole")
    assert whole.returncode == 1, whole.stdout[-3000:]  # the broken kernel fails: failures merge too
    for k in (1, 2):
        part = _verify(tmp_path / f"shard{k}", "--shard", f"{k}/2", "--shard-times", str(tmp_path / "whole"))
        assert part.returncode in (0, 1), part.stdout[-3000:]
    proc = subprocess.run([sys.executable, "-m", "reports", "merge", str(tmp_path / "merged"),
                           str(tmp_path / "shard1"), str(tmp_path / "shard2")], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    one, merged = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "merged"))
    ran = [json.loads((tmp_path / f"shard{k}" / "summary.json").read_text())["outcomes"] for k in (1, 2)]
    assert all(sum(o.values()) for o in ran), ran  # both shards ran tests
    assert merged["status"] == one["status"] == "complete"
    for key in ("outcomes", "measurements", "failed_measurements", "by_implementation_op_dtype", "coverage",
                "metamorphic", "worst_cases"):
        assert merged[key] == one[key], key
    assert sorted(f["test"] for f in merged["failures"]) == sorted(f["test"] for f in one["failures"])
    assert merged["failures"] and all(f["replay"] for f in merged["failures"])
    assert [r["shard"] for r in merged["run"]["shards"]] == ["1/2", "2/2"]
    assert one["run"]["shards"] is None and one["run"]["shard"] is None
    assert "Status: complete" in proc.stdout


def test_merge_refuses_what_is_not_a_shard_report(tmp_path):
    with pytest.raises(merge.MergeError, match="not the report folder"):
        merge.merge(tmp_path / "out", [tmp_path])
    with pytest.raises(merge.MergeError, match="name the report folders"):
        merge.merge(tmp_path / "out", [])


def test_the_first_tests_are_dealt_round_robin():
    """Worker k starts with tests k and k + workers (the longest ones, one each), then takes one at a time."""
    values = {"dist": "load", "tx": ["2*popen"], "maxschedchunk": None}  # what -n 2 sets
    config = SimpleNamespace(getvalue=values.get, getoption=values.get)
    scheduler = shards.one_test_at_a_time(config, log=None)
    tests = [f"t{i}" for i in range(10)]
    nodes = [_Node(name) for name in ("gw0", "gw1")]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, tests)
    scheduler.schedule()
    assert {node.name: node.sent for node in nodes} == {"gw0": [0, 2], "gw1": [1, 3]}
    assert scheduler.pending == list(range(4, 10))



class _Node:
    """What the verify scheduler uses of a pytest-xdist worker: the tests sent to it, in order."""

    def __init__(self, name):
        self.name, self.gateway, self.shutting_down, self.sent = name, SimpleNamespace(id=name), False, []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def _fake_run(tests, seconds, workers, *, affine=True):
    """Drive the verify scheduler over ``tests`` (collected longest first) with ``workers`` fake nodes, each
    running the tests sent to it in order, each for its ``seconds``: ``({node: [(start, test), ...]}, end)``."""
    import heapq

    values = {"dist": "load", "tx": [f"{workers}*popen"], "maxschedchunk": None}
    config = SimpleNamespace(getvalue=values.get, getoption=values.get)
    scheduler = shards.one_test_at_a_time(config, log=None,
                                          estimate=(lambda ids: {t: seconds[t] for t in ids}) if affine else None)

    nodes = [_Node(f"gw{k}") for k in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, tests)
    scheduler.schedule()
    ran: dict[str, list[tuple[float, str]]] = {node.name: [] for node in nodes}
    clock, events = 0.0, []  # (when the node's running test ends, node number)

    def start(k):
        if scheduler.node2pending[nodes[k]]:
            test = tests[scheduler.node2pending[nodes[k]][0]]
            ran[nodes[k].name].append((clock, test))
            heapq.heappush(events, (clock + seconds[test], k))

    for k in range(workers):
        start(k)
    while events:
        clock, k = heapq.heappop(events)
        scheduler.mark_test_complete(nodes[k], scheduler.node2pending[nodes[k]][0], duration=1.0)
        start(k)
    return ran, clock


def test_a_worker_keeps_to_the_kernels_it_has_run_and_the_longest_tests_still_go_first():
    """Each kernel and dtype's tests go to few workers (each worker compiles the Triton kernels of every
    kernel and dtype it runs), the run takes no longer than handing out the longest first, and no test
    starts after a test shorter than half of it has started."""
    from verify.shards import kernel_key

    kernels = [f"k{i}-float16" for i in range(6)]
    seconds = {f"test_p{p}.py::test_p{p}[{k}]": 30.0 - p for p in range(20) for k in kernels}
    seconds["test_law.py::test_law"] = 0.5
    tests = sorted(seconds, key=lambda t: -seconds[t])
    ran, took = _fake_run(tests, seconds, workers=4)
    plain, plain_took = _fake_run(tests, seconds, workers=4, affine=False)
    assert sorted(t for runs in ran.values() for _, t in runs) == sorted(tests)  # every test once

    def pairs(schedule):  # (worker, kernel) pairs: the kernels' compiles, once per worker that runs them
        return {(node, kernel_key(t)) for node, runs in schedule.items() for _, t in runs}

    assert len(pairs(ran)) <= len(kernels) + 4 < len(pairs(plain)), (pairs(ran), len(pairs(plain)))
    assert took <= plain_took * 1.05, (took, plain_took)
    started = sorted((when, seconds[t]) for runs in ran.values() for when, t in runs)
    for i, (when, length) in enumerate(started):
        assert all(length <= 2 * other for earlier, other in started[:i] if earlier < when), (when, length)
