"""The report writers: the JSON-lines stream, atomic files, summaries of finished and killed runs,
failure files whose replay command fails again, HTML that escapes what kernels put in it, pytest-xdist
runs that merge into one report, and the accuracy sweep."""

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reports import cli, html, plots, summary, write
from reports.progress import Progress
from reports.session import ReportSession, clear_report_dir, write_atomic
from strategies import sweep as sweeps
from verify import accuracy as driver, stages

ROOT = Path(__file__).resolve().parent.parent
BROKEN = "tests/fixtures/outside_kernels.py:attention_broken_drops_last_key"
HOSTILE = "<script>alert(1)</script>"
CASE = {"batch": 1, "heads_q": 1, "heads_kv": 1, "len_q": 3, "len_k": 5, "head_dim": 4, "dtype": "float16",
        "causal": False, "magnitude": "normal", "seed": 0, "layout": "contiguous", "scale": None,
        "block_m": None, "block_n": None}


def _env():
    """The environment of the subprocesses; the replay commands they print start with ``python``, which is
    this interpreter (its folder first on PATH), as it is in an activated virtual environment."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path}


def _measurement(impl="k", op="out", ratio=0.5, passed=True, len_k=5, dtype="float16"):
    return {"implementation": impl, "property": "out_matches_reference", "op": op,
            "case": {**CASE, "len_k": len_k, "dtype": dtype}, "max_abs": 1e-3 * ratio, "max_rel": 1e-3,
            "rmse": 1e-4, "max_ulp": 2.0, "error_over_bound": ratio, "error_over_baseline": 1.0, "pass": passed}


# ------------------------------------------------------------------------------------ writers
def test_stream_is_readable_line_by_line_while_the_run_goes(tmp_path):
    session = ReportSession(tmp_path, worker="gw3", header={"device": "cpu"})
    session.record(_measurement(ratio=math.inf))
    session.record({**_measurement(), "max_abs": math.nan, "odd": object()})
    lines = (tmp_path / "measurements-gw3.jsonl").read_text().splitlines()  # before close: flushed
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["error_over_bound"] == "inf" and second["max_abs"] == "nan"
    assert second["odd"].startswith("<object")
    run = json.loads((tmp_path / "run-gw3.json").read_text())
    assert run["worker"] == "gw3" and "finished" not in run
    session.close(outcomes={"passed": 2})
    run = json.loads((tmp_path / "run-gw3.json").read_text())
    assert run["finished"] and run["counts"]["measurements"] == 2 and run["outcomes"] == {"passed": 2}


def test_atomic_write_replaces_whole_files_and_leaves_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    write_atomic(target, "old")
    write_atomic(target, "new")
    assert target.read_text() == "new"

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        write_atomic(target, "half-written")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_clear_removes_only_report_files(tmp_path):
    session = ReportSession(tmp_path)
    session.record(_measurement())
    session.close()
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / ".summary.json.abc.tmp").write_text("stale temp file of a killed run")
    write.write_summary(tmp_path)
    clear_report_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["notes.txt"]


def test_summary_of_a_killed_run_skips_the_truncated_line_and_says_partial(tmp_path):
    session = ReportSession(tmp_path, header={"device": "cpu", "implementations": [{"name": "k", "spec": "k"}]})
    for ratio in (0.1, 0.7, 3.0):
        session.record(_measurement(ratio=ratio, passed=ratio <= 1))
    session._stream.write('{"implementation": "k", "op": "out", "max_a')  # the process died here
    session._stream.flush()
    result = write.write_summary(tmp_path)
    assert result["status"] == "partial" and result["unfinished_workers"] == ["main"]
    assert result["measurements"] == 3 and result["unreadable_lines"] == 1
    (row,) = result["by_implementation_op_dtype"]
    assert row["max_error_over_bound"] == 3.0 and row["failed"] == 1
    worst = result["worst_cases"][0]
    assert worst["error_over_bound"] == 3.0 and worst["replay"].startswith("python -m verify.replay --impl k ")
    assert "PARTIAL" in (tmp_path / "report.md").read_text()
    assert "PARTIAL" in (tmp_path / "report.html").read_text()


def test_failure_file_holds_the_case_and_its_replay_command(tmp_path):
    session = ReportSession(tmp_path)
    path = session.failure(test="verify/test_forward.py::test_x[k-float16]", message="out differs",
                           replay="python -m verify.replay --impl k --property p --case '{}'", case=CASE,
                           prop="out_matches_reference", implementation="k")
    data = json.loads(path.read_text())
    assert data["case"] == CASE and data["replay"].startswith("python -m verify.replay")
    assert path.parent.name == "failures" and "/" not in path.name


def test_html_escapes_hostile_names_messages_and_commands(tmp_path, monkeypatch):
    session = ReportSession(tmp_path, header={"command": f"pytest --impl '{HOSTILE}'", "device": "cpu",
                                              "implementations": [{"name": HOSTILE, "spec": HOSTILE}]})
    for ratio in (0.2, 5.0):
        session.record(_measurement(impl=HOSTILE, ratio=ratio, passed=ratio < 1))
    session.record(_measurement(impl="$\\frac{1}{0}$ _hidden", ratio=0.3))  # matplotlib math mode, legend '_'
    session.failure(test=f"verify/test_x.py::test_y[{HOSTILE}]", message=f"{HOSTILE} broke & \"quoted\"",
                    replay=f"python -m verify.replay --impl '{HOSTILE}'", case=CASE, prop="p", implementation=HOSTILE)
    session.close()
    result = write.write_summary(tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "html_error" not in result
    assert HOSTILE not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<script") == 0 and "data:image/png;base64," in page

    monkeypatch.setattr(plots, "unavailable", lambda: "matplotlib is not available (test)")
    page = html.report_html(result, summary.read_measurements(tmp_path)[0])
    assert "data:image/png" not in page and "not drawn, matplotlib is not available" in page
    assert "&lt;script&gt;" in page and HOSTILE not in page


def test_progress_bar_draws_on_a_terminal_only():
    quiet = io.StringIO()
    bar = Progress(3, stream=quiet)
    bar.update(label="fa2_blocked")
    bar.close()
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    bar = Progress(2, stream=loud, enabled=True, min_interval=0)
    bar.update(label="fa2_blocked float16")
    bar.update(label="eager")
    bar.close()
    assert "1/2" in loud.getvalue() and "2/2 100%" in loud.getvalue() and loud.getvalue().endswith("\n")


def test_xdist_workers_get_their_own_gpu(monkeypatch):
    import types

    import torch

    from verify import plugin

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    worker = types.SimpleNamespace(workerinput={"workerid": "gw3"})
    assert plugin.xdist_worker_device(worker, None) == "cuda:1" and calls == [1]
    assert plugin.xdist_worker_device(worker, "cuda") == "cuda:1"
    assert plugin.xdist_worker_device(worker, "cuda:0") == "cuda:0"
    assert plugin.xdist_worker_device(worker, "cpu") == "cpu"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")  # inherited by a subprocess: not a worker
    assert plugin.xdist_worker_device(types.SimpleNamespace(), None) is None


# ------------------------------------------------------------------------------------ whole runs
def test_failing_case_is_written_and_its_replay_fails_again_on_its_own(tmp_path):
    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify", "--impl", BROKEN, "-x", "--hypothesis-profile=ci",
                           "-p", "no:cacheprovider", "-q", "--report-dir", str(report)],
                          cwd=ROOT, capture_output=True, text=True, env=_env())
    assert proc.returncode == 1, proc.stdout[-3000:]
    (path,) = (report / "failures").glob("*.json")
    failure = json.loads(path.read_text())
    assert failure["implementation"] == BROKEN and failure["case"]["len_k"] >= 2
    assert failure["replay"].startswith("python -m verify.replay ")
    result = json.loads((report / "summary.json").read_text())
    assert result["status"] == "complete" and result["outcomes"] == {"failed": 1} and result["failures"]
    assert (report / "report.html").exists() and (report / "report.md").exists()
    replay = subprocess.run(failure["replay"], shell=True, cwd=ROOT, capture_output=True, text=True, env=_env())
    assert replay.returncode == 1, replay.stdout + replay.stderr
    first_line = failure["message"].splitlines()[0]
    assert "FAILED" in replay.stdout and first_line in replay.stdout


def test_run_killed_half_way_leaves_a_report_that_summarises(tmp_path):
    report = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "verify", "--hypothesis-profile=ci", "--impl",
                             "fa2_blocked", "-p", "no:cacheprovider", "-q", "--report-dir", str(report)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    stream = report / "measurements-main.jsonl"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if stream.exists() and stream.read_text().count("\n") >= 40:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        assert stream.exists(), "no measurement within 60 s"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    provisional = json.loads((report / "summary.json").read_text())  # written after the pre-flight
    assert provisional["status"] == "partial" and provisional["measurements"] == 0, provisional
    out = subprocess.run([sys.executable, "-m", "reports", "summarise", str(report)], cwd=ROOT,
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr
    assert "PARTIAL" in out.stdout
    result = json.loads((report / "summary.json").read_text())
    assert result["status"] == "partial" and result["measurements"] >= 40
    assert {row["implementation"] for row in result["by_implementation_op_dtype"]} == {"fa2_blocked"}
    assert "data:image/png;base64," in (report / "report.html").read_text()


def test_xdist_workers_write_their_own_streams_and_one_merged_report(tmp_path):
    pytest.importorskip("xdist")
    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify", "-n", "2", "--impl", BROKEN,
                           "-k", "out_matches_reference or lse_matches_reference", "--hypothesis-profile=ci",
                           "-p", "no:cacheprovider", "-q", "--report-dir", str(report)],
                          cwd=ROOT, capture_output=True, text=True, env=_env())
    assert proc.returncode == 1, proc.stdout[-3000:]
    streams = {p.name: p.read_text().count("\n") for p in report.glob("measurements-*.jsonl")}
    assert streams.get("measurements-gw0.jsonl") and streams.get("measurements-gw1.jsonl"), streams
    runs = {p.name: json.loads(p.read_text()) for p in report.glob("run-*.json")}
    assert {"run-main.json", "run-gw0.json", "run-gw1.json"} <= set(runs)
    assert all(r.get("finished") for r in runs.values())
    result = json.loads((report / "summary.json").read_text())
    assert result["status"] == "complete" and result["measurements"] == sum(streams.values())
    assert result["outcomes"]["failed"] == len(result["failures"]) >= 2
    assert {f["worker"] for f in result["failures"]} <= {"gw0", "gw1"}
    assert all(f["replay"] for f in result["failures"])
    # Every test's time, from both workers, with the kernel's and the reference's share.
    timed = [json.loads(line) for p in report.glob("timing-gw*.jsonl") for line in p.read_text().splitlines()]
    ran_body = sum(result["outcomes"].get(k, 0) for k in ("passed", "failed"))  # skips in setup never start
    assert ran_body <= len(timed) <= ran_body + result["outcomes"].get("skipped", 0)
    ran = [t for t in timed if t["property"] == "out_matches_reference" and t["stages"]["reference"] > 0]
    assert ran and all(t["stages"]["kernel"] > 0 and sum(t["stages"].values()) <= t["seconds"] for t in ran)
    assert "## Time per property" in (report / "report.md").read_text()


# ------------------------------------------------------------------------------------ accuracy
def test_accuracy_sweep_writes_all_three_outputs_and_resumes(tmp_path, capsys):
    out = tmp_path / "acc"
    args = ["--device", "cpu", "--len", "16", "--head-dim", "8", "--dtype", "float16",
            "--magnitude", "normal", "sparse_outliers", "--causal", "yes", "--impl", "fa2_blocked", "--out", str(out)]
    assert driver.main([*args, "--time-limit", "0"]) == 2  # nothing measured yet
    partial = json.loads((out / "accuracy.json").read_text())
    assert partial["status"] == "partial" and partial["missing"] == 2 * 2
    assert driver.main([*args, "--resume"]) == 0
    result = json.loads((out / "accuracy.json").read_text())
    assert result["status"] == "complete" and len(result["results"]) == 2 * 2
    assert {r["implementation"] for r in result["results"]} == {"fa2_blocked", "eager"}
    ops = result["results"][0]["ops"]
    assert set(ops) == {"out", "lse", "dq", "dk", "dv"}
    assert all(ops[op]["rmse"] > 0 and ops[op]["error_over_bound"] >= 0 for op in ops)
    assert set(result["rmse"]["out"]["fa2_blocked"]) == {"float16 normal", "float16 sparse_outliers"}
    assert "fa2_blocked" in (out / "accuracy.md").read_text()
    assert "data:image/png;base64," in (out / "accuracy.html").read_text()
    assert len(result["meta"]["commands"]) == 2
    capsys.readouterr()
    assert cli.main(["summarise", str(out)]) == 0 and "complete" in capsys.readouterr().out


@pytest.mark.parametrize("spec, status, words", [
    (BROKEN, 1, "a criterion failed: "),
    ("sdpa_flash", 2, "nothing was measured for sdpa_flash: every case was skipped"),
])
def test_accuracy_exit_status_says_failed_or_nothing_measured(tmp_path, capsys, spec, status, words):
    args = ["--device", "cpu", "--len", "8", "--head-dim", "4", "--dtype", "float16",
            "--magnitude", "normal", "--causal", "no", "--no-backward", "--impl", spec, "--out", str(tmp_path)]
    assert driver.main(args) == status
    assert words in capsys.readouterr().err


def test_accuracy_reports_unrunnable_implementations_instead_of_crashing(tmp_path):
    from flashverify_kernels.registry import registry

    impls = driver.select_implementations([f"{BROKEN.rsplit(':', 1)[0]}:attention_out_only", "sdpa_flash"],
                                            device="cpu")
    sweep = sweeps.Sweep(lengths=(8,), head_dims=(8,), dtypes=("float16",), magnitudes=("normal",),
                           causal=(False,))
    result = driver.run(sweep, impls, device="cpu", out_dir=tmp_path, command="test", progress=False)
    skipped = {s["implementation"]: s["reason"] for s in result["not_measured"]}
    assert "cpu is not among them" in skipped["sdpa_flash"]
    plain = next(r for r in result["results"] if r["implementation"].endswith("attention_out_only"))
    assert "lse" not in plain["ops"] and "out" in plain["ops"]
    assert registry()["sdpa_flash"].causal_alignment == "top_left"


def test_accuracy_records_a_kernel_that_raises_as_not_measured(tmp_path):
    from flashverify_kernels.registry import Implementation

    def explode(q, k, v, *, causal=False, scale=None):
        raise RuntimeError("No available kernel. Aborting execution.")

    impl = Implementation(name="exploding", forward=explode)
    sweep = sweeps.Sweep(lengths=(8,), head_dims=(8,), dtypes=("float16",), magnitudes=("normal",),
                           causal=(False,))
    result = driver.run(sweep, [impl], device="cpu", out_dir=tmp_path, command="test", progress=False)
    (entry,) = result["not_measured"]
    assert entry["implementation"] == "exploding" and "No available kernel" in entry["reason"]
    assert result["status"] == "complete" and result["results"] == []


def test_kernel_that_raises_gets_its_drawn_case_and_a_replay_that_raises_again(tmp_path):
    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify/test_forward.py", "-k",
                           "test_out_matches_reference and float32", "--impl",
                           "tests/fixtures/raising_kernels.py:attention_raises_on_long_keys",
                           "--hypothesis-profile=ci", "-p", "no:cacheprovider", "-q", "--report-dir", str(report)],
                          cwd=ROOT, capture_output=True, text=True, env=_env())
    assert proc.returncode == 1, proc.stdout[-3000:]
    (path,) = (report / "failures").glob("*.json")
    failure = json.loads(path.read_text())
    assert failure["message"].startswith(
        "tests/fixtures/raising_kernels.py:attention_raises_on_long_keys: the kernel raised (not a wrong answer) at ")
    assert "declare its limits" in failure["message"] and "RuntimeError: kernel gave up on Nk=6" in failure["message"]
    assert summary.failure_kind(failure) == "kernel raised"
    assert "if the kernel does not support float32 inputs, head_dim" in proc.stdout  # the hint, on the terminal
    assert failure["case"]["len_k"] == 6 and failure["property"] == "out_matches_reference"
    assert f"  replay: {failure['replay']}" in proc.stdout  # the terminal says how to replay it too
    replay = subprocess.run(failure["replay"], shell=True, cwd=ROOT, capture_output=True, text=True, env=_env())
    assert replay.returncode == 1 and "kernel gave up on Nk=6" in replay.stderr


def test_key_value_tables_have_no_empty_header_row():
    from reports.html import key_values, table

    assert "<thead>" not in key_values([("device", "cpu"), ("profile", "ci")])
    assert "<th>name</th>" in table(("name", "value"), [("a", 1)])


def test_failures_are_counted_by_kind_so_a_limit_is_not_read_as_a_wrong_answer():
    failures = [
        {"test": "a", "message": "k: resource limit (not a wrong answer): the kernel's forward needs 393216 bytes"},
        {"test": "b", "message": "k: out differs from the float64 reference\n  max abs error 1"},
        {"test": "c", "message": "k: compile failure (not a wrong answer): the kernel's forward failed to compile"},
        {"test": "d", "message": "k: out differs from the float64 reference"},
        {"test": "e", "message": "RuntimeError: kernel gave up"},
    ]
    assert [summary.failure_kind(f) for f in failures] == [
        "resource limit (not a wrong answer)", "wrong answer", "compile failure (not a wrong answer)",
        "wrong answer", "other"]
    assert summary.failure_counts(failures) == ("5: 2 wrong answer, 1 resource limit (not a wrong answer), "
                                                "1 compile failure (not a wrong answer), 1 other")
    assert summary.failure_counts([]) == "0"
    text = summary.markdown({"status": "complete", "measurements": 0, "unreadable_lines": 0,
                             "by_implementation_op_dtype": [], "failures": failures})
    assert "## Failures (5: 2 wrong answer," in text and "### a (resource limit (not a wrong answer))" in text


def test_the_implementations_table_says_how_each_gives_gradients(tmp_path):
    impls = [{"name": "flexlike", "spec": "flexlike", "autograd": True, "backward": False},
             {"name": "triton", "spec": "triton", "autograd": True, "backward": True},
             {"name": "fwd_only", "spec": "fwd_only", "autograd": False, "backward": False},
             {"name": "old_record", "spec": "old_record", "backward": False}]
    session = ReportSession(tmp_path, header={"device": "cpu", "implementations": impls})
    session.record(_measurement(ratio=0.5, passed=True))
    write.write_summary(tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "<th>gradients</th>" in page and "backward+Delta" not in page
    cells = {name: page.split(f"<td>{name}</td>", 1)[1].split("</tr>", 1)[0] for name in
             ("flexlike", "triton", "fwd_only", "old_record")}
    assert "<td>autograd</td>" in cells["flexlike"]
    assert "<td>autograd and its backward function (dQ, dK, dV, Delta)</td>" in cells["triton"]
    assert "<td>none</td>" in cells["fwd_only"]
    assert "<td>no backward function</td>" in cells["old_record"]


def test_a_nested_stage_is_charged_alone_and_the_time_is_folded_per_property(tmp_path, monkeypatch):
    now = iter(range(100))
    monkeypatch.setattr(stages, "_now", lambda: float(next(now)))
    stages.start_test()  # kernel 0-1; bounds 2-3, then the reference inside them 3-6 (two steps), bounds 6-7
    with stages.stage("kernel"):
        pass
    with stages.stage("bounds"):
        with stages.stage("reference"):
            next(now), next(now)
    with stages.stage("kernel"):  # kernel 8-9, a compile 9-11 (two steps), kernel 11-12
        with stages.stage("compile"):
            next(now)
    spent, compiles = stages.end_test()
    assert spent == {"kernel": 3.0, "compile": 2.0, "reference": 3.0, "bounds": 2.0, "baseline": 0.0}
    assert compiles == 0  # counted by the wrapped compile only
    with stages.stage("kernel"):  # no test timed: nothing is charged, nothing breaks
        pass
    with pytest.raises(ValueError, match="should be one of"):
        with stages.stage("triton"):
            pass
    session = ReportSession(tmp_path, worker="gw0")
    session.timing({"test": "a", "property": "p", "seconds": 14.0, "stages": spent, "compiles": 1})
    session.timing({"test": "b", "property": "p", "seconds": 4.0, "stages": {"kernel": 4.0}, "compiles": 3})
    session.timing({"test": "c", "property": "q", "seconds": 1.0, "stages": {}})
    session.close()
    result = write.write_summary(tmp_path, html=False)["time"]
    p, q = result["by_property"]
    assert (p["property"], p["tests"], p["seconds"], p["slowest_test"]) == ("p", 2, 18.0, "a")
    assert p["stages"] == {"kernel": 7.0, "compile": 2.0, "reference": 3.0, "bounds": 2.0, "baseline": 0.0,
                           "rest": 4.0}
    assert q["stages"]["rest"] == 1.0 and result["seconds"] == 19.0
    assert (p["compiles"], q["compiles"], result["compiles"]) == (4, 0, 4)
    text = (tmp_path / "report.md").read_text()
    assert "| p | 2 | 18.0 | 14.0 | 7.0 (39%) | 2.0 (11%) | 3.0 (17%) | 2.0 (11%) | 0.0 (0%) | 4.0 (22%) | 4 |" in text


def test_a_compile_is_charged_to_its_own_stage_even_when_it_raises(monkeypatch):
    """``triton.compiler.compile`` wrapped: its time leaves the kernel's stage and counts as a compile, a compile
    that raises included; outside a timed test it runs as it is."""
    compiler = pytest.importorskip("triton.compiler")
    now = iter(range(100))
    monkeypatch.setattr(stages, "_now", lambda: float(next(now)))

    def compile(src, fail=False):
        next(now)
        if fail:
            raise RuntimeError("compilation failed")
        return f"compiled {src}"

    monkeypatch.setattr(compiler, "compile", compile)
    assert stages.time_triton_compiles() and stages.time_triton_compiles()  # the second call wraps nothing more
    assert compiler.compile.__wrapped__ is compile
    assert compiler.compile("k") == "compiled k"  # no test timed
    stages.start_test()
    with stages.stage("kernel"):  # kernel 0-1, a compile 1-3, kernel 3-4, a compile that fails 4-6, kernel 6-7
        assert compiler.compile("k") == "compiled k"
        with pytest.raises(RuntimeError):
            compiler.compile("k", fail=True)
    spent, compiles = stages.end_test()
    assert (spent["kernel"], spent["compile"], compiles) == (3.0, 4.0, 2)


def test_metamorphic_margins_are_streamed_and_folded_per_property(tmp_path):
    session = ReportSession(tmp_path, worker="gw0")
    for ratio, passed in ((0.1, True), (0.3, True), (1.5, False)):
        session.margin({"implementation": "k", "property": "score_shift_invariance", "check": "out after shifting",
                        "dtype": "float16", "difference_over_tolerance": ratio, "pass": passed})
    session.margin({"implementation": "k", "property": "value_linearity", "check": "out(v A + b)",
                    "dtype": "float32", "difference_over_tolerance": math.inf, "pass": False})
    session.close()
    result = write.write_summary(tmp_path, html=False)
    rows = {r["property"]: r for r in result["metamorphic"]}
    shift = rows["score_shift_invariance"]
    assert (shift["comparisons"], shift["failed"], shift["median_difference_over_tolerance"],
            shift["max_difference_over_tolerance"]) == (3, 1, 0.3, 1.5)
    assert rows["value_linearity"]["max_difference_over_tolerance"] == math.inf
    text = (tmp_path / "report.md").read_text()
    assert "## Metamorphic checks" in text and "| k | score_shift_invariance | float16 | 3 | 1 | 0.3 | 1.5 |" in text


@pytest.mark.slow(seconds=20)
def test_the_last_lines_of_a_failing_run_hold_the_reason_the_case_and_the_replay(tmp_path):
    """A failing run's output ends with each failure's reason, its case in one line and its replay command,
    after pytest's own summary (its skip reasons included), without Hypothesis's draws or target scores."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify/test_forward.py", "-k",
                           "(out_matches_reference or lse_matches_reference or layouts_agree) and float32",
                           "--impl", "tests/mutants.py:causal_off_by_one", "--hypothesis-profile=ci", "-p",
                           "no:cacheprovider", "-q", "-rs", "--report-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, env=_env())
    assert proc.returncode == 1, proc.stdout[-3000:]
    tail = "\n".join(proc.stdout.splitlines()[-15:])
    assert "differs from the float64 reference" in tail and "[criterion" in tail, tail
    assert re.search(r"^  case: B=\d+ Hq=\d+ .* seed=\d+$", tail, flags=re.MULTILINE), tail
    assert "  replay: python -m verify.replay --impl tests/mutants.py:causal_off_by_one" in tail, tail
    assert "Highest target score" not in proc.stdout and "Draw 1 (case)" not in proc.stdout
    assert "AttentionCase(batch=" not in tail


