"""Registry of attention and softmax implementations under test.

Note
----
Why it exists: the suite checks kernels it has never seen. Each kernel is declared once, with what it
supports (dtypes, devices, head dims, grouped-query attention, causal alignment, tunable block sizes,
backward, an exposed Delta, determinism), and the generic properties in ``verify/`` run over those
declarations. A property that a declaration says is unsupported is skipped with a visible reason.

Where things are: :class:`Implementation` and its allowed values are defined in
:mod:`flashverify_kernels.declaration` (re-exported here); the kernels are plain modules by backend
(``pytorch/``: the blocked FA1/FA2, the online softmax, the adapters to PyTorch's attention; ``triton/``;
``hopper/``) that import nothing from here; this module imports them and holds the one list of shipped
declarations, ``SHIPPED``.

What is tested: every ``Implementation`` of kind ``"attention"`` runs the forward and backward
catalogue; every one of kind ``"softmax"`` runs the online-softmax catalogue.

How to add a kernel: write a function with the contract of docs/contract.md (a copyable example is
``examples/reference_attention.py``),
``forward(q, k, v, *, causal, scale) -> (out, lse)`` (or ``out`` alone), declare it::

    MY_KERNEL = Implementation(name="my_kernel", forward=my_forward, gqa=True,
                               block_m=(64, 128), block_n=(32, 64))

and either add it to ``SHIPPED`` below (a shipped kernel lives in its own module under its backend's folder,
which holds the kernel only, and is declared here) or point the suite at it with
``pytest verify --impl package.module:MY_KERNEL`` or ``--impl path/to/file.py:MY_KERNEL``. A plain
callable also works: ``--impl path/to/file.py:my_forward`` gets the defaults of :func:`from_callable`.
A function written in flash_attn's or xformers' calling convention needs no glue: ``--impl
path/to/file.py:my_func --convention flash_attn`` (or ``...:my_func@flash_attn``; :mod:`flashverify_kernels.calling_conventions`).

Optional capabilities a declaration may add (each unlocks the properties that need it):

``deterministic`` (default True)
    Repeated calls on the same inputs give bitwise identical results (forward and autograd backward).
    ``run_to_run_identical`` holds a declared-deterministic kernel to that; for one declared
    ``deterministic=False`` (atomics in its backward, say) it measures the run-to-run difference,
    records it in the report and skips with the measured values in the reason.
``out_buffers`` (default False)
    The forward also accepts keyword tensors ``out=`` (q's shape and dtype) and ``lse=``
    (``[B, Hq, Nq]``, the LSE dtype), each optional: views with any strides into caller buffers. It writes
    its results there, touches no memory outside the views, and returns them as ``(out, lse)``.
    ``outputs_stay_in_bounds`` passes views into NaN-filled buffers and checks that every padding
    element is bitwise unchanged afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from flashverify_kernels import calling_conventions
from flashverify_kernels.declaration import (ALIGNMENTS, ALL_DTYPES, DECLARED, KINDS, Implementation,
                                             ImplementationError, declare)
from flashverify_kernels.pytorch import adapters, blocked, online_softmax

try:
    from flashverify_kernels.triton import attention as triton_attention
    from flashverify_kernels.triton import decode as triton_decode
    from flashverify_kernels.triton import softmax as triton_softmax
except ImportError:  # Triton is an optional extra: without it the Triton kernels are not shipped
    triton_attention = triton_decode = triton_softmax = None

__all__ = ["ALIGNMENTS", "ALL_DTYPES", "KINDS", "SHIPPED", "Implementation", "ImplementationError",
           "declare", "default_selection", "from_callable", "load", "registry", "split_convention"]

# ------------------------------------------------------------------------------------ online softmax
_SOFTMAX_BLOCKS = (1, 2, 3, 5, 8, 16, 64)

STREAMING = Implementation(name="softmax_streaming", kind="softmax", forward=online_softmax.streaming_softmax,
                           autograd=False, description="online softmax, one element at a time")
BLOCKED = Implementation(name="softmax_blocked", kind="softmax", forward=online_softmax.blocked_softmax,
                         block_n=_SOFTMAX_BLOCKS, block_m=(1,), autograd=False,
                         description="online softmax, one block at a time")
BATCHED = Implementation(name="softmax_batched", kind="softmax", forward=online_softmax.batched_softmax,
                         autograd=False, description="softmax of all rows at once")

# ---------------------------------------------------------------------- blocked PyTorch FlashAttention
# Any positive block size is valid; the suite draws from these.
_BLOCKS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 32, 64)
# The tile loops run in Python, a few launches per tile: at most 32 x 32 tiles per head (lengths up to
# 2048 with 64-wide tiles) keeps an example under a second or so on a GPU.
_MAX_TILES = 1024

# Every variant of the attention spec: windows, chunks, softcap, ALiBi, sinks, split-KV, variable-length
# sequences packed, padded or in a paged KV cache of any page size, and a value head dim of its own.
_EVERY_VARIANT = dict(gqa=True, windows=True, chunks=True, softcap=True, alibi=True, sinks=True, splits=True,
                      sequences=("dense", "packed", "padded", "paged"), head_dim_v=True)
FA2_BLOCKED = Implementation(
    name="fa2_blocked", forward=blocked.fa2_forward, backward=blocked.fa2_backward, **_EVERY_VARIANT,
    block_m=_BLOCKS, block_n=_BLOCKS, sibling="fa1_blocked", out_buffers=True, max_tiles=_MAX_TILES,
    dtypes=(*ALL_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2), descale=True,
    description="blocked PyTorch FlashAttention-2: outer-scaled forward (float8 with descales too), blocked backward",
)
FA1_BLOCKED = Implementation(
    name="fa1_blocked", forward=blocked.fa1_forward, backward=blocked.fa2_backward, **_EVERY_VARIANT,
    block_m=_BLOCKS, block_n=_BLOCKS, out_buffers=True, max_tiles=_MAX_TILES,
    description="blocked PyTorch FlashAttention-1: inner-scaled forward",
)

# ------------------------------------------------------------------------------------------ adapters
EAGER = Implementation(
    name="eager", forward=adapters.eager_forward, **_EVERY_VARIANT,
    description="same-precision eager attention (the criterion-1 baseline)",
)
SDPA_MATH = Implementation(
    name="sdpa_math", forward=adapters.sdpa_math_forward, gqa=True, causal_alignment="top_left",
    returns_lse=False, in_default=False, description="torch scaled_dot_product_attention, math backend",
)
# The GPU backends, declared conservatively: the backward of every fused backend sums with atomics or in
# a tiling-dependent order (not deterministic); the dtypes and head dims are the ones each backend
# documents. Like every adapter to a peer they run when named (--impl sdpa_flash), not in the default
# selection.
def _gpu_peer(**fields) -> Implementation:
    """An adapter to a GPU peer: CUDA only, top-left causal, out alone, not deterministic, run when named."""
    return Implementation(devices=("cuda",), causal_alignment="top_left", returns_lse=False, deterministic=False,
                          in_default=False, **fields)


SDPA_FLASH = _gpu_peer(
    name="sdpa_flash", forward=adapters.sdpa_flash_forward, dtypes=adapters.HALF, head_dims=adapters.MULTIPLES_OF_8,
    description="torch scaled_dot_product_attention, flash backend (FlashAttention-2)",
)
SDPA_EFFICIENT = _gpu_peer(
    name="sdpa_efficient", forward=adapters.sdpa_efficient_forward, dtypes=adapters.EFFICIENT_DTYPES,
    head_dims=adapters.MULTIPLES_OF_8,
    description="torch scaled_dot_product_attention, memory-efficient backend (xFormers kernel)",
)
SDPA_CUDNN = _gpu_peer(
    name="sdpa_cudnn", forward=adapters.sdpa_cudnn_forward, dtypes=adapters.HALF, head_dims=adapters.CUDNN_HEAD_DIMS,
    description="torch scaled_dot_product_attention, cuDNN backend",
)
# FlexAttention: every variant it expresses through its masks and score modifications (flashverify_kernels/pytorch/adapters.py
# says how), aligned bottom-right, with its LSE; no padded sequences, paged KV cache or split-KV (not in its
# API). A GPU peer as those above (CUDA only, run when named, not declared deterministic: besides the fused
# backward's order, the sinks' gradient is summed with atomics), but bottom-right and with the LSE.
_FLEX_VARIANTS = dict(gqa=True, windows=True, chunks=True, softcap=True, alibi=True, sinks=True,
                      sequences=adapters.FLEX_SEQUENCES, causal_alignment="bottom_right",
                      returns_lse=True, in_default=False)
FLEX_ATTENTION = Implementation(
    name="flex_attention", forward=adapters.flex_attention_forward, dtypes=adapters.FLEX_DTYPES,
    head_dims=adapters.FLEX_HEAD_DIMS, devices=("cuda",), deterministic=False, **_FLEX_VARIANTS,
    # Each new shape, dtype and mask compiles a kernel (seconds to a minute with 16 workers on one GPU): at
    # the gpu profile's 15 examples per property some properties ran past pytest's 300 s timeout.
    max_examples=5,
    description="torch FlexAttention, compiled (fused Triton kernel): block masks (bottom-right causal, windows, "
                "chunks, packed sequences as documents), softcap and ALiBi as score mods, sinks as a key of value 0",
)
# The same adapter through uncompiled flex_attention (FlexAttention's unfused math and math backward), on CPU
# too and in float64: it checks the adapter's masks, score modifications, sinks and LSE without a GPU, not
# the fused kernel (tests/test_flex_adapter.py; pytest verify --impl flashverify_kernels.registry:FLEX_ATTENTION_UNCOMPILED).
# Declared float32 and float64 only: in float16 the roundings are those of FlexAttention's reference math,
# which no one runs as a kernel (its backward casts scale * dS to the input dtype). Not shipped.
FLEX_ATTENTION_UNCOMPILED = Implementation(
    name="flex_attention_uncompiled", forward=adapters.flex_attention_uncompiled_forward,
    dtypes=(torch.float32, torch.float64), **_FLEX_VARIANTS,
    description="torch FlexAttention, uncompiled (its unfused math), with the flex_attention adapter's variants",
)

_SHIPPED_WITHOUT_TRITON = (STREAMING, BLOCKED, BATCHED, FA2_BLOCKED, FA1_BLOCKED,
                           EAGER, SDPA_MATH, SDPA_FLASH, SDPA_EFFICIENT, SDPA_CUDNN, FLEX_ATTENTION)

# -------------------------------------------------------------------------------------------- Triton
# On a machine without a GPU the Triton kernels run in Triton's interpreter when TRITON_INTERPRET=1 is set
# before Triton is imported: they then also declare the CPU (the kernel modules' DEVICES), only small
# tiles (the interpreter runs every program in Python), and the interpreter's bfloat16 tl.dot as an
# environment limit.
if triton_attention is not None and triton_softmax is not None:
    _INTERPRET = triton_attention.INTERPRET
    _BF16_DOT_LIMIT = ((torch.bfloat16, "Triton interpreter: tl.dot on bfloat16 operands is unsupported "
                                        "(bf16 held as int16); bf16 is verified on GPU only"),)
    _ENVIRONMENT_LIMITS = _BF16_DOT_LIMIT if _INTERPRET else ()
    # The interpreter converts float32 to float8 by truncation, not to nearest as the GPU does (a p of 0.478
    # becomes 0.25 in e5m2): the cast of p then errs by up to twice what the bound allows.
    _FP8_LIMITS = tuple((dtype, "Triton interpreter: float32 -> float8 conversions truncate instead of rounding "
                                "to nearest; float8 is verified on GPU only")
                        for dtype in triton_attention.FP8_DTYPES) if _INTERPRET else ()
    # The interpreter runs every program instance in Python: cap the examples per property there.
    _MAX_EXAMPLES = 10 if _INTERPRET else None
    # Each query head (and each KV split of the decode kernel) is a program instance, which the interpreter
    # runs in Python: past 4 heads in all (B * Hq; groups up to 16 and 128 splits on a GPU) a case costs
    # seconds there. The blocked kernels draw them on a CPU, and a GPU run draws them for these.
    _MAX_BATCH_HEADS = 4 if _INTERPRET else None
    _MAX_SPLITS = 8 if _INTERPRET else None
    # Tile sizes the suite draws. The launchers accept powers of two from 16 to 256, but float32 tiles of
    # 128 rows do not fit a GPU's shared memory for large head dims, and every dtype must run every tile.
    _ATTENTION_BLOCKS = (16, 32) if _INTERPRET else (16, 32, 64)
    _TRITON_SOFTMAX_BLOCKS = (16, 32, 64) if _INTERPRET else (16, 32, 64, 256, 1024)

    TRITON_SOFTMAX = Implementation(
        name="triton_softmax", kind="softmax", forward=triton_softmax.softmax,
        dtypes=triton_softmax.DTYPES, devices=triton_softmax.DEVICES,
        block_m=(1,), block_n=_TRITON_SOFTMAX_BLOCKS, autograd=False,
        description="Triton online softmax: one pass for (m, l), one pass to normalise",
    )
    def _triton_attention(**fields) -> Implementation:
        """The fields the Triton FA1 and FA2 share: their dtypes, devices and head dims, GQA, the variants
        (windows, chunks, softcap, ALiBi, sinks, packed sequences, a value head dim of its own), the drawn tiles, the FA2 backward,
        deterministic, out= buffers, the interpreter's limits."""
        return Implementation(**{
            "backward": triton_attention.fa2_backward, "deterministic": True, "block_m": _ATTENTION_BLOCKS,
            "block_n": _ATTENTION_BLOCKS, "max_examples": _MAX_EXAMPLES, "dtypes": triton_attention.DTYPES,
            "devices": triton_attention.DEVICES, "head_dims": triton_attention.HEAD_DIMS, "gqa": True,
            "head_dim_v": True, "windows": True, "chunks": True, "softcap": True, "alibi": True, "sinks": True,
            "sequences": ("dense", "packed"), "out_buffers": True, "environment_limits": _ENVIRONMENT_LIMITS,
            "max_batch_heads": _MAX_BATCH_HEADS, **fields})

    TRITON_FA2 = _triton_attention(
        name="triton_fa2", forward=triton_attention.fa2_forward, sibling="triton_fa1",
        dtypes=triton_attention.FORWARD_DTYPES, descale=True, environment_limits=_ENVIRONMENT_LIMITS + _FP8_LIMITS,
        min_block={dtype: triton_attention.FP8_MIN_TILE for dtype in triton_attention.FP8_DTYPES},
        description="Triton FlashAttention-2: outer-scaled forward, Delta/dK-dV/dQ backward without atomics",
    )
    TRITON_FA1 = _triton_attention(
        name="triton_fa1", forward=triton_attention.fa1_forward,
        description="Triton FlashAttention-1: inner-scaled forward (renormalised every KV step); FA2 backward",
    )
    # The FA2 kernels as a caller gets them without block sizes: tiles, warps and stages autotuned per head
    # dim, dtype, causal flag, variant and length class (the configurations flashverify_kernels.triton.bench times). On the GPU
    # only (the interpreter always runs its small fixed tiles) and named, not in the default selection: every
    # new autotuning key compiles and times several configurations of three kernels (a minute per example
    # with 16 workers on one H100), hence few examples per property.
    _AUTOTUNED = () if _INTERPRET else (_triton_attention(
        name="triton_fa2_autotuned", forward=triton_attention.fa2_forward, block_m=None, block_n=None,
        in_default=False, max_examples=4,
        description="Triton FlashAttention-2 with autotuned tiles (no block_m/block_n: what flashverify_kernels.triton.bench times)",
    ),)
    # The FA2 kernels with deterministic=False: the dK/dV kernel adds dQ with atomics (5 tile products per
    # pair of tiles, not 7; no dQ kernel), so dQ's last bits may change from run to run. Run when named.
    TRITON_FA2_ATOMIC_DQ = _triton_attention(
        name="triton_fa2_atomic_dq", forward=functools.partial(triton_attention.fa2_forward, deterministic=False),
        backward=functools.partial(triton_attention.fa2_backward, deterministic=False), deterministic=False,
        in_default=False,
        description="Triton FlashAttention-2, backward with dQ added by atomics in the dK/dV kernel (no dQ kernel)",
    )
    TRITON_DECODE = Implementation(
        name="triton_decode", forward=triton_decode.decode_forward, dtypes=triton_decode.DTYPES,
        devices=triton_decode.DEVICES, head_dims=triton_decode.HEAD_DIMS, gqa=True, head_dim_v=True, windows=True,
        softcap=True, alibi=True, sinks=True, splits=True, sequences=("paged",), max_len_q=triton_decode.MAX_QUERIES,
        max_splits=_MAX_SPLITS, max_batch_heads=_MAX_BATCH_HEADS, autograd=False, deterministic=True, environment_limits=_ENVIRONMENT_LIMITS, max_examples=_MAX_EXAMPLES,
        description="Triton split-KV decoding from a paged KV cache (1..16 queries per sequence) and its combine",
    )
    # The FA2 kernels as Hopper runs them by default (flashverify_kernels/hopper/forward.py and gluon_backward.py: the forward
    # and the backward's dK/dV kernel, warp-specialized, in Gluon), with gluon=True so that every drawn case
    # runs them (the drawn tiles go to the Triton dQ kernel, which runs at head dim 64 only: at 128 the
    # deterministic backward's dK/dV kernel adds dQ in a fixed order): declared as those kernels' limits
    # (float16/bfloat16, head dim 64 or 128, plain attention, positive scales).
    # Registered on a GPU of compute capability 9.0 only: the deterministic one in the default selection
    # there, the one whose dK/dV kernel adds dQ (deterministic=False) when named.
    _GLUON_FIELDS = dict(dtypes=(torch.float16, torch.bfloat16), head_dims=triton_attention.gluon_forward.HEAD_DIMS,
                         head_dim_v=False, windows=False, chunks=False, softcap=False, alibi=False, sinks=False, sequences=("dense",),
                         scales=(None, 0.5, 0.125, 1.0, 2.5, 1e-8, 0.1, 1 / 3))
    _GLUON = () if _INTERPRET or not triton_attention.gluon_forward.AVAILABLE or not torch.cuda.is_available() \
        or torch.cuda.get_device_capability() != (9, 0) else (_triton_attention(
            name="triton_fa2_gluon", forward=functools.partial(triton_attention.fa2_forward, gluon=True),
            description="FlashAttention-2 forward and backward dK/dV of Hopper (Gluon, warp-specialized); "
                        "Triton Delta, and dQ at head dim 64", **_GLUON_FIELDS), _triton_attention(
            name="triton_fa2_gluon_atomic_dq",
            forward=functools.partial(triton_attention.fa2_forward, gluon=True, deterministic=False),
            backward=functools.partial(triton_attention.fa2_backward, gluon=True, deterministic=False),
            deterministic=False, in_default=False,
            description="FlashAttention-2 forward and backward dK/dV of Hopper (Gluon, warp-specialized), dQ "
                        "added by TMA reduces in the dK/dV kernel; Triton Delta", **_GLUON_FIELDS))
    _TRITON: tuple[Implementation, ...] = (TRITON_SOFTMAX, TRITON_FA2, TRITON_FA1, *_AUTOTUNED, *_GLUON,
                                           TRITON_FA2_ATOMIC_DQ, TRITON_DECODE)
