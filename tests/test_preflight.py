"""The pre-flight call (verify/preflight.py) and the first run of a kernel author from their own directory.

A kernel that cannot be called as the contract says (a signature that does not take its arguments, the
wrong result structure, shape, dtype or device, inputs modified in place, ``scale=None`` mishandled, a
file that does not import) stops the run with one usage error naming the problem, exit status 4, before
any property runs. A kernel that raises on the tiny case gets a note and the run goes on: every other case
is verified. ``pytest --pyargs verify`` works from any directory, with the kernel file given by a path
relative to it and its own folder importable.
"""

from __future__ import annotations

import math
import os
import re
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flashverify_kernels.registry import Implementation, from_callable
from verify.preflight import PreflightError, preflight

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "reference_attention.py"


def _attention(q, k, v, *, causal=False, scale=None):
    from examples.reference_attention import attention

    return attention(q, k, v, causal=causal, scale=scale)


def _plain(fn):
    return from_callable(fn, "kernel.py:attention", device="cpu")


def test_the_reference_example_passes_preflight():
    preflight(_plain(_attention), device="cpu")


def _scale_required(q, k, v, *, causal, scale):
    return _attention(q, k, v, causal=causal, scale=1.0 * scale)


def _none_means_one(q, k, v, *, causal, scale):
    return _attention(q, k, v, causal=causal, scale=1.0 if scale is None else scale)


def _drops_a_row(q, k, v, *, causal, scale):
    out, lse = _attention(q, k, v, causal=causal, scale=scale)
    return out[:, :, 1:], lse


def _float64_out(q, k, v, *, causal, scale):
    return _attention(q, k, v, causal=causal, scale=scale)[0].double()


def _lse_in_input_dtype(q, k, v, *, causal, scale):
    out, lse = _attention(q, k, v.half(), causal=causal, scale=scale)
    return out.to(q.dtype), lse.half()


def _raises(q, k, v, *, causal, scale):
    raise NotImplementedError("head_dim 8 is not supported")


def _raises_when_causal(q, k, v, *, causal, scale):
    if causal:
        raise ValueError("causal masks are not implemented")
    return _attention(q, k, v, causal=causal, scale=scale)


def _returns_three(q, k, v, *, causal, scale):
    out, lse = _attention(q, k, v, causal=causal, scale=scale)
    return out, lse, lse


def _bnhd_out(q, k, v, *, causal, scale):
    """The most common layout mistake: out returned as [B, Nq, H, D], the LSE as [B, Nq, H]."""
    out, lse = _attention(q, k, v, causal=causal, scale=scale)
    return out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()


def _centres_k_in_place(q, k, v, *, causal, scale):
    """A correct (out, lse), then the key mean subtracted from the caller's k (what one public kernel does)."""
    result = _attention(q, k, v, causal=causal, scale=scale)
    k.sub_(k.mean(dim=2, keepdim=True))
    return result


def _takes_no_scale(q, k, v, *, causal):
    return _attention(q, k, v, causal=causal)


@pytest.mark.parametrize("fn, words", [
    (_scale_required, "raised TypeError: unsupported operand type(s) for *: 'float' and 'NoneType'"),
    (_none_means_one, "gives different results for scale=None and scale=1/sqrt(D)=0.353553"),
    (_drops_a_row, "returned out.shape=(2, 3, 4, 8), but should be (2, 3, 5, 8)"),
    (_bnhd_out, "returned out.shape=(2, 5, 3, 8), but should be (2, 3, 5, 8)"),
    (_float64_out, "returned out.dtype=float64, but should be float32"),
    (_lse_in_input_dtype, "returned lse.dtype=float16, but should be float32"),
    (_returns_three, "returned tuple of length 3, but should return out or (out, lse)"),
    (_centres_k_in_place, "modified its input k in place"),
    (_takes_no_scale, "the forward cannot be called so: got an unexpected keyword argument 'scale'"),
])
def test_a_kernel_that_cannot_be_called_is_named(fn, words):
    with pytest.raises(PreflightError, match=re.escape(words)):
        preflight(_plain(fn), device="cpu")


@pytest.mark.parametrize("fn, words", [
    (_raises, "raised NotImplementedError: head_dim 8 is not supported (at "),
    (_raises_when_causal, "causal=True, scale=None) on the tiny case B=2 Hq=3 Hkv=3 Nq=5 Nk=7 D=8 float32 "
                          "on cpu raised ValueError: causal masks are not implemented"),
])
def test_a_kernel_that_raises_on_the_tiny_case_gets_a_note_and_the_run_goes_on(fn, words):
    (note,) = preflight(_plain(fn), device="cpu")
    assert words in note and "the run goes on" in note and "declare its limits" in note


def test_the_tiny_case_sizes_all_differ():
    from verify.preflight import tiny_case

    q, k, _ = tiny_case(_plain(_attention), "cpu")
    sizes = (q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3])
    assert len(set(sizes)) == 5, sizes


def test_a_scale_none_type_error_says_what_none_means():
    with pytest.raises(PreflightError, match=re.escape("scale=None, which means 1/sqrt(D)")):
        preflight(_plain(_scale_required), device="cpu")


def test_declared_dtypes_and_head_dims_are_respected():
    calls = []

    def fp16_only(q, k, v, *, causal, scale):
        calls.append((q.dtype, q.shape[-1]))
        if q.dtype != torch.float16 or q.shape[-1] not in (16, 32):
            raise TypeError(f"unsupported {q.dtype}, D={q.shape[-1]}")
        return _attention(q, k, v, causal=causal, scale=scale)

    impl = Implementation(name="fp16_only", forward=fp16_only, dtypes=(torch.float16,), head_dims=(32, 16))
    preflight(impl, device="cpu")
    assert calls and set(calls) == {(torch.float16, 16)}


