"""A small pool of compile configurations per kernel and dtype, for runs where compiling is the cost.

A JIT-compiled kernel (Triton's, ``torch.compile``'s) compiles once for every combination of what it
specialises on: its tiles, its head dims padded to a power of two (and whether they are one), the causal flag,
each attention variant switched on or off, the memory layout. Drawn independently, those choices make almost
every example a new combination: on a GPU nearly all of a run's time went to compiling kernels that ran once.

Under the gpu profile (``Limits.compile_pool``) a case first draws one of :func:`compile_pool`'s rows and takes
those choices from it; everything else (lengths, batch and heads, the head dim within its power of two, window
widths, softcap values, slopes, sink logits, split counts, magnitudes, scales, seeds) is drawn as without a
pool. Every property of a kernel and dtype draws from the same rows, so a compiled kernel serves the
examples of many properties instead of one.

The rows are fixed (the same in every run and every worker) and built so that the pool keeps what independent
draws reach:

- row 0 switches everything off and takes the first option of every choice (what failures shrink to);
- then one row per switch with that switch alone on (a failure that needs one variant shrinks to it alone);
- then rows in which every pair of switches takes all four on/off combinations (pairwise coverage: a
  window with a softcap, ALiBi without causal masking, sinks with split-KV...);
- every option of every multi-valued choice (each tile pair, each head-dim class, each layout) occurs in
  some row once the pool has at least as many rows as the choice has options.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from collections.abc import Sequence

# The on/off choices a compiled kernel specialises on (the attention variants, the causal flag, variable-length
# sequences, float8 descales).
SWITCHES = ("causal", "window", "softcap", "alibi", "chunk", "sinks", "splits", "varlen", "descale")
# The multi-valued ones: an index into the options the case's class and declaration allow (taken modulo their
# number, so that one row means the same thing to every property of a kernel).
CHOICES = ("tiles", "head_dim", "head_dim_v", "layout")
# Fixed: every run, worker and property builds the same pool.
_SEED = 20261203


@dataclasses.dataclass(frozen=True)
class Row:
    """One compile configuration: which switches are on, and an index for each multi-valued choice."""

    on: frozenset[str]
    index: tuple[tuple[str, int], ...]

    def pick(self, choice: str, options: Sequence):
        """The option of ``choice`` this row takes among ``options`` (non-empty)."""
        if not options:
            raise ValueError(f"no options to pick {choice} from")
        return options[dict(self.index)[choice] % len(options)]


def _pairwise_rows(rng: random.Random) -> list[frozenset[str]]:
    """Rows of switches (greedy, from random candidates) in which every pair of switches takes all four
    on/off combinations."""
    missing = {(a, b, va, vb) for a, b in itertools.combinations(SWITCHES, 2) for va in (0, 1) for vb in (0, 1)}
    rows: list[frozenset[str]] = []
    while missing:
        best, best_hits = frozenset(), -1
        for _ in range(64):
            on = frozenset(s for s in SWITCHES if rng.random() < 0.5)
            hits = sum((a in on, b in on) == (bool(va), bool(vb)) for a, b, va, vb in missing)
            if hits > best_hits:
                best, best_hits = on, hits
        rows.append(best)
        missing = {(a, b, va, vb) for a, b, va, vb in missing if (a in best, b in best) != (bool(va), bool(vb))}
    return rows


@functools.lru_cache(maxsize=None)
def compile_pool(size: int) -> tuple[Row, ...]:
    """The pool's ``size`` rows (module docstring). ``size`` must hold the all-off row, the one-switch rows
    and the pairwise rows."""
    rng = random.Random(_SEED)
    switches = [frozenset(), *(frozenset({s}) for s in SWITCHES), *_pairwise_rows(rng)]
    if size < len(switches):
        raise ValueError(f"compile_pool={size}, but should be at least {len(switches)} (the all-off row, one row "
                         f"per switch and the rows that cover every pair of switches)")
    while len(switches) < size:
        switches.append(frozenset(s for s in SWITCHES if rng.random() < 0.5))
    # Each choice's index runs over a permutation of 0 .. size - 1 (row 0 keeps 0): modulo any number of
    # options up to ``size`` every option occurs, in a different row for each choice.
    indices = {}
    for choice in CHOICES:
        rest = list(range(1, size))
        rng.shuffle(rest)
        indices[choice] = [0, *rest]
    return tuple(Row(on=on, index=tuple((c, indices[c][i]) for c in CHOICES)) for i, on in enumerate(switches))


def padded(dim: int) -> int:
    """The power of two (at least 16) a kernel pads a head dim to."""
    return max(16, 1 << max(0, dim - 1).bit_length())


def head_dim_classes(dims: Sequence[int]) -> list[list[int]]:
    """``dims`` grouped by what a kernel compiles for: the padded head dim and whether the dim is exactly it,
    each group sorted, the groups in the order of their smallest dim."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for d in sorted(set(dims)):
        groups.setdefault((padded(d), d == padded(d)), []).append(d)
    return sorted(groups.values(), key=lambda g: g[0])
