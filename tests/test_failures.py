"""verify/failures.py: a failed test turned into the fields of its failure files, the out-of-memory wording,
and the planned end of a process after a sticky CUDA error; verify/replay.py's one replay command.

No pytest run here: fake items and reports stand in for pytest's (the whole runs are in tests/test_faults.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import shlex
import types

import pytest
import torch

import references.attention
from flashverify_kernels import _validate, registry
from references.spec import AttentionSpec
from reports import summary
from reports.failures import raised_by_suite
from strategies.cases import AttentionCase
from tests.fixtures.outside_kernels import attention
from tests.fixtures.raising_kernels import attention_raises_on_long_keys
from verify import failures, properties, replay
from verify.calls import run_backward
from verify.context import Context, PropertyFailure, TimeoutFailure
from verify.faults import OutOfMemoryError
from verify.runner import run_example

CASE = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=3, len_k=5, head_dim=4, dtype="float32",
                     spec=AttentionSpec(causal=False),
                     magnitude="normal", seed=1, layout="contiguous")
PROP = "out_matches_reference"
TEST = f"verify/test_forward.py::test_{PROP}[fa2_blocked-float32]"
STICKY = "CUDA error: an illegal memory access was encountered"


@pytest.fixture(scope="module")
def context():
    return Context(impl=registry.load("fa2_blocked", device="cpu"), prop=PROP, case=CASE)


def _item(*, params=None, nodeid=TEST, config=None):
    return types.SimpleNamespace(nodeid=nodeid, name=nodeid.split("::")[1], originalname=f"test_{PROP}",
                                 callspec=types.SimpleNamespace(params=params or {}),
                                 config=config or types.SimpleNamespace(_flashverify_budget=None))


def _raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback (raised here, outside any property)."""
    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001 - handed back to the test
        return raised


def _no_device():
    raise AssertionError("the device was asked for, but no replay command is built from Hypothesis's notes here")


