"""The flashverify pytest plugin: ``--impl``, ``--report-dir``, ``--device``, the report header and the
report hooks.

The installed package registers this module as a pytest plugin (entry point ``pytest11``), so
``pytest --pyargs verify`` runs the suite from any directory; the repository's ``conftest.py`` loads it
only when the package is not installed. Hypothesis profiles and size limits: ``verify/profiles.py``.

Time limit: a ``pytest verify`` run gives every test (one property of one implementation in one dtype:
all its Hypothesis examples, Triton compilations included) ``DEFAULT_TIMEOUT`` = 900 s, through
pytest-timeout. ``--timeout SECONDS`` (pytest-timeout's own option, or its ``PYTEST_TIMEOUT`` variable or
``timeout`` ini key) replaces it, ``--timeout 0`` turns it off; runs that collect no ``verify`` tests
(``pytest tests``) get no default. A test past its limit fails with a :class:`verify.harness.TimeoutFailure`
naming the case that was running and its replay command, its failure file is written, and the run goes
on. A hang Python cannot interrupt (a GPU kernel that never finishes: the host waits in native code) is
caught by a watchdog a grace period later (10% of the limit, 5 to 60 s), which writes the failure file
and the summary and then ends the process (pytest-timeout's thread method; under pytest-xdist the
worker is replaced and the run goes on).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kernels import registry as kernel_registry  # noqa: E402
from strategies.attention import Limits  # noqa: E402
from verify import gpu  # noqa: E402
from verify.profiles import limits_for, profile_name  # noqa: E402

DEFAULT_REPORT_DIR = "flashverify-report"
# Per-test time limit of `pytest verify` runs (seconds): a test runs up to hundreds of Hypothesis
# examples, and on a GPU its first examples compile Triton kernels.
DEFAULT_TIMEOUT = 900.0

def pytest_addoption(parser):
    group = parser.getgroup("flashverify")
    group.addoption("--impl", action="append", default=[], metavar="IMPL",
                    help="implementation to verify: a registry name, package.module:attr or "
                         "path/to/file.py:attr (repeatable; default: every shipped implementation "
                         "that runs on the device)")
    group.addoption("--report-dir", default=DEFAULT_REPORT_DIR, metavar="DIR",
                    help=f"where the error report is written (default: ./{DEFAULT_REPORT_DIR})")
    group.addoption("--device", default=None, metavar="DEVICE",
                    help="device for the inputs: cpu or cuda[:N] (default: cuda if available, else cpu)")
    group.addoption("--no-report", action="store_true", default=False, help="write no report")
    group.addoption("--gpu-memory", type=float, default=None, metavar="GIB",
                    help="use at most GIB of each GPU's memory (emulates a smaller card); the workers of "
                         "pytest -n on one GPU share it (default: the GPU's free memory at the start)")


def _profile(config) -> str:
    return profile_name(config)


def _device(config) -> str:
    dev = _xdist_worker_device(config, config.getoption("--device"))
    if dev is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(dev)
    except (RuntimeError, TypeError) as exc:
        raise pytest.UsageError(f"--device {dev!r} is not a torch device ({exc}); use cpu or cuda[:N]") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {dev} was asked for, but torch sees no CUDA device")
    if parsed.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device {dev}: only cpu and cuda devices are supported")
    return dev


def _xdist_worker(config) -> str | None:
    """This process's pytest-xdist worker id (``gw0``, ...), or None in the controller or without xdist.

    Read from the worker's config, not from ``PYTEST_XDIST_WORKER``: a ``pytest verify`` started as a
    subprocess by a test running under xdist inherits that variable without being a worker.
    """
    return getattr(config, "workerinput", {}).get("workerid")


def _xdist_worker_device(config, dev: str | None) -> str | None:
    """Under pytest-xdist with several GPUs, worker ``gwN`` runs on ``cuda:(N mod device count)`` when the
    device is unset or a bare ``cuda`` (and makes it the current CUDA device, which kernels that launch
    on the current device, like Triton's, use). Any other ``--device`` is kept as given."""
    worker = _xdist_worker(config) or ""
    if dev not in (None, "cuda") or not worker.startswith("gw") or not worker[2:].isdigit():
        return dev
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return dev
    index = int(worker[2:]) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def _xdist_controller(config) -> bool:
    """True in the controller of a pytest-xdist run (it hands tests to workers and runs none itself)."""
    return (_xdist_worker(config) is None and bool(getattr(config.option, "numprocesses", None))
            and getattr(config.option, "dist", "no") != "no")


def _workers(config) -> int:
    """How many processes run tests: pytest-xdist's worker count, else 1."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return int(workerinput.get("workercount") or os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return int(config.option.numprocesses) if _xdist_controller(config) else 1


def _spread(config) -> bool:
    """Whether pytest-xdist workers are spread over the GPUs, one GPU each (:func:`_xdist_worker_device`)."""
    return (config.getoption("--device") in (None, "cuda") and torch.cuda.is_available()
            and torch.cuda.device_count() >= 2)


_MEMORY_AT_START = "flashverify_memory_at_start"


def _memory_at_start(config, index: int) -> tuple[int, int]:
    """``(free, total)`` bytes of CUDA device ``index`` when the run started: measured once by the
    process that starts the run and handed to pytest-xdist workers (:func:`pytest_configure_node`),
    so a worker that replaces a crashed one gets the same budget as the others."""
    given = getattr(config, "workerinput", {}).get(_MEMORY_AT_START) or {}
    if str(index) not in given:
        given = config.__dict__.setdefault("_flashverify_memory_at_start", {})
        if str(index) not in given:
            given[str(index)] = list(gpu.memory_at_start(index))
    free, total = given[str(index)]
    return int(free), int(total)


def _gpu_budget(config) -> gpu.Budget | None:
    """This process's share of its GPU's memory (``verify/gpu.py``), applied to its allocator; None on
    CPU. In the controller of a pytest-xdist run: what each worker on that GPU gets (applied there)."""
    if hasattr(config, "_flashverify_budget"):
        return config._flashverify_budget
    device = torch.device(_device(config))
    cap = config.getoption("--gpu-memory")
    budget = None
    if device.type != "cuda":
        if cap is not None:
            raise pytest.UsageError(f"--gpu-memory {cap:g} was given, but the run is on {device} "
                                    f"({'no CUDA device is visible' if not torch.cuda.is_available() else '--device'}):"
                                    " it caps GPU memory only")
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = _memory_at_start(config, index)
        sharing = gpu.workers_on_device(device=index, workers=_workers(config),
                                        device_count=torch.cuda.device_count(), spread=_spread(config))
        try:
            budget = gpu.plan_budget(device=index, total_bytes=total, free_bytes=free, workers=sharing,
                                     gpu_memory_gib=cap)
        except gpu.BudgetError as exc:
            raise pytest.UsageError(str(exc)) from None
        if not _xdist_controller(config):
            gpu.apply_budget(budget)
    config._flashverify_budget = budget
    return budget


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist controller, before each worker starts: hand it the free memory of each GPU at the
    start of the run (:func:`_memory_at_start`)."""
    config = node.config
    if node.workerinput.get(_MEMORY_AT_START) or not _collects_verify(config):
        return
    device = torch.device(_device(config))
    if device.type != "cuda":
        return
    if _spread(config):
        indices = range(torch.cuda.device_count())
    else:
        indices = [device.index if device.index is not None else torch.cuda.current_device()]
    for index in indices:
        _memory_at_start(config, index)
    node.workerinput[_MEMORY_AT_START] = dict(config._flashverify_memory_at_start)


def _selection(config):
    cached = getattr(config, "_flashverify_selection", None)
    if cached is not None:
        return cached
    device = _device(config)
    specs = config.getoption("--impl")
    if specs:
        try:
            impls = [kernel_registry.load(spec, device=device) for spec in specs]
        except kernel_registry.ImplementationError as exc:
            raise pytest.UsageError(str(exc)) from None
    else:
        impls = kernel_registry.default_selection(device=device)
    config._flashverify_selection = impls
    return impls


def pytest_cmdline_main(config):
    """Give `pytest verify` runs the default per-test time limit unless one was asked for (this runs
    before pytest-timeout reads its settings in pytest_configure, in the controller and in every
    pytest-xdist worker)."""
    if not hasattr(config.option, "timeout") or not _collects_verify(config):
        return None  # pytest-timeout not installed (or disabled with -p no:timeout), or not a verify run
    if config.option.timeout is None and not os.environ.get("PYTEST_TIMEOUT") and not config.getini("timeout"):
        config.option.timeout = DEFAULT_TIMEOUT
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "requires(feature): the property needs a declared capability")
    if torch.device(_device(config)).type == "cpu":
        # The suite's tensors are small: one intra-op thread is several times faster than many
        # (thread start-up dominates), and pytest-xdist workers then share the cores cleanly.
        torch.set_num_threads(int(os.environ.get("FLASHVERIFY_CPU_THREADS", "1")))
    if _collects_verify(config):
        _gpu_budget(config)  # validates --gpu-memory; caps this process's allocator before any test
    config._flashverify_report = None
    worker = _xdist_worker(config) or "main"
    if not config.getoption("--no-report") and _collects_verify(config):
        from reports.session import ReportSession, clear_report_dir

        if worker == "main":
            clear_report_dir(config.getoption("--report-dir"))

        from reports.session import command_line

        config._flashverify_report = ReportSession(
            config.getoption("--report-dir"), worker=worker,
            header={**_header_data(config), "command": command_line(config.invocation_params.args)})