else:
    _TRITON = ()


def _unique(impls: tuple[Implementation, ...]) -> tuple[Implementation, ...]:
    """``impls`` unchanged, once no two of them share a name (names are how --impl selects them)."""
    seen: set[str] = set()
    for impl in impls:
        if impl.name in seen:
            raise ImplementationError(f"two shipped implementations are named {impl.name!r}: every name in "
                                      "flashverify_kernels.registry.SHIPPED must be unique")
        seen.add(impl.name)
    return impls


# Every shipped implementation, in the order of the default selection.
SHIPPED: tuple[Implementation, ...] = _unique(_SHIPPED_WITHOUT_TRITON + _TRITON)


def registry() -> dict[str, Implementation]:
    """Every shipped implementation, by name (a new dict on every call)."""
    return {impl.name: impl for impl in SHIPPED}


def from_callable(fn: Callable[..., Any], name: str, *, device: str) -> Implementation:
    """Declare a plain callable with the defaults of the contract (README.md): float16, bfloat16,
    float32 and float64 on the suite's device, bottom-right causal, autograd, any head dim, no GQA,
    fixed tiles, unless the callable carries other fields from :func:`flashverify_kernels.declaration.declare`.
    Whether it returns the LSE is found out when it is called."""
    declared = getattr(fn, DECLARED, {})
    fields = {"devices": (torch.device(device).type,), "description": f"plain callable {name}", "plain": not declared,
              **declared}
    return Implementation(name=name, forward=fn, selector=name, **fields)


