"""Registers, local memory (spills) and shared memory of the Triton FA2 kernels compiled for an H100
(sm_90), on a machine without a GPU.

    pip install --target /tmp/triton36 triton==3.6.0       # the Triton of the GPU runs
    PYTHONPATH=/tmp/triton36:. python docs/experiments/kernel_resources.py [MODULE] [KERNEL ...]

Each kernel is specialised as a launch on the GPU would specialise it (``JITFunction.warmup`` with CPU
tensors and a stand-in driver that names an sm_90 target: the same divisibility and ``== 1`` hints), then
Triton's own ``cuobjdump`` reads the cubin. float16, D = 128, contiguous [16, 16, 1024, 128] tensors, no
variant; ``BM``/``BN`` (default 64 x 128), ``GROUP`` (query heads per KV head, default 1) in the environment.

The stack figure (bytes of local memory per thread) is what the GPU reports as ``n_spills * 4``. Found this way (and confirmed on an
H100): from 2368ffc the dK/dV kernel spilled (1448-1912 bytes per thread against 0-128 before), because
its loop over the group's query heads, no longer compiled away at group = 1, carried the accumulators
around the inner loops (3363f45 specialised the group again; the commit after it folded the group into
the inner loops, which removed that loop). Another Triton (3.9 here) gives other figures: use the GPU's.

A record of an experiment, not tested code.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

sys.path.insert(0, os.getcwd())
from tests.test_triton_compile import FLOATS, POINTERS  # noqa: E402


class _Sm90:
    """Enough of a driver for ``warmup``: the target, device 0, stream 0."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


_DTYPES = {"*fp16": torch.float16, "*fp32": torch.float32, "*i32": torch.int32}
_INTS = {"len_q": 1024, "len_k": 1024, "heads_q": 16, "heads_kv": 16, "seq_bucket": 1024, "window_left": -1,
         "window_right": -1, "chunk": 0, "head_dim": 128}


def _argument(name: str, group: int):
    if name in POINTERS:
        return torch.empty(64, dtype=torch.float32 if name == "DQ" else _DTYPES[POINTERS[name]])
    if name in FLOATS:
        return 0.0 if name == "softcap" else 0.088
    if name.startswith("stride"):
        # [B, H, N, D] contiguous: column stride 1, row stride D, batch and head strides multiples of 16
        return 1 if name[-1] in "d" or name == "stride_lm" else 128 if name[-1] in "mn" else 1024 * 128 * 16
    if name == "group":
        return group
    return _INTS.get(name, 7)


def figures(module, name: str, constants: dict, group: int = 1, warps: int = 8, stages: int = 3):
    """(registers, stack bytes per thread, shared bytes) of ``module.name`` compiled for sm_90."""
    kernel = getattr(module, name)
    constants = {k: v for k, v in constants.items() if k in {p.name for p in kernel.params}}
    args = [_argument(p.name, group) for p in kernel.params if not p.is_constexpr]
    compiled = kernel.warmup(*args, grid=(1,), num_warps=warps, num_stages=stages, **constants)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = int(re.search(r"REG:(\d+)", text).group(1))
    stack = int(re.search(r"STACK:(\d+)", text).group(1))
    return regs, stack, compiled.metadata.shared


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "kernels/triton_attention.py"
    spec = importlib.util.spec_from_file_location("resources_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    driver.set_active(_Sm90())
    block_m, block_n = int(os.environ.get("BM", 64)), int(os.environ.get("BN", 128))
    group = int(os.environ.get("GROUP", 1))
    base = dict(BLOCK_D=128, EVEN_D=True, HEAD_DIM=128, SPLIT=True, ALIGNED=True, WINDOW=False, CHUNK=False,
                SOFTCAP=False, ALIBI=False, SINKS=False, VARLEN=False, NATURAL=False, INNER_SCALED=False,
                LIBDEVICE=True, ATOMIC_DQ=False, BLOCK_M=block_m, BLOCK_N=block_n)
    print(f"{path}: triton {triton.__version__}, sm_90, float16, D = 128, tiles {block_m} x {block_n}, "
          f"group {group}")
    for name in sys.argv[2:] or ["_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"]:
        for tma in (False, True):
            for causal in (False, True):
                regs, stack, shared = figures(module, name, {**base, "TMA": tma, "CAUSAL": causal}, group)
                print(f"  {name} {'descriptors' if tma else 'pointers':11s} {'causal' if causal else 'full':6s}: "
                      f"{regs} registers, stack {stack} B, shared {shared} B", flush=True)


if __name__ == "__main__":
    main()
