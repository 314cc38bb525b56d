"""Failure capture: a failed test turned into the fields of its failure files (each distinct failure with
its case and replay command, or a note saying where it happened outside any example), the
out-of-memory wording (the suite's float64 work running out is a skip, the kernel's a failure), and the
planned end of a process after a sticky CUDA error.

The hooks in ``verify/plugin.py`` call these; the case of a failure other than a property's own is read
from the property's context in the traceback, else from Hypothesis's notes (``reports/failures.py``).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import pytest
import torch

from verify import gpu

ROOT = Path(__file__).resolve().parent.parent


def property_failures(exc):
    """The suite's own failures in ``exc`` (itself, or in an exception group): each carries its case."""
    from verify.context import PropertyFailure, StickyDeviceError, TimeoutFailure

    if isinstance(exc, (PropertyFailure, StickyDeviceError, TimeoutFailure)):
        yield exc
    for sub in getattr(exc, "exceptions", ()) or ():
        yield from property_failures(sub)


def _is_group(exc) -> bool:
    """An exception group (Hypothesis's "N distinct failures", a FlakyFailure): holds its failures."""
    subs = getattr(exc, "exceptions", None)
    return isinstance(subs, (tuple, list)) and bool(subs) and all(isinstance(e, BaseException) for e in subs)


def _leaves(exc):
    """The distinct failures in ``exc``: every exception of a group (nested groups flattened), else ``exc``."""
    if _is_group(exc):
        for sub in exc.exceptions:
            yield from _leaves(sub)
    else:
        yield exc


def out_of_memory(exc):
    """The ``torch.OutOfMemoryError`` in ``exc`` (itself, in an exception group, or what it was raised
    from), or None."""
    from verify.faults import OutOfMemoryError

    return next((e for e in gpu.exception_chain(exc) if isinstance(e, OutOfMemoryError)), None)


def release_after_report(exc, oom) -> None:
    """The report is written: drop the tensors the tracebacks of ``exc`` hold, then the device cache."""
    from verify.faults import clear_frames, release_out_of_memory

    if exc is not oom:
        clear_frames(exc.__traceback__)
    release_out_of_memory(oom)


# What Hypothesis adds to a failure that is about the suite, not the kernel: its reproduction blob (the
# failure file's replay command replays the case) and its explain phase's lines of the suite's own files.
_HYPOTHESIS_NOISE = ("@reproduce_failure(", "Explanation:")
# And what it adds that the suite says better once the failure has its case: the failing call and its draws
# (a 25-line AttentionCase dump; the case is one line and the replay command replays it) and the best
# target() scores, which are the passing examples' and read as if they were the failure's.
_HYPOTHESIS_CASE = ("Failing test case", "Falsifying example", "Draw ", "Highest target score")


def _drop_hypothesis_noise(exc, *, has_case: bool = False) -> None:
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        notes[:] = [n for n in notes if not any(mark in str(n) for mark in _HYPOTHESIS_NOISE)
                    and not (has_case and (str(n).lstrip().startswith(_HYPOTHESIS_CASE) or "(label='" in str(n)))]


def _add_note(exc, text: str) -> None:
    """Add ``text`` to ``exc``'s notes (pytest prints them under the exception)."""
    try:
        exc.__notes__ = [*(getattr(exc, "__notes__", None) or []), text]
    except (AttributeError, TypeError):  # an exception type that takes no attributes
        pass


def unreliable_note(exc, leaf, own: bool) -> str | None:
    """What a Hypothesis ``FlakyFailure`` means for ``leaf``, one of its failures: the example failed, and
    when Hypothesis ran the same case again it did not fail that way. None for any other ``exc``."""
    try:
        from hypothesis.errors import FlakyFailure
    except ImportError:  # pragma: no cover - a Hypothesis without it has no such failure
        return None
    if not isinstance(exc, FlakyFailure):
        return None
    if own:
        return ("Hypothesis ran this case again and it did not fail the same way: the kernel's result for the "
                "same input changed from one call to the next (not deterministic, or dependent on what ran "
                "before it in this process)")
    return (f"Hypothesis ran this case again and the kernel did not raise the same way: the {type(leaf).__name__} "
            "depends on what ran before it in this process (a compile cache or a recompilation, autotuning, "
            "device state), so the replay command alone may pass; rerun the test to see it again")


def failure_fields(f) -> dict:
    """Failure-file fields of one of the suite's own failures (:func:`property_failures`)."""
    return {"message": str(f), "replay": f.replay, "case": f.case.to_dict() if hasattr(f.case, "to_dict") else None,
            "prop": f.prop, "implementation": f.impl}