def _error_with_place(exc: BaseException) -> str:
    """``Type: message (file:line)`` for an error raised while importing a user's kernel: the line of
    the innermost frame outside importlib, or the syntax error's own place."""
    import traceback

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError):
        return text  # its message already names the file and line
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    if frames:
        text += f" ({frames[-1].filename}:{frames[-1].lineno})"
    return text


def _package_root(folder: Path) -> Path:
    """The first folder above ``folder`` that is not a package (has no ``__init__.py``), or ``folder``."""
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        folder = folder.parent
    return folder


def _importable(folder: Path) -> None:
    """Make ``folder``'s modules importable after every other place (a user's own packages, named like ours
    or not, never shadow the suite's or an installed one)."""
    text = str(folder)
    if text not in sys.path:
        sys.path.append(text)


def _load_attr(spec: str, names: Sequence[str] = ()) -> Any:
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        known = f" ({', '.join(sorted(names))})" if names else ""
        raise ImplementationError(
            f"--impl {spec!r} is neither a registered name{known} nor of the form "
            "package.module:attr or path/to/file.py:attr"
        )
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise ImplementationError(f"--impl {spec!r}: file {target!r} does not exist")
        # The kernel file's own folder is importable from it (as for `python file.py`): its helper
        # modules next to it can be imported by name. A file inside a package of the user's (kernels/my.py
        # with kernels/__init__.py) imports its siblings through that package: the folder above the package
        # becomes importable too, after everything else, so that it never shadows an installed package.
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        _importable(_package_root(path.resolve().parent))
        module_name = "flashverify_impl_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise ImplementationError(f"--impl {spec!r}: cannot load {target!r} as a Python file")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001 - any error in the user's file is a usage error
                del sys.modules[module_name]
                raise ImplementationError(f"--impl {spec!r}: importing {target!r} failed: "
                                          f"{_error_with_place(exc)}") from exc
    else:
        _importable(Path.cwd())  # a module of the user's repository, named from its root
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # noqa: BLE001 - ImportError, or any error raised while importing it
            raise ImplementationError(f"--impl {spec!r}: cannot import module {target!r}: "
                                      f"{_error_with_place(exc)}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImplementationError(f"--impl {spec!r}: module {target!r} has no attribute {attr!r}") from None


def split_convention(spec: str) -> tuple[str, str | None]:
    """``("mypkg:fn", "flash_attn")`` for ``"mypkg:fn@flash_attn"``; ``(spec, None)`` when it names none
    (an ``@`` inside a path or before the attribute is part of the spec)."""
    head, at, tail = spec.rpartition("@")
    return (head, tail) if at and head and tail.isidentifier() else (spec, None)


def _load_in_convention(spec: str, convention: str, *, device: str, shipped) -> Implementation:
    """A callable written in another API's calling convention (:mod:`flashverify_kernels.calling_conventions`),
    declared with the convention's defaults on the suite's device; named ``spec@convention``."""
    selector = f"{spec}@{convention}"
    if convention not in calling_conventions.CONVENTIONS:
        raise ImplementationError(f"--impl {selector!r}: {convention!r} is not a calling convention; known: "
                                  + ", ".join(calling_conventions.CONVENTIONS))
    words = (f"it speaks the suite's contract already: name it without a convention (--convention applies to "
             f"every --impl without its own @convention; to mix, write mypkg:fn@{convention} on the ones in "
             f"that convention)")
    if spec in shipped:
        raise ImplementationError(f"--impl {selector!r}: {spec!r} is a shipped implementation; {words}")
    obj = _load_attr(spec, names=list(shipped))
    if isinstance(obj, Implementation):
        raise ImplementationError(f"--impl {selector!r}: {spec!r} names an Implementation; {words}")
    if not callable(obj):
        raise ImplementationError(f"--impl {selector!r} names a {type(obj).__name__}, but should name a function "
                                  f"written in the {convention} convention")
    fields = {"devices": (torch.device(device).type,), "selector": selector, **getattr(obj, DECLARED, {})}
    return calling_conventions.adapt(obj, convention, name=selector, **fields)


def load(spec: str, *, device: str, convention: str | None = None) -> Implementation:
    """Resolve one ``--impl`` value: a registry name, ``package.module:attr`` or ``path/file.py:attr``;
    ``...:attr@CONVENTION``, or ``convention`` given (``--convention``, for a value without its own), for a
    callable written in another API's calling convention (:mod:`flashverify_kernels.calling_conventions`)."""
    shipped = registry()
    spec, own = split_convention(spec)
    if own or convention:
        return _load_in_convention(spec, own or convention, device=device, shipped=shipped)
    if spec in shipped:
        return shipped[spec]
    obj = _load_attr(spec, names=list(shipped))
    if isinstance(obj, Implementation):
        return dataclasses.replace(obj, selector=spec)
    if callable(obj):
        return from_callable(obj, spec, device=device)
    raise ImplementationError(
        f"--impl {spec!r} names a {type(obj).__name__}, but should name an Implementation or a callable"
    )


def default_selection(*, device: str) -> list[Implementation]:
    """Every shipped kernel that runs on this device (adapters to peers only when named)."""
    dev = torch.device(device).type
    return [impl for impl in registry().values() if dev in impl.devices and impl.in_default]
