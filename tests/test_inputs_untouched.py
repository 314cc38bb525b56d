"""``inputs_untouched``: a kernel that writes into its inputs (a real third-party kernel subtracted the mean of
K from the caller's ``k`` in place), into the memory around their views, or into ``dout`` in its backward
fails, with a shrunk case and a message that says which input changed, where, and from what to what; the
shipped kernels pass.

The offending kernels are in ``tests/fixtures/inplace_kernels.py``: their results are right, so only this
property can see them. ``pytest verify`` runs on them in a subprocess, as a user would run it, and the
property is also called directly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashverify_kernels.registry import Implementation
from references.spec import AttentionSpec
from strategies.cases import LAYOUTS, AttentionCase
from tests.fixtures import inplace_kernels
from tests.fixtures.outside_kernels import attention
from verify.context import Context, PropertyFailure
from verify.properties import inputs_untouched

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = "tests/fixtures/inplace_kernels.py"
PROP = "inputs_untouched"
DTYPES = ("float16", "bfloat16", "float32", "float64")


def _pytest_verify(report: Path, *impls: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "verify", "-k", PROP, "--hypothesis-profile=ci", "-p", "no:cacheprovider",
           "-q", "--report-dir", str(report), *(a for impl in impls for a in ("--impl", impl))]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _jsonl(report: Path, pattern: str) -> list[dict]:
    return [json.loads(line) for path in report.glob(pattern) for line in path.read_text().splitlines() if line]


# --- pytest verify on the offenders and on correct kernels --------------------------------------------------

# A kernel that modifies q, k or v on every call stops the run at the pre-flight (below); these two do it only
# where the tiny case cannot see: memory past a padded or packed view, and dout in the backward.
OFFENDERS = ("writes_past_the_end_of_v", "zeroes_dout_in_backward")


@pytest.fixture(scope="module")
def offenders_run(tmp_path_factory):
    """One ``pytest verify -k inputs_untouched`` over the offenders: their failure files by
    (kernel, dtype), and the run's output."""
    report = tmp_path_factory.mktemp("inplace") / "report"
    proc = _pytest_verify(report, *(f"{FIXTURES}:{name}" for name in OFFENDERS))
    failures = {}
    for path in (report / "failures").glob("*.json"):
        data = json.loads(path.read_text())
        name = data["implementation"].removeprefix(f"{FIXTURES}:")
        failures[name, data["case"]["dtype"]] = data
    return proc, failures


def test_pytest_verify_fails_each_offender_in_every_dtype(offenders_run):
    proc, failures = offenders_run
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert f"{len(OFFENDERS) * len(DTYPES)} failed" in out, out[-3000:]
    assert sorted(failures) == sorted((name, dtype) for name in OFFENDERS for dtype in DTYPES), sorted(failures)
    for failure in failures.values():
        assert failure["property"] == PROP
        assert failure["replay"].startswith(f"python -m verify.replay --impl {FIXTURES}:")
        assert "--property inputs_untouched" in failure["replay"]


def _small(case: dict) -> bool:
    """Shrunk: one batch and head, at most two queries, keys and head-dim columns."""
    return (case["batch"] == case["heads_q"] == case["heads_kv"] == 1
            and max(case["len_q"], case["len_k"], case["head_dim"]) <= 2)


def test_the_key_centring_kernel_stops_the_run_at_the_preflight_naming_k(tmp_path):
    proc = _pytest_verify(tmp_path / "report", f"{FIXTURES}:centres_keys_in_place")
    assert proc.returncode == 4, (proc.stdout + proc.stderr)[-3000:]
    assert "modified its input k in place" in proc.stderr and "no property was run" in proc.stderr, proc.stderr


def test_the_kernel_writing_past_v_fails_on_a_padded_or_packed_case_naming_the_memory_outside(offenders_run):
    _, failures = offenders_run
    for dtype in DTYPES:
        failure = failures["writes_past_the_end_of_v", dtype]
        case, message = failure["case"], failure["message"]
        assert _small(case) and case["layout"] in ("padded", "packed"), case
        assert "v changed outside its view: 1 element " in message, message
        assert "1 element past the last element of the v view" in message, message
        assert "nan (0x" in message and "became 0.0 (0x0" in message, message
        assert "v changed inside" not in message, message


def test_the_kernel_zeroing_dout_fails_in_its_backward(offenders_run):
    _, failures = offenders_run
    for dtype in DTYPES:
        failure = failures["zeroes_dout_in_backward", dtype]
        assert _small(failure["case"]), failure["case"]
        message = failure["message"]
        assert "in its forward and backward through autograd" in message, message
        assert "dout changed inside its view: " in message and "became 0.0 (0x0" in message, message


def test_pytest_verify_passes_correct_kernels_and_runs_their_examples(tmp_path):
    report = tmp_path / "report"
    proc = _pytest_verify(report, "eager", "fa2_blocked", "tests/fixtures/outside_kernels.py:attention")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "12 passed" in out, out[-3000:]
    assert not list((report / "failures").glob("*.json"))
    # Examples really ran: every test drew the ci profile's examples (20), none was skipped or empty.
    coverage = _jsonl(report, "coverage-*.jsonl")
    assert len(coverage) == 12, coverage
    assert all(r["property"] == PROP and r["examples"] >= 15 for r in coverage), coverage


# --- the property called directly --------------------------------------------------------------------------

CASE = AttentionCase(batch=1, heads_q=2, heads_kv=2, len_q=3, len_k=4, head_dim=5, dtype="float32",
                     spec=AttentionSpec(causal=True), magnitude="normal", seed=1, layout="contiguous")


