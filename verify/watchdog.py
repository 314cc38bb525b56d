"""The per-test time limit and the native-hang watchdog.

A ``pytest verify`` run gives every test (one property of one implementation in one dtype: all its
Hypothesis examples, Triton compilations included) ``DEFAULT_TIMEOUT`` = 900 s, through pytest-timeout.
``--timeout SECONDS`` (pytest-timeout's own option, or its ``PYTEST_TIMEOUT`` variable or ``timeout`` ini
key) replaces it, ``--timeout 0`` turns it off; runs that collect no ``verify`` tests (``pytest tests``)
get no default. A test past its limit fails with a :class:`verify.context.TimeoutFailure` naming the case
that was running and its replay command, its failure file is written, and the run goes on. A hang
Python cannot interrupt (a GPU kernel that never finishes: the host waits in native code) is caught by a
watchdog a grace period later (10% of the limit, 5 to 60 s), which writes the failure file and the
summary and then ends the process (pytest-timeout's thread method; under pytest-xdist the worker is
replaced and the run goes on).

Interruptions: in the process that writes the run's summary (no pytest-xdist, or its controller) SIGINT
(Ctrl-C, ``timeout -s INT``) and SIGTERM (``timeout``, a CI job out of time or cancelled) end the run as
Ctrl-C does, so that the report comes out PARTIAL with the tests not run (:func:`catch_interrupts`); the
same signal delivered again while the run ends does not cut the report short.
"""

from __future__ import annotations

import os
import signal
import threading
import time

# Per-test time limit of `pytest verify` runs (seconds): a test runs up to hundreds of Hypothesis
# examples, and on a GPU its first examples compile Triton kernels.
DEFAULT_TIMEOUT = 900.0


def give_default_timeout(config) -> None:
    """Give the run ``DEFAULT_TIMEOUT`` unless a time limit was asked for (option, variable or ini key)."""
    if config.option.timeout is None and not os.environ.get("PYTEST_TIMEOUT") and not config.getini("timeout"):
        config.option.timeout = DEFAULT_TIMEOUT


def start_timer(item, settings, *, worker: str | None) -> None:
    """Install the time limit of one test in place of pytest-timeout's own.

    pytest-timeout's signal method raises pytest's ``Failed``, which Hypothesis catches as a failing
    example and then replays to shrink it: the replay hangs again, with no timer left, and the run
    never ends. Here SIGALRM raises :class:`verify.context.TimeoutFailure` instead, which Hypothesis
    lets through, naming the example that was running. A watchdog thread covers hangs that never
    return to Python (where no signal handler can run): a grace period after the limit it writes the
    failure file and the summary, then ends the process as pytest-timeout's thread method does. Where
    SIGALRM cannot be used (another platform or thread, ``--timeout-method=thread``), the watchdog alone
    runs, at the limit. ``item.cancel_timeout`` stops both. ``worker`` is this process's pytest-xdist
    worker id, None without one.
    """
    import pytest_timeout

    seconds = float(settings.timeout)
    main_thread = threading.main_thread()
    use_signal = (settings.method == "signal" and hasattr(signal, "SIGALRM")
                  and threading.current_thread() is main_thread)
    grace = min(60.0, max(5.0, seconds / 10)) if use_signal else 0.0
    watchdog = threading.Timer(seconds + grace, _native_hang, (item, settings, worker))
    watchdog.name = f"flashverify timeout {item.nodeid}"
    watchdog.daemon = True

    def on_alarm(signum, frame):
        __tracebackhide__ = True
        if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
            return
        from verify.context import TimeoutFailure, running_context, timeout_message

        ctx = running_context()
        raise TimeoutFailure(timeout_message(ctx, seconds=seconds), ctx=ctx)

    def cancel():
        watchdog.cancel()
        if use_signal:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # what pytest-timeout's pytest_timeout_cancel_timer calls
    if use_signal:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    watchdog.start()