def _collects_verify(config) -> bool:
    args = [str(a) for a in config.args] or [str(p) for p in config.getini("testpaths")]
    return any("verify" in Path(a.split("::")[0]).parts or a.startswith("verify") for a in args)


def _header_data(config) -> dict:
    device = _device(config)
    impls = _selection(config)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import hypothesis

    return {
        "implementations": [{"name": i.name, "kind": i.kind, "spec": i.cli_name, "description": i.description,
                             "dtypes": [str(d).removeprefix("torch.") for d in i.dtypes],
                             "causal_alignment": i.causal_alignment, "gqa": i.gqa, "tunable": i.tunable,
                             "backward": i.backward is not None, "deterministic": i.deterministic}
                            for i in impls],
        "device": device,
        "device_name": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else platform.processor() or platform.machine(),
        "profile": _profile(config),
        "limits": dataclasses.asdict(_limits(config)),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
                     "hypothesis": hypothesis.__version__},
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "memory_budget": (budget.to_dict() if _collects_verify(config) and (budget := _gpu_budget(config))
                          else None),
    }


def _limits(config) -> Limits:
    """The profile's size limits, fitted on a GPU to this worker's memory budget (``verify/gpu.py``)."""
    limits = limits_for(torch.device(_device(config)).type, _profile(config))
    budget = _gpu_budget(config) if _collects_verify(config) else None
    if budget is None:
        return limits
    try:
        return gpu.limits_within(limits, budget, from_budget=_profile(config) == "gpu")
    except gpu.BudgetError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config):
    data = _header_data(config)
    lines = [f"flashverify: device={data['device']} ({data['device_name']}), profile={data['profile']}, "
             f"max_len={data['limits']['max_len']}, max_head_dim={data['limits']['max_head_dim']}",
             "flashverify: versions " + ", ".join(f"{k} {v}" for k, v in data["versions"].items())
             + (", TRITON_INTERPRET=1" if data["triton_interpret"] else "")]
    budget = _gpu_budget(config) if _collects_verify(config) else None
    if budget is not None:
        lines.append(f"flashverify: memory budget {budget.describe()}, max_scores={data['limits']['max_scores']}")
    for impl in data["implementations"]:
        caps = [impl["kind"], "/".join(impl["dtypes"]), f"causal {impl['causal_alignment']}"]
        caps += [c for c, on in (("gqa", impl["gqa"]), ("tunable blocks", impl["tunable"]),
                                 ("backward+delta", impl["backward"])) if on]
        lines.append(f"flashverify: under test {impl['spec']}: {', '.join(caps)}")
    report = config._flashverify_report
    if report is not None:
        lines.append(f"flashverify: report -> {report.dir}")
    return lines


