"""Reachability checks: that a strategy draws some case with a property, found without shrinking it."""

from __future__ import annotations

from hypothesis import Phase, find, settings


def reach(strategy, predicate, *, max_examples: int):
    """The first of ``max_examples`` derandomized draws of ``strategy`` that satisfies ``predicate``.

    Hypothesis's ``find`` without its shrink phase: a reachability check needs a witness, not the smallest
    one, and shrinking took three quarters of the time of the boundary-class checks. Raises
    ``hypothesis.errors.NoSuchExample`` when no draw satisfies ``predicate``."""
    return find(strategy, predicate, settings=settings(max_examples=max_examples, database=None, derandomize=True,
                                                       phases=(Phase.generate,)))
