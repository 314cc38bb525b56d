"""verify/interpreter.py: Triton's interpreter with the repeated patching and the unasserted overflow checks
skipped gives the same bits as without, for the shipped Triton kernels (forward, backward, decode), and stays out of the way when it cannot
apply."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verify import interpreter

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys, torch
from verify import interpreter
if sys.argv[1] == "skip":
    assert interpreter.skip_repatching() is None
    assert interpreter.skip_unasserted_overflow_checks() is None
    from triton.runtime import interpreter as triton_interpreter
    assert triton_interpreter.interpreter_builder.options.sanitize_overflow is False
from flashverify_kernels.registry import registry
from strategies.cases import AttentionCase
from references.spec import AttentionSpec

impls = registry()
results = {}
for seed, causal in ((1, True), (2, False)):
    case = AttentionCase(batch=1, heads_q=4, heads_kv=2, len_q=37, len_k=45, head_dim=24, dtype="float32",
                         seed=seed, block_m=16, block_n=16, spec=AttentionSpec(causal=causal))
    t = case.build()
    q, k, v = (x.detach().requires_grad_(True) for x in (t.q, t.k, t.v))
    out, lse = impls["triton_fa2"].call(q, k, v, spec=case.spec, block_m=16, block_n=16)
    out.backward(t.dout)
    for name, x in (("out", out), ("lse", lse), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        results[f"{seed}-{name}"] = x.detach().double().flatten().tolist()
torch.save(results, sys.argv[2])
"""


@pytest.mark.slow(seconds=40)
def test_skipping_the_repatching_changes_no_bit(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    got = {}
    for mode in ("skip", "plain"):
        out = tmp_path / f"{mode}.pt"
        proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        import torch

        got[mode] = torch.load(out)
    assert got["skip"].keys() == got["plain"].keys() and len(got["skip"]) == 10
    differ = [key for key in got["skip"] if got["skip"][key] != got["plain"][key]]
    assert not differ, f"results differ with the repatching skipped: {differ}"


def test_it_says_why_it_does_not_apply(monkeypatch):
    monkeypatch.setattr(interpreter, "_installed", False)
    monkeypatch.setattr(interpreter, "_overflow_checks_skipped", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert interpreter.skip_repatching() == "TRITON_INTERPRET is not 1"
    assert interpreter.skip_unasserted_overflow_checks() == "TRITON_INTERPRET is not 1"


def test_overflow_checks_stay_where_debug_asserts_them(monkeypatch):
    pytest.importorskip("triton")
    import dataclasses

    from triton.runtime import interpreter as triton_interpreter

    builder = triton_interpreter.interpreter_builder
    monkeypatch.setattr(interpreter, "_overflow_checks_skipped", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True, sanitize_overflow=True))
    monkeypatch.setattr(triton_interpreter, "_get_np_dtype", triton_interpreter._get_np_dtype)
    assert "debug option is on" in interpreter.skip_unasserted_overflow_checks()
    assert builder.options.sanitize_overflow is True