def pytest_generate_tests(metafunc):
    impls = _selection(metafunc.config)
    if "impl" in metafunc.fixturenames:
        chosen = [i for i in impls if i.kind == "attention"]
        metafunc.parametrize("impl", chosen, ids=[i.name for i in chosen])
    if "softmax_impl" in metafunc.fixturenames:
        chosen = [i for i in impls if i.kind == "softmax"]
        metafunc.parametrize("softmax_impl", chosen, ids=[i.name for i in chosen])


def pytest_collection_modifyitems(session, config, items):
    """Forward properties before backward ones (the first failure shown is the simplest verdict), and
    every test tagged with the implementation it calls, or as a law that calls none (verify/outcomes.py)."""
    from verify import outcomes

    for item in items:
        item.user_properties.extend(outcomes.tags(getattr(getattr(item, "callspec", None), "params", {})))
    items.sort(key=lambda item: outcomes.module_rank(item.path))  # stable: each module keeps its order


def pytest_sessionstart(session):
    """Call each selected attention implementation once on a tiny case (verify/preflight.py) before any
    property runs: a kernel that cannot be called as the contract says is one usage error, not dozens
    of identical failures. Runs once, in the controller (not in pytest-xdist workers)."""
    config = session.config
    if _xdist_worker(config) or not _collects_verify(config):
        return
    from verify.preflight import PreflightError, preflight

    device = _device(config)
    for impl in _selection(config):
        try:
            preflight(impl, device=device)
        except PreflightError as exc:
            raise pytest.UsageError(f"{exc}\n  (--impl {impl.cli_name}; no property was run)") from None


