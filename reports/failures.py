"""The words of a failure file for a test that fails by an exception other than a property's own
failure (a kernel that raises, crashes or returns something unusable): the exception's text and
where it was raised. The case and replay command come from the example the exception left
(:func:`verify.context.failing_context`).
"""

from __future__ import annotations

import ast
import functools
import sys
import sysconfig
import traceback
from pathlib import Path

# The words that open the failure message of a kernel that raised in a property example (its failure class).
KERNEL_RAISED = "the kernel raised (not a wrong answer)"
# And of the suite's own code raising in one (a bug in flashverify, not a verdict on the kernel).
SUITE_RAISED = "the suite itself raised (a bug in flashverify, not a verdict on the kernel)"

# The suite's own packages, under the repository's root: what raises there is the suite's.
SUITE_PACKAGES = ("verify", "references", "strategies", "reports")


def exception_text(exc: BaseException) -> str:
    """``Type: message`` followed by the exception's notes (Hypothesis puts the failing draws there)."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def raised_at(exc: BaseException, *, root=None) -> str:
    """Where ``exc`` was raised, in words: ``at path:line (function)`` of the innermost frame of its
    traceback (``path`` relative to ``root`` when inside it, else the file's last two parts)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "at an unknown place (the exception has no traceback)"
    return f"at {frame_at(frames[-1], root=root)}"


@functools.lru_cache(maxsize=None)
def _library_dirs() -> tuple[Path, ...]:
    """The standard library's and the installed packages' folders (this interpreter's and its base's)."""
    paths = sysconfig.get_paths()
    dirs = {paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix}).get(key)
             for key in ("stdlib", "platstdlib")}
    return tuple(Path(d).resolve() for d in dirs if d)


def _is_library(path: Path, filename: str) -> bool:
    """A frame of no one's own code: the standard library, an installed package (torch, Hypothesis,
    pytest, Triton, numpy, ...) or code with no file (``<frozen ...>``, ``<string>``)."""
    if filename.startswith("<"):
        return True
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return True
    return any(path.is_relative_to(d) for d in _library_dirs())


def _suite_package(path: Path, root: Path) -> bool:
    return any(path.is_relative_to(root / package) for package in SUITE_PACKAGES)


def _is_kernel_stage(expr: ast.expr) -> bool:
    """``stage("kernel")`` (:func:`verify.stages.stage`): the block it times is a call of the kernel."""
    name = getattr(getattr(expr, "func", None), "id", None) or getattr(getattr(expr, "func", None), "attr", None)
    return (isinstance(expr, ast.Call) and name == "stage" and bool(expr.args)
            and isinstance(expr.args[0], ast.Constant) and expr.args[0].value == "kernel")


@functools.lru_cache(maxsize=None)
def _kernel_call_lines(filename: str) -> tuple[tuple[int, int], ...]:
    """The line spans of the bodies of ``with stage("kernel"):`` blocks in one of the suite's files."""
    try:
        tree = ast.parse(Path(filename).read_text(encoding="utf-8"), filename)
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple((node.body[0].lineno, node.end_lineno or node.body[-1].lineno) for node in ast.walk(tree)
                 if isinstance(node, (ast.With, ast.AsyncWith))
                 and any(_is_kernel_stage(item.context_expr) for item in node.items))


def suite_frame(exc: BaseException, root) -> traceback.FrameSummary | None:
    """The frame of the suite's own code that raised ``exc``, or None when the kernel did.

    The frames of the standard library and of installed packages are left out of ``exc``'s traceback (they
    only ran on someone's behalf: torch inside the float64 reference is the suite's, inside a kernel the
    kernel's); the innermost frame left decides. In the suite's packages under ``root`` (``verify/``,
    ``references/``, ``strategies/``, ``reports/``) the suite raised; anywhere else (``flashverify_kernels/``,
    its input validation included, a user's kernel file, a test's own function) the kernel did.

    One exception: a suite frame that was calling the kernel is the kernel's. That is a line inside a
    ``with stage("kernel"):`` block (the suite times every call of a kernel so: what a kernel with no Python
    frame of its own raises, a C extension or autograd's backward through its graph in ``out.backward``,
    stops there), or a call into ``torch.autograd`` (``gradcheck``'s backward is the kernel's; the
    references compute their gradients without autograd). Where it cannot tell, it says the kernel raised."""
    root = Path(root).resolve()
    frames = traceback.extract_tb(exc.__traceback__)
    for i in range(len(frames) - 1, -1, -1):
        path = Path(frames[i].filename)
        try:
            path = path.resolve()
        except (OSError, RuntimeError):
            pass
        if _suite_package(path, root):
            deeper = [Path(f.filename).as_posix() for f in frames[i + 1:]]
            calling_kernel = any(lo <= (frames[i].lineno or 0) <= hi
                                 for lo, hi in _kernel_call_lines(frames[i].filename))
            into_autograd = any("/torch/autograd/" in f for f in deeper)
            return None if calling_kernel or into_autograd else frames[i]
        if not _is_library(path, frames[i].filename):
            return None
    return None


def raised_by_suite(exc: BaseException, root) -> bool:
    """Whether the suite's own code raised ``exc`` (a bug in flashverify), not the kernel: :func:`suite_frame`."""
    return suite_frame(exc, root) is not None


def frame_at(frame: traceback.FrameSummary, *, root=None) -> str:
    """``path:line (function)`` of ``frame``: ``path`` within its installed package (``torch/nn/functional.py``)
    for an installed package's file, else relative to ``root`` when inside it, else the file's last two parts."""
    path = Path(frame.filename)
    installed = [i for i, part in enumerate(path.parts) if part in ("site-packages", "dist-packages")]
    try:
        shown = path.resolve().relative_to(Path(root).resolve()) if root is not None else None
    except ValueError:
        shown = None
    if installed and installed[-1] + 1 < len(path.parts):
        shown = Path(*path.parts[installed[-1] + 1:])
    if shown is None:
        shown = Path(*path.parts[-2:]) if len(path.parts) >= 2 else path
    return f"{shown}:{frame.lineno} ({frame.name})"


def property_of_test(test_name: str, known: set[str]) -> str | None:
    """``test_out_matches_reference`` -> ``out_matches_reference`` when that is a known property."""
    prop = test_name.removeprefix("test_")
    return prop if prop in known else None