def test_the_html_report_shows_the_failures_first_and_fits_the_implementations():
    data = {"status": "complete", "measurements": 1, "failed_measurements": 1, "unreadable_lines": 0,
            "by_implementation_op_dtype": [], "worst_cases": [], "outcomes": {"failed": 1},
            "failures": [{"test": "verify/test_forward.py::test_x[k-float16]", "message": "k: out differs from the "
                          "float64 reference", "replay": "python -m verify.replay --impl k", "file": "f.json"}],
            "run": {"implementations": [{"name": "k", "spec": "my.py:k", "kind": "attention", "dtypes": ["float16"],
                                         "not_covered": ["ALiBi: not covered, a plain callable is assumed not to "
                                                         "support it (declare it to have it drawn)"]}]}}
    page = html.report_html(data, [])
    assert page.index("<h2>Failures (1: 1 wrong answer)</h2>") < page.index("<h2>Run</h2>")
    assert page.index("python -m verify.replay --impl k") < page.index("<h2>Run</h2>")
    assert '<table class="fit">' in page and "1 left out (assumed (plain callable))" in page
    md = summary.markdown(data)
    assert md.index("## Failures (1") < md.index("| implementation |")


def test_failing_points_are_ringed_in_the_error_plot():
    if plots.unavailable():
        pytest.skip(plots.unavailable())
    points = {("float16", "out"): {"k": [(4.0, 1e-3, False), (8.0, 2.0, True), (16.0, math.inf, True)]}}
    png = plots.scatter_panels(points, rows=["float16"], cols=["out"], xlabel="Nk", ylabel="err", title="t" * 150)
    assert png and len(png) > 1000
    rows = [{"case": {**CASE, "len_k": 8}, "op": "out", "max_abs": 2.0, "implementation": "k", "pass": False}]
    assert html._points_error_vs_len(rows)[("float16", "out")]["k"] == [(8.0, 2.0, True)]
