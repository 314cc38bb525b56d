"""Faults other than wrong answers: a kernel that hangs or runs out of device memory must give a failure
that says so (with the case and its replay command), a report entry, and a run that goes on.

The kernels are in ``tests/fixtures/faulty_kernels.py``; each test runs ``pytest verify`` on them in a
subprocess, as a user would."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from references.spec import AttentionSpec

ROOT = Path(__file__).resolve().parent.parent
FAULTY = "tests/fixtures/faulty_kernels.py"


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _pytest_verify(tmp_path, *args, timeout=120):
    cmd = [sys.executable, "-m", "pytest", "verify", "--hypothesis-profile=ci", "-p", "no:cacheprovider",
           "--report-dir", str(tmp_path / "report"), *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=timeout)
    return proc, time.monotonic() - start


def _failures(tmp_path) -> dict[str, dict]:
    out = {}
    for path in (tmp_path / "report" / "failures").glob("*.json"):
        data = json.loads(path.read_text())
        out[data["test"]] = data
    return out


def _summary(tmp_path) -> dict:
    return json.loads((tmp_path / "report" / "summary.json").read_text())


# --- hangs -------------------------------------------------------------------------------------------------

def test_a_hanging_kernel_fails_its_tests_with_the_timeout_and_the_run_goes_on(tmp_path):
    # hangs_forever never returns on non-causal calls: the drawn test and the non-causal longest case hang,
    # the causal longest case (run after both) passes.
    proc, seconds = _pytest_verify(tmp_path, "--impl", f"{FAULTY}:hangs_forever", "-k",
                                   "out_matches_reference and float32", "--timeout", "5", "-rA")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "2 failed, 1 passed" in out, out[-3000:]
    assert re.search(r"PASSED \S*test_longest_out_matches_reference\[\S*-float32-causal\]", out), out[-3000:]
    assert out.count("Timeout: the test did not finish within 5 s") >= 2, out[-4000:]
    assert seconds < 60, f"two 5 s timeouts took {seconds:.0f} s"

    failures = _failures(tmp_path)
    assert len(failures) == 2, list(failures)
    for test, failure in failures.items():
        assert "hangs_forever-float32" in test
        assert failure["message"].startswith("Timeout: the test did not finish within 5 s"), failure
        assert failure["property"] == "out_matches_reference"
        assert failure["case"]["spec"]["causal"] is False  # the case that was running when the time ran out
        assert failure["replay"].startswith(f"python -m verify.replay --impl {FAULTY}:hangs_forever")
    summary = _summary(tmp_path)
    assert summary["status"] == "complete" and summary["outcomes"] == {"passed": 1, "failed": 2}
    assert all("Timeout" in f["message"] for f in summary["failures"])
    assert "Timeout: the test did not finish" in (tmp_path / "report" / "report.md").read_text()


def test_a_hang_python_cannot_interrupt_ends_the_run_with_the_report_written(tmp_path):
    # hangs_in_native_code waits in C with SIGALRM blocked (as a host waits on a GPU kernel that never
    # finishes): no signal handler can run, so the watchdog writes the report and ends the process.
    proc, seconds = _pytest_verify(tmp_path, "--impl", f"{FAULTY}:hangs_in_native_code", "-k",
                                   "test_out_matches_reference and float32", "--timeout", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "stuck in native code" in out and "Stack of MainThread" in out, out[-4000:]
    assert seconds < 60, f"took {seconds:.0f} s"  # 2 s limit + 5 s grace, plus start-up
    (failure,) = _failures(tmp_path).values()
    assert failure["message"].startswith("Timeout: the test did not finish within 2 s")
    assert "stuck in native code" in failure["message"] and failure["replay"]
    summary = _summary(tmp_path)
    assert summary["status"] == "partial"  # the tests after the hung one never ran, and the report says so
    assert [f["test"] for f in summary["failures"]] == [failure["test"]]


def test_verify_runs_get_a_default_time_limit_and_other_runs_do_not(tmp_path):
    def header(*args):
        proc = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-p", "no:cacheprovider"],
                              cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    verify = ["verify", "--impl", "fa2_blocked", "-k", "out_matches_reference", "--no-report"]
    assert "timeout: 900.0s" in header(*verify)
    assert "timeout: 7.0s" in header(*verify, "--timeout", "7")
    assert "timeout:" not in header("tests/test_faults.py")


# --- out of memory -----------------------------------------------------------------------------------------

def test_out_of_memory_fails_with_the_case_and_the_run_goes_on(tmp_path):
    forward = f"{FAULTY}:out_of_memory_on_long_keys"  # forward raises for Nk > 5
    backward = f"{FAULTY}:out_of_memory_in_backward"  # correct forward, backward raises
    proc, _ = _pytest_verify(tmp_path, "--impl", forward, "--impl", backward, "-k",
                             "(test_out_matches_reference or test_gradients_match_reference) and float32", "-rA")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "3 failed, 1 passed" in out, out[-3000:]
    assert re.search(r"PASSED \S*test_out_matches_reference\[\S*out_of_memory_in_backward-float32\]", out)
    assert "ran out of device memory" in out

    failures = {"/".join(re.search(r"::(\w+)\[.*:(\w+)-float32\]$", test).groups()): f
                for test, f in _failures(tmp_path).items()}
    assert set(failures) == {"test_out_matches_reference/out_of_memory_on_long_keys",
                             "test_gradients_match_reference/out_of_memory_on_long_keys",
                             "test_gradients_match_reference/out_of_memory_in_backward"}, list(failures)
    fwd = failures["test_out_matches_reference/out_of_memory_on_long_keys"]
    assert "the kernel ran out of device memory in its forward (torch.OutOfMemoryError: CUDA out of memory" \
        in fwd["message"]
    assert fwd["case"]["len_k"] == 6, fwd["case"]  # shrunk to the smallest case that runs out
    assert "Nk=6" in fwd["message"] and "replay: python -m verify.replay" in fwd["message"]
    bwd = failures["test_gradients_match_reference/out_of_memory_in_backward"]
    assert "the kernel (or the check around it) ran out of device memory" in bwd["message"]
    assert f"raised in {FAULTY}:" in bwd["message"] and bwd["replay"] and bwd["case"]["len_k"] == 1
    summary = _summary(tmp_path)
    assert summary["status"] == "complete" and summary["outcomes"] == {"passed": 1, "failed": 3}

    replay = subprocess.run(fwd["replay"].replace("python", sys.executable, 1), shell=True, cwd=ROOT,
                            capture_output=True, text=True, env=_env(), timeout=120)
    assert replay.returncode == 1 and "ran out of device memory" in replay.stdout, replay.stdout + replay.stderr


def test_out_of_memory_releases_what_the_traceback_holds_and_empties_the_cuda_cache(monkeypatch):
    import weakref

    from verify import faults

    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    def kernel():
        workspace = torch.empty(1 << 16)  # what a kernel holds when its next allocation fails
        kernel.workspace = weakref.ref(workspace)
        raise faults.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    try:
        kernel()
    except faults.OutOfMemoryError as exc:
        assert kernel.workspace() is not None  # the traceback keeps the kernel's frame and its tensors
        text = faults.release_out_of_memory(exc)
        assert kernel.workspace() is None  # released while the exception is still being handled
    assert text == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert emptied == [True]


def _simulate_out_of_memory_in_logsumexp(monkeypatch):
    # torch.logsumexp (which the reference calls, and the kernel does not) raises as CUDA's allocator
    # would: the raiser is compiled as a file of torch's, so the innermost frame outside torch is the
    # reference's own line, as with a real out-of-memory error.
    code = compile("def logsumexp(*args, **kwargs):\n"
                   "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 8.00 GiB')\n",
                   os.path.join(os.path.dirname(torch.__file__), "_flashverify_simulated_oom.py"), "exec")
    namespace = {"torch": torch}
    exec(code, namespace)
    monkeypatch.setattr(torch, "logsumexp", namespace["logsumexp"])


def test_out_of_memory_in_the_float64_reference_skips_the_case(monkeypatch):
    import pytest

    from flashverify_kernels import registry
    from strategies.cases import AttentionCase
    from verify import properties
    from verify.context import Context

    _simulate_out_of_memory_in_logsumexp(monkeypatch)
    impl = registry.load("tests/fixtures/outside_kernels.py:attention", device="cpu")
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=3, len_k=5, head_dim=4, dtype="float32",
                         spec=AttentionSpec(causal=False), magnitude="normal", seed=1, layout="contiguous")
    ctx = Context(impl=impl, prop="out_matches_reference", case=case)
    with pytest.raises(properties.NotForThisKernel, match="float64 reference ran out of device memory on "
                       "B=1 Hq=1 Hkv=1 Nq=3 Nk=5 D=4 .*15 scores; lower the profile's max_scores"):
        properties.out_matches_reference(ctx, case)


def test_out_of_memory_in_the_suite_outside_the_kernel_is_not_blamed_on_the_kernel(monkeypatch):
    from verify import failures
    from references import attention as reference
    from strategies.cases import AttentionCase
    from verify.faults import OutOfMemoryError

    _simulate_out_of_memory_in_logsumexp(monkeypatch)
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=3, len_k=5, head_dim=4, dtype="float32",
                         spec=AttentionSpec(causal=False), magnitude="normal", seed=1, layout="contiguous")
    t = case.build()
    try:
        reference.attention(t.q, t.k, t.v)
    except OutOfMemoryError as exc:
        oom = exc
    else:
        raise AssertionError("the simulated out-of-memory error was not raised")
    item = types.SimpleNamespace(nodeid="verify/test_forward.py::test_out_matches_reference[x-float32]",
                                 name="test_out_matches_reference[x-float32]",
                                 originalname="test_out_matches_reference")
    fields = failures.other_failure(item, oom)
    message = failures.out_of_memory_message(item, oom, fields)
    assert "the suite's float64 reference ran out of device memory, not the kernel" in message
    assert "raised in references/" in message


# --- sticky CUDA errors (simulated: tests/fixtures/sticky_kernels.py) ----------------------------------------

STICKY = "tests/fixtures/sticky_kernels.py:illegal_address_on_long_keys"  # raises for Nk > 7, else correct
FORWARD_TESTS = "(test_out_matches_reference or test_lse_matches_reference or test_out_within_visible_values) and float32"


def _check_sticky_failure(failure):
    assert failure["implementation"] == STICKY, failure
    assert failure["message"].startswith(f"{STICKY}: the kernel hit a sticky CUDA error in its forward "
                                         "(RuntimeError: CUDA error: an illegal memory access was encountered)")
    # The case that hit the error, not one shrunk in a broken context: more than five keys.
    assert failure["case"]["len_k"] > 7, failure["case"]
    assert failure["replay"].startswith(f"python -m verify.replay --impl {STICKY} --property ")


def test_a_sticky_cuda_error_stops_a_run_without_xdist_with_a_partial_report(tmp_path):
    proc, _ = _pytest_verify(tmp_path, "verify/test_forward.py", "--impl", STICKY, "-k", FORWARD_TESTS)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert re.search(r"\b1 failed, \d+ deselected in", out), out[-2000:]
    assert "this process's CUDA context is unusable" in out and "replay: python -m verify.replay" in out

    (failure,) = _failures(tmp_path).values()
    _check_sticky_failure(failure)
    summary = _summary(tmp_path)
    assert summary["status"] == "partial", summary["status"]
    (stop,) = summary["stopped"]
    assert stop["test"] == failure["test"] and "illegal memory access" in stop["reason"]
    assert len(stop["not_run"]) == 2 and all(STICKY in t for t in stop["not_run"]), stop
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"Status: PARTIAL: the run stopped after {failure['test']}" in md
    assert all(t in md for t in stop["not_run"])
    assert "flashverify report: PARTIAL: the run stopped after" in out


@pytest.mark.slow(seconds=45)
def test_a_sticky_cuda_error_ends_the_xdist_worker_and_the_run_goes_on(tmp_path):
    proc, _ = _pytest_verify(tmp_path, "verify/test_forward.py", "--impl", STICKY, "--impl", "fa2_blocked",
                             "-k", FORWARD_TESTS, "-n", "2", "-rA", "--max-worker-restart", "1", timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "3 failed, 3 passed" in out, out[-3000:]  # each test counted once: no second "crashed" failure
    for name in ("test_out_matches_reference", "test_lse_matches_reference", "test_out_within_visible_values"):
        assert re.search(rf"PASSED \S*{name}\[fa2_blocked-float32\]", out), out[-3000:]
    assert "crashed while running" not in out
    assert "maximum crashed workers reached" not in out  # a planned end is not a crash: no restart counted
    assert out.count("ended after its sticky CUDA error") == 3, out[-3000:]

    failures = _failures(tmp_path)
    assert len(failures) == 3, list(failures)
    for failure in failures.values():
        _check_sticky_failure(failure)
    summary = _summary(tmp_path)
    assert summary["status"] == "complete" and summary["outcomes"] == {"passed": 3, "failed": 3}, summary["outcomes"]
    # Every worker's part of the report is complete, the replaced ones included.
    runs = list((tmp_path / "report").glob("run-gw*.json"))
    assert len(runs) >= 4 and all(json.loads(p.read_text()).get("finished") for p in runs)

    replay = subprocess.run(next(iter(failures.values()))["replay"].replace("python", sys.executable, 1),
                            shell=True, cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=120)
    assert replay.returncode != 0 and "illegal memory access" in replay.stdout + replay.stderr


# --- every failure replayable ---------------------------------------------------------------------------

def test_each_distinct_failure_gets_its_own_file_case_and_replay_and_no_hypothesis_blob(tmp_path):
    two_bugs = "tests/fixtures/raising_kernels.py:attention_with_two_bugs"  # ValueError if causal, else RuntimeError
    proc, _ = _pytest_verify(tmp_path, "verify/test_forward.py", "--impl", two_bugs, "-k",
                             "test_out_matches_reference and float32")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "Hypothesis found 2 distinct failures" in out, out[-4000:]
    failures = sorted(_failures(tmp_path).values(), key=lambda f: f["case"]["spec"]["causal"])
    assert [f["case"]["spec"]["causal"] for f in failures] == [False, True], failures
    assert failures[0]["message"].startswith("distinct failure ")
    assert "RuntimeError: non-causal path gave up on Nk=6" in failures[0]["message"]
    assert "ValueError: causal path gave up on Nk=6" in failures[1]["message"]
    for f in failures:
        assert f["case"]["len_k"] == 6  # each shrunk on its own
        assert f["replay"].startswith(f"python -m verify.replay --impl {two_bugs} --property out_matches_reference")
        assert f["replay"] in out  # the terminal has the replay line of each kernel exception
    md = (tmp_path / "report" / "report.md").read_text()
    for text in (out, md):
        assert "@reproduce_failure" not in text and "Explanation:" not in text


def test_a_failure_outside_any_drawn_example_says_where_it_happened():
    from verify import failures

    def fixture_setup():
        raise RuntimeError("no example was drawn")

    try:
        fixture_setup()
    except RuntimeError as exc:
        error = exc
    item = types.SimpleNamespace(nodeid="verify/test_forward.py::test_out_matches_reference[x-float32]",
                                 name="test_out_matches_reference[x-float32]",
                                 originalname="test_out_matches_reference")
    fields = failures.other_failure(item, error)
    assert fields["case"] is None and fields["replay"] is None
    assert fields["note"].startswith("it was raised outside any property example, at tests/test_faults.py:")
    assert fields["note"].endswith("(fixture_setup)")


def test_out_of_memory_in_the_suite_skips_the_test_and_in_the_kernel_fails_it(monkeypatch):
    import pytest

    from verify import failures
    from references import attention as reference
    from strategies.cases import AttentionCase
    from verify.faults import OutOfMemoryError

    _simulate_out_of_memory_in_logsumexp(monkeypatch)
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=3, len_k=6, head_dim=4, dtype="float32",
                         spec=AttentionSpec(causal=False), magnitude="normal", seed=1, layout="contiguous")
    t = case.build()
    item = types.SimpleNamespace(nodeid="verify/test_forward.py::test_out_matches_reference[x-float32]",
                                 name="test_out_matches_reference[x-float32]",
                                 originalname="test_out_matches_reference",
                                 config=types.SimpleNamespace(_flashverify_budget=None))
    try:
        reference.attention(t.q, t.k, t.v)
    except OutOfMemoryError as exc:
        suite = exc
    with pytest.raises(pytest.skip.Exception, match="the suite's float64 reference ran out of device memory, "
                       "not the kernel"):
        failures.skip_if_the_suite_ran_out_of_memory(item, ExceptionGroup("2 distinct failures", [suite]))

    from tests.fixtures import faulty_kernels

    try:
        faulty_kernels.out_of_memory_on_long_keys(t.q, t.k, t.v)
    except OutOfMemoryError as exc:
        kernel = exc
    # The kernel's: no skip, the test fails.
    failures.skip_if_the_suite_ran_out_of_memory(item, kernel)


def test_a_group_of_one_failure_keeps_the_group_s_words_and_its_case(tmp_path):
    from verify import failures

    def kernel_call():
        raise RuntimeError("kernel gave up")

    try:
        kernel_call()
    except RuntimeError as exc:
        inner = exc
    group = ExceptionGroup("Inconsistent results: an example failed on the first run but now succeeds", [inner])
    item = types.SimpleNamespace(nodeid="verify/test_forward.py::test_out_matches_reference[x-float32]",
                                 name="test_out_matches_reference[x-float32]",
                                 originalname="test_out_matches_reference",
                                 config=types.SimpleNamespace(_flashverify_budget=None))
    (fields,) = failures.explain_failure(item, group, worker=None)
    assert fields["message"].startswith("ExceptionGroup: Inconsistent results: an example failed on the first run")
    assert "RuntimeError: kernel gave up" in fields["message"]
    assert fields["note"].startswith("it was raised outside any property example, at tests/test_faults.py:")
    assert any("no replay command: it was raised outside any property example" in n for n in inner.__notes__)


def test_tests_that_never_ran_because_xdist_gave_up_make_the_report_partial(tmp_path):
    # A kernel that kills its process in every test, with worker restarts disabled: pytest-xdist stops at
    # the first crash, and the tests it never ran are named, not a "complete" report.
    crashes = "tests/fixtures/sticky_kernels.py:crashes_the_process"
    proc, _ = _pytest_verify(tmp_path, "verify/test_forward.py", "--impl", crashes, "-k", FORWARD_TESTS,
                             "-n", "1", "--max-worker-restart", "0", timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    summary = _summary(tmp_path)
    assert summary["status"] == "partial", summary["status"]
    (stop,) = summary["stopped"]
    assert stop["test"] is None and stop["reason"].startswith("pytest-xdist: worker gw0 crashed"), stop
    assert 1 <= len(stop["not_run"]) <= 2 and all(crashes in t for t in stop["not_run"]), stop
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Status: PARTIAL: pytest-xdist: worker gw0 crashed" in md and "Workers that did not finish: gw0." in md


def test_a_sticky_cuda_error_after_the_forward_ends_the_test_with_the_case_that_ran():
    # Raised by the backward or by the suite's own work once the kernel broke the context: the runner
    # turns it into StickyDeviceError (not shrunk) naming this example's case; on CPU it is left alone.
    import pytest

    from flashverify_kernels import registry
    from strategies.attention import Limits
    from strategies.cases import AttentionCase
    from verify.context import Context, StickyDeviceError
    from verify.runner import Env, run_example

    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=3, len_k=5, head_dim=4, dtype="float16",
                         spec=AttentionSpec(causal=False))
    impl = registry.load("fa2_blocked", device="cpu")

    def backward_breaks(ctx, case):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def env(device):
        return Env(device=device, profile="ci", limits=Limits(), record=lambda _m: None)

    ctx = Context(impl=impl, prop="gradients_match_reference", device="cuda:0", case=case)
    with pytest.raises(StickyDeviceError) as info:
        run_example(backward_breaks, ctx, case, env("cuda:0"))
    assert info.value.case == case and "replay: python -m verify.replay" in str(info.value)
    assert "illegal memory access" in str(info.value)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_example(backward_breaks, Context(impl=impl, prop="x", case=case), case, env("cpu"))


# --- interrupted runs: Ctrl-C, or a time limit's SIGINT / SIGTERM --------------------------------------------

SLOW = f"{FAULTY}:slow_on_full_attention"


def _interrupt_when(tmp_path, args, ready, signum, *, times=1, timeout=180):
    """``pytest verify`` in a subprocess, sent ``signum`` once ``ready(its output so far)`` holds (``times``
    times, 0.3 s apart); (exit status, output). The child starts with SIGINT's default action, as under a
    terminal (a shell may hand a background job SIGINT ignored)."""
    log = tmp_path / "out.log"
    cmd = [sys.executable, "-m", "pytest", "verify", "--hypothesis-profile=ci", "-p", "no:cacheprovider",
           "--report-dir", str(tmp_path / "report"), *args]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=_env(),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + timeout
            while not ready(log.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            for i in range(times):
                if i:
                    time.sleep(0.3)
                if proc.poll() is None:
                    proc.send_signal(signum)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, log.read_text()


@pytest.mark.slow(seconds=30)
def test_ctrl_c_ends_the_run_with_a_partial_report_naming_the_tests_not_run(tmp_path):
    # Without pytest-xdist, the signal as soon as the first test starts (pytest -v names it then).
    first = f"verify/test_forward.py::test_out_matches_reference[{SLOW}-float32]"
    rc, out = _interrupt_when(tmp_path, ["--impl", SLOW, "-k", "out_matches_reference and float32", "-v"],
                              lambda text: first in text, signal.SIGINT)
    assert rc == pytest.ExitCode.INTERRUPTED, out[-3000:]
    summary = _summary(tmp_path)
    assert summary["status"] == "partial", summary["status"]
    (stop,) = summary["stopped"]
    assert stop["test"] is None and stop["reason"] == "interrupted (SIGINT: Ctrl-C, or a time limit)", stop
    # the test it interrupted, then the two longest cases (full and causal) it never got to; or, where the
    # interrupt did not reach the test body and only the check before the next test ended the run
    # (verify/watchdog.py, end_if_interrupted), the test ends first and the two longest are not run. The
    # second was seen in two of three full `pytest tests -n 2` runs on a 2-core machine, never alone.
    longest = [t for t in stop["not_run"] if "test_longest" in t]
    assert len(longest) == 2 and stop["not_run"] in ([first, *longest], longest), stop
    n = len(stop["not_run"])
    md = (tmp_path / "report" / "report.md").read_text()
    status = md.splitlines()[2]
    assert status == (f'Status: PARTIAL: interrupted (SIGINT: Ctrl-C, or a time limit); {n} test(s) not run '
                      '(listed under "Tests not run").'), status
    assert f"## Tests not run ({n})" in md and all(f"- `{t}`" in md for t in stop["not_run"])
    assert f"Tests not run ({n})" in (tmp_path / "report" / "report.html").read_text()
    assert "flashverify report: PARTIAL: interrupted (SIGINT" in out, out[-2000:]


@pytest.mark.slow(seconds=45)
def test_sigterm_ends_an_xdist_run_with_a_partial_report(tmp_path):
    # What `timeout` sends the process it started, here pytest-xdist's controller alone: the run ends as on
    # Ctrl-C once a test of the fast kernel has passed, while the slow kernel's test still runs. The signal
    # comes three times, 0.3 s apart: GNU timeout signals the process, then its whole process group, and a
    # KeyboardInterrupt raised again while pytest ends the run (xdist's teardown, the report) would end the
    # process with no report at all (on the CPU machine it did; a GPU run stopped by `timeout` left none:
    # docs/gpu-runs.md).
    rc, out = _interrupt_when(tmp_path, ["--impl", SLOW, "--impl", "fa2_blocked", "-k",
                                         "out_matches_reference and float32 and not longest", "-n", "2", "-v"],
                              lambda text: "PASSED" in text, signal.SIGTERM, times=3)
    assert rc == pytest.ExitCode.INTERRUPTED, out[-3000:]
    summary = _summary(tmp_path)
    assert summary["status"] == "partial", summary["status"]
    (stop,) = summary["stopped"]
    assert stop["reason"] == "interrupted (SIGTERM: a time limit, or a cancelled job)", stop
    assert f"verify/test_forward.py::test_out_matches_reference[{SLOW}-float32]" in stop["not_run"], stop
    assert summary["outcomes"].get("passed", 0) >= 1, summary["outcomes"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert md.splitlines()[2].startswith("Status: PARTIAL: interrupted (SIGTERM: a time limit, or a cancelled "
                                         "job); "), md[:600]


def _not_raised(handler, signum):
    """Run the signal's handler as a second delivery would; a KeyboardInterrupt from it fails the test (rather
    than ending the whole pytest session)."""
    try:
        result = handler(signum, None)
    except KeyboardInterrupt as exc:
        pytest.fail(f"the signal delivered again raised KeyboardInterrupt({exc})")
    assert result is None


def test_an_interrupt_that_was_lost_is_raised_again_before_the_next_example(monkeypatch):
    # CPython drops an exception raised in a garbage-collection callback: a KeyboardInterrupt raised by the
    # signal handler there never reaches pytest. The handler remembers the signal, and the next example
    # (or test) raises it again, until pytest has seen one.
    from verify import watchdog

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        watchdog.catch_interrupts()
        handler = signal.getsignal(signal.SIGTERM)
        assert handler is not signal.SIG_DFL
        watchdog.end_if_interrupted()  # nothing asked the run to end yet
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            handler(signal.SIGTERM, None)  # what the signal runs; suppose the interpreter drops it
        assert watchdog.interrupted_by() == "SIGTERM: a time limit, or a cancelled job"
        _not_raised(handler, signal.SIGTERM)  # the same signal again at once
        with pytest.raises(KeyboardInterrupt, match="Python dropped the first one"):
            watchdog.end_if_interrupted()
        watchdog.interrupt_reached()  # pytest got it: the run is ending
        watchdog.end_if_interrupted()
        watchdog.release_interrupts()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and watchdog.interrupted_by() is None
    finally:
        watchdog.release_interrupts()
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_again_after_the_grace_is_raised(monkeypatch):
    # Within watchdog.REPEAT_GRACE_S of the first, the same signal is its second delivery and does nothing;
    # after it, someone asks again, and it is raised (the report may then be cut short, as asked).
    from verify import watchdog

    monkeypatch.setattr(watchdog, "REPEAT_GRACE_S", 3600.0)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        watchdog.catch_interrupts()
        handler = signal.getsignal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            handler(signal.SIGINT, None)
        _not_raised(handler, signal.SIGINT)
        monkeypatch.setattr(watchdog, "REPEAT_GRACE_S", 0.0)  # as if the grace had passed
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            handler(signal.SIGINT, None)
        assert watchdog.interrupted_by() == "SIGINT: Ctrl-C, or a time limit"
    finally:
        watchdog.release_interrupts()
        signal.signal(signal.SIGINT, previous)


def test_an_example_that_leaves_nothing_allocated_skips_the_full_collection(monkeypatch):
    """A full gc.collect walks every object of the process (about 0.15 s on a GPU worker): after an
    example it runs only when the example left tensors allocated, and what a collection cannot free
    (a buffer kept across calls) does not make every later example collect again."""
    from verify import faults

    allocated = {"bytes": 0}
    calls = []
    monkeypatch.setattr(faults, "_SETTLED", {})
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["bytes"])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(faults.gc, "collect", lambda *a: calls.append("collect") or 0)

    faults.release_example_memory("cuda:0")  # every tensor died with its references
    assert calls == []
    allocated["bytes"] = 1 << 20  # a cycle (a traceback's frames) holds a tensor
    faults.release_example_memory("cuda:0")
    assert calls == ["collect", "empty_cache"]
    faults.release_example_memory("cuda:0")  # still allocated after the collection: a live buffer
    assert calls == ["collect", "empty_cache"]
    allocated["bytes"] = 0  # the buffer is gone; the next leak is collected again
    faults.release_example_memory("cuda:0")
    allocated["bytes"] = 1 << 10
    faults.release_example_memory("cuda:0")
    assert calls == ["collect", "empty_cache"] * 2


def test_a_failing_example_on_a_gpu_lets_go_of_its_tensors_before_the_failure_is_kept(monkeypatch):
    """Hypothesis keeps an example's failure while it shrinks, pytest keeps the test's last one after it
    (``sys.last_value``): the frames of their tracebacks must not keep the failing case's tensors on the
    device, or every later example of the test, and the worker's next tests, run out of memory for it.
    On CPU the frames stay (pytest shows their locals with ``--showlocals``)."""
    import gc
    import weakref

    from flashverify_kernels import registry
    from strategies.attention import Limits
    from strategies.cases import AttentionCase
    from verify import runner
    from verify.context import Context
    from verify.runner import Env, run_example

    monkeypatch.setattr(runner, "release_example_memory", lambda device: None)
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=3, len_k=5, head_dim=4, dtype="float16",
                         spec=AttentionSpec(causal=False))
    impl = registry.load("fa2_blocked", device="cpu")
    held = []

    def fails_holding_a_tensor(ctx, case):
        scores = torch.zeros(1 << 16)
        held.append(weakref.ref(scores))
        try:
            raise RuntimeError("the kernel failed")  # chained: the context's frames are let go too
        except RuntimeError:
            assert scores.sum() == 1, "the property failed"

    def run(device):
        env = Env(device=device, profile="ci", limits=Limits(), record=lambda _m: None)
        with pytest.raises(AssertionError, match="the property failed") as info:
            run_example(fails_holding_a_tensor, Context(impl=impl, prop="x", case=case), case, env)
        gc.collect()
        return info.value

    kept = run("cuda:0")
    assert held[-1]() is None, "the failure kept the example's tensor alive"
    assert "the kernel failed" in str(kept.__context__)  # the failure itself is intact
    kept_on_cpu = run("cpu")
    assert held[-1]() is not None
    del kept_on_cpu
