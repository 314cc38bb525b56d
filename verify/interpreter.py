"""Triton's interpreter without its repeated language patching: the same results, a quarter less time.

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
"""

from __future__ import annotations

import functools
import inspect
import os

_installed = False


def skip_repatching() -> str | None:
    """Install the skip (once per process) when ``TRITON_INTERPRET=1``; return why not, or None."""
    global _installed
    if _installed:
        return None
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET is not 1"
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception as exc:  # noqa: BLE001 - no Triton, nothing to speed up
        return f"Triton's interpreter cannot be imported ({type(exc).__name__})"
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