@pytest.fixture(scope="session")
def env(request):
    from verify.runner import Env

    config = request.config
    report = config._flashverify_report
    return Env(device=_device(config), profile=_profile(config), limits=_limits(config),
               record=report.record if report is not None else (lambda _m: None),
               seed=config.getoption("hypothesis_seed", default=None),
               coverage=report.coverage if report is not None else (lambda _m: None))


def _property_failures(exc):
    from verify.harness import PropertyFailure, StickyDeviceError, TimeoutFailure

    if isinstance(exc, (PropertyFailure, StickyDeviceError, TimeoutFailure)):
        yield exc
    for sub in getattr(exc, "exceptions", ()) or ():
        yield from _property_failures(sub)


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


def _out_of_memory(exc):
    """The ``torch.OutOfMemoryError`` in ``exc`` (itself, in an exception group, or what it was raised
    from), or None."""
    from verify.gpu import exception_chain
    from verify.harness import OutOfMemoryError

    return next((e for e in exception_chain(exc) if isinstance(e, OutOfMemoryError)), None)


# What Hypothesis adds to a failure that is about the suite, not the kernel: its reproduction blob (the
# failure file's replay command replays the case) and its explain phase's lines of the suite's own files.
_HYPOTHESIS_NOISE = ("@reproduce_failure(", "Explanation:")


def _drop_hypothesis_noise(exc) -> None:
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        notes[:] = [n for n in notes if not any(mark in str(n) for mark in _HYPOTHESIS_NOISE)]


def _add_note(exc, text: str) -> None:
    """Add ``text`` to ``exc``'s notes (pytest prints them under the exception)."""
    try:
        exc.__notes__ = [*(getattr(exc, "__notes__", None) or []), text]
    except (AttributeError, TypeError):  # an exception type that takes no attributes
        pass