def outside_call_fields(exc, when: str) -> dict:
    """Failure-file fields of a failure outside the test's body (a fixture, or the time limit, in its
    ``when`` phase): the suite's own failure in ``exc`` if there is one, else the exception with a note."""
    from reports.failures import exception_text

    failures = list(property_failures(exc))
    return failure_fields(failures[0]) if failures else {
        "message": exception_text(exc), "replay": None, "case": None, "prop": None, "implementation": None,
        "note": f"the failure happened in the test's {when}, outside any drawn example"}


def raised_in_references(oom) -> bool:
    """Whether ``oom`` was raised by the suite's own float64 work (the innermost frame outside torch is in
    references/: the reference, the eager baseline, the bounds)."""
    return _raised_where(oom)[1]


def _raised_where(oom) -> tuple[str, bool]:
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(oom.__traceback__) if not f.filename.startswith(torch_dir)]
    if not frames:
        return "", False
    path = Path(frames[-1].filename).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f", raised in {shown}:{frames[-1].lineno} ({frames[-1].name})", path.is_relative_to(ROOT / "references")


def out_of_memory_message(item, oom, fields) -> str:
    """The failure message of an out-of-memory error that escaped the harness (raised in a backward, or
    in the suite's float64 reference): where it was raised, and whether the suite or the kernel ran out."""
    from verify.faults import exception_line

    place, in_reference = _raised_where(oom)
    who = ("the suite's float64 reference ran out of device memory, not the kernel: the case is too large "
           "for this device at float64 (lower the profile's limits)" if in_reference
           else "the kernel (or the check around it) ran out of device memory")
    lines = [f"{fields.get('implementation') or item.nodeid}: {who} ({exception_line(oom)}{place}); "
             "the device memory was released and the run goes on"]
    if fields.get("prop"):
        lines.append(f"property: {fields['prop']}")
    if fields.get("case"):
        lines.append(f"case: {_case_text(fields['case'])}")
    if fields.get("replay"):
        lines.append(f"replay: {fields['replay']}")
    elif fields.get("note"):
        lines.append(f"no replay command: {fields['note']}")
    return "\n  ".join(lines)


def suite_raised_at(exc) -> str | None:
    """``at verify/x.py:N (fn)``: where the suite's own code raised ``exc`` (a bug in flashverify, not the
    kernel: :func:`reports.failures.suite_frame`), with the innermost frame when a library raised it there;
    None when the kernel raised it. A sticky CUDA error or an out-of-memory error is never the suite's: the
    first surfaces wherever the device is next waited for (the kernel broke the context), the second has its
    own words (:func:`out_of_memory_message`)."""
    from reports.failures import frame_at, suite_frame

    frame = suite_frame(exc, ROOT)
    if frame is None or gpu.sticky_cuda_error(exc) is not None or out_of_memory(exc) is not None:
        return None
    innermost = traceback.extract_tb(exc.__traceback__)[-1]
    inside = "" if innermost == frame else f", inside {frame_at(innermost, root=ROOT)}"
    return f"at {frame_at(frame, root=ROOT)}{inside}"


def other_failure(item, exc) -> dict:
    """Failure-file fields for one failure other than a PropertyFailure (a kernel that raises, or the
    suite's own code: :func:`suite_raised_at`): the case is the one the property example was running when
    the exception was raised (the example marks its exceptions: :func:`verify.context.attach_context`), with
    its replay command; without one, a note saying where the exception was raised, outside any example."""
    from reports.failures import KERNEL_RAISED, SUITE_RAISED, exception_text, raised_at
    from verify.faults import declare_hint
    from verify.context import failing_context

    ctx = failing_context(exc)
    if ctx is not None and hasattr(ctx.case, "to_dict"):
        where = suite_raised_at(exc)
        if where is not None:
            message = (f"{ctx.impl.name}: {SUITE_RAISED} {where} on this case; please report it with the replay "
                       f"command\n{exception_text(exc)}")
        else:
            message = (f"{ctx.impl.name}: {KERNEL_RAISED} {raised_at(exc, root=ROOT)} on a case its declaration "
                       f"allows{declare_hint(exc, case=ctx.case)}\n{exception_text(exc)}")
        return {"message": message, "replay": ctx.replay_command(), "case": ctx.case.to_dict(),
                "prop": ctx.prop, "implementation": ctx.impl.name, "note": None}
    params = getattr(getattr(item, "callspec", None), "params", {})
    impl = params.get("impl") or params.get("softmax_impl")
    return {"message": exception_text(exc), "replay": None, "case": None, "prop": None,
            "implementation": getattr(impl, "name", None),
            "note": f"it was raised outside any property example, {raised_at(exc, root=ROOT)}"}


