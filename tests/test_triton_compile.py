"""The Triton kernels compile for a GPU, on a machine without one.

Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU runs check the kernels) runs the Python of a
kernel, not its compiler: code the interpreter accepts can still be refused when compiled for a GPU
(a pointer reassigned inside an ``if``, once, in the FA2 forward's variable-length path). This test
compiles each kernel, all the way to a cubin with the ptxas that ships with Triton, for an sm_90 target
(the H100's) in the configurations that switch the most code on: every variant at once, and none. It
needs no GPU; it is skipped where Triton's NVIDIA backend or its ptxas is missing.

Argument types come from the parameter names: the pointers named below, the float scalars named below,
every other runtime parameter an int32, and the compile-time constants given per kernel, which must be
exactly the kernel's (a kernel that gains or loses one fails here, naming it).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from kernels import triton_attention as ta  # noqa: E402
from kernels import triton_decode as td  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - an older or newer Triton without these names
    pytest.skip("this Triton has no triton.compiler.ASTSource / GPUTarget", allow_module_level=True)

TARGET = GPUTarget("cuda", 90, 32)
F16, F32, I32 = "*fp16", "*fp32", "*i32"
POINTERS = {"Q": F16, "K": F16, "V": F16, "Out": F16, "DO": F16, "DOut": F16, "DK": F16, "DV": F16, "DQ": F16,
            "Lse": F32, "Delta": F32, "Slopes": F32, "Sinks": F32, "OutPart": F32, "LsePart": F32,
            "CuQ": I32, "CuK": I32, "BlockTable": I32, "SeqlensK": I32}
FLOATS = {"qk_scale", "sm_scale", "softcap"}
VARIANTS = ("WINDOW", "CHUNK", "SOFTCAP", "ALIBI", "SINKS", "VARLEN")
TILE = dict(BLOCK_D=64, EVEN_D=True, BLOCK_M=64, BLOCK_N=64)


def _jit(kernel):
    """The kernel's JITFunction (under the interpreter the module holds an InterpretedFunction of it)."""
    return getattr(kernel, "fn", kernel) if not hasattr(kernel, "params") else kernel


def _compile(kernel, constexprs: dict) -> None:
    params = _jit(kernel).params
    declared = {p.name for p in params if p.is_constexpr}
    assert declared == set(constexprs), (
        f"{kernel.__name__ if hasattr(kernel, '__name__') else kernel}: the test gives constants "
        f"{sorted(constexprs)}, the kernel declares {sorted(declared)}")
    signature = {p.name: "constexpr" if p.is_constexpr else POINTERS.get(p.name) or
                 ("fp32" if p.name in FLOATS else "i32") for p in params}
    try:
        triton.compile(ASTSource(fn=_jit(kernel), signature=signature, constexprs=constexprs), target=TARGET)
    except Exception as exc:
        if "ptxas" in str(exc) and ("not found" in str(exc) or "No such file" in str(exc)):
            pytest.skip(f"Triton's ptxas is not available here: {str(exc).splitlines()[0]}")
        raise


def _flags(on: bool) -> dict:
    return {name: on for name in VARIANTS}


@pytest.mark.parametrize("on", [False, True], ids=["plain", "every_variant"])
def test_fa2_forward_compiles_for_sm90(on):
    # NATURAL: the running max in natural units, which a softcap, ALiBi or sinks need
    _compile(ta._attn_fwd, {**TILE, **_flags(on), "ALIGNED": True, "CAUSAL": True, "SPLIT": True,
                            "INNER_SCALED": False, "NATURAL": on, "LIBDEVICE": True})


@pytest.mark.parametrize("kernel", ["_attn_bwd_dkdv", "_attn_bwd_dq"])
def test_fa2_backward_compiles_for_sm90(kernel):
    flags = {k: v for k, v in _flags(True).items() if k != "SINKS"}  # dsinks are summed outside the kernels
    _compile(getattr(ta, kernel), {**TILE, **flags, "ALIGNED": True, "CAUSAL": True, "SPLIT": True,
                                   "NATURAL": True, "LIBDEVICE": True})


def test_fa2_delta_compiles_for_sm90():
    _compile(ta._attn_bwd_delta, dict(BLOCK_D=64, EVEN_D=True, ALIGNED=True, VARLEN=True, BLOCK_M=64))


def test_decode_and_combine_compile_for_sm90():
    _compile(td._decode_split, dict(BLOCK_D=64, EVEN_D=True, BLOCK_M=16, BLOCK_N=64, CAUSAL=True, WINDOW=True,
                                    SOFTCAP=True, ALIBI=True, SINKS=True, NATURAL=True, LIBDEVICE=True))
    _compile(td._decode_combine, dict(BLOCK_D=64, BLOCK_M=16))