def test_the_replay_command_runs_the_case_it_names(context, capsys):
    command = context.replay_command()
    assert command == replay.replay_command(impl="fa2_blocked", prop=PROP, case=CASE.to_dict(), device="cpu")
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "verify.replay"]
    assert replay.main(argv[3:]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "passed"


def test_a_kernel_exception_takes_the_case_of_the_example_it_left(context):
    def out_matches_reference(ctx, case):
        raise RuntimeError("kernel gave up")

    env = types.SimpleNamespace(device="cpu")
    try:
        run_example(out_matches_reference, context, CASE, env)
    except RuntimeError as exc:
        error = exc
    fields = failures.other_failure(_item(), error)
    message = fields.pop("message")
    assert fields == {"replay": context.replay_command(), "case": CASE.to_dict(), "prop": PROP,
                      "implementation": "fa2_blocked", "note": None}
    assert message.startswith("fa2_blocked: the kernel raised (not a wrong answer) at tests/test_failures.py:")
    assert message.endswith("\nRuntimeError: kernel gave up") and "declare its limits" in message


def _example_error(prop, ctx, case=CASE) -> Exception:
    """What ``prop`` raised on ``case`` as a property example (marked with its context)."""
    with pytest.raises(Exception) as info:
        run_example(prop, ctx, case, types.SimpleNamespace(device="cpu"))
    return info.value


def _line_of(fn, text: str) -> int:
    """The line of ``fn``'s source that holds ``text``."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_the_suite_raising_in_an_example_says_so_not_that_the_kernel_raised(context, monkeypatch):
    # The kernel's forward runs and returns; the suite's float64 reference then raises (its chunking budget broken).
    monkeypatch.setattr(references.attention, "DEFAULT_BUDGET_BYTES", 0)
    error = _example_error(properties.PROPERTIES[PROP], context)
    fields = failures.other_failure(_item(), error)
    message = fields.pop("message")
    assert fields == {"replay": context.replay_command(), "case": CASE.to_dict(), "prop": PROP,
                      "implementation": "fa2_blocked", "note": None}
    line = _line_of(references.attention.rows_per_chunk, 'raise ValueError(f"budget=')
    assert message == ("fa2_blocked: the suite itself raised (a bug in flashverify, not a verdict on the kernel) at "
                       f"references/attention.py:{line} (rows_per_chunk) on this case; please report it with the "
                       "replay command\nValueError: budget=0, but should be a positive number of bytes")
    assert summary.failure_kind({"message": message}) == "suite raised"

    # The terminal's note and the run's summary say it too, with the replay command and no hint to declare limits.
    (explained,) = failures.explain_failure(_item(), error, worker=None)
    assert explained["message"] == message and explained["replay"] == context.replay_command()
    assert error.__notes__[-1] == (f"flashverify: fa2_blocked [{PROP}] case: {failures._case_text(CASE.to_dict())}\n"
                                   f"  replay: {context.replay_command()}")
    assert summary.brief({"test": TEST, **explained})[1:3] == [
        f"  {message.splitlines()[0]}", "  ValueError: budget=0, but should be a positive number of bytes"]


def test_torch_raising_inside_the_suite_s_reference_is_the_suite_s(context):
    def out_matches_reference(ctx, case):
        t = case.build("cpu")
        references.attention.forward(t.q.to_sparse(), t.k, t.v, spec=case.spec)  # a property's own bug: torch raises

    message = failures.other_failure(_item(), _example_error(out_matches_reference, context))["message"]
    assert message.startswith("fa2_blocked: the suite itself raised (a bug in flashverify, not a verdict on the "
                              "kernel) at references/attention.py:")
    assert "declare its limits" not in message
    assert message.splitlines()[-1] == "NotImplementedError: Cannot access storage of SparseTensorImpl"


def test_a_kernel_raising_in_a_real_property_is_still_the_kernel_s(context):
    impl = registry.from_callable(attention_raises_on_long_keys, "raises", device="cpu")
    ctx = dataclasses.replace(context, impl=impl)
    case = dataclasses.replace(CASE, len_k=6)
    fields = failures.other_failure(_item(), _example_error(properties.PROPERTIES[PROP], ctx, case))
    assert fields["message"].startswith("raises: the kernel raised (not a wrong answer) at "
                                        "tests/fixtures/raising_kernels.py:")
    assert "declare its limits" in fields["message"] and fields["replay"] == ctx.replay_command()
    assert summary.failure_kind(fields) == "kernel raised"


def _breaks_its_graph(q, k, v, *, causal=False, scale=None):
    """Correct values, but a backward that cannot run: it modifies in place what autograd saved."""
    out, lse = attention(q, k, v, causal=causal, scale=scale)
    saved = out.exp()
    saved.mul_(1.0)
    return out + 0 * (saved - saved.detach()), lse


@pytest.mark.parametrize("how", ["out.backward", "gradcheck"])
def test_a_kernel_s_backward_raising_in_autograd_is_the_kernel_s_though_no_frame_of_it_is_left(context, how):
    # Autograd raises in C++: the innermost frame outside torch is the suite's call of the kernel's backward.
    ctx = dataclasses.replace(context, impl=registry.from_callable(_breaks_its_graph, "breaks", device="cpu"))

    def backward(ctx, case):  # the suite's out.backward(dout), in its stage("kernel") block
        t = case.build("cpu")
        run_backward(ctx, case, t.q, t.k, t.v, t.dout)

    if how == "gradcheck":  # torch.autograd.gradcheck's backward, called from the property itself
        error = _example_error(properties.PROPERTIES["gradcheck_float64"], ctx, dataclasses.replace(CASE, dtype="float64"))
    else:
        error = _example_error(backward, ctx)
    assert "modified by an inplace operation" in str(error)
    assert failures.other_failure(_item(), error)["message"].startswith("breaks: the kernel raised (not a wrong answer)")


def _module_at(path, source: str):
    """A module loaded from ``source`` written to ``path`` (its functions' frames name that file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"fake_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAKE = """
import torch
from verify.stages import stage

def raises():
    raise RuntimeError("raised here")

def torch_raises():
    return torch.nn.functional.softmax(torch.ones(2), dim=5)

def calls_the_kernel():
    with stage("kernel"):
        return torch.nn.functional.softmax(torch.ones(2), dim=5)
"""


@pytest.mark.parametrize("folder, suite", [("references", True), ("verify", True), ("strategies", True),
                                           ("reports", True), ("flashverify_kernels", False),
                                           ("tests/fixtures", False), ("my_kernels", False)])
def test_who_raised_is_the_innermost_frame_outside_the_libraries(tmp_path, folder, suite):
    module = _module_at(tmp_path / folder / "fake.py", FAKE)
    assert raised_by_suite(_error_of(module.raises), tmp_path) is suite
    assert raised_by_suite(_error_of(module.torch_raises), tmp_path) is suite  # torch's frames are left out
    assert raised_by_suite(_error_of(module.calls_the_kernel), tmp_path) is False  # the suite calling the kernel


def test_a_suite_error_raised_in_a_library_names_the_suite_s_line_and_the_library_s(context, tmp_path, monkeypatch):
    module = _module_at(tmp_path / "references" / "fake.py", FAKE)
    monkeypatch.setattr(failures, "ROOT", tmp_path)
    message = failures.other_failure(_item(), _example_error(lambda ctx, case: module.torch_raises(), context))["message"]
    line = _line_of(module.torch_raises, "softmax")
    assert message.startswith("fa2_blocked: the suite itself raised (a bug in flashverify, not a verdict on the kernel) "
                              f"at references/fake.py:{line} (torch_raises), inside torch/nn/functional.py:")
    assert "(softmax) on this case; please report it with the replay command\n" in message


def _error_of(fn) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_the_real_suite_and_the_kernels_validation_are_told_apart(monkeypatch):
    root = failures.ROOT
    assert raised_by_suite(_error_of(lambda: references.attention.expand_kv(torch.zeros(1, 2, 1, 1), 3)), root)
    assert raised_by_suite(_error_of(lambda: references.attention.rows_per_chunk(5, 4, 1, budget=0)), root)
    assert not raised_by_suite(_error_of(lambda: _validate.check_window("both", kernel="fa2")), root)
    assert not raised_by_suite(RuntimeError("never raised: no traceback"), root)
    # A sticky CUDA error surfaces wherever the device is next waited for: the suite's frame does not own it.
    monkeypatch.setenv(references.attention.CHUNK_ROWS_ENV, STICKY)
    sticky = _error_of(lambda: references.attention.rows_per_chunk(5, 4, 1))
    assert raised_by_suite(sticky, root) and failures.suite_raised_at(sticky) is None


def test_an_exception_no_example_marked_names_where_it_was_raised_and_no_case(context):
    error = _raised(RuntimeError("kernel gave up"))
    error.add_note(f"Draw 1 (case): {CASE!r}")  # Hypothesis's notes are not read: the example marks its own
    fields = failures.other_failure(_item(params={"impl": context.impl}), error)
    assert fields["case"] is None and fields["replay"] is None and fields["implementation"] == "fa2_blocked"
    assert fields["note"].startswith("it was raised outside any property example, at tests/test_failures.py:")


def test_a_failure_outside_the_test_body_keeps_the_suite_s_own_failure_or_says_where_it_happened(context):
    timeout = TimeoutFailure("Timeout: the test did not finish", ctx=context)
    fields = failures.outside_call_fields(BaseExceptionGroup("while tearing down", [timeout]), "teardown")
    assert fields == {"message": "Timeout: the test did not finish", "replay": context.replay_command(),
                      "case": CASE.to_dict(), "prop": PROP, "implementation": "fa2_blocked"}
    fields = failures.outside_call_fields(ValueError("fixture broke"), "setup")
    assert fields["message"] == "ValueError: fixture broke" and fields["case"] is None and fields["replay"] is None
    assert fields["note"] == "the failure happened in the test's setup, outside any drawn example"


def test_each_distinct_failure_gets_its_fields_and_the_hypothesis_blob_is_dropped(context):
    try:
        context.fail("out is wrong")
    except PropertyFailure as exc:
        own = exc
    kernel = _raised(RuntimeError("kernel gave up"))
    kernel.add_note("@reproduce_failure('6.0.0', b'AAAA')")
    group = ExceptionGroup("Hypothesis found 2 distinct failures.", [own, kernel])
    first, second = failures.explain_failure(_item(), group, worker=None)
    assert first["message"].startswith("distinct failure 1 of 2 (ExceptionGroup: Hypothesis found 2 distinct "
                                       "failures.")
    assert "out is wrong" in first["message"] and first["replay"] == context.replay_command()
    assert first["case"] == CASE.to_dict()
    assert second["message"].startswith("distinct failure 2 of 2")
    assert "RuntimeError: kernel gave up" in second["message"]
    assert "@reproduce_failure" not in second["message"] and second["replay"] is None
    assert not any("@reproduce_failure" in n for n in kernel.__notes__)
    assert kernel.__notes__[-1].startswith("flashverify: no property example was running\n  no replay command: "
                                           "it was raised outside any property example, at tests/test_failures.py:")


def test_out_of_memory_is_found_where_it_was_raised_and_blamed_on_the_kernel_outside_references():
    def backward():
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    try:
        try:
            backward()
        except OutOfMemoryError as exc:
            raise RuntimeError("backward failed") from exc
    except RuntimeError as exc:
        outer = exc
    oom = failures.out_of_memory(ExceptionGroup("1 distinct failure", [outer]))
    assert isinstance(oom, OutOfMemoryError) and oom is outer.__cause__
    assert failures.out_of_memory(_raised(RuntimeError("no memory problem"))) is None
    assert not failures.raised_in_references(oom)
    message = failures.out_of_memory_message(_item(), oom, {"implementation": "fa2_blocked", "prop": PROP})
    assert message.startswith("fa2_blocked: the kernel (or the check around it) ran out of device memory "
                              "(torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB, raised in "
                              "tests/test_failures.py:")
    assert message.endswith(f"(backward)); the device memory was released and the run goes on\n  property: {PROP}")


def test_a_sticky_cuda_error_marks_the_worker_and_its_planned_end_is_no_second_failure():
    nodeid = f"{TEST}#sticky"
    config = types.SimpleNamespace(_flashverify_budget=None)
    item = _item(nodeid=nodeid, config=config)
    (fields,) = failures.explain_failure(item, _raised(RuntimeError(STICKY)), worker="gw1")
    assert config._flashverify_poisoned == {"test": nodeid, "error": f"RuntimeError: {STICKY}"}
    assert ("this process's CUDA context is unusable, every later CUDA call in it would fail; this worker ends "
            "after the test and pytest-xdist runs its remaining tests in a fresh one") in fields["message"]

    # The controller sees the poisoned test's report, then the crash of its worker.
    rep = types.SimpleNamespace(nodeid=nodeid, user_properties=[])
    failures.tag_poisoned(item, rep)
    failures.tag_poisoned(_item(nodeid=f"{TEST}#other", config=config), rep)  # not the poisoned test: no tag
    assert len(rep.user_properties) == 1
    failures.remember_poisoned(rep)
    lines, dsession = [], types.SimpleNamespace(_failed_nodes_count=1)
    plugins = {"dsession": dsession, "terminalreporter": types.SimpleNamespace(write_line=lines.append)}
    manager = types.SimpleNamespace(get_plugin=plugins.get)
    sched = types.SimpleNamespace(config=types.SimpleNamespace(pluginmanager=manager))
    crash = types.SimpleNamespace(outcome="failed", when="???", longrepr="worker 'gw1' crashed")
    failures.planned_worker_end(nodeid, crash, sched)
    assert (crash.outcome, crash.when, crash.longrepr, dsession._failed_nodes_count) == ("passed", "teardown", None, 0)
    assert lines == [f"flashverify: the worker that ran {nodeid} ended after its sticky CUDA error (RuntimeError: "
                     f"{STICKY}); its remaining tests run in a fresh worker"]
    other = types.SimpleNamespace(outcome="failed", when="???", longrepr="worker 'gw0' crashed")
    failures.planned_worker_end(f"{TEST}#other", other, sched)  # a real crash stays one
    assert other.outcome == "failed" and dsession._failed_nodes_count == 0


def test_without_xdist_a_sticky_cuda_error_stops_the_run_after_its_test():
    config = types.SimpleNamespace(_flashverify_budget=None, _flashverify_report=None)
    session = types.SimpleNamespace(items=[], shouldfail=False)
    items = [_item(nodeid=f"{TEST}#{i}", config=config) for i in range(3)]
    for item in items:
        item.session = session
    session.items = items
    failures.end_if_poisoned(items[1], None)  # nothing poisoned the process: the run goes on
    assert session.shouldfail is False
    (fields,) = failures.explain_failure(items[1], _raised(RuntimeError(STICKY)), worker=None)
    assert "the run stops after this test" in fields["message"]
    failures.end_if_poisoned(items[0], None)  # not the test that poisoned it
    assert session.shouldfail is False
    failures.end_if_poisoned(items[1], None)
    assert config._flashverify_stopped == {"test": items[1].nodeid, "not_run": [items[2].nodeid],
                                           "reason": f"sticky CUDA error: RuntimeError: {STICKY}"}
    assert session.shouldfail.startswith(f"flashverify: sticky CUDA error in {items[1].nodeid}")
    assert session.shouldfail.endswith("1 test(s) not run (listed in the report)")


def test_a_flaky_failure_says_the_case_did_not_fail_again_and_what_that_means(context):
    from hypothesis.errors import FlakyFailure

    def out_matches_reference(ctx, case):
        raise RuntimeError("LoweringException: NoValidChoicesError")

    try:
        run_example(out_matches_reference, context, CASE, types.SimpleNamespace(device="cpu"))
    except RuntimeError as exc:
        kernel = exc
    flaky = FlakyFailure("Hypothesis test_x(data=...) produces unreliable results: Failed on the first call but did "
                         "not on a subsequent one", [kernel])
    (fields,) = failures.explain_failure(_item(), flaky, worker=None)
    assert fields["message"].startswith("hypothesis.errors.FlakyFailure: Hypothesis test_x(data=...) produces "
                                        "unreliable results")
    assert "the kernel did not raise the same way: the RuntimeError depends on what ran before it" in fields["message"]
    assert "the replay command alone may pass" in fields["message"]
    assert fields["replay"] == context.replay_command() and fields["case"] == CASE.to_dict()
    assert any("depends on what ran before it" in n for n in kernel.__notes__)

    try:
        context.fail("out is wrong")
    except PropertyFailure as exc:
        own = exc
    (fields,) = failures.explain_failure(_item(), FlakyFailure("unreliable", [own]), worker=None)
    assert "the kernel's result for the same input changed from one call to the next" in fields["message"]
    assert fields["replay"] == context.replay_command()

    # any other group of one: no such words
    (fields,) = failures.explain_failure(_item(), ExceptionGroup("one", [_raised(RuntimeError("x"))]), worker=None)
    assert "Hypothesis ran this case again" not in fields["message"]
