"""The Triton kernels compile for a GPU, on a machine without one.

Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU runs check the kernels) runs the Python of a
kernel, not its compiler: code the interpreter accepts can still be refused when compiled for a GPU
(a pointer reassigned inside an ``if``, once, in the FA2 forward's variable-length path). This test
compiles each kernel, all the way to a cubin with the ptxas that ships with Triton, for an sm_90 target
(the H100's) in the configurations that switch the most code on: every variant at once, and none. It
needs no GPU; it is skipped where Triton's NVIDIA backend or its ptxas is missing.

The compiling happens in a fresh Python process with ``TRITON_INTERPRET`` removed from its environment:
in a process where the interpreter is on (``tests/conftest.py`` turns it on), ``triton.jit`` makes
interpreter objects, not compilable ``JITFunction``s, and the kernels' ``@triton.jit`` helpers with them.
One process compiles every case (one torch and Triton import) and reports each as JSON.

Argument types come from the parameter names: the pointers named below, the float scalars named below,
every other runtime parameter an int32, and the compile-time constants given per kernel, which must be
exactly the kernel's (a kernel that gains or loses one fails here, naming it).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
F16, F32, I32 = "*fp16", "*fp32", "*i32"
POINTERS = {"Q": F16, "K": F16, "V": F16, "Out": F16, "DO": F16, "DOut": F16, "DK": F16, "DV": F16, "DQ": F16,
            "Lse": F32, "Delta": F32, "Rows": F32, "Slopes": F32, "Sinks": F32, "OutPart": F32, "LsePart": F32,
            "CuQ": I32, "CuK": I32, "BlockTable": I32, "SeqlensK": I32, "QDescale": F32, "KDescale": F32,
            "VDescale": F32}
FLOATS = {"qk_scale", "sm_scale", "softcap"}
# descriptor -> (dtype, its rows' constant, its columns' constant: v and dO are v's head dim wide)
DESCRIPTORS = {"DescK": ("fp16", "BLOCK_N", "BLOCK_D"), "DescV": ("fp16", "BLOCK_N", "BLOCK_DV"),
               "DescQ": ("fp16", "BLOCK_M", "BLOCK_D"), "DescDO": ("fp16", "BLOCK_M", "BLOCK_DV"),
               "DescDQ": ("fp32", "BLOCK_M", "BLOCK_D")}
VARIANTS = ("WINDOW", "CHUNK", "SOFTCAP", "ALIBI", "SINKS", "VARLEN")
TILE = dict(BLOCK_D=64, EVEN_D=True, BLOCK_DV=64, EVEN_DV=True, SAME_DV=True, BLOCK_M=64, BLOCK_N=64)
# Multi-head latent attention's q/k 192 (a 256 tile, masked) with v 128: v's own tile, no TMA.
MLA_TILE = dict(BLOCK_D=256, EVEN_D=False, BLOCK_DV=128, EVEN_DV=True, SAME_DV=False, BLOCK_M=64, BLOCK_N=64)


def _flags(on: bool) -> dict:
    return {name: on for name in VARIANTS}


_BWD_FLAGS = {k: v for k, v in _flags(True).items() if k != "SINKS"}  # dsinks are summed outside the kernels

# case id -> (module under flashverify_kernels, kernel, compile-time constants)
CASES = {
    # NATURAL: the running max in natural units, which a softcap, ALiBi or sinks need
    # TMA: the unmasked tiles through tensor descriptors built on the host (dense rows only)
    **{f"fwd_{name}": ("triton.attention", "_attn_fwd",
                       {**TILE, **_flags(on), "ALIGNED": True, "CAUSAL": True, "SPLIT": True, "INNER_SCALED": False,
                        "NATURAL": on, "LIBDEVICE": True, "TMA": not on, "DESCALE": False})
       for name, on in (("plain", False), ("every_variant", True))},
    # float8 (e4m3) q, k, v with FlashAttention-3's descales, out bfloat16: pointer loads (no TMA)
    "fwd_fp8_descaled": ("triton.attention", "_attn_fwd",
                         {**TILE, **_flags(False), "ALIGNED": True, "CAUSAL": True, "SPLIT": True,
                          "INNER_SCALED": False, "NATURAL": False, "LIBDEVICE": True, "TMA": False, "DESCALE": True}),
    "fwd_scores_modified_tma": ("triton.attention", "_attn_fwd",
                                {**TILE, **_flags(False), "SOFTCAP": True, "ALIBI": True, "SINKS": True, "ALIGNED": True,
                                 "CAUSAL": True, "SPLIT": True, "INNER_SCALED": False, "NATURAL": True,
                                 "LIBDEVICE": True, "TMA": True, "DESCALE": False}),
    # ATOMIC_DQ (dK/dV only): dQ added with atomics from the dK/dV kernel (deterministic=False); GQA (dK/dV
    # only): one loop over (query head, Q block), taken here without atomics, the plain loop with them; MASKED_TMA
    # (backward only; the launcher's choice at head dim 128): the masked tiles through the descriptors too
    **{f"{kernel}{suffix}": ("triton.attention", kernel,
                             {**TILE, **flags, "ALIGNED": True, "CAUSAL": True, "SPLIT": True, "NATURAL": True,
                              "LIBDEVICE": True, "TMA": tma, "MASKED_TMA": tma,
                              **({"ATOMIC_DQ": atomic, "GQA": not atomic} if kernel == "_attn_bwd_dkdv" else {})})
       for kernel in ("_attn_bwd_dkdv", "_attn_bwd_dq")
       for suffix, flags, tma, atomic in (
           ("", _BWD_FLAGS, False, False),
           ("_tma", {**_BWD_FLAGS, "WINDOW": False, "CHUNK": False, "VARLEN": False}, True, False),
           ("_atomic_dq", _BWD_FLAGS, False, True),
           ("_tma_atomic_dq", {**_BWD_FLAGS, "WINDOW": False, "CHUNK": False, "VARLEN": False}, True, True))
       if kernel == "_attn_bwd_dkdv" or not atomic},
    # A value head dim of its own (head_dim_v): forward, dK/dV and dQ kernels with v's own tile width.
    **{f"{kernel}_mla": ("triton.attention", kernel,
                         {**MLA_TILE, **(_flags(True) if kernel == "_attn_fwd" else _BWD_FLAGS), "ALIGNED": True,
                          "CAUSAL": True, "SPLIT": True, "NATURAL": True, "LIBDEVICE": True, "TMA": False,
                          **({"INNER_SCALED": False, "DESCALE": False} if kernel == "_attn_fwd" else {"MASKED_TMA": False}),
                          **({"ATOMIC_DQ": False, "GQA": True} if kernel == "_attn_bwd_dkdv" else {})})
       for kernel in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq")},
    "_attn_bwd_delta": ("triton.attention", "_attn_bwd_delta",
                        dict(BLOCK_D=64, EVEN_D=True, ALIGNED=True, VARLEN=True, ROWS=False, BLOCK_M=64)),
    # ROWS: also the Gluon dK/dV kernel's rows buffer (dense batches)
    "_attn_bwd_delta_rows": ("triton.attention", "_attn_bwd_delta",
                             dict(BLOCK_D=64, EVEN_D=True, ALIGNED=True, VARLEN=False, ROWS=True, BLOCK_M=64)),
    "_decode_split": ("triton.decode", "_decode_split",
                      dict(BLOCK_D=64, EVEN_D=True, BLOCK_DV=64, EVEN_DV=True, BLOCK_M=16, BLOCK_N=64, CAUSAL=True,
                           WINDOW=True, SOFTCAP=True, ALIBI=True, SINKS=True, NATURAL=True, LIBDEVICE=True)),
    "_decode_combine": ("triton.decode", "_decode_combine", dict(BLOCK_D=64, BLOCK_M=16)),
}


def _compile_one(module: str, name: str, constexprs: dict) -> tuple[str, str]:
    """In the child process: ("ok", ""), ("skip", why) or ("fail", the error)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(f"flashverify_kernels.{module}"), name)
    if not isinstance(kernel, JITFunction):
        return "fail", f"{module}.{name} is a {type(kernel).__name__}, not a JITFunction: is TRITON_INTERPRET set?"
    declared = {p.name for p in kernel.params if p.is_constexpr}
    if declared != set(constexprs):
        return "fail", (f"{module}.{name}: the test gives constants {sorted(constexprs)}, the kernel declares "
                        f"{sorted(declared)}")
    signature = {p.name: "constexpr" if p.is_constexpr else POINTERS.get(p.name) or
                 ("fp32" if p.name in FLOATS else "i32") for p in kernel.params}
    if name == "_attn_bwd_dkdv":
        signature["DQ"] = "*fp32"  # the float32 dQ sums the launcher gives it (atomic dQ)
    if constexprs.get("DESCALE"):  # float8 inputs, bfloat16 out
        signature.update(Q="*fp8e4nv", K="*fp8e4nv", V="*fp8e4nv", Out="*bf16")
    # Descriptor arguments: host-built [B, H, N, D] descriptors with TMA, the tensors themselves without.
    for desc, (dtype, rows, cols) in DESCRIPTORS.items():
        if desc in signature:
            on = constexprs["TMA"] and (desc != "DescDQ" or constexprs["ATOMIC_DQ"])
            signature[desc] = (f"tensordesc<{dtype}[1,1,{constexprs[rows]},{constexprs[cols]}]>" if on
                               else f"*{dtype}")
    try:
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32))
    except Exception as exc:  # noqa: BLE001 - reported to the parent whatever it is
        text = f"{type(exc).__name__}: {exc}"
        if "ptxas" in text and ("not found" in text or "No such file" in text):
            return "skip", f"Triton's ptxas is not available here: {text.splitlines()[0]}"
        return "fail", text
    return "ok", ""


def _child_main() -> None:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        print(json.dumps({case: ["skip", f"this Triton cannot compile ahead of time here: {exc}"] for case in CASES}))
        return
    print(json.dumps({case: list(_compile_one(*CASES[case])) for case in CASES}))


@functools.lru_cache(maxsize=1)
def _results() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    proc = subprocess.run([sys.executable, "-c", "from tests.test_triton_compile import _child_main; _child_main()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the compiling process exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90(case):
    status, message = _results()[case]
    if status == "skip":
        pytest.skip(message)
    assert status == "ok", f"{case} does not compile for sm_90: {message}"
