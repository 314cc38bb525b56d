"""The flashverify pytest plugin: ``--impl``, ``--report-dir``, ``--device``, the report header and the
report hooks.

The installed package registers this module as a pytest plugin (entry point ``pytest11``), so
``pytest --pyargs verify`` runs the suite from any directory; the repository's ``conftest.py`` loads it
only when the package is not installed. Hypothesis profiles and size limits: ``verify/profiles.py``.

Per-test time limit and native-hang watchdog: ``verify/watchdog.py``. Failure capture (failure files, the
out-of-memory wording, the planned end after a sticky CUDA error): ``verify/failures.py``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from strategies.attention import Limits  # noqa: E402
from strategies.cases import dtype_name  # noqa: E402
from verify import failures, gpu, interpreter, shards, stages, watchdog  # noqa: E402
from verify.profiles import limits_for, profile_name  # noqa: E402

DEFAULT_REPORT_DIR = "flashverify-report"

def pytest_addoption(parser):
    group = parser.getgroup("flashverify")
    group.addoption("--impl", action="append", default=[], metavar="IMPL",
                    help="implementation to verify: a registry name, package.module:attr or "
                         "path/to/file.py:attr (repeatable; default: every shipped implementation "
                         "that runs on the device)")
    group.addoption("--convention", default=None, metavar="NAME",
                    help="the calling convention of every --impl that names a plain function without its own "
                         "@NAME: flash_attn, flash_attn_varlen, flash_attn_kvcache or xformers "
                         "(flashverify_kernels/calling_conventions.py; default: the suite's own contract)")
    group.addoption("--report-dir", default=DEFAULT_REPORT_DIR, metavar="DIR",
                    help=f"where the error report is written (default: ./{DEFAULT_REPORT_DIR})")
    group.addoption("--device", default=None, metavar="DEVICE",
                    help="device for the inputs: cpu or cuda[:N] (default: cuda if available, else cpu)")
    group.addoption("--no-report", action="store_true", default=False, help="write no report")
    group.addoption("--gpu-memory", type=float, default=None, metavar="GIB",
                    help="use at most GIB of each GPU's memory (emulates a smaller card); the workers of "
                         "pytest -n on one GPU share it (default: the GPU's free memory at the start)")
    group.addoption("--shard", default=None, metavar="K/N",
                    help="run only the K-th of N disjoint slices of the selected tests (one per CI runner; "
                         "python -m reports merge joins their report folders into one report)")
    group.addoption("--shard-times", default=None, metavar="DIR",
                    help="balance the --shard slices by the test times in an earlier run's report folder")


def _profile(config) -> str:
    return profile_name(config)


def _device(config) -> str:
    dev = xdist_worker_device(config, config.getoption("--device"))
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


def xdist_worker_device(config, dev: str | None) -> str | None:
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


# Where Linux states a cgroup's CPU quota: cgroup v2's "quota period" (or "max"), and v1's two files.
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_CPU = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def available_cores() -> int:
    """The cores this process may run on: ``os.cpu_count()`` bounded by the process's CPU affinity and by its
    cgroup's CPU quota (a container given 2 cores of a 64-core host sees 64 in ``os.cpu_count()``, and 64 torch
    threads on 2 cores would spin against each other)."""
    count = os.cpu_count() or 1
    try:
        count = min(count, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        pass
    try:
        if CGROUP_CPU_MAX.exists():
            quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        else:
            quota, period = (path.read_text().strip() for path in CGROUP_V1_CPU)
        if quota not in ("max", "-1") and int(period) > 0:
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):  # no cgroup quota to read
        pass
    return max(1, count)


def cpu_threads(config) -> int:
    """Torch's intra-op threads in this process (``FLASHVERIFY_CPU_THREADS`` overrides). On the CPU: one,
    since the suite's tensors are small and thread start-up dominates. With a GPU, the host's work (building
    inputs, the checks, Triton's compiles) runs beside the other workers': the cores shared out among the
    processes, at least one each, so that 16 workers on 16 cores do not start 16 threads each."""
    given = os.environ.get("FLASHVERIFY_CPU_THREADS")
    if given:
        return max(1, int(given))
    if torch.device(_device(config)).type == "cpu":
        return 1
    return max(1, available_cores() // max(1, _workers(config)))


def _spread(config) -> bool:
    """Whether pytest-xdist workers are spread over the GPUs, one GPU each (:func:`xdist_worker_device`)."""
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


def gpu_budget(config) -> gpu.Budget | None:
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
    # Imported here, not when the plugin loads: the registry imports the Triton kernels, and Triton reads
    # TRITON_INTERPRET when it is imported; tests/conftest.py, loaded after the plugins, sets it on a machine
    # without a GPU.
    from flashverify_kernels import registry as kernel_registry

    device = _device(config)
    specs, convention = config.getoption("--impl"), config.getoption("--convention")
    if convention is not None and not specs:
        raise pytest.UsageError(f"--convention {convention} applies to the kernels named with --impl, and none was "
                                "given: add --impl package.module:fn or --impl path/to/file.py:fn")
    if specs:
        try:
            impls = [kernel_registry.load(spec, device=device, convention=convention) for spec in specs]
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
    watchdog.give_default_timeout(config)
    return None


def pytest_unconfigure(config):
    watchdog.release_interrupts()


def pytest_keyboard_interrupt(excinfo):
    watchdog.interrupt_reached()


def pytest_configure(config):
    interpreter.skip_repatching()  # Triton's interpreter (TRITON_INTERPRET=1) patches its language once a launch
    interpreter.skip_unasserted_overflow_checks()  # and computes no overflow check that nothing asserts
    torch.set_num_threads(cpu_threads(config))
    if _collects_verify(config):
        gpu_budget(config)  # validates --gpu-memory; caps this process's allocator before any test
        stages.time_triton_compiles()  # Triton's compiles get a stage of their own in the time table
    config._flashverify_report = None
    worker = _xdist_worker(config) or "main"
    if not config.getoption("--no-report") and _collects_verify(config):
        if not _xdist_worker(config):
            watchdog.catch_interrupts()  # the process that writes the summary: SIGINT and SIGTERM end the run
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
    from reports.session import device_name, versions

    device = _device(config)
    impls = _selection(config)
    return {
        "implementations": [{"name": i.name, "kind": i.kind, "spec": i.cli_name, "description": i.description,
                             "dtypes": [dtype_name(d) for d in i.dtypes],
                             "causal_alignment": i.causal_alignment, "gqa": i.gqa, "tunable": i.tunable,
                             "autograd": i.autograd, "backward": i.backward is not None,
                             "deterministic": i.deterministic,
                             "not_covered": i.not_covered(),
                             "allowed_classes": _allowed_classes(i, config)}
                            for i in impls],
        "device": device,
        "device_name": device_name(device),
        "profile": _profile(config),
        "limits": dataclasses.asdict(_limits(config)),
        "versions": versions(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "memory_budget": (budget.to_dict() if _collects_verify(config) and (budget := gpu_budget(config))
                          else None),
        "shard": config.getoption("--shard"),
    }


def _allowed_classes(impl, config) -> list[str]:
    """The boundary classes the declaration lets the suite draw (strategies.attention.allowed_classes)."""
    from strategies.attention import allowed_classes
    from verify.runner import declared_draws, limits_of

    if impl.kind != "attention":
        return []
    return allowed_classes(limits_of(impl, _limits(config)), **declared_draws(impl, None, {}))


def _limits(config) -> Limits:
    """The profile's size limits, fitted on a GPU to this worker's memory budget (``verify/gpu.py``)."""
    limits = limits_for(torch.device(_device(config)).type, _profile(config))
    budget = gpu_budget(config) if _collects_verify(config) else None
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
             "flashverify: versions " + ", ".join(f"{k} {v}" for k, v in data["versions"].items() if v)
             + (", TRITON_INTERPRET=1" if data["triton_interpret"] else "")]
    budget = gpu_budget(config) if _collects_verify(config) else None
    if budget is not None:
        lines.append(f"flashverify: memory budget {budget.describe()}, max_scores={data['limits']['max_scores']}")
    for impl in data["implementations"]:
        caps = [impl["kind"], "/".join(impl["dtypes"]), f"causal {impl['causal_alignment']}"]
        caps += [c for c, on in (("gqa", impl["gqa"]), ("tunable blocks", impl["tunable"]),
                                 ("backward+delta", impl["backward"])) if on]
        lines.append(f"flashverify: under test {impl['spec']}: {', '.join(caps)}")
        for words in impl["not_covered"]:
            lines.append(f"flashverify:   {words}")
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
    every test tagged with the implementation it calls, or as a law that calls none (verify/outcomes.py).
    Under pytest-xdist the longest tests go first instead (verify/shards.py estimates them), so that the
    run does not end with one worker on a long test and the others idle."""
    from verify import outcomes

    for item in items:
        item.user_properties.extend(outcomes.tags(getattr(getattr(item, "callspec", None), "params", {})))
    items.sort(key=lambda item: outcomes.module_rank(item.path))  # stable: each module keeps its order
    if _collects_verify(config) and (_xdist_worker(config) is not None or _xdist_controller(config)):
        seconds = _estimates(config, [item.nodeid for item in items])
        items.sort(key=lambda item: -seconds[item.nodeid])


def _estimates(config, test_ids: list[str]) -> dict[str, float]:
    """Each test's estimated seconds (verify/shards.py), on the kind of device this run uses; a usage error
    for a ``--shard-times`` folder that does not exist."""
    try:
        recorded = shards.recorded_times(config.getoption("--shard-times"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    device = config.getoption("--device") or ("cuda" if torch.cuda.is_available() else "cpu")
    device_type = "cuda" if str(device).startswith("cuda") else "cpu"
    return shards.estimates(test_ids, recorded, device_type)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """A verify run's ``--dist load`` (the default of ``-n``) hands out one test at a time unless
    ``--maxschedchunk`` is given, longest first and kernel-affine (verify/shards.py)."""
    if not _collects_verify(config):
        return None
    return shards.one_test_at_a_time(config, log, estimate=lambda test_ids: _estimates(config, test_ids))


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_shard(session, config, items):
    """With ``--shard K/N``: keep the K-th slice of what is selected (verify/shards.py), deselect the rest."""
    spec = config.getoption("--shard")
    if spec is None:
        return
    try:
        index, count = shards.parse(spec)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    slice_of = shards.assign(ids := [item.nodeid for item in items], count, _estimates(config, ids))
    keep = [item for item in items if slice_of[item.nodeid] == index]
    dropped = [item for item in items if slice_of[item.nodeid] != index]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def pytest_sessionstart(session):
    """Call each selected attention implementation once on a tiny case (verify/preflight.py) before any
    property runs: a kernel that cannot be called as the contract says is one usage error, not dozens
    of identical failures; one that raises on the tiny case gets a line saying so, and the run goes on.
    Runs once, in the controller (not in pytest-xdist workers)."""
    config = session.config
    if _xdist_worker(config) or not _collects_verify(config):
        return
    from verify.preflight import PreflightError, describe_tiny_case, preflight

    device = _device(config)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    report = config._flashverify_report
    for impl in _selection(config):
        if report is not None:  # a kernel that crashes its process here leaves a report that names it
            named = impl.name if impl.name == impl.cli_name else f"{impl.name} (--impl {impl.cli_name})"
            report.doing(f"the pre-flight, calling {named} on its tiny case ({describe_tiny_case(impl, device)})")
            _write_provisional_report(report)
        try:
            notes = preflight(impl, device=device)
        except PreflightError as exc:
            message = f"{exc}\n  (--impl {impl.cli_name}; no property was run)"
            if report is not None:
                report.doing(None)
                report.close(exitstatus=pytest.ExitCode.USAGE_ERROR,
                             stopped={"test": None, "reason": f"the pre-flight stopped the run: {message}",
                                      "not_run": []})
                _write_provisional_report(report)
            raise pytest.UsageError(message) from None
        for note in notes:
            if reporter is not None:
                reporter.write_line(f"flashverify: {note}")
    if report is not None:
        report.doing(None)
        _write_provisional_report(report)  # PARTIAL until the run ends and replaces it


def _write_provisional_report(report) -> None:
    """The report of what has been measured so far (none at the start), so that a process that dies before
    the run ends leaves one; the end of the run replaces it."""
    from reports.write import write_summary

    try:
        write_summary(report.dir)
    except Exception:  # noqa: BLE001 - the report must not take the run down with it
        pass


@pytest.fixture(scope="session")
def env(request):
    from verify.runner import Env

    config = request.config
    report = config._flashverify_report
    return Env(device=_device(config), profile=_profile(config), limits=_limits(config),
               record=report.record if report is not None else (lambda _m: None),
               seed=config.getoption("hypothesis_seed", default=None),
               coverage=report.coverage if report is not None else (lambda _m: None),
               margin=report.margin if report is not None else (lambda _m: None))


_FAILURES = pytest.StashKey[list]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Around each test body: on a GPU, its peak memory into the report and the cache emptied after it;
    on a failure, the fields of one failure file per distinct failure (:func:`verify.failures.explain_failure`)."""
    item.stash[_FAILURES] = []
    budget = getattr(item.config, "_flashverify_budget", None)
    started = time.monotonic()
    stages.start_test()
    if budget is not None:
        gpu.start_test(budget.device)
    try:
        return (yield)
    except (KeyboardInterrupt, SystemExit, pytest.skip.Exception, pytest.xfail.Exception, pytest.exit.Exception):
        raise
    except BaseException as exc:
        if _collects_verify(item.config):  # the suite's own tests, not another project's that has it installed
            failures.skip_if_the_suite_ran_out_of_memory(item, exc)
            item.stash[_FAILURES] = failures.explain_failure(item, exc, worker=_xdist_worker(item.config))
        raise
    finally:
        seconds, (spent, compiles) = time.monotonic() - started, stages.end_test()
        _record_time(item, seconds, spent, compiles)
        if budget is not None and getattr(item.config, "_flashverify_poisoned", None) is None:
            _record_peak_memory(item, budget, seconds)


def _test_fields(item) -> dict:
    """The implementation, property and dtype of a test of the suite (from its parameters)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    impl = params.get("impl") or params.get("softmax_impl")
    return {"test": item.nodeid, "implementation": getattr(impl, "name", None),
            "property": getattr(item, "originalname", item.name).removeprefix("test_"), "dtype": params.get("dtype")}


def _record_time(item, seconds: float, spent: dict[str, float], compiles: int) -> None:
    """The test's wall time, the seconds of each stage (:mod:`verify.stages`) and the Triton kernels it compiled
    into ``timing-<worker>.jsonl``, as the test ends."""
    report = getattr(item.config, "_flashverify_report", None)
    if report is None or not _collects_verify(item.config):
        return
    report.timing({**_test_fields(item), "seconds": round(seconds, 3), "stages": spent, "compiles": compiles})


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
    report.memory({**_test_fields(item), "device": f"cuda:{budget.device}", "peak_bytes": peak,
                   "budget_bytes": budget.worker_bytes, "seconds": round(seconds, 3)})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or call.excinfo is None:
        return
    exc = call.excinfo.value
    oom = failures.out_of_memory(exc)
    report = item.config._flashverify_report
    try:
        if rep.when != "call":  # a fixture, or the time limit, failed the test outside its body
            if report is not None:
                report.failure(test=f"{item.nodeid} ({rep.when})", **failures.outside_call_fields(exc, rep.when))
            return
        explained = item.stash.get(_FAILURES, None) or (
            failures.explain_failure(item, exc, worker=_xdist_worker(item.config))
            if report is not None else [])
        for i, fields in enumerate(explained if report is not None else ()):
            report.failure(test=item.nodeid + (f"#{i}" if i else ""), **fields)
        failures.tag_poisoned(item, rep)
    finally:
        if oom is not None:
            failures.release_after_report(exc, oom)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """After a test whose failure was a sticky CUDA error (its reports written and sent): end this
    pytest-xdist worker, which pytest-xdist replaces, or without xdist stop the run (PARTIAL report).
    Before a test: end the run if a SIGINT or SIGTERM asked for it and its interrupt was lost
    (:func:`verify.watchdog.end_if_interrupted`)."""
    watchdog.end_if_interrupted()
    result = yield
    failures.end_if_poisoned(item, _xdist_worker(item.config))
    return result


# Tests with an outcome (in the process that writes the summary): any other collected test never ran
# (:func:`_never_ran`, :func:`_interrupted`).
_REPORTED: set[str] = set()


def pytest_runtest_logreport(report):
    """Remember the tests that got an outcome and (pytest-xdist controller) those that poisoned their worker
    (:func:`pytest_handlecrashitem`)."""
    failures.remember_poisoned(report)
    if report.when in ("call", "???") or (report.when == "setup" and not report.passed):
        _REPORTED.add(report.nodeid)
        watchdog.end_if_interrupted()  # pytest-xdist's controller runs no test: a lost interrupt ends the run here


def _collected(session) -> list[str]:
    """The run's collected tests: pytest-xdist's controller collects none itself, so its scheduler's."""
    if _xdist_controller(session.config):
        dsession = session.config.pluginmanager.get_plugin("dsession")
        return list(getattr(getattr(dsession, "sched", None), "collection", None) or [])
    return [item.nodeid for item in session.items]


def _without_outcome(session) -> list[str]:
    return [nodeid for nodeid in _collected(session) if nodeid not in _REPORTED]


def _never_ran(session) -> dict | None:
    """pytest-xdist controller: the collected tests that never got an outcome (pytest-xdist stopped
    replacing crashed workers, or ended early for another reason than -x), as the report's ``stopped``."""
    if session.shouldfail or session.shouldstop:
        return None  # -x / --maxfail stopped the run (its exit status says so)
    missing = _without_outcome(session)  # none where nothing was distributed
    if not missing:
        return None
    dsession = session.config.pluginmanager.get_plugin("dsession")
    why = getattr(dsession, "_summary_report", None) or "ended before every test ran"
    return {"test": None, "reason": f"pytest-xdist: {why}", "not_run": missing}


def _interrupted(session, exitstatus) -> dict | None:
    """An interrupted run (Ctrl-C; SIGINT or SIGTERM from a time limit or a cancelled CI job): the collected
    tests that got no outcome, the one running when it came included, as the report's ``stopped``."""
    if exitstatus != pytest.ExitCode.INTERRUPTED:
        return None
    return {"test": None, "reason": f"interrupted ({watchdog.interrupted_by() or 'KeyboardInterrupt'})",
            "not_run": _without_outcome(session)}


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """pytest-xdist controller: a worker that ended after a sticky CUDA error crashed "while running" the
    test that poisoned it, whose failure is already reported: the crash adds no second failure."""
    failures.planned_worker_end(crashitem, report, sched)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """Install the time limit of one test in place of pytest-timeout's own (a firstresult hook):
    :func:`verify.watchdog.start_timer`."""
    watchdog.start_timer(item, settings, worker=_xdist_worker(item.config))
    return True


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
    from reports.write import write_summary

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
    stopped = getattr(session.config, "_flashverify_stopped", None) or _interrupted(session, exitstatus)
    if stopped is None and _xdist_controller(session.config):
        stopped = _never_ran(session)
    report.close(outcomes=outcomes, exitstatus=session.exitstatus, stopped=stopped)
    try:
        session.config._flashverify_summary = write_summary(report.dir, outcomes=outcomes)
    except Exception as exc:  # noqa: BLE001 - a report bug must not turn the test outcome into an error
        session.config._flashverify_summary = {"error": f"{type(exc).__name__}: {exc}"}


# Failures the end of a run's output shows in full (the rest are counted, and all are in the report).
BRIEF_FAILURES = 3


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After pytest's own summary (its failures and its short test summary, skips included): the tally, the
    report's place and the failing cases in brief, so that the last lines of a run hold each failure's reason,
    its case in one line and its replay command."""
    result = yield
    _summary_lines(terminalreporter, config)
    return result


def _summary_lines(terminalreporter, config) -> None:
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
    failing = summary.get("failures") or []
    if failing:
        from reports.summary import brief

        terminalreporter.write_line(f"flashverify report: {len(failing)} failing case(s) in {report.dir / 'failures'}"
                                    f", each with its replay command:")
        for failure in failing[:BRIEF_FAILURES]:
            for line in brief(failure):
                terminalreporter.write_line(line, red=line.endswith(":") and not line.startswith(" "))
        if len(failing) > BRIEF_FAILURES:
            terminalreporter.write_line(f"... and {len(failing) - BRIEF_FAILURES} more: report.md lists them all")
    for key in ("error", "html_error"):
        if summary.get(key):
            terminalreporter.write_line(f"flashverify report: writing the report failed: {summary[key]}", red=True)
