"""Device memory and device faults (verify/gpu.py and the plugin's use of it), on CPU: the budget
arithmetic, the limits it gives, the usage errors of --gpu-memory, and the sticky CUDA error recogniser,
with torch.cuda's functions replaced by stand-ins where the plugin calls them."""

import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from strategies.attention import ROW_HEADS, Limits
from verify import gpu
from verify import plugin

ROOT = Path(__file__).resolve().parent.parent
GIB = gpu.GIB


# --- the estimate and the budget ------------------------------------------------------------------------

def test_suite_peak_bytes_is_the_documented_estimate():
    got = gpu.suite_peak_bytes(batch=2, heads_q=3, len_q=5, len_k=7, head_dim=11)
    assert got == 8 * 20 * (2 * 3 * 5 * 7) + 8 * 24 * (2 * 3 * (5 + 7) * 11)
    # split-KV: the kernel's partial outputs, one [B, Hq, Nq, D] per split
    split = gpu.suite_peak_bytes(batch=2, heads_q=3, len_q=5, len_k=7, head_dim=11, num_splits=4)
    assert split == got + 8 * 4 * (2 * 3 * 5 * 11)
    with pytest.raises(ValueError, match="len_k=-1, but should be at least 0"):
        gpu.suite_peak_bytes(batch=1, heads_q=1, len_q=1, len_k=-1, head_dim=1)


def test_each_worker_gets_the_free_memory_over_the_workers_less_its_context():
    b = gpu.plan_budget(device=0, total_bytes=80 * GIB, free_bytes=78 * GIB, workers=12)
    assert b.worker_bytes == 78 * GIB // 12 - gpu.CONTEXT_RESERVE
    assert b.fraction == pytest.approx(b.worker_bytes / (80 * GIB))
    assert b.source == "free memory at start" and "12 worker(s)" in b.describe()


def test_gpu_memory_caps_the_run_as_a_smaller_card_would():
    b = gpu.plan_budget(device=0, total_bytes=80 * GIB, free_bytes=78 * GIB, workers=4, gpu_memory_gib=16)
    assert b.usable_bytes == 16 * GIB and b.worker_bytes == 4 * GIB - gpu.CONTEXT_RESERVE
    assert b.source == "--gpu-memory 16"
    # More than is free (but not more than the card): the free memory, and the budget says so.
    b = gpu.plan_budget(device=0, total_bytes=80 * GIB, free_bytes=10 * GIB, workers=1, gpu_memory_gib=40)
    assert b.usable_bytes == 10 * GIB and "only 10.0 GiB were free" in b.source


@pytest.mark.parametrize("cap, words", [
    (100, "--gpu-memory 100 GiB is more than cuda:0 has (80.0 GiB)"),
    (0, "--gpu-memory 0: the memory cap must be a positive number of GiB"),
    (-2, "--gpu-memory -2: the memory cap must be a positive number of GiB"),
    (math.nan, "--gpu-memory nan: the memory cap must be a positive number of GiB"),
])
def test_a_gpu_memory_cap_that_cannot_be_is_refused(cap, words):
    with pytest.raises(gpu.BudgetError) as info:
        gpu.plan_budget(device=0, total_bytes=80 * GIB, free_bytes=78 * GIB, workers=1, gpu_memory_gib=cap)
    assert str(info.value) == words


def test_too_many_workers_for_the_memory_is_refused_with_what_to_change():
    with pytest.raises(gpu.BudgetError, match=r"2.00 GiB \(--gpu-memory 2\) shared by 4 worker\(s\) leaves 0.00 GiB "
                       r"per worker .* use fewer workers \(-n\) or more memory"):
        gpu.plan_budget(device=0, total_bytes=80 * GIB, free_bytes=78 * GIB, workers=4, gpu_memory_gib=2)


