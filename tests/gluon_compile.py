"""Compiling a Gluon kernel of kernels/ for sm_90 without a GPU, for tests/test_gluon_forward.py and
tests/test_gluon_backward.py.

:func:`results` runs a test's loop over kernel configurations in a fresh Python process (Triton's
interpreter off), after a prelude that defines ``desc(dt, gdt, rows, d)`` (a ``[1, 1, rows, d]`` tensor
descriptor's signature type) and ``build(key, fn, signature, constexprs)``: compile ``fn`` for sm_90,
assemble its PTX with Triton's own ptxas (``-v``) and record ``{"rc", "ptxas" (its report), "wgmma" (the
warpgroup MMAs in the PTX)}``, or ``{"error"}``, under ``key``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_PRELUDE = r"""
import json, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

ptxas = get_ptxas(90).path
results = {}


def desc(dt, gdt, rows, d):
    block = [1, 1, rows, d]
    layout = gl.NVMMASharedLayout.get_default_for(block, gdt)
    return f"tensordesc<{dt}[{','.join(map(str, block))}],{layout!r}>"


def build(key, fn, signature, constexprs):
    try:
        kernel = triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as exc:
        results[key] = {"error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}
        return
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(kernel.asm["ptx"])
    run = subprocess.run([ptxas, "-v", "-arch=sm_90a", fh.name, "-o", fh.name + ".o"], capture_output=True,
                         text=True)
    results[key] = {"rc": run.returncode, "ptxas": run.stderr[-3000:],
                    "wgmma": len(re.findall(r"wgmma\.mma_async", kernel.asm["ptx"]))}
"""


def results(body: str) -> dict:
    """The records of ``body`` (a script that calls ``build``), run after the prelude in a fresh process;
    skips the test where Triton's NVIDIA backend is not installed."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError:
        pytest.skip("Triton's NVIDIA backend is not installed")
    script = _PRELUDE + body + '\nprint("RESULTS " + json.dumps(results))\n'
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, f"the compile process printed no results (rc {run.returncode}):\n{run.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


def assert_not_serialized(result: dict) -> None:
    """One record of :func:`results`: compiled, assembled, with warpgroup MMAs, and without ptxas note C7514
    ("wgmma.mma_async instructions are serialized"), which a product in flight across a loop's back edge
    brings and which removes every overlap the Gluon kernels exist for."""
    assert "error" not in result, result.get("error")
    assert result["rc"] == 0, result["ptxas"]
    assert result["wgmma"] > 0
    assert "C7514" not in result["ptxas"] and "serialized" not in result["ptxas"], result["ptxas"]