def skip_if_the_suite_ran_out_of_memory(item, exc) -> None:
    """Every failure in ``exc`` is the suite's own float64 work (references/: reference, baseline,
    bounds) running out of device memory: skip the test with the reason, not a kernel failure."""
    leaves = list(_leaves(exc))
    ooms = [out_of_memory(leaf) for leaf in leaves]
    if not ooms or not all(o is not None and raised_in_references(o) for o in ooms):
        return
    from verify.faults import clear_frames, release_out_of_memory

    fields = other_failure(item, leaves[0])
    reason = out_of_memory_message(item, ooms[0], fields)
    clear_frames(exc.__traceback__)
    for o in ooms:
        release_out_of_memory(o)
    raise pytest.skip.Exception(reason, _use_item_location=True) from None


def explain_failure(item, exc, *, worker: str | None) -> list[dict]:
    """The failure-file fields of each distinct failure in ``exc`` (each with its case and replay
    command, or a note saying where it happened outside any example), and the terminal to match:
    a replay line added to every exception that has none, Hypothesis's reproduction blob and
    explanation dropped, a sticky CUDA error named (and the process marked poisoned). ``worker`` is
    this process's pytest-xdist worker id, None without one."""
    from verify.context import PropertyFailure, StickyDeviceError, TimeoutFailure
    from verify.faults import declare_hint, exception_line
    from verify.context import failing_context

    leaves = list(_leaves(exc))
    _drop_hypothesis_noise(exc)
    budget = getattr(item.config, "_flashverify_budget", None)
    out = []
    for i, leaf in enumerate(leaves):
        own = isinstance(leaf, (PropertyFailure, StickyDeviceError, TimeoutFailure))
        has_case = (own and getattr(leaf, "replay", None) is not None) or failing_context(leaf) is not None
        _drop_hypothesis_noise(leaf, has_case=has_case)
        if len(leaves) == 1 and leaf is not exc:
            _drop_hypothesis_noise(exc, has_case=has_case)
        fields = failure_fields(leaf) if own else other_failure(item, leaf)
        if own and not fields.get("replay"):
            fields["note"] = "no property example was running (the failure happened drawing or shrinking cases)"
        oom = None if own else out_of_memory(leaf)
        extra = []
        if oom is not None:
            fields["message"] = out_of_memory_message(item, oom, fields)
        if (oom is not None or (own and "ran out of device memory" in str(leaf))) and budget is not None:
            extra.append(f"this worker's memory budget is {budget.describe()}; the case was drawn to fit it, so "
                         "the kernel's out-of-memory error is the kernel's")
        sticky = gpu.sticky_cuda_error(leaf)
        if sticky is not None:
            extra.append(_poison(item, sticky, worker))
            if not isinstance(leaf, StickyDeviceError):  # raised outside the kernel's forward call
                extra.append("the error surfaced outside the kernel's forward call, so Hypothesis went on in the "
                             "broken context: this case may be a smaller one than the first that hit it (every "
                             "later example fails there); replay it in a fresh process to confirm")
        unreliable = unreliable_note(exc, leaf, own)
        if unreliable is not None:
            extra.append(unreliable)
        if len(leaves) > 1:
            fields["message"] = (f"distinct failure {i + 1} of {len(leaves)} ({exception_line(exc)})\n"
                                 + fields["message"])
        elif leaf is not exc:  # a group of one, e.g. Hypothesis's FlakyFailure: its own words come first
            fields["message"] = f"{exception_line(exc)}\n" + fields["message"]
        if extra:
            fields["message"] += "\n  " + "\n  ".join(extra)
        if not own:
            where = [f"flashverify: {fields['implementation']} [{fields['prop']}] case: {_case_text(fields['case'])}"
                     if fields.get("case") else "flashverify: no property example was running"]
            where.append(f"  replay: {fields['replay']}" if fields.get("replay")
                         else f"  no replay command: {fields.get('note')}")
            ctx = failing_context(leaf)
            if ctx is not None and oom is None and hasattr(ctx.case, "head_dim") and suite_raised_at(leaf) is None:
                where.append(declare_hint(leaf, case=ctx.case).strip())
            if oom is not None:
                where.insert(0, fields["message"])
            _add_note(leaf, "\n".join(where + [f"  {e}" for e in extra]))
        elif extra:
            _add_note(leaf, "\n".join(f"flashverify: {e}" for e in extra))
        out.append(fields)
    return out


