"""verify/watchdog.py: the default time limit of ``pytest verify`` runs and the per-test timer (the hang
in native code that only the watchdog thread can end is run whole in tests/test_faults.py)."""

from __future__ import annotations

import signal
import threading
import time
import types

import pytest
import pytest_timeout

from flashverify_kernels import registry
from references.spec import AttentionSpec
from strategies.cases import AttentionCase
from verify import context, watchdog
from verify.context import Context, TimeoutFailure

TEST = "verify/test_forward.py::test_out_matches_reference[fa2_blocked-float32]"


def _config(timeout=None, ini=""):
    return types.SimpleNamespace(option=types.SimpleNamespace(timeout=timeout), getini={"timeout": ini}.get)


def _settings(timeout: float, method: str) -> pytest_timeout.Settings:
    return pytest_timeout.Settings(timeout=timeout, method=method, func_only=False, disable_debugger_detection=True)


def _watchdog_thread(item) -> threading.Thread:
    (thread,) = [t for t in threading.enumerate() if t.name == f"flashverify timeout {item.nodeid}"]
    return thread


def test_verify_runs_get_the_default_time_limit_unless_one_was_asked_for(monkeypatch):
    monkeypatch.delenv("PYTEST_TIMEOUT", raising=False)
    config = _config()
    watchdog.give_default_timeout(config)
    assert config.option.timeout == watchdog.DEFAULT_TIMEOUT == 900.0
    config = _config(timeout=7.0)
    watchdog.give_default_timeout(config)
    assert config.option.timeout == 7.0
    config = _config(ini="30")
    watchdog.give_default_timeout(config)
    assert config.option.timeout is None  # the ini key is pytest-timeout's to read
    monkeypatch.setenv("PYTEST_TIMEOUT", "12")
    config = _config()
    watchdog.give_default_timeout(config)
    assert config.option.timeout is None


def test_a_test_past_its_limit_ends_with_the_case_that_was_running():
    # SIGALRM is only delivered to the main thread (pytest-xdist runs tests there): elsewhere the watchdog
    # alone would run, and end this process at the limit.
    assert threading.current_thread() is threading.main_thread()
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=3, len_k=5, head_dim=4, dtype="float32",
                         spec=AttentionSpec(causal=False))
    running = Context(impl=registry.load("fa2_blocked", device="cpu"), prop="out_matches_reference", case=case)

    def out_matches_reference(ctx, case):
        while True:
            time.sleep(0.01)

    item = types.SimpleNamespace(nodeid=f"{TEST} (signal)")
    started = time.monotonic()
    watchdog.start_timer(item, _settings(0.2, "signal"), worker=None)
    try:
        thread = _watchdog_thread(item)
        with pytest.raises(TimeoutFailure) as info, context.running(running):  # as run_example runs it
            out_matches_reference(running, case)
    finally:
        item.cancel_timeout()
    assert time.monotonic() - started < 5
    thread.join(timeout=5)
    assert not thread.is_alive()  # cancelled with the test
    assert info.value.case == case and info.value.replay == running.replay_command()
    assert str(info.value).startswith("Timeout: the test did not finish within 0.2 s")
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_without_sigalrm_the_watchdog_thread_alone_keeps_the_time_and_is_cancelled_with_the_test():
    before = signal.getsignal(signal.SIGALRM)
    item = types.SimpleNamespace(nodeid=f"{TEST} (thread)")
    watchdog.start_timer(item, _settings(60, "thread"), worker=None)
    try:
        thread = _watchdog_thread(item)
        assert thread.daemon and thread.is_alive()
        assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        item.cancel_timeout()
    thread.join(timeout=5)
    assert not thread.is_alive()
