"""A kernel that fails for another reason than a wrong answer, in words: out of device memory (its memory
released, so that the next tests can run), a resource it cannot have (Triton's ``OutOfResources``, a compile
error, a CUDA launch refused for its configuration), or an exception on a case its declaration allows (the
hint to declare its limits). Each is distinct from a wrong answer in the failure's words and the report's
failure kinds.
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
from typing import Any

import torch

from verify.gpu import exception_chain

# torch.cuda.OutOfMemoryError is the same class in recent torch; torch.OutOfMemoryError is newer.
OutOfMemoryError: type[RuntimeError] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def declare_hint(error: BaseException | None = None, *, case: Any = None, joiner: str = "\n  ") -> str:
    """The hint for a kernel that raised on a case its declaration allows: declare the limits it has, so
    that the suite draws only what it supports (as ``scale=None`` gets its own hint)."""
    what = "this dtype, head dim or length"
    if case is not None and getattr(case, "head_dim", None) is not None:
        what = f"{case.dtype} inputs, head_dim {case.head_dim} or Nq={case.len_q}, Nk={case.len_k}"
    return (f"{joiner}if the kernel does not support {what}, declare its limits (dtypes=, head_dims=, "
            "max_head_dim=, len_k_multiple=, ...: README.md, \"Declaring a kernel's limits\") and the suite draws "
            "only cases within them; otherwise the replay command reproduces the error")


def free_device_memory() -> None:
    """Release what dead tensors hold: collect reference cycles (tracebacks make them), then return
    the CUDA caching allocator's free blocks to the device."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# Bytes allocated on each CUDA device when the last example ended with nothing left to collect.
_SETTLED: dict[str, int] = {}


def release_example_memory(device: str) -> None:
    """After an example on ``device``: collect the reference cycles (a traceback's frames, an autograd
    graph) only when the example left tensors allocated, and then return the freed blocks to the device.

    A full collection walks every object of the process (torch, Triton and Hypothesis hold millions),
    about 0.15 s each time: as long as the run of one test's examples. Where an example's tensors all
    died with their references, nothing is allocated beyond what was settled, and the caching
    allocator's blocks are reused by the next example; when it needs more than the budget leaves,
    the allocator returns its cached blocks and retries by itself (the budget is its memory fraction).
    Whatever stays allocated after a collection (a buffer a kernel keeps across calls) becomes the new
    settled amount, so it does not make every later example collect."""
    allocated = torch.cuda.memory_allocated(device)
    if allocated <= _SETTLED.get(device, 0):
        _SETTLED[device] = allocated
        return
    gc.collect()
    torch.cuda.empty_cache()
    _SETTLED[device] = torch.cuda.memory_allocated(device)


def clear_frames(tb) -> None:
    """``traceback.clear_frames``, and the snapshot of each frame's locals that Python before 3.13 keeps
    past ``frame.clear()`` (taken by whatever read ``frame.f_locals``): the locals' tensors are let go."""
    while tb is not None:
        try:
            tb.tb_frame.clear()
        except RuntimeError:  # a frame still running (the caller's)
            pass
        else:
            tb.tb_frame.f_locals  # noqa: B018 - read after clear(), the snapshot drops the cleared names
        tb = tb.tb_next


def release_failed_example(exc: BaseException) -> None:
    """Drop the locals of the frames a failing example's exception unwound (and of the exceptions chained
    to it): its tensors. Hypothesis keeps the first failure while it shrinks, and pytest keeps the last one
    after the test (``sys.last_value``): with its frames, a failure on a large case would hold its inputs,
    outputs and references on the device, and every later example of the test, and the next tests of the
    worker, would run out of memory for that. The message and the lines of the traceback stay."""
    for e in exception_chain(exc):  # itself, a group's members, what each was raised from or during
        clear_frames(e.__traceback__)


def exception_line(exc: BaseException) -> str:
    """``module.Type: first line of the message`` (a CUDA out-of-memory message goes on for lines)."""
    kind = type(exc).__name__ if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{type(exc).__name__}"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{kind}: {first}" if first else kind


