"""Compiling a Gluon kernel of flashverify_kernels/hopper/ for sm_90 without a GPU, for tests/test_gluon_forward.py and
tests/test_gluon_backward.py.

:func:`results` runs a test's loop over kernel configurations in a fresh Python process (Triton's
interpreter off), after a prelude that defines ``desc(dt, gdt, rows, d)`` (a ``[1, 1, rows, d]`` tensor
descriptor's signature type) and ``build(key, fn, signature, constexprs)``: compile ``fn`` for sm_90,
assemble its PTX with Triton's own ptxas (``-v``) and record ``{"rc", "ptxas" (its report), "wgmma" (the
warpgroup MMAs in the PTX), "grid_waits" (its ``griddepcontrol.wait``), "clears" (its ``atom.global.exch``)}``,
or ``{"error"}``, under ``key``.

Under pytest-xdist every worker that runs a test of the module runs its fixture; the workers' processes
then share the builds of one body through a directory of the run (``PYTEST_XDIST_TESTRUNUID``): each key
is compiled by the first process to claim it (an exclusive create), the others read its record, so that the
two workers of ``pytest tests -n 2`` split the compiles instead of each doing all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_PRELUDE = r"""
import json, os, re, subprocess, tempfile, time
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

ptxas = get_ptxas(90).path
results = {}
shared = os.environ.get("GLUON_COMPILE_SHARED")  # a directory shared with other workers' processes, or unset
claimed_elsewhere = []


def desc(dt, gdt, rows, d):
    block = [1, 1, rows, d]
    layout = gl.NVMMASharedLayout.get_default_for(block, gdt)
    return f"tensordesc<{dt}[{','.join(map(str, block))}],{layout!r}>"


def compile_one(fn, signature, constexprs):
    try:
        kernel = triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as fh:
            fh.write(kernel.asm["ptx"])
        run = subprocess.run([ptxas, "-v", "-arch=sm_90a", ptx, "-o", ptx + ".o"], capture_output=True, text=True)
    return {"rc": run.returncode, "ptxas": run.stderr[-3000:],
            "wgmma": len(re.findall(r"wgmma\.mma_async", kernel.asm["ptx"])),
            "grid_waits": len(re.findall(r"griddepcontrol\.wait", kernel.asm["ptx"])),
            "clears": len(re.findall(r"atom\.global\.exch", kernel.asm["ptx"]))}


def build(key, fn, signature, constexprs):
    if shared:
        try:
            os.close(os.open(os.path.join(shared, key + ".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another process compiles it
            claimed_elsewhere.append((key, fn, signature, constexprs))
            return
    results[key] = compile_one(fn, signature, constexprs)
    if shared:
        part = os.path.join(shared, key + ".part")
        with open(part, "w") as fh:
            json.dump(results[key], fh)
        os.replace(part, os.path.join(shared, key + ".json"))


def collect():
    # the records other processes claimed; one they never wrote (their process died) is compiled here
    deadline = time.monotonic() + float(os.environ.get("GLUON_COMPILE_WAIT", "300"))
    for key, fn, signature, constexprs in claimed_elsewhere:
        path = os.path.join(shared, key + ".json")
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.5)
        if os.path.exists(path):
            with open(path) as fh:
                results[key] = json.load(fh)
        else:
            results[key] = compile_one(fn, signature, constexprs)
"""


def shared_directory(body: str) -> Path | None:
    """The directory in which the processes of one pytest-xdist run share ``body``'s records, or None
    outside such a run."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id:
        return None
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"flashverify-gluon-compile-{run_id}-{digest}"


def results(body: str) -> dict:
    """The records of ``body`` (a script that calls ``build``), run after the prelude in a fresh process;
    skips the test where Triton's NVIDIA backend is not installed."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError:
        pytest.skip("Triton's NVIDIA backend is not installed")
    script = _PRELUDE + body + '\ncollect()\nprint("RESULTS " + json.dumps(results))\n'
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    shared = shared_directory(body)
    if shared is not None:
        shared.mkdir(parents=True, exist_ok=True)
        env["GLUON_COMPILE_SHARED"] = str(shared)
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