def test_nothing_is_called_where_the_kernel_runs_in_no_dtype():
    def never(*args, **kwargs):
        raise AssertionError("called")

    cuda_only = Implementation(name="cuda_only", forward=never, devices=("cuda",))
    preflight(cuda_only, device="cpu")


def test_scale_none_agrees_within_a_few_roundings():
    """``D ** -0.5`` and ``1 / math.sqrt(D)`` may differ in the last bit: not a contract violation."""

    def pow_scale(q, k, v, *, causal, scale):
        return _attention(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5 if scale is None else scale)

    preflight(_plain(pow_scale), device="cpu")
    assert math.isclose(8 ** -0.5, 1 / math.sqrt(8))


# ------------------------------------------------------------------ a kernel author's own directory
def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q",
           "--hypothesis-profile=ci", "--report-dir", str(cwd / "report"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_own_directory_kernel_file_passes(tmp_path):
    """The README's command for one's own kernel, run from another directory: the example copied there,
    importing a helper module that sits next to it, passes the whole catalogue; what a plain callable
    does not declare (GQA, tiles) is skipped visibly."""
    (tmp_path / "my_helpers.py").write_text("import math\n\ndef default_scale(d):\n    return 1 / math.sqrt(d)\n")
    source = EXAMPLE.read_text().replace("import torch\n", "import torch\nfrom my_helpers import default_scale\n", 1)
    source = source.replace("scale = 1.0 / math.sqrt(head_dim)", "scale = default_scale(head_dim)")
    assert "default_scale(head_dim)" in source
    (tmp_path / "my_kernel.py").write_text(source)
    proc = _run(tmp_path, "--impl", "my_kernel.py:attention", "-x", "-rs")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"flashverify: my_kernel\.py:attention: \d+ passed, \d+ skipped", proc.stdout), proc.stdout[-2000:]
    assert "my_kernel.py:attention declares no grouped-query attention" in proc.stdout


@pytest.mark.parametrize("source, words", [
    ("def attention(q, k, v, *, causal, scale)\n    return q\n", "SyntaxError: expected ':'"),
    ("import no_such_helper_module\n", "ModuleNotFoundError: No module named 'no_such_helper_module'"),
    ("def attention(q, k, v, *, causal, scale):\n    return q.sum()\n", "returned out.shape=()"),
])
def test_own_directory_broken_kernel_is_one_usage_error(tmp_path, source, words):
    (tmp_path / "my_kernel.py").write_text(textwrap.dedent(source))
    proc = _run(tmp_path, "--impl", "my_kernel.py:attention")
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert words in proc.stderr, proc.stderr[-3000:]
    assert "INTERNALERROR" not in proc.stdout + proc.stderr
    if "returned" in words:  # the kernel was loaded and called: the report says why the run stopped
        report = (tmp_path / "report" / "report.md").read_text()
        assert "Status: PARTIAL: the pre-flight stopped the run" in report and words in report, report[:2000]


def test_a_kernel_that_crashes_its_process_in_the_pre_flight_leaves_a_report_that_names_it(tmp_path):
    crashes = str(ROOT / "tests" / "fixtures" / "sticky_kernels.py") + ":crashes_at_once"
    proc = _run(tmp_path, "--impl", crashes)
    assert proc.returncode == 139, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["status"] == "partial" and summary["unfinished_workers"] == ["main"], summary
    report = (tmp_path / "report" / "report.md").read_text()
    assert (f"main was in the pre-flight, calling {crashes} on its tiny case (B=2 Hq=3 Hkv=3 Nq=5 Nk=7 D=8 "
            "float32 on cpu): if the process ended there, that is where it crashed.") in report, report[:2000]


_WRAPPERS = {
    "bnhd": ("def wrapped(q, k, v, *, causal=False, scale=None):\n"
             "    out, lse = attention(q, k, v, causal=causal, scale=scale)\n"
             "    return out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()\n"),
    "centres_k": ("def wrapped(q, k, v, *, causal=False, scale=None):\n"
                  "    result = attention(q, k, v, causal=causal, scale=scale)\n"
                  "    k.sub_(k.mean(dim=2, keepdim=True))\n"
                  "    return result\n"),
    "no_float32": ("def wrapped(q, k, v, *, causal=False, scale=None):\n"
                   "    if q.dtype == torch.float32:\n"
                   "        raise NotImplementedError('float32 is not supported')\n"
                   "    return attention(q, k, v, causal=causal, scale=scale)\n"),
}


@pytest.mark.slow(seconds=10)
@pytest.mark.parametrize("kind, status, words", [
    ("bnhd", 4, "returned out.shape=(2, 5, 3, 8), but should be (2, 3, 5, 8)"),
    ("centres_k", 4, "modified its input k in place"),
    ("no_float32", 1, "raised NotImplementedError: float32 is not supported"),
])
def test_only_a_broken_calling_convention_stops_the_run(tmp_path, kind, status, words):
    """Out laid out [B, Nq, H, D] and an input modified in place are one usage error each (exit 4); a kernel
    that raises on the tiny case gets a note, and its other cases are verified: float32 fails, the rest pass."""
    (tmp_path / "my_kernel.py").write_text(EXAMPLE.read_text() + "\n\n" + _WRAPPERS[kind])
    proc = _run(tmp_path, "--impl", "my_kernel.py:wrapped", "-k", "test_out_matches_reference")
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert words in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    if status == 1:
        assert "the run goes on" in proc.stdout and "declare its limits" in proc.stdout
        assert "1 failed, 3 passed" in proc.stdout and "[my_kernel.py:wrapped-float32]" in proc.stdout