def release_out_of_memory(exc: BaseException) -> str:
    """Drop the tensors an out-of-memory exception keeps alive through its traceback (the locals of
    the frames it unwound), free the device memory, and return :func:`exception_line`."""
    text = exception_line(exc)
    clear_frames(exc.__traceback__)
    free_device_memory()
    return text


# Triton's OutOfResources names (``triton/compiler/compiler.py``) and the unit of their numbers.
_RESOURCE_UNITS = {"shared memory": "bytes of shared memory", "tensor memory": "columns of tensor memory",
                   "threads": "threads per block"}


# OutOfResources's own words, for one that reached us as text only (re-raised as another type).
_OUT_OF_RESOURCES_TEXT = re.compile(r"out of resource: (?P<name>[\w ]+?), Required: (?P<required>\d+), "
                                    r"Hardware limit: (?P<limit>\d+)")


# CUDA (and HIP) errors of a launch the driver refuses for this configuration, which leave the context
# usable (the sticky ones are verify.gpu.STICKY_PATTERNS): too many registers or threads per block, a
# grid or block dimension past the card's limits.
_LAUNCH_REFUSED = re.compile(r"too many resources requested for launch|LAUNCH_OUT_OF_RESOURCES|"
                             r"LaunchOutOfResources|invalid configuration argument|INVALID_CONFIGURATION|"
                             r"\bout of resources\b|ErrorOutOfResources", re.IGNORECASE)


# A compile failure raised as a plain error: MLIR's pass manager in Triton's backends.
_COMPILE_TEXT = re.compile(r"PassManager::run failed")


def _triton_class(module: str, name: str) -> type | None:
    """A Triton exception class, or None where Triton (or that class) is not loaded: an exception of that
    class can only have been raised once its module was, so Triton is never imported here (it may not be
    installed, and importing it is slow)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def _resource_cause(exc: BaseException) -> tuple[str, BaseException, dict[str, Any]] | None:
    """``(kind, error, details)`` for the resource failure in ``exc`` or what it was explicitly raised
    from (``raise ... from``; not an exception it was merely raised while handling, such as a fallback
    that failed for another reason): kind ``resources`` (Triton's OutOfResources: ``required``, ``limit``,
    ``name``), ``compile`` (a Triton compile error) or ``launch`` (a launch CUDA refused); else None."""
    out_of_resources = _triton_class("triton.runtime.errors", "OutOfResources")
    ptxas = _triton_class("triton.runtime.errors", "PTXASError")
    compilation = _triton_class("triton.compiler.errors", "CompilationError")
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (AssertionError, OutOfMemoryError)):  # a property's own failure, or out of memory
            return None
        if out_of_resources is not None and isinstance(e, out_of_resources):
            return "resources", e, {"required": getattr(e, "required", None), "limit": getattr(e, "limit", None),
                                    "name": getattr(e, "name", None)}
        if any(cls is not None and isinstance(e, cls) for cls in (compilation, ptxas)):
            return "compile", e, {}
        text = str(e)
        found = _OUT_OF_RESOURCES_TEXT.search(text)
        if found:
            return "resources", e, {"required": int(found["required"]), "limit": int(found["limit"]),
                                    "name": found["name"]}
        if isinstance(e, RuntimeError) and _COMPILE_TEXT.search(text):
            return "compile", e, {}
        if isinstance(e, RuntimeError) and _LAUNCH_REFUSED.search(text):
            return "launch", e, {}
        e = e.__cause__
    return None


def _where(case: Any) -> str:
    """``at head_dim 256 block 128x128 (float16)`` for a case (what it has of these)."""
    parts = []
    head_dim = getattr(case, "head_dim", None)
    if head_dim is not None:
        parts.append(f"head_dim {head_dim}")
    block_m, block_n = getattr(case, "block_m", None), getattr(case, "block_n", None)
    if block_m is None and block_n is None:
        parts.append("with the kernel's own blocks")
    else:
        parts.append(f"block {block_m if block_m is not None else 'own'}x{block_n if block_n is not None else 'own'}")
    dtype = getattr(case, "dtype", None)
    return "at " + " ".join(parts) + (f" ({dtype})" if dtype else "")


def _card(device: Any) -> str | None:
    """The CUDA device's name (``torch.cuda.get_device_name``), or None off CUDA or when it cannot be read."""
    try:
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_name(device)
    except Exception:
        return None