_FAILURES = pytest.StashKey[list]()
# Tests whose failure was a sticky CUDA error (seen by the pytest-xdist controller in their reports): the
# crash of the worker that ran them is the planned end of a poisoned process, not another failure.
_POISONED_TESTS: dict[str, str] = {}
_POISONED = "flashverify_poisoned"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Around each test body: on a GPU, its peak memory into the report and the cache emptied after it;
    on a failure, the fields of one failure file per distinct failure (:func:`_explain_failure`)."""
    item.stash[_FAILURES] = []
    budget = getattr(item.config, "_flashverify_budget", None)
    started = time.monotonic()
    if budget is not None:
        gpu.start_test(budget.device)
    try:
        return (yield)
    except (KeyboardInterrupt, SystemExit, pytest.skip.Exception, pytest.xfail.Exception, pytest.exit.Exception):
        raise
    except BaseException as exc:
        if _collects_verify(item.config):  # the suite's own tests, not another project's that has it installed
            _skip_if_the_suite_ran_out_of_memory(item, exc)
            item.stash[_FAILURES] = _explain_failure(item, exc)
        raise
    finally:
        if budget is not None and getattr(item.config, "_flashverify_poisoned", None) is None:
            _record_peak_memory(item, budget, time.monotonic() - started)


def _record_peak_memory(item, budget, seconds: float) -> None:
    """The test's peak allocated device memory and its wall time into the report (``memory-<worker>.jsonl``,
    written as each test ends, so a run cut by a time limit still says where its time went); the cache
    emptied."""
    try:
        peak = gpu.end_test(budget.device)
    except Exception as exc:  # noqa: BLE001 - a device that cannot say must not replace the test's outcome
        peak = None
        sys.stderr.write(f"flashverify: no peak memory for {item.nodeid}: {type(exc).__name__}: {exc}\n")
    report = item.config._flashverify_report
    if report is None or peak is None:
        return
    params = getattr(getattr(item, "callspec", None), "params", {})
    impl = params.get("impl") or params.get("softmax_impl")
    report.memory({"test": item.nodeid, "implementation": getattr(impl, "name", None),
                   "property": getattr(item, "originalname", item.name).removeprefix("test_"),
                   "dtype": params.get("dtype"), "device": f"cuda:{budget.device}", "peak_bytes": peak,
                   "budget_bytes": budget.worker_bytes, "seconds": round(seconds, 3)})


def _skip_if_the_suite_ran_out_of_memory(item, exc) -> None:
    """Every failure in ``exc`` is the suite's own float64 work (references/: reference, baseline,
    bounds) running out of device memory: skip the test with the reason, not a kernel failure."""
    leaves = list(_leaves(exc))
    ooms = [_out_of_memory(leaf) for leaf in leaves]
    if not ooms or not all(o is not None and _raised_in_references(o) for o in ooms):
        return
    import traceback

    from verify.harness import release_out_of_memory

    fields = _other_failure(item, leaves[0])
    reason = _out_of_memory_message(item, ooms[0], fields)
    traceback.clear_frames(exc.__traceback__)
    for o in ooms:
        release_out_of_memory(o)
    raise pytest.skip.Exception(reason, _use_item_location=True) from None


def _explain_failure(item, exc) -> list[dict]:
    """The failure-file fields of each distinct failure in ``exc`` (each with its case and replay
    command, or a note saying where it happened outside a drawn example), and the terminal to match:
    a replay line added to every exception that has none, Hypothesis's reproduction blob and
    explanation dropped, a sticky CUDA error named (and the process marked poisoned)."""
    from verify.harness import PropertyFailure, StickyDeviceError, TimeoutFailure, exception_line

    leaves = list(_leaves(exc))
    _drop_hypothesis_noise(exc)
    budget = getattr(item.config, "_flashverify_budget", None)
    out = []
    for i, leaf in enumerate(leaves):
        _drop_hypothesis_noise(leaf)
        own = isinstance(leaf, (PropertyFailure, StickyDeviceError, TimeoutFailure))
        fields = _failure_fields(leaf) if own else _other_failure(item, leaf)
        if own and not fields.get("replay"):
            fields["note"] = "no property example was running (the failure happened drawing or shrinking cases)"
        oom = None if own else _out_of_memory(leaf)
        extra = []
        if oom is not None:
            fields["message"] = _out_of_memory_message(item, oom, fields)
        if (oom is not None or (own and "ran out of device memory" in str(leaf))) and budget is not None:
            extra.append(f"this worker's memory budget is {budget.describe()}; the case was drawn to fit it, so "
                         "the kernel's out-of-memory error is the kernel's")
        sticky = gpu.sticky_cuda_error(leaf)
        if sticky is not None:
            extra.append(_poison(item, sticky))
            if not isinstance(leaf, StickyDeviceError):  # raised outside the kernel's forward call
                extra.append("the error surfaced outside the kernel's forward call, so Hypothesis went on in the "
                             "broken context: this case may be a smaller one than the first that hit it (every "
                             "later example fails there); replay it in a fresh process to confirm")
        if len(leaves) > 1:
            fields["message"] = (f"distinct failure {i + 1} of {len(leaves)} ({exception_line(exc)})\n"
                                 + fields["message"])
        elif leaf is not exc:  # a group of one, e.g. Hypothesis's FlakyFailure: its own words come first
            fields["message"] = f"{exception_line(exc)}\n" + fields["message"]
        if extra:
            fields["message"] += "\n  " + "\n  ".join(extra)
        if not own:
            where = [f"flashverify: {fields['implementation']} [{fields['prop']}] case: {_case_text(fields['case'])}"
                     if fields.get("case") else "flashverify: no drawn case"]
            where.append(f"  replay: {fields['replay']}" if fields.get("replay")
                         else f"  no replay command: {fields.get('note')}")
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


def _poison(item, sticky) -> str:
    """Mark this process poisoned by a sticky CUDA error (ended after the test: :func:`pytest_runtest_protocol`)
    and say so."""
    from verify.harness import exception_line

    config = item.config
    if getattr(config, "_flashverify_poisoned", None) is None:
        config._flashverify_poisoned = {"test": item.nodeid, "error": exception_line(sticky)}
    then = ("this worker ends after the test and pytest-xdist runs its remaining tests in a fresh one"
            if _xdist_worker(config) else "the run stops after this test (a fresh process is needed: rerun, "
            "or use pytest -n to have workers replaced); the report is PARTIAL and lists the tests not run")
    return (f"sticky CUDA error ({exception_line(sticky)}): this process's CUDA context is unusable, every "
            f"later CUDA call in it would fail; {then}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or call.excinfo is None:
        return
    exc = call.excinfo.value
    oom = _out_of_memory(exc)
    report = item.config._flashverify_report
    try:
        if rep.when != "call":  # a fixture, or the time limit, failed the test outside its body
            failures = list(_property_failures(exc))
            if report is not None:
                fields = _failure_fields(failures[0]) if failures else {
                    "message": _exception_text(exc), "replay": None, "case": None, "prop": None,
                    "implementation": None,
                    "note": f"the failure happened in the test's {rep.when}, outside any drawn example"}
                report.failure(test=f"{item.nodeid} ({rep.when})", **fields)
            return
        failures = item.stash.get(_FAILURES, None) or (_explain_failure(item, exc) if report is not None else [])
        for i, fields in enumerate(failures if report is not None else ()):
            report.failure(test=item.nodeid + (f"#{i}" if i else ""), **fields)
        poisoned = getattr(item.config, "_flashverify_poisoned", None)
        if poisoned is not None and poisoned["test"] == item.nodeid:
            rep.user_properties.append((_POISONED, poisoned["error"]))
    finally:
        if oom is not None:  # the report is written: drop the tensors the tracebacks hold, then the cache
            import traceback

            from verify.harness import release_out_of_memory

            if exc is not oom:
                traceback.clear_frames(exc.__traceback__)
            release_out_of_memory(oom)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """After a test whose failure was a sticky CUDA error (its reports written and sent): end this
    pytest-xdist worker, which pytest-xdist replaces, or without xdist stop the run (PARTIAL report)."""
    result = yield
    poisoned = getattr(item.config, "_flashverify_poisoned", None)
    if poisoned is not None and poisoned["test"] == item.nodeid:
        _end_poisoned_process(item, poisoned)
    return result


def _end_poisoned_process(item, poisoned: dict) -> None:
    config = item.config
    report = config._flashverify_report
    items = list(item.session.items)
    not_run = items[items.index(item) + 1:] if item in items else []
    if _xdist_worker(config):
        if report is not None:
            report.close(exitstatus=1)
        sys.stderr.write(f"\nflashverify: {_xdist_worker(config)} ends after a sticky CUDA error in {item.nodeid} "
                         f"({poisoned['error']}); pytest-xdist runs its remaining tests in a fresh worker\n")
        sys.stderr.flush()
        os._exit(3)
    config._flashverify_stopped = {"test": item.nodeid, "reason": f"sticky CUDA error: {poisoned['error']}",
                                   "not_run": [i.nodeid for i in not_run]}
    item.session.shouldfail = (f"flashverify: sticky CUDA error in {item.nodeid} ({poisoned['error']}): this "
                               f"process's CUDA context is unusable, so the run stops here; {len(not_run)} "
                               "test(s) not run (listed in the report)")


# Tests with an outcome (pytest-xdist controller): any other collected test never ran (:func:`_never_ran`).
_REPORTED: set[str] = set()


def pytest_runtest_logreport(report):
    """pytest-xdist controller: remember the tests that poisoned their worker (:func:`pytest_handlecrashitem`)
    and the tests that got an outcome."""
    for key, value in getattr(report, "user_properties", ()) or ():
        if key == _POISONED:
            _POISONED_TESTS[report.nodeid] = value
    if report.when in ("call", "???") or (report.when == "setup" and not report.passed):
        _REPORTED.add(report.nodeid)


def _never_ran(session) -> dict | None:
    """pytest-xdist controller: the collected tests that never got an outcome (pytest-xdist stopped
    replacing crashed workers, or ended early for another reason than -x), as the report's ``stopped``."""
    dsession = session.config.pluginmanager.get_plugin("dsession")
    collection = getattr(getattr(dsession, "sched", None), "collection", None)
    if not collection or session.shouldfail or session.shouldstop:
        return None  # nothing was distributed, or -x / --maxfail stopped the run (its exit status says so)
    missing = [nodeid for nodeid in collection if nodeid not in _REPORTED]
    if not missing:
        return None
    why = getattr(dsession, "_summary_report", None) or "pytest-xdist ended before every test ran"
    return {"test": None, "reason": f"pytest-xdist: {why}", "not_run": missing}


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
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


