"""The words of a failure file for a test that fails by an exception other than a property's own
failure (a kernel that raises, crashes or returns something unusable): the exception's text and
where it was raised. The case and replay command come from the example the exception left
(:func:`verify.context.failing_context`).
"""

from __future__ import annotations

import traceback
from pathlib import Path

# The words that open the failure message of a kernel that raised in a property example (its failure class).
KERNEL_RAISED = "the kernel raised (not a wrong answer)"


def exception_text(exc: BaseException) -> str:
    """``Type: message`` followed by the exception's notes (Hypothesis puts the failing draws there)."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def raised_at(exc: BaseException, *, root=None) -> str:
    """Where ``exc`` was raised, in words: ``at path:line (function)`` of the innermost frame of its
    traceback (``path`` relative to ``root`` when inside it, else the file's last two parts)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "at an unknown place (the exception has no traceback)"
    frame = frames[-1]
    path = Path(frame.filename)
    try:
        shown = path.resolve().relative_to(Path(root).resolve()) if root is not None else None
    except ValueError:
        shown = None
    if shown is None:
        shown = Path(*path.parts[-2:]) if len(path.parts) >= 2 else path
    return f"at {shown}:{frame.lineno} ({frame.name})"


def property_of_test(test_name: str, known: set[str]) -> str | None:
    """``test_out_matches_reference`` -> ``out_matches_reference`` when that is a known property."""
    prop = test_name.removeprefix("test_")
    return prop if prop in known else None
