"""What a ``pytest verify`` run verified, kernel by kernel, and the order its tests run in.

A test that passes is not a verdict on a kernel unless it called one. The online-softmax laws (merging
``(m, l)`` states, partitions of a row) never call a selected kernel; they are counted apart. For each
selected implementation the run counts the tests that called it and ended passed or failed (a skip is
not a verdict); an implementation named with ``--impl`` that no test exercised makes the run exit 1 with
"nothing was verified for X" (with the default selection, at least one kernel must have been exercised).

The plugin tags every collected test with ``user_properties`` (they travel with pytest-xdist's reports):
``("flashverify_impl", name)`` for a test of one implementation, ``("flashverify_law", True)`` for one
that calls none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

IMPL_KEY = "flashverify_impl"
LAW_KEY = "flashverify_law"

# Forward first (the simplest verdict on a kernel), then backward, the longest cases, the softmax laws.
MODULE_ORDER = ("test_forward.py", "test_backward.py", "test_longest.py", "test_online_softmax.py")


def tags(params: dict) -> list[tuple[str, object]]:
    """The user_properties of a test whose parametrization is ``params``: the implementation it calls,
    a law (no implementation parameter), or nothing (an implementation parameter with no value, the
    placeholder pytest puts when no selected implementation is of that kind)."""
    from flashverify_kernels.registry import Implementation

    keys = [k for k in ("impl", "softmax_impl") if k in params]
    if not keys:
        return [(LAW_KEY, True)]
    impl = params[keys[0]]
    return [(IMPL_KEY, impl.name)] if isinstance(impl, Implementation) else []


def module_rank(path: str | Path) -> int:
    """Sort key of a test module: forward before backward (unknown modules keep their place, after)."""
    name = Path(str(path)).name
    return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)


@dataclasses.dataclass
class Tally:
    """Call-phase outcomes per implementation, and of the laws that call no kernel."""

    by_impl: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    laws: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, user_properties: Iterable[tuple[str, object]], outcome: str) -> None:
        props = dict(user_properties)
        if props.get(LAW_KEY):
            self.laws[outcome] = self.laws.get(outcome, 0) + 1
        elif IMPL_KEY in props:
            counts = self.by_impl.setdefault(str(props[IMPL_KEY]), {})
            counts[outcome] = counts.get(outcome, 0) + 1

    def exercised(self, name: str) -> int:
        counts = self.by_impl.get(name, {})
        return counts.get("passed", 0) + counts.get("failed", 0)

    def unverified(self, selected: Sequence[str], *, explicit: bool) -> list[str]:
        """The implementations that make the run dishonest if it exits 0: with an explicit selection,
        every one no test exercised; with the default one, all of them if none was exercised."""
        missing = [name for name in selected if not self.exercised(name)]
        if explicit or len(missing) == len(selected):
            return missing
        return []

    def lines(self) -> list[str]:
        """The terminal summary: kernel verdicts first, the laws apart."""
        out = []
        for name, counts in self.by_impl.items():
            shown = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped") if counts.get(k))
            out.append(f"flashverify: {name}: {shown}")
        if self.laws:
            shown = ", ".join(f"{n} {k}" for k, n in sorted(self.laws.items()))
            out.append(f"flashverify: laws that call no kernel (counted for none): {shown}")
        return out


def tally(reports_by_outcome: dict[str, list]) -> Tally:
    """A :class:`Tally` of pytest's terminal-reporter stats (``{"passed": [TestReport, ...], ...}``).
    Only call-phase reports count; a skip, in whatever phase, is counted as ``skipped``."""
    t = Tally()
    for outcome in ("passed", "failed", "skipped"):
        for rep in reports_by_outcome.get(outcome, ()):
            if getattr(rep, "when", None) == "call" or (outcome == "skipped" and hasattr(rep, "when")):
                t.add(getattr(rep, "user_properties", ()), outcome)
    return t


def nothing_verified_message(names: Sequence[str]) -> str:
    return "; ".join(f"nothing was verified for {name}: no property called it (every test of it was "
                     "skipped or deselected; the reasons: pytest -rs)" for name in names)