def _failure_fields(f) -> dict:
    return {"message": str(f), "replay": f.replay, "case": f.case.to_dict() if hasattr(f.case, "to_dict") else None,
            "prop": f.prop, "implementation": f.impl}


def _exception_text(exc) -> str:
    from reports.failures import exception_text

    return exception_text(exc)


def _raised_in_references(oom) -> bool:
    """Whether ``oom`` was raised by the suite's own float64 work (the innermost frame outside torch is in
    references/: the reference, the eager baseline, the bounds)."""
    return _raised_where(oom)[1]


def _raised_where(oom) -> tuple[str, bool]:
    import traceback

    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(oom.__traceback__) if not f.filename.startswith(torch_dir)]
    if not frames:
        return "", False
    path = Path(frames[-1].filename).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f", raised in {shown}:{frames[-1].lineno} ({frames[-1].name})", path.is_relative_to(ROOT / "references")


def _out_of_memory_message(item, oom, fields) -> str:
    """The failure message of an out-of-memory error that escaped the harness (raised in a backward, or
    in the suite's float64 reference): where it was raised, and whether the suite or the kernel ran out."""
    from verify.harness import exception_line

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


def _other_failure(item, exc) -> dict:
    """Failure-file fields for one failure other than a PropertyFailure (a kernel that raises): the case
    is the one the property was running when the exception was raised (read from the traceback), else
    the one read back from Hypothesis's notes when it can be, with its replay command; with neither, a
    note saying where the exception was raised."""
    from reports.failures import drawn_case, exception_text, property_of_test, raised_at
    from reports.session import replay_command
    from verify import properties
    from verify.harness import failing_context

    ctx = failing_context(exc)
    if ctx is not None and hasattr(ctx.case, "to_dict"):
        return {"message": exception_text(exc), "replay": ctx.replay_command(), "case": ctx.case.to_dict(),
                "prop": ctx.prop, "implementation": ctx.impl.name, "note": None}
    params = getattr(getattr(item, "callspec", None), "params", {})
    impl = params.get("impl") or params.get("softmax_impl")
    known = set(properties.PROPERTIES) | set(properties.SOFTMAX_PROPERTIES)
    prop = property_of_test(getattr(item, "originalname", item.name), known)
    case, why = drawn_case(exc)
    replay = None
    if case is not None and prop is not None and impl is not None:
        replay = replay_command(impl=impl.cli_name, prop=prop, case=case, device=_device(item.config))
    elif case is not None:
        why = "the test is not one property of one implementation"
    if case is None and why and why.startswith("the failure carries no drawn case"):
        why = f"it was raised outside any drawn example, {raised_at(exc, root=ROOT)}"
    return {"message": exception_text(exc), "replay": replay, "case": case, "prop": prop,
            "implementation": getattr(impl, "name", None), "note": None if replay else why}


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """Install the time limit of one test in place of pytest-timeout's own (a firstresult hook).

    pytest-timeout's signal method raises pytest's ``Failed``, which Hypothesis catches as a failing
    example and then replays to shrink it: the replay hangs again, with no timer left, and the run
    never ends. Here SIGALRM raises :class:`verify.harness.TimeoutFailure` instead, which Hypothesis
    lets through, naming the example that was running. A watchdog thread covers hangs that never
    return to Python (where no signal handler can run): a grace period after the limit it writes the
    failure file and the summary, then ends the process as pytest-timeout's thread method does. Where
    SIGALRM cannot be used (another platform or thread, ``--timeout-method=thread``), the watchdog alone
    runs, at the limit.
    """
    import pytest_timeout

    seconds = float(settings.timeout)
    main_thread = threading.main_thread()
    use_signal = (settings.method == "signal" and hasattr(signal, "SIGALRM")
                  and threading.current_thread() is main_thread)
    grace = min(60.0, max(5.0, seconds / 10)) if use_signal else 0.0
    watchdog = threading.Timer(seconds + grace, _native_hang, (item, settings, main_thread.ident))
    watchdog.name = f"flashverify timeout {item.nodeid}"
    watchdog.daemon = True

    def on_alarm(signum, frame):
        __tracebackhide__ = True
        if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
            return
        from verify.harness import TimeoutFailure, running_context, timeout_message

        ctx = running_context(frame)
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
    return True


