"""What a failure file records when a test fails by an exception other than a property's own
failure (a kernel that raises, crashes or returns something unusable).

A :class:`verify.harness.PropertyFailure` carries its case and replay command. Any other exception
only has Hypothesis's notes, which show the drawn case as a ``repr``: ``Draw 1 (case):
AttentionCase(batch=1, heads_q=1, ...)``. That text is parsed here with :mod:`ast` into literals
(never evaluated) and validated by the case class, so the failure file holds plain JSON and the
replay command runs the same case. When the property changed the case after drawing it (a second
draw such as ``group`` or ``len_q longer by``), the drawn case is not the one that failed, and no
replay command is written; the note says so. (The plugin reads the case from the property's own
context in the traceback first, which holds the case after any such change: the notes are the fallback.)
"""

from __future__ import annotations

import ast
import re
import traceback
from pathlib import Path
from typing import Any

_DRAW = re.compile(r"^Draw \d+ \(([^)]*)\):\s*", re.MULTILINE)
_CASE_CLASSES = ("AttentionCase", "SoftmaxCase")


def exception_text(exc: BaseException) -> str:
    """``Type: message`` followed by the exception's notes (Hypothesis puts the failing draws there)."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _literal_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """``Name(field=literal, ...)`` parsed without evaluating anything, or None."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    fields = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            fields[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, SyntaxError, TypeError):
            return None
    return node.func.id, fields


def drawn_case(exc: BaseException) -> tuple[dict[str, Any] | None, str | None]:
    """The case Hypothesis reports for a failing example, as a validated dict, or ``(None, why)``."""
    notes = "\n".join(str(n) for n in getattr(exc, "__notes__", None) or [])
    draws = list(_DRAW.finditer(notes))
    if not draws:
        return None, "the failure carries no drawn case (it did not happen inside a Hypothesis example)"
    labels = [m.group(1) for m in draws]
    if labels != ["case"]:
        return None, (f"the property drew {', '.join(labels)} after the case, so the drawn case is not the one "
                      "that failed, and the failure happened before the property's context held the case")
    start = draws[0].end()
    depth, end = 0, None
    for i in range(start, len(notes)):
        ch = notes[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                end = i + 1
                break
    parsed = _literal_call(notes[start:end]) if end else None
    if parsed is None or parsed[0] not in _CASE_CLASSES:
        return None, "the drawn case could not be read back from Hypothesis's notes"
    name, fields = parsed
    try:
        if name == "AttentionCase":
            from strategies.cases import AttentionCase

            return AttentionCase.from_dict(fields).to_dict(), None
        from strategies.softmax import SoftmaxCase

        return SoftmaxCase.from_dict(fields).to_dict(), None
    except (ValueError, TypeError) as exc:
        return None, f"the drawn case is not valid: {exc}"


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