def _error_text(exc: BaseException, *, max_lines: int = 16) -> str:
    """The exception's type and full message (a compile error's source excerpt included), indented."""
    kind = type(exc).__name__ if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{type(exc).__name__}"
    body = str(exc).strip().splitlines()
    if not body:
        return kind
    if len(body) > max_lines:
        body = body[:max_lines] + [f"... ({len(body) - max_lines} more lines)"]
    return f"{kind}: " + "\n    ".join(body)


def resource_failure(exc: BaseException, case: Any, *, device: Any = None, where: str = "forward") -> str | None:
    """Words for a kernel that could not run ``case`` for a resource reason, or None for any other error.

    Recognised in ``exc`` or what it was raised from (``raise ... from``): Triton's ``OutOfResources``
    (shared memory, tensor memory or threads per block past the card's limit), Triton's compile errors
    (``CompilationError`` and its subclasses, ``PTXASError``, MLIR's failed pass manager), and the CUDA
    errors of a launch refused for its configuration ("too many resources requested for launch",
    "invalid configuration argument", "out of resources"). A sticky CUDA
    error (:func:`verify.gpu.sticky_cuda_error`), an out-of-memory error and a property's own failure are
    not resource failures: each keeps its own path. ``where`` is the kernel's ``forward`` or ``backward``;
    ``device`` names the card on CUDA.

    The words start with what kind of failure it is and ``(not a wrong answer)``, say what the kernel
    needed at the case's head dim, blocks and dtype, and end with the kernel's own error::

        resource limit (not a wrong answer): the kernel's forward needs 393216 bytes of shared memory,
        the card has 232448, at head_dim 256 block 128x128 (float16)
    """
    from verify.gpu import sticky_cuda_error

    if sticky_cuda_error(exc) is not None:
        return None
    found = _resource_cause(exc)
    if found is None:
        return None
    kind, error, details = found
    card = _card(device)
    the_card = f"the card ({card})" if card else "the card"
    at = _where(case)
    if kind == "resources":
        name = details.get("name") or "resources"
        unit = _RESOURCE_UNITS.get(name, name)
        words = (f"resource limit (not a wrong answer): the kernel's {where} needs {details.get('required')} {unit}, "
                 f"{the_card} has {details.get('limit')}, {at}")
    elif kind == "compile":
        first = (str(getattr(error, "error_message", None) or "").strip().splitlines()
                 or str(error).strip().splitlines() or [type(error).__name__])[0]
        words = (f"compile failure (not a wrong answer): the kernel's {where} failed to compile for this case, "
                 f"{at}{' on ' + card if card else ''} ({first})")
    else:
        why = ("a grid or block dimension past the card's limits" if "config" in str(error).lower()
               else "more registers, threads or shared memory per block than the card has")
        words = (f"resource limit (not a wrong answer): CUDA refused to launch the kernel's {where} for this case "
                 f"({why}), {at}{' on ' + card if card else ''}")
    return f"{words}\n  the kernel raised {_error_text(error)}"


@contextlib.contextmanager
def resource_failures_fail(ctx, case, *, device, where: str):
    """A resource failure of the kernel inside the block fails ``ctx`` (a :class:`verify.context.Context`) in words (:func:`resource_failure`:
    a PropertyFailure with the case and its replay, chained to the kernel's error); any other error,
    sticky CUDA errors and out-of-memory included, goes on as it was."""
    __tracebackhide__ = True
    try:
        yield
    except Exception as exc:
        words = resource_failure(exc, case, device=device, where=where)
        if words is None:
            raise
        clear_frames(exc.__traceback__)  # the kernel's tensors need not live as long as the failure
        ctx.fail(words)