def _native_hang(item, settings, main_ident):
    """The watchdog's end of a test that never returned: failure file and summary, then exit status 1."""
    import pytest_timeout

    if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
        return
    from verify.harness import TimeoutFailure, running_context, timeout_message

    ctx = running_context(sys._current_frames().get(main_ident))
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
            report.failure(test=item.nodeid, **_failure_fields(failure))
            if _xdist_worker(config):
                # pytest-xdist replaces this worker and runs the rest: this worker's part is complete.
                report.close(exitstatus=1)
            else:
                # The tests after this one will not run: the run stays unfinished, the summary PARTIAL.
                from reports.summary import write_summary

                reporter = config.pluginmanager.get_plugin("terminalreporter")
                outcomes = {key: len(reporter.stats.get(key, [])) for key in ("passed", "failed", "skipped")
                            if reporter is not None and reporter.stats.get(key)}
                outcomes["failed"] = outcomes.get("failed", 0) + 1
                write_summary(report.dir, outcomes=outcomes)
                terminal.line(f"flashverify report: {report.dir / 'report.html'} (PARTIAL: the run ends at this test)")
    except Exception as exc:  # noqa: BLE001 - the process must end whatever the report does
        terminal.line(f"flashverify report: writing the report failed: {type(exc).__name__}: {exc}", red=True)
    pytest_timeout.timeout_timer(item, settings)  # dumps every thread's stack, then os._exit(1)