def test_workers_share_the_device_they_are_spread_to():
    assert gpu.workers_on_device(device=0, workers=8, device_count=3, spread=True) == 3  # gw0, gw3, gw6
    assert gpu.workers_on_device(device=2, workers=8, device_count=3, spread=True) == 2  # gw2, gw5
    assert gpu.workers_on_device(device=1, workers=8, device_count=3, spread=False) == 8  # --device cuda:1
    assert gpu.workers_on_device(device=0, workers=2, device_count=4, spread=True) == 1


def _largest_case_bytes(limits: Limits) -> int:
    heads = min(limits.max_batch * limits.max_heads_kv * limits.max_group, limits.max_batch_heads, ROW_HEADS)
    return (gpu.BYTES_PER_SCORE * limits.max_scores
            + gpu.BYTES_PER_ROW_ELEMENT * heads * 2 * limits.max_len * limits.max_head_dim)


@pytest.mark.parametrize("gib, workers", [(80, 1), (80, 12), (16, 4), (24, 1), (4, 2)])
def test_the_gpu_profile_limits_come_from_the_budget_and_fit_it(gib, workers):
    from verify.profiles import limits_for

    budget = gpu.plan_budget(device=0, total_bytes=gib * GIB, free_bytes=gib * GIB, workers=workers)
    table = limits_for("cuda", "gpu")
    limits = gpu.limits_within(table, budget, from_budget=True)
    assert _largest_case_bytes(limits) <= budget.worker_bytes
    assert limits.max_len <= min(gpu.MAX_LEN_CEILING, 2 * math.isqrt(limits.max_scores))
    # Not a fixed table: a quarter of the memory holds about a quarter of the scores.
    smaller = gpu.plan_budget(device=0, total_bytes=gib * GIB, free_bytes=gib * GIB // 4, workers=workers) \
        if gib * GIB // 4 // workers > gpu.CONTEXT_RESERVE + gpu.MIN_WORKER_BUDGET else None
    if smaller is not None:
        assert gpu.limits_within(table, smaller, from_budget=True).max_scores < limits.max_scores


def test_max_len_is_the_longest_that_fits_the_budget():
    from verify.profiles import limits_for

    table = limits_for("cuda", "gpu")
    card16 = gpu.plan_budget(device=0, total_bytes=80 * GIB, free_bytes=78 * GIB, workers=4, gpu_memory_gib=16)
    limits = gpu.limits_within(table, card16, from_budget=True)
    assert 1024 <= limits.max_len < gpu.MAX_LEN_CEILING, limits
    longer = gpu.max_scores_within(card16.worker_bytes, Limits(**{**limits.__dict__, "max_len": limits.max_len + 1}))
    assert limits.max_len + 1 > 2 * math.isqrt(longer)  # one more and the rule breaks: the longest
    whole = gpu.plan_budget(device=0, total_bytes=80 * GIB, free_bytes=78 * GIB, workers=1)
    assert gpu.limits_within(table, whole, from_budget=True).max_len == gpu.MAX_LEN_CEILING


def test_other_profiles_limits_are_only_lowered_by_the_budget():
    from verify.profiles import limits_for

    table = limits_for("cuda", "ci")
    roomy = gpu.plan_budget(device=0, total_bytes=80 * GIB, free_bytes=80 * GIB, workers=1)
    assert gpu.limits_within(table, roomy, from_budget=False) == table
    tight = gpu.Budget(device=0, total_bytes=80 * GIB, usable_bytes=GIB, workers=1, worker_bytes=4 * 2 ** 20,
                       source="test")
    lowered = gpu.limits_within(table, tight, from_budget=False)
    assert lowered.max_scores < table.max_scores and _largest_case_bytes(lowered) <= tight.worker_bytes


# --- the plugin's budget, with torch.cuda's functions replaced ---------------------------------------------

class _Config:
    """What the plugin reads of a pytest config, for one process of a run."""

    def __init__(self, *, device="cuda", gpu_memory=None, workerinput=None, numprocesses=None):
        self.option = types.SimpleNamespace(numprocesses=numprocesses, dist="load" if numprocesses else "no")
        self._options = {"--device": device, "--gpu-memory": gpu_memory}
        self.args = ["verify"]
        if workerinput is not None:
            self.workerinput = workerinput

    def getoption(self, name, default=None):
        return self._options.get(name, default)

    def getini(self, name):
        return []


@pytest.fixture
def fake_cuda(monkeypatch):
    """An 80 GiB GPU with 78 GiB free; records the memory fraction set and the calls made."""
    calls = types.SimpleNamespace(fractions=[], measured=[], emptied=0, reset=[])

    def mem_get_info(index):
        calls.measured.append(index)
        return 78 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: calls.fractions.append((fraction, device)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.reset.append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 123 * 2 ** 20)

    def empty_cache():
        calls.emptied += 1

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    return calls


def test_a_worker_caps_its_allocator_at_its_share_of_the_memory_measured_at_the_start(fake_cuda, monkeypatch):
    from references import attention as reference

    monkeypatch.setattr(reference, "DEFAULT_BUDGET_BYTES", 256 * 2 ** 20)
    # gw5 replaces a crashed worker of a 4-worker run: it gets the free memory the controller measured
    # at the start (40 GiB here), not what is free now, which the other workers hold part of.
    config = _Config(workerinput={"workerid": "gw5", "workercount": 4,
                                  "flashverify_memory_at_start": {"0": [40 * GIB, 80 * GIB]}})
    budget = plugin.gpu_budget(config)
    assert budget.workers == 4 and budget.worker_bytes == 10 * GIB - gpu.CONTEXT_RESERVE
    assert fake_cuda.measured == []  # nothing measured in the worker
    assert fake_cuda.fractions == [(budget.fraction, 0)]
    # The reference's row chunks may take an eighth of the budget (9 GiB / 8 here).
    assert reference.DEFAULT_BUDGET_BYTES == budget.worker_bytes // gpu.REFERENCE_CHUNK_SHARE


def test_the_controller_measures_once_and_hands_the_measurement_to_every_worker(fake_cuda):
    config = _Config(numprocesses=4)
    budget = plugin.gpu_budget(config)
    assert budget.workers == 4 and fake_cuda.fractions == []  # the controller runs no tests: no cap there
    nodes = [types.SimpleNamespace(config=config, workerinput={"workerid": f"gw{i}"}) for i in range(2)]
    for node in nodes:
        plugin.pytest_configure_node(node)
    assert fake_cuda.measured == [0]
    for node in nodes:
        assert node.workerinput["flashverify_memory_at_start"] == {"0": [78 * GIB, 80 * GIB]}


def test_gpu_memory_usage_errors(fake_cuda, monkeypatch):
    with pytest.raises(pytest.UsageError, match="--gpu-memory 100 GiB is more than cuda:0 has"):
        plugin.gpu_budget(_Config(gpu_memory=100))
    with pytest.raises(pytest.UsageError, match="--gpu-memory 0: the memory cap must be a positive number"):
        plugin.gpu_budget(_Config(gpu_memory=0))
    with pytest.raises(pytest.UsageError, match=r"--gpu-memory 8 was given, but the run is on cpu .*GPU memory only"):
        plugin.gpu_budget(_Config(device="cpu", gpu_memory=8))
    assert fake_cuda.fractions == []
    assert plugin.gpu_budget(_Config(device="cpu")) is None


def test_gpu_memory_on_a_machine_without_a_gpu_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify", "--gpu-memory", "16", "--collect-only",
                           "-p", "no:cacheprovider", "--no-report"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "--gpu-memory 16 was given, but the run is on cpu (no CUDA device is visible)" in out


def test_each_test_resets_and_reads_the_peak_and_empties_the_cache(fake_cuda):
    gpu.start_test(0)
    assert gpu.end_test(0) == 123 * 2 ** 20
    assert fake_cuda.reset == [0] and fake_cuda.emptied == 1


def test_peak_memory_per_property_in_the_report(tmp_path):
    from reports import memory
    from reports.session import ReportSession
    from reports.summary import markdown, summarise

    report = ReportSession(tmp_path, worker="gw0")
    for test, prop, peak, seconds in (("t1", "out_matches_reference", 3, 1.5), ("t2", "out_matches_reference", 5, 2.0),
                                      ("t3", "gradients_match_reference", 7, 4.25)):
        report.memory({"test": test, "property": prop, "peak_bytes": peak * 2 ** 20, "budget_bytes": 2 ** 30,
                       "seconds": seconds})
    report.close()
    mem = memory.summary(tmp_path)
    assert mem["budget_bytes"] == 2 ** 30
    rows = {r["property"]: r for r in mem["by_property"]}
    assert rows["out_matches_reference"]["max_peak_bytes"] == 5 * 2 ** 20
    assert rows["out_matches_reference"]["max_peak_test"] == "t2" and rows["out_matches_reference"]["tests"] == 2
    md = markdown(summarise(tmp_path))
    assert rows["out_matches_reference"]["seconds"] == 3.5 and rows["out_matches_reference"]["max_seconds"] == 2.0
    assert "## Peak device memory and time per property" in md and "budget: 1024 MiB" in md
    assert "| gradients_match_reference | 1 | 7.0 | 7.0 | t3 | 4.2 | 4.2 |" in md


def test_a_cpu_run_has_no_memory_section(tmp_path):
    from reports.session import ReportSession
    from reports.summary import markdown, summarise

    ReportSession(tmp_path, worker="main").close()
    assert "Peak device memory" not in markdown(summarise(tmp_path))


# --- sticky CUDA errors ----------------------------------------------------------------------------------

STICKY = [
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: unspecified launch failure",
    "CUDA error: device-side assert triggered",
    "CUDA error: unknown error",
    "CUDA error: misaligned address",
    "Triton Error [CUDA]: an illegal memory access was encountered",
    "Triton Error [CUDA]: unknown error",
    "CUDA driver error: CUDA_ERROR_ILLEGAL_ADDRESS",
]


@pytest.mark.parametrize("message", STICKY)
def test_sticky_cuda_errors_are_recognised(message):
    exc = RuntimeError(message + "\nCUDA kernel errors might be asynchronously reported at some other API call")
    assert gpu.sticky_cuda_error(exc) is exc


def test_a_sticky_error_is_found_where_it_was_raised_from_and_in_groups():
    inner = RuntimeError(STICKY[0])
    try:
        try:
            raise inner
        except RuntimeError as e:
            raise ValueError("the kernel failed") from e
    except ValueError as outer:
        assert gpu.sticky_cuda_error(outer) is inner
    group = ExceptionGroup("2 distinct failures", [ValueError("wrong"), RuntimeError(STICKY[1])])
    assert str(gpu.sticky_cuda_error(group)) == STICKY[1]


@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),  # the context survives it
    RuntimeError("CUDA error: invalid argument"),  # an API misuse, not sticky
    ValueError("head_dim=300 is not supported"),
    AssertionError("out differs ... illegal memory access ..."),  # a property's message quoting anything
])
def test_other_errors_are_not_sticky(exc):
    assert gpu.sticky_cuda_error(exc) is None


