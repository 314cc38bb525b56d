"""Triton's interpreter without its repeated language patching and its unasserted overflow checks: the same
results, in half the time.

Under ``TRITON_INTERPRET=1`` every launch patches ``triton.language`` so that its builtins run on NumPy, runs
the grid, and restores it. Every call of a ``@triton.jit`` helper from inside the kernel patches the language
again, though the launch already did: for a kernel whose tile loop calls helpers, that re-patching (a walk
over every member of ``triton.language``, about a millisecond) took a quarter of a CPU run's time in Triton's
interpreter (``verify/stages.py`` puts 89% of the README's command 1 in the kernels).

:func:`skip_repatching` makes a helper's call skip the patching when the launch in progress has already
patched every language module the helper sees (the kernel's, and those an earlier helper of the launch
saw: ``triton.language.core`` for ``tl.sum`` and ``tl.max``); anything else is patched as before. It changes nothing when Triton's
interpreter is not in use or does not have the pieces it wraps (another Triton version): then it says so
and leaves Triton alone.

:func:`skip_unasserted_overflow_checks` drops work whose result the interpreter throws away. Its options turn
``sanitize_overflow`` on and ``debug`` off: every integer ``+``, ``-`` and ``*`` of a kernel (its index and
pointer arithmetic) is redone in int64 and compared with int32's range, and the comparison goes to
``device_assert``, which does nothing with ``debug`` off. Turning ``sanitize_overflow`` off where ``debug`` is
off keeps every result and assertion as they were and takes a third off an interpreted kernel's time. With
``TRITON_DEBUG=1``-style options (``debug`` on) nothing is changed. It also builds once the table from
Triton's types to NumPy's that the interpreter builds again at every cast and splat.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os

import numpy as np

_installed = False


def _interpreter():
    """``(triton.language, triton.runtime.interpreter)`` when ``TRITON_INTERPRET=1`` and Triton imports; else why
    not, in words."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET is not 1"
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception as exc:  # noqa: BLE001 - no Triton, nothing to speed up
        return f"Triton's interpreter cannot be imported ({type(exc).__name__})"
    return tl, interpreter


def skip_repatching() -> str | None:
    """Install the skip (once per process) when ``TRITON_INTERPRET=1``; return why not, or None."""
    global _installed
    if _installed:
        return None
    found = _interpreter()
    if isinstance(found, str):
        return found
    tl, interpreter = found
    executor = getattr(interpreter, "GridExecutor", None)
    patch = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch is None or scope is None or not callable(getattr(executor, "__call__", None)):
        return "this Triton's interpreter has no GridExecutor, _patch_lang or _LangPatchScope"

    state = {"launch": False, "patched": None}
    langs_of: dict[int, frozenset[int]] = {}

    def langs(fn) -> frozenset[int]:
        key = id(fn)
        if key not in langs_of:
            langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                      if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[key]

    @functools.wraps(patch)
    def patch_lang(fn):
        if not state["launch"]:
            return patch(fn)
        if state["patched"] is None:  # the launch's own patching
            result = patch(fn)
            state["patched"] = langs(fn)
            return result
        if langs(fn) <= state["patched"]:  # a helper inside the launch: already patched
            return scope()
        result = patch(fn)  # a helper that sees another module (triton.language.core for tl.sum, tl.max)
        state["patched"] = state["patched"] | langs(fn)
        return result

    run = executor.__call__

    @functools.wraps(run)
    def launch(self, *args, **kwargs):
        outer = dict(state)
        state.update(launch=True, patched=None)
        try:
            return run(self, *args, **kwargs)
        finally:
            state.update(outer)

    interpreter._patch_lang = patch_lang
    executor.__call__ = launch
    _installed = True
    return None


_overflow_checks_skipped = False


def skip_unasserted_overflow_checks() -> str | None:
    """With ``TRITON_INTERPRET=1``, turn off the interpreter's overflow sanitizing where its ``debug`` is off
    (nothing asserts its checks then) and build its type table once; return why not, or None."""
    global _overflow_checks_skipped
    if _overflow_checks_skipped:
        return None
    found = _interpreter()
    if isinstance(found, str):
        return found
    tl, interpreter = found
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    to_numpy = getattr(interpreter, "_get_np_dtype", None)
    if not dataclasses.is_dataclass(options) or not {"debug", "sanitize_overflow"} <= {
            f.name for f in dataclasses.fields(options)} or to_numpy is None:
        return "this Triton's interpreter has no interpreter_builder.options with debug and sanitize_overflow"
    if options.debug:
        return "the interpreter's debug option is on: its overflow checks are asserted"
    builder.options = dataclasses.replace(options, sanitize_overflow=False)

    table = {}
    for name in ("int1", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                 "bfloat16", "float32", "float64", "float8e5", "float8e5b16", "float8e4nv", "float8e4b8",
                 "float8e4b15"):
        ty = getattr(tl, name, None)
        if ty is not None:
            try:
                table[ty] = to_numpy(ty)
            except KeyError:  # a type this Triton's interpreter does not map
                pass
    pointer = np.dtype(np.uint64)

    @functools.wraps(to_numpy)
    def np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return pointer
        found = table.get(scalar)
        return found if found is not None else to_numpy(tt_dtype)

    interpreter._get_np_dtype = np_dtype
    _overflow_checks_skipped = True
    return None