def _case_text(case: dict) -> str:
    from reports.summary import describe_case

    return describe_case(case)


# --- the planned end of a process after a sticky CUDA error -----------------------------------------------

# Tests whose failure was a sticky CUDA error (seen by the pytest-xdist controller in their reports): the
# crash of the worker that ran them is the planned end of a poisoned process, not another failure.
_POISONED_TESTS: dict[str, str] = {}
_POISONED = "flashverify_poisoned"


def _poison(item, sticky, worker: str | None) -> str:
    """Mark this process poisoned by a sticky CUDA error (ended after the test: :func:`end_if_poisoned`)
    and say so."""
    from verify.faults import exception_line

    config = item.config
    if getattr(config, "_flashverify_poisoned", None) is None:
        config._flashverify_poisoned = {"test": item.nodeid, "error": exception_line(sticky)}
    then = ("this worker ends after the test and pytest-xdist runs its remaining tests in a fresh one"
            if worker else "the run stops after this test (a fresh process is needed: rerun, "
            "or use pytest -n to have workers replaced); the report is PARTIAL and lists the tests not run")
    return (f"sticky CUDA error ({exception_line(sticky)}): this process's CUDA context is unusable, every "
            f"later CUDA call in it would fail; {then}")


def tag_poisoned(item, rep) -> None:
    """The report of the test that poisoned this process carries its sticky error, for the controller
    (:func:`remember_poisoned`)."""
    poisoned = getattr(item.config, "_flashverify_poisoned", None)
    if poisoned is not None and poisoned["test"] == item.nodeid:
        rep.user_properties.append((_POISONED, poisoned["error"]))


def remember_poisoned(report) -> None:
    """pytest-xdist controller: remember the test that poisoned its worker (:func:`planned_worker_end`)."""
    for key, value in getattr(report, "user_properties", ()) or ():
        if key == _POISONED:
            _POISONED_TESTS[report.nodeid] = value


def planned_worker_end(crashitem, report, sched) -> None:
    """pytest-xdist controller: a worker that ended after a sticky CUDA error crashed "while running" the
    test that poisoned it, whose failure is already reported: the crash adds no second failure."""
    if crashitem not in _POISONED_TESTS:
        return
    report.outcome, report.when, report.longrepr = "passed", "teardown", None
    config = getattr(sched, "config", None)
    dsession = config.pluginmanager.get_plugin("dsession") if config is not None else None
    if isinstance(getattr(dsession, "_failed_nodes_count", None), int):
        # A planned end is not a crash: it must not count toward --max-worker-restart (4 x workers by
        # default), or a kernel that corrupts the context in every test would stop the run half-way.
        # pytest-xdist adds one for this node after this hook.
        dsession._failed_nodes_count -= 1
    reporter = config.pluginmanager.get_plugin("terminalreporter") if config is not None else None
    if reporter is not None:
        reporter.write_line(f"flashverify: the worker that ran {crashitem} ended after its sticky CUDA error "
                            f"({_POISONED_TESTS[crashitem]}); its remaining tests run in a fresh worker")


def end_if_poisoned(item, worker: str | None) -> None:
    """After a test whose failure was a sticky CUDA error (its reports written and sent): end this
    pytest-xdist worker, which pytest-xdist replaces, or without xdist stop the run (PARTIAL report)."""
    config = item.config
    poisoned = getattr(config, "_flashverify_poisoned", None)
    if poisoned is None or poisoned["test"] != item.nodeid:
        return
    report = config._flashverify_report
    items = list(item.session.items)
    not_run = items[items.index(item) + 1:] if item in items else []
    if worker:
        if report is not None:
            report.close(exitstatus=1)
        sys.stderr.write(f"\nflashverify: {worker} ends after a sticky CUDA error in {item.nodeid} "
                         f"({poisoned['error']}); pytest-xdist runs its remaining tests in a fresh worker\n")
        sys.stderr.flush()
        os._exit(3)
    config._flashverify_stopped = {"test": item.nodeid, "reason": f"sticky CUDA error: {poisoned['error']}",
                                   "not_run": [i.nodeid for i in not_run]}
    item.session.shouldfail = (f"flashverify: sticky CUDA error in {item.nodeid} ({poisoned['error']}): this "
                               f"process's CUDA context is unusable, so the run stops here; {len(not_run)} "
                               "test(s) not run (listed in the report)")
