"""Hypothesis strategies for attention cases: shapes first, then block sizes, flags and magnitudes.

Every draw carries a label, so a failing example prints as a readable list of choices. Shapes are
drawn before anything that depends on them, and lengths are drawn near block boundaries (1, one
less, one more, exact multiples) as often as anywhere else; everything shrinks towards B = H = 1,
short sequences, the ``normal`` magnitude class, the contiguous layout and seed 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hypothesis import strategies as st

from strategies.cases import LAYOUTS, MAGNITUDES, SCALES, AttentionCase


@dataclasses.dataclass(frozen=True)
class Limits:
    """How large generated cases may get (set per Hypothesis profile and device in conftest.py)."""

    max_len: int = 48
    max_head_dim: int = 48
    max_batch: int = 2
    max_heads_kv: int = 2
    max_group: int = 3
    # Cap on (query tiles) x (key tiles), keeps Python-level blocked kernels fast with tiny blocks.
    max_tiles: int = 160
    # Cap on B * Hq * Nq * Nk, keeps the float64 reference's score matrices in memory.
    max_scores: int = 2 ** 22

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"Limits.{f.name}={getattr(self, f.name)}, but should be at least 1")


def _near_blocks(blocks: Sequence[int] | None, max_len: int) -> list[int]:
    """Lengths next to small multiples of the declared block sizes (a fixed list, so that shrinking
    one draw never changes the shape of the others)."""
    if not blocks:
        return []
    return sorted({m * b + o for b in blocks for m in (1, 2, 3) for o in (-1, 0, 1)
                   if 1 <= m * b + o <= max_len} | {max_len})


def _lengths(*, near: list[int], max_len: int):
    """A sequence length: anything up to ``max_len``, or one of the lengths next to a block boundary."""
    plain = st.integers(min_value=1, max_value=max_len)
    return st.one_of(plain, st.sampled_from(near)) if near else plain


def _blocks(blocks: Sequence[int], length: int, max_tiles_per_axis: int):
    """A declared block size; one that would split ``length`` into more than ``max_tiles_per_axis``
    tiles is replaced by the smallest one that does not. The draw is always over the full declared
    list, so a shrinking length keeps the block it had."""
    ordered = sorted(blocks)
    fitting = [b for b in ordered if -(-length // b) <= max_tiles_per_axis] or [ordered[-1]]
    return st.sampled_from(ordered).map(lambda b: b if b in fitting else min(
        (f for f in fitting if f >= b), default=fitting[0]))


@st.composite
def attention_cases(draw, *, dtype: str, limits: Limits = Limits(), head_dims: Sequence[int] | None = None,
                    gqa: bool = False, block_m: Sequence[int] | None = None,
                    block_n: Sequence[int] | None = None, causal: bool | None = None,
                    magnitudes: Sequence[str] = MAGNITUDES, layouts: Sequence[str] = LAYOUTS,
                    draw_scale: bool = True):
    """Return a strategy for :class:`AttentionCase` values.

    dtype       the dtype name (``"float16"`` ...), fixed by the test's parametrisation
    limits      size limits (lengths, head dim, batch, heads, tiles)
    head_dims   head dims the kernel accepts (None: any up to ``limits.max_head_dim``)
    gqa         whether to draw grouped-query cases (Hkv < Hq)
    block_m/n   tile sizes the kernel accepts (None: not tunable; the case carries no blocks)
    causal      fix the causal flag (None: draw it)
    magnitudes  magnitude classes to draw from (the first is what failures shrink to)
    layouts     memory layouts to draw from
    draw_scale  also draw explicit softmax scales (None, the default 1/sqrt(D), comes first)

    Shapes come first, then block sizes among those that keep the tile count bounded, then the flags,
    the magnitude class, the layout and the seed. Every draw has a fixed shape, so the shrinker can
    simplify each one without disturbing the others. Cost: a dozen small integers per case; tensors
    are only built when the test calls ``build``.
    """
    if not magnitudes or not layouts:
        raise ValueError("magnitudes and layouts should not be empty")
    batch = draw(st.integers(1, limits.max_batch), label="batch")
    heads_kv = draw(st.integers(1, limits.max_heads_kv), label="heads_kv")
    group = draw(st.integers(1, limits.max_group), label="group") if gqa else 1
    if head_dims is None:
        head_dim = draw(st.integers(1, limits.max_head_dim), label="head_dim")
    else:
        allowed = sorted(d for d in head_dims if d <= limits.max_head_dim) or [min(head_dims)]
        head_dim = draw(st.sampled_from(allowed), label="head_dim")
    len_q = draw(_lengths(near=_near_blocks(block_m, limits.max_len), max_len=limits.max_len), label="len_q")
    max_k = max(1, min(limits.max_len, limits.max_scores // (batch * heads_kv * group * len_q)))
    len_k = draw(_lengths(near=_near_blocks(block_n, max_k), max_len=max_k), label="len_k")
    per_axis = max(1, int(limits.max_tiles ** 0.5))
    bm = draw(_blocks(block_m, len_q, per_axis), label="block_m") if block_m else None
    bn = draw(_blocks(block_n, len_k, per_axis), label="block_n") if block_n else None
    is_causal = draw(st.booleans(), label="causal") if causal is None else causal
    magnitude = draw(st.sampled_from(list(magnitudes)), label="magnitude")
    layout = draw(st.sampled_from(list(layouts)), label="layout")
    scale = draw(st.sampled_from(SCALES), label="scale") if draw_scale else None
    seed = draw(st.integers(0, 2 ** 16), label="seed")
    return AttentionCase(batch=batch, heads_q=heads_kv * group, heads_kv=heads_kv, len_q=len_q,
                         len_k=len_k, head_dim=head_dim, dtype=dtype, causal=is_causal,
                         magnitude=magnitude, seed=seed, layout=layout, scale=scale,
                         block_m=bm, block_n=bn)