def _check_verified(session) -> None:
    """Exit 1 with "nothing was verified for X" when no test called a selected implementation
    (verify/outcomes.py); the tally goes to the terminal summary."""
    from verify import outcomes

    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if _xdist_worker(config) or reporter is None or not _collects_verify(config) or config.option.collectonly:
        return
    tally = outcomes.tally(reporter.stats)
    config._flashverify_tally = tally
    if session.shouldfail or session.shouldstop:
        return  # -x or an interruption ended the run early: its exit status already says so
    names = [impl.name for impl in _selection(config)]
    missing = tally.unverified(names, explicit=bool(config.getoption("--impl")))
    if missing:
        config._flashverify_unverified = outcomes.nothing_verified_message(missing)
        if session.exitstatus in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_sessionfinish(session, exitstatus):
    _check_verified(session)
    report = session.config._flashverify_report
    if report is None:
        return
    if _xdist_worker(session.config):
        report.close(exitstatus=exitstatus)
        return  # the controller writes the merged summary once every worker has finished
    from reports.summary import write_summary

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    outcomes = {}
    if reporter is not None:
        for key in ("passed", "failed", "skipped", "xfailed", "xpassed", "error"):
            n = len(reporter.stats.get(key, []))
            if n:
                outcomes[key] = n
    tally = getattr(session.config, "_flashverify_tally", None)
    for key, n in (tally.laws.items() if tally is not None else ()):
        # Laws that call no kernel are counted apart: "passed" counts verdicts on kernels.
        outcomes[key] -= n
        outcomes[f"{key} (laws, no kernel)"] = n
        if not outcomes[key]:
            del outcomes[key]
    stopped = getattr(session.config, "_flashverify_stopped", None)
    if stopped is None and _xdist_controller(session.config):
        stopped = _never_ran(session)
    report.close(outcomes=outcomes, exitstatus=session.exitstatus, stopped=stopped)
    try:
        session.config._flashverify_summary = write_summary(report.dir, outcomes=outcomes)
    except Exception as exc:  # noqa: BLE001 - a report bug must not turn the test outcome into an error
        session.config._flashverify_summary = {"error": f"{type(exc).__name__}: {exc}"}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tally = getattr(config, "_flashverify_tally", None)
    for line in tally.lines() if tally is not None else ():
        terminalreporter.write_line(line)
    unverified = getattr(config, "_flashverify_unverified", None)
    if unverified:
        terminalreporter.write_line(f"flashverify: {unverified}", red=True, bold=True)
    report = config._flashverify_report
    if report is None:
        return
    summary = getattr(config, "_flashverify_summary", None) or {}
    terminalreporter.write_line(f"flashverify report: {report.dir / 'report.html'} (also report.md, summary.json; "
                                f"measurements in {report.dir}/measurements-*.jsonl)")
    for stop in summary.get("stopped") or []:
        after = f"the run stopped after {stop['test']} ({stop['reason']})" if stop.get("test") else stop["reason"]
        terminalreporter.write_line(f"flashverify report: PARTIAL: {after}; {len(stop['not_run'])} test(s) not run, "
                                    "listed in report.md", red=True)
    failures = summary.get("failures") or []
    if failures:
        terminalreporter.write_line(f"flashverify report: {len(failures)} failing case(s) in {report.dir / 'failures'}"
                                    f", each with its replay command")
    for key in ("error", "html_error"):
        if summary.get(key):
            terminalreporter.write_line(f"flashverify report: writing the report failed: {summary[key]}", red=True)