def _check(forward, case=CASE, **declared) -> None:
    impl = Implementation(name=getattr(forward, "__name__", "kernel"), forward=forward, **declared)
    inputs_untouched(Context(impl=impl, prop=PROP, device="cpu", case=case), case)


def _fails(forward, case=CASE, **declared) -> str:
    with pytest.raises(PropertyFailure) as info:
        _check(forward, case, **declared)
    return str(info.value)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_correct_kernel_passes_in_every_layout_and_dtype(layout, dtype):
    # The padded and packed layouts hold NaN around the views: compared bitwise, NaN equals itself.
    _check(attention, CASE.replace(layout=layout, dtype=dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_property_fails_the_key_centring_kernel_in_every_layout(layout):
    message = _fails(inplace_kernels.centres_keys_in_place, CASE.replace(layout=layout))
    assert "k changed inside its view: 40 elements of 40 (" in message, message
    assert "first at [0, 0, 0, 0]: " in message, message
    assert "property: inputs_untouched" in message and "replay: python -m verify.replay" in message


def test_memory_outside_the_view_is_named_with_the_buffer_it_shares():
    padded = _fails(inplace_kernels.writes_past_the_end_of_v, CASE.replace(layout="padded"))
    assert "v changed outside its view: 1 element (" in padded, padded
    assert "share" not in padded, padded
    packed = _fails(inplace_kernels.writes_past_the_end_of_v, CASE.replace(layout="packed"))
    assert "of the memory around the v view (the buffer q, k, v, dout share)" in packed, packed
    # A contiguous v ends its storage: the fixture writes nothing there, and nothing is reported.
    _check(inplace_kernels.writes_past_the_end_of_v, CASE.replace(layout="contiguous"))


def test_dout_is_checked_through_the_backward_only_when_the_kernel_has_one():
    message = _fails(inplace_kernels.zeroes_dout_in_backward)
    assert "in its forward and backward through autograd" in message, message
    assert "dout changed inside its view: 30 elements of 30" in message, message
    _check(inplace_kernels.zeroes_dout_in_backward, autograd=False)  # forward alone: dout is never handed over


def _centres_keys_under_autograd_only(q, k, v, *, causal=False, scale=None):
    if k.requires_grad:
        with torch.no_grad():
            k.sub_(k.mean(dim=2, keepdim=True))
    return attention(q, k, v, causal=causal, scale=scale)


def test_a_change_made_on_the_backward_runs_leaves_reaches_the_callers_memory():
    # The backward run hands the kernel fresh leaves (x.detach()): they share the inputs' storage, so a
    # kernel that writes only when its inputs require grad is still caught.
    message = _fails(_centres_keys_under_autograd_only)
    assert "in its forward and backward through autograd" in message and "k changed inside its view" in message


def _rewrites_padding_after_v(bits: int):
    def forward(q, k, v, *, causal=False, scale=None):
        past = v.storage_offset() + sum((n - 1) * s for n, s in zip(v.shape, v.stride())) + 1
        with torch.no_grad():
            v.detach().as_strided((1,), (1,), past).view(torch.int32).fill_(bits)
        return attention(q, k, v, causal=causal, scale=scale)
    return forward


def test_the_comparison_is_bitwise():
    # The padding holds float("nan") (0x7fc00000): writing the same NaN back changes nothing; a NaN with the
    # sign bit set compares like NaN as a float, but is another value.
    padded = CASE.replace(layout="padded")
    _check(_rewrites_padding_after_v(0x7FC00000), padded)
    message = _fails(_rewrites_padding_after_v(-0x00400000), padded)  # 0xffc00000
    assert "v changed outside its view: 1 element (1 byte changed)" in message, message
    assert "nan (0x7fc00000) became nan (0xffc00000)" in message, message


def _makes_k_contiguous(q, k, v, *, causal=False, scale=None):
    k.data = k.data.contiguous()  # replaces the caller's k by a copy: its strides change
    return attention(q, k, v, causal=causal, scale=scale)


def test_replacing_an_input_tensor_is_reported():
    message = _fails(_makes_k_contiguous, CASE.replace(layout="bnhd"))
    assert "k itself was changed: shape, strides, storage offset, dtype and storage were " in message, message


def test_a_kernel_that_writes_into_the_callers_paged_cache_fails():
    """Every convention is checked: the paged cache a kernel is handed, its unused slots and pages included."""
    case = AttentionCase(batch=1, heads_q=2, heads_kv=2, len_q=2, len_k=8, head_dim=4, dtype="float32",
                         spec=AttentionSpec(sequences="paged", seqlens_q=(1, 1), seqlens_k=(3, 5), page_size=2,
                                            page_seed=3))
    _check(attention_paged, case, sequences=("paged",))
    message = _fails(inplace_kernels.zero_fills_the_paged_cache, case, sequences=("paged",))
    assert "k as the kernel takes it changed inside its view: 32 elements of 96" in message, message
    assert "nan (0x7fc00000) became 0.0" in message and "block_table" in message, message


def test_a_kernel_that_writes_into_cu_seqlens_fails():
    case = AttentionCase(batch=1, heads_q=2, heads_kv=2, len_q=4, len_k=5, head_dim=4, dtype="float32",
                         spec=AttentionSpec(sequences="packed", seqlens_q=(1, 3), seqlens_k=(2, 3)))
    message = _fails(inplace_kernels.rewrites_cu_seqlens, case, sequences=("packed",))
    assert "cu_seqlens_k changed inside its view: 3 elements of 3" in message, message


def attention_paged(q, k, v, *, causal=False, scale=None, **keywords):
    from flashverify_kernels.pytorch import blocked

    return blocked.fa2_forward(q, k, v, causal=causal, scale=scale, **keywords)
