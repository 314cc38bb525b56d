"""The Triton FA2 backward of the working tree against another version of the kernels' module, case by
case, each case in its own process (a fault is sticky: it ends the process, not the comparison).

    EXP_MODULE=path/to/triton_attention.py PYTHONPATH=. python docs/experiments/backward_versions.py

``EXP_MODULE`` as in dkdv_scaling.py (e.g. ``git show 3363f45:kernels/triton_attention.py > .exp/old.py``
in a folder git ignores, carried to the GPU machine). float16, B = 2, Hq = 4, D = 64, fixed 64 x 64
tiles; over KV heads 4 and 2 (groups 1 and 2), N = 256 and 4096, causal or not, descriptors (TMA) forced
on or off in both modules. Prints max |this - other| of dQ, dK, dV, or the error that ended the process.
Written when the dK/dV kernel's group was folded into its inner loops: the first version faulted on the
H100 in every non-causal case, the fixed one is bitwise equal to 3363f45's except where the summation
order of a group changed (causal, group 2). Those figures came from this script's first draft (the same
cases and comparison, the two modules named in the code); this form has not been run on a GPU yet.

A record of an experiment, not tested code.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys

import torch


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(hkv: int, n: int, causal: bool, tma: bool) -> dict[str, float]:
    from kernels import triton_attention as this
    other = _load(os.environ["EXP_MODULE"], "other_triton_attention")
    for module in (this, other):
        if hasattr(module, "TMA_MIN_LENGTH"):  # modules before 072fe1c: descriptors from a length on
            module.TMA_MIN_LENGTH = 0 if tma else 1 << 30
        if not tma:
            module._use_tma = lambda *args: False
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(2, 4, n, 64, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, hkv, n, 64, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
    out, lse = other.fa2_forward_raw(q, k, v, causal=causal, block_m=64, block_n=64)
    theirs = other.fa2_backward(q, k, v, out, lse, dout, causal=causal, block_m=64, block_n=64)
    ours = this.fa2_backward(q, k, v, out, lse, dout, causal=causal, block_m=64, block_n=64)
    torch.cuda.synchronize()
    return {name: float((a.float() - b.float()).abs().max()) for name, a, b in zip(("dq", "dk", "dv"), ours, theirs)}


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(_case(*json.loads(sys.argv[1]))))
        return
    for hkv, n, causal, tma in itertools.product((4, 2), (256, 4096), (False, True), (False, True)):
        proc = subprocess.run([sys.executable, __file__, json.dumps([hkv, n, causal, tma])], capture_output=True,
                              text=True, timeout=300)
        lines = (proc.stdout if proc.returncode == 0 else proc.stderr).strip().splitlines() or ["?"]
        result = lines[-1] if proc.returncode == 0 else f"FAILED: {lines[-1][:120]}"
        print(f"Hkv={hkv} N={n} causal={causal} descriptors={tma}: {result}", flush=True)


if __name__ == "__main__":
    main()