def test_gpu_workers_share_the_cores_and_a_cpu_run_keeps_one_thread(fake_cuda, monkeypatch):
    monkeypatch.delenv("FLASHVERIFY_CPU_THREADS", raising=False)
    monkeypatch.setattr(plugin, "available_cores", lambda: 16)
    worker = {"workerid": "gw3", "workercount": 16}
    assert plugin.cpu_threads(_Config(workerinput=worker)) == 1
    assert plugin.cpu_threads(_Config(workerinput={"workerid": "gw0", "workercount": 4})) == 4
    assert plugin.cpu_threads(_Config(workerinput={"workerid": "gw0", "workercount": 32})) == 1
    assert plugin.cpu_threads(_Config()) == 16  # one process on the GPU: every core
    assert plugin.cpu_threads(_Config(device="cpu", workerinput=worker)) == 1
    monkeypatch.setenv("FLASHVERIFY_CPU_THREADS", "3")
    assert plugin.cpu_threads(_Config(workerinput=worker)) == 3


@pytest.mark.parametrize("name", ["eager", "fa2_blocked", "triton_fa2", "triton_decode"])
@pytest.mark.parametrize(("total_gib", "workers"), [(139.8, 16), (16, 4)])
def test_every_drawn_case_fits_the_worker_budget(name, total_gib, workers):
    """The gpu profile's draws of a shipped kernel's declaration (variable-length batches, a length
    longer than the other, groups up to 64, KV caches up to 128k keys) stay within the worker's
    budget by the suite's own estimate: a paged cache repeats its query length per sequence and a
    padded batch pads every sequence to the longest, so the further sequences give way where needed."""
    from hypothesis import HealthCheck, given, settings

    from flashverify_kernels.registry import registry
    from strategies.attention import attention_cases
    from verify.profiles import limits_for
    from verify.runner import declared_draws, limits_of

    budget = gpu.plan_budget(device=0, total_bytes=int(total_gib * GIB), free_bytes=int(total_gib * GIB),
                             workers=workers)
    limits = gpu.limits_within(limits_for("cuda", "gpu"), budget, from_budget=True)
    impl = registry()[name]
    over = []
    for draw in ({}, {"min_group": 2}, {"longer": "len_k", "causal": True}, {"longer": "len_q", "causal": True}):
        if "min_group" in draw and not impl.gqa:
            continue

        @settings(max_examples=300, database=None, derandomize=True, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(attention_cases(dtype="float64", limits=limits_of(impl, limits, "float64"),
                               **declared_draws(impl, draw.pop("causal", None), dict(draw))))
        def check(case):
            peak = gpu.suite_peak_bytes(batch=case.batch, heads_q=case.heads_q, len_q=case.len_q,
                                        len_k=case.len_k, head_dim=case.head_dim, num_splits=case.spec.num_splits)
            if peak > budget.worker_bytes:
                over.append((peak / GIB, case.describe()))

        check()
    assert not over, over[:3]


@pytest.mark.parametrize(("affinity", "cpu_max", "v1", "cores"), [
    (64, None, None, 64),  # no quota anywhere: the affinity
    (8, None, None, 8),  # pinned to 8 of the 64
    (64, "200000 100000", None, 2),  # cgroup v2: 2 cores of quota
    (64, "max 100000", None, 64),  # cgroup v2 without a quota
    (64, "150000 100000", None, 1),  # 1.5 cores: one whole core
    (64, None, ("300000", "100000"), 3),  # cgroup v1
    (64, None, ("-1", "100000"), 64),  # cgroup v1 without a quota
    (4, "800000 100000", None, 4),  # the smaller of the two
    (64, "garbled", None, 64),  # unreadable: ignored
])
def test_available_cores_is_bounded_by_the_affinity_and_the_cgroup_quota(tmp_path, monkeypatch, affinity, cpu_max,
                                                                          v1, cores):
    monkeypatch.setattr(plugin.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(plugin.os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    v2 = tmp_path / "cpu.max"
    if cpu_max is not None:
        v2.write_text(cpu_max + "\n")
    quota, period = tmp_path / "cfs_quota_us", tmp_path / "cfs_period_us"
    if v1 is not None:
        quota.write_text(v1[0] + "\n")
        period.write_text(v1[1] + "\n")
    monkeypatch.setattr(plugin, "CGROUP_CPU_MAX", v2)
    monkeypatch.setattr(plugin, "CGROUP_V1_CPU", (quota, period))
    assert plugin.available_cores() == cores