def _native_hang(item, settings, worker):
    """The watchdog's end of a test that never returned: failure file and summary, then exit status 1."""
    import pytest_timeout

    if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
        return
    from verify.failures import failure_fields
    from verify.context import TimeoutFailure, running_context, timeout_message

    ctx = running_context()
    failure = TimeoutFailure(timeout_message(ctx, seconds=float(settings.timeout), native=True), ctx=ctx)
    config = item.config
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)  # the message goes to the terminal, not to the capture
    terminal = config.get_terminal_writer()
    terminal.line("")
    terminal.sep("+", title=f"flashverify: {item.nodeid}")
    terminal.line(str(failure))
    report = config._flashverify_report
    try:
        if report is not None:
            report.failure(test=item.nodeid, **failure_fields(failure))
            if worker:
                # pytest-xdist replaces this worker and runs the rest: this worker's part is complete.
                report.close(exitstatus=1)
            else:
                # The tests after this one will not run: the run stays unfinished, the summary PARTIAL.
                from reports.write import write_summary

                reporter = config.pluginmanager.get_plugin("terminalreporter")
                outcomes = {key: len(reporter.stats.get(key, [])) for key in ("passed", "failed", "skipped")
                            if reporter is not None and reporter.stats.get(key)}
                outcomes["failed"] = outcomes.get("failed", 0) + 1
                write_summary(report.dir, outcomes=outcomes)
                terminal.line(f"flashverify report: {report.dir / 'report.html'} (PARTIAL: the run ends at this test)")
    except Exception as exc:  # noqa: BLE001 - the process must end whatever the report does
        terminal.line(f"flashverify report: writing the report failed: {type(exc).__name__}: {exc}", red=True)
    pytest_timeout.timeout_timer(item, settings)  # dumps every thread's stack, then os._exit(1)


# --------------------------------------------------------------------------------------------------
# Interruptions
# --------------------------------------------------------------------------------------------------

_SIGNALS = {"SIGINT": "SIGINT: Ctrl-C, or a time limit", "SIGTERM": "SIGTERM: a time limit, or a cancelled job"}
_pending: str | None = None  # the signal that asked the run to end, once one has
_pending_at = 0.0  # when it came (time.monotonic())
# A signal within this long of the first is the same request delivered again, not raised: GNU `timeout` signals
# the process it started and then its whole process group, so the controller gets its signal twice, and a
# KeyboardInterrupt raised while pytest writes the report ends the process without one. Later, it is raised:
# someone asks again.
REPEAT_GRACE_S = 2.0
_reached = False  # its KeyboardInterrupt reached pytest (:func:`interrupt_reached`)
_installed: dict = {}  # signal number -> (our handler, the handler it replaced)


def catch_interrupts() -> None:
    """End the run on SIGINT and SIGTERM as on Ctrl-C (a ``KeyboardInterrupt``), remembering which came
    (:func:`interrupted_by`): pytest then finishes the session and the report is written, where SIGTERM's
    default action would end the process with no report at all. Only in the main thread, and only for a
    signal that still has Python's default handling (nobody else handles it); :func:`release_interrupts`
    puts the handlers back. A signal within :data:`REPEAT_GRACE_S` of the first does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name, default in (("SIGINT", signal.default_int_handler), ("SIGTERM", signal.SIG_DFL)):
        signum = getattr(signal, name)
        if signal.getsignal(signum) is not default:
            continue

        def on_signal(_signum, _frame, name=name):
            global _pending, _pending_at
            now = time.monotonic()
            if _pending is None:
                _pending, _pending_at = name, now
            elif now - _pending_at < REPEAT_GRACE_S:
                return  # delivered again: the run is ending already (end_if_interrupted raises a lost one)
            raise KeyboardInterrupt(name)

        signal.signal(signum, on_signal)
        _installed[signum] = (on_signal, default)


def release_interrupts() -> None:
    """Undo :func:`catch_interrupts` (where nobody replaced its handlers since) and forget the signal."""
    global _pending, _reached
    for signum, (ours, previous) in list(_installed.items()):
        if signal.getsignal(signum) is ours:
            signal.signal(signum, previous)
        del _installed[signum]
    _pending, _reached = None, False


def interrupt_reached() -> None:
    """A ``KeyboardInterrupt`` reached pytest (its ``pytest_keyboard_interrupt``): the run is ending, so
    :func:`end_if_interrupted` raises no more."""
    global _reached
    _reached = True


def interrupted_by() -> str | None:
    """What asked the run to end (``"SIGTERM: a time limit, or a cancelled job"``), or None."""
    return _SIGNALS.get(_pending) if _pending else None


def end_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` again if a signal asked the run to end and the run is still going: a
    signal handler's exception raised while Python runs a garbage-collection callback (Hypothesis keeps
    one) is dropped by CPython, so that the first one can be lost. Called before each test and each
    example (the controller of pytest-xdist: after each test's outcome), so that a lost one ends the run
    there."""
    if _pending and not _reached:
        raise KeyboardInterrupt(f"{_pending} (raised again: Python dropped the first one, raised in a "
                                "garbage-collection callback)")

