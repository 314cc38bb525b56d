"""Hypothesis strategies for attention cases: a boundary class, shapes, block sizes, flags, magnitudes.

Every draw carries a label, so a failing example prints as a readable list of choices. A case first
draws its *shape class*: half the time ``plain`` (short sequences, lengths next to block boundaries as
often as anywhere else), otherwise one of the classes of input that kernels get wrong and that plain
uniform draws almost never reach, each built by construction (no filtering):

``decode``              one query (Nq = 1), causal when the property lets the case choose, grouped-query
                        when the kernel declares it (the decode fast paths of real kernels)
``no_keys``             Nk = 0: every row is fully masked (out = 0, lse = -inf)
``long``                B = H = 1 and lengths up to ``max_len``, just below, at and above powers of two
``wide_head``           head dims just below, at and above 64 and 128 (what kernels split or switch on)
``kv_tiles_wider``      causal, block_n > block_m and at least two key tiles
``k_aligned_q_ragged``  causal, Nk a multiple of block_n, Nq not a multiple of block_m
``masked_q_tiles``      causal with Nq - Nk >= block_m: whole query tiles see no key
``long_context``        one query against more keys than ``max_len`` (a decode step on a long KV cache), up
                        to ``Limits.max_context`` (128k keys under the gpu profile), its rows (B * Hq * Nk *
                        D) within those the worker's budget holds; drawn only where ``max_context`` is
                        above ``max_len``

For a kernel that declares no block sizes the tile classes use the tile sizes real kernels use
(:data:`NOMINAL_BLOCKS`, as far as ``max_len`` allows), and are judged against any pair of them. Everything shrinks towards the ``plain`` class,
B = H = 1, short sequences, the ``normal`` magnitude class, the contiguous layout, the default scale and
seed 0. :func:`boundary_classes` names the classes a case reaches, whatever class drew it; the runner
reports them per property (``event()`` and the report's coverage table).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from strategies import reuse as st

from references.spec import SEQUENCES, AttentionSpec
from strategies.cases import FP8_NAMES, LAYOUTS, MAGNITUDES, SCALES, AttentionCase
from strategies.compile_pool import Row, compile_pool, head_dim_classes

SHAPE_CLASSES = ("plain", "decode", "no_keys", "long", "wide_head", "kv_tiles_wider", "k_aligned_q_ragged",
                 "masked_q_tiles", "long_context")
# Tile sizes of real kernels, for the tile classes of a kernel that declares none.
NOMINAL_BLOCKS = (16, 32, 64, 128)
# Page sizes of a paged KV cache (the smallest first: failures shrink to it): one key per page, sizes that
# are not powers of two, and those of real caches.
PAGE_SIZES = (1, 3, 16, 5, 256)
# Variable-length sequences after the first: at most this many more.
MORE_SEQUENCES = 3
# Query heads per KV head past the small ones (1 .. 3, drawn from a range): the groups production models
# use, where decode kernels switch code paths (a group packed as rows of one tile past 4): 4 (Llama-3-8B,
# Mistral-7B), 5 and 7 (not powers of two: Qwen2.5-7B has 7), 8 (Llama-3-70B), 16, and multi-query
# attention's dozens where the profile allows them (``Limits.max_group``).
GROUPS = (4, 5, 7, 8, 16, 32, 64)
# Split counts past the few (2 .. 5, drawn from a range): up to FlashAttention-2's heuristic's 128, more
# splits than key tiles (and than keys) at short contexts.
SPLITS = (8, 16, 32, 64, 128)
# ``Limits.max_len`` holds for up to this many heads (B * Hq); a case with more has its lengths cut in
# proportion, so that its rows (B * Hq * N, what q, k, v and the outputs hold) stay within those of
# ROW_HEADS heads at max_len (verify/gpu.py budgets a worker's memory for them).
ROW_HEADS = 16


@dataclasses.dataclass(frozen=True)
class Limits:
    """How large generated cases may get (per Hypothesis profile and device: ``verify/profiles.py``)."""

    max_len: int = 48
    max_head_dim: int = 48
    max_batch: int = 2
    max_heads_kv: int = 2
    max_group: int = 16
    # Cap on B * Hq: a large group is drawn with fewer batches and KV heads, not more heads in all.
    max_batch_heads: int = 16
    max_splits: int = 128
    # Cap on (query tiles) x (key tiles), keeps Python-level blocked kernels fast with tiny blocks.
    max_tiles: int = 160
    # Cap on B * Hq * Nq * Nk, keeps the float64 reference's score matrices in memory.
    max_scores: int = 2 ** 22
    # Lengths and head dims of the ``plain`` class (the other classes go up to max_len / max_head_dim).
    short_len: int = 40
    short_head_dim: int = 40
    # Keys of a one-query case past max_len (the ``long_context`` class): a decode step on a long KV
    # cache; 0, or anything up to max_len: no such class.
    max_context: int = 0
    # Rows of the compile pool (strategies/compile_pool.py) the compile-time choices of a case come from: its
    # tiles, head-dim classes, causal flag, variants switched on, layout. 0: each drawn on its own.
    compile_pool: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            least = 0 if f.name in ("max_context", "compile_pool") else 1
            if getattr(self, f.name) < least:
                raise ValueError(f"Limits.{f.name}={getattr(self, f.name)}, but should be at least {least}")
        if self.compile_pool:
            compile_pool(self.compile_pool)  # refuses a pool too small for what it keeps

    @property
    def context_len(self) -> int:
        """The most keys a one-query case may have: ``max_context`` where it is above ``max_len``."""
        return max(self.max_len, self.max_context)

    @property
    def max_rows(self) -> int:
        """The most ``B * Hq * (Nq + Nk) * D`` (what q, k, v and the outputs hold) a case may have: that of
        ROW_HEADS heads at ``max_len`` queries and keys and the largest head dim (what verify/gpu.py
        budgets a worker's memory for)."""
        return ROW_HEADS * 2 * self.max_len * self.max_head_dim

    @property
    def tiles_per_axis(self) -> int:
        """Query (or key) tiles per head allowed along one axis: ``max_tiles`` split evenly."""
        return tiles_per_axis(self.max_tiles)

    @property
    def plain_len(self) -> int:
        return min(self.short_len, self.max_len)

    @property
    def plain_head_dim(self) -> int:
        return min(self.short_head_dim, self.max_head_dim)


def tiles_per_axis(max_tiles: int) -> int:
    """The tiles along one axis (query or key) of a ``max_tiles`` cap split evenly: ``isqrt``, at least 1."""
    return max(1, math.isqrt(max_tiles))


def _near_blocks(blocks: Sequence[int] | None, max_len: int) -> list[int]:
    """Lengths next to small multiples of the declared block sizes (a fixed list, so that shrinking
    one draw never changes the shape of the others)."""
    if not blocks:
        return []
    return sorted({m * b + o for b in blocks for m in (1, 2, 3) for o in (-1, 0, 1)
                   if 1 <= m * b + o <= max_len} | {max_len})


def _near_powers_of_two(lo: int, hi: int) -> list[int]:
    """``2^k - 1``, ``2^k`` and ``2^k + 1`` for the powers of two from 16, within ``[lo, hi]``."""
    values = {p + o for k in range(4, 18) for p in (2 ** k,) for o in (-1, 0, 1)}
    return sorted(v for v in values if lo <= v <= hi)


def _wide_head_dims(top: int) -> list[int]:
    """Head dims next to 64 and 128 (where kernels split the head dim or change tiles), and the largest."""
    return sorted({d for d in (63, 64, 65, 72, 127, 128, 129, 130, top) if d <= top})


def _lengths(*, near: list[int], max_len: int, min_len: int = 1):
    """A sequence length: anything in ``[min_len, max_len]``, or one next to a block boundary."""
    plain = st.integers(min_value=min_len, max_value=max(min_len, max_len))
    near = [n for n in near if min_len <= n <= max_len]
    return st.one_of(plain, st.sampled_from(near)) if near else plain


def _blocks_for(blocks: Sequence[int], per_axis: int, long_class: bool) -> list[int]:
    """The declared blocks to draw from; for the ``long`` class only those whose tile limit lets a
    length pass 64 (when any does)."""
    ordered = sorted(blocks)
    return ([b for b in ordered if per_axis * b > 64] or ordered) if long_class else ordered


def _groups(lo: int, hi: int):
    """Query heads per KV head in ``[lo, hi]``: 1 .. 3 from a range (what failures shrink to) or one of
    :data:`GROUPS`."""
    small = st.integers(lo, max(lo, min(3, hi)))
    large = [g for g in GROUPS if lo <= g <= hi and g > 3]
    return st.one_of(small, st.sampled_from(large)) if large else small


def _splits(hi: int):
    """``num_splits``: 1 first, else 2 .. 5 or one of :data:`SPLITS` up to ``hi``."""
    many = [n for n in SPLITS if n <= hi]
    return st.one_of(st.just(1), st.integers(2, min(5, hi)) if hi >= 2 else st.just(1),
                     *([st.sampled_from(many)] if many else []))


def scales():
    """Return a strategy for the ``scale`` argument: None (the contract's ``1/sqrt(D)``) half the time,
    else one of :data:`strategies.cases.SCALES`, which holds 0, negative scales, scales above 1, a tiny
    one and ones float16 cannot represent (the contract takes any finite float)."""
    return st.one_of(st.none(), st.sampled_from(SCALES))


def _tile_pair(block_m: Sequence[int] | None, block_n: Sequence[int] | None, max_len: int, per_axis: int,
               *, kind: str, row: Row | None = None):
    """(block_m, block_n) for a tile class: the declared sizes, or :data:`NOMINAL_BLOCKS`, that fit
    ``max_len``; for ``kv_tiles_wider`` a pair with block_n > block_m and room for two key tiles within
    ``max_len`` when the declaration allows one; for ``k_aligned_q_ragged`` a block_m above 1."""
    bms = [b for b in sorted(block_m or NOMINAL_BLOCKS) if b <= max_len] or [min(block_m or NOMINAL_BLOCKS)]
    bns = [b for b in sorted(block_n or NOMINAL_BLOCKS) if b <= max_len] or [min(block_n or NOMINAL_BLOCKS)]
    if kind == "k_aligned_q_ragged":  # a length is never ragged against block 1
        bms = [b for b in bms if b > 1] or bms
    if kind == "kv_tiles_wider":
        pairs = [(m, n) for m in bms for n in bns if n > m and 2 * n <= max_len and 2 <= per_axis]
        if pairs:
            return st.sampled_from(pairs) if row is None else st.just(row.pick("tiles", pairs))
    if row is not None:  # the pair a compile pool row takes
        return st.just(row.pick("tiles", [(m, n) for m in bms for n in bns]))
    return st.tuples(st.sampled_from(bms), st.sampled_from(bns))


@st.composite
def attention_cases(draw, *, dtype: str, limits: Limits = Limits(), head_dims: Sequence[int] | None = None,
                    gqa: bool = False, block_m: Sequence[int] | None = None,
                    block_n: Sequence[int] | None = None, causal: bool | None = None,
                    alignment: str = "bottom_right", magnitudes: Sequence[str] = MAGNITUDES,
                    layouts: Sequence[str] = LAYOUTS,
                    shape_classes: Sequence[str] = SHAPE_CLASSES,
                    min_len_k: int = 0, min_len_q: int = 1, min_group: int = 1, longer: str | None = None,
                    max_extra: int = 8, equal_lengths: bool = False, len_q_multiple: int = 1,
                    len_k_multiple: int = 1, scale_choices: Sequence[float | None] | None = None,
                    max_batch_heads: int | None = None, windows: bool = False, softcap: bool = False,
                    alibi: bool = False, chunks: bool = False, sinks: bool = False, splits: bool = False,
                    sequences: Sequence[str] = ("dense",), page_sizes: Sequence[int] | None = None,
                    max_len_q: int | None = None, min_len: int = 0, head_dim_v: bool = False,
                    descale: bool = False):
    """Return a strategy for :class:`AttentionCase` values.

    dtype          the dtype name (``"float16"`` ...), fixed by the test's parametrisation
    descale        with a float8 dtype, also draw descales (none first; a dense batch only): q, k and v
                   quantised with one factor per batch entry and key/value head (``references/fp8.py``)
    limits         size limits (lengths, head dim, batch, heads, tiles)
    head_dims      head dims the kernel accepts (None: any up to ``limits.max_head_dim``)
    head_dim_v     also draw a value head dim of its own (v, out and dout ``[..., Dv]``; the same as q's and
                   k's first, what failures shrink to; else any accepted head dim, or multi-head latent
                   attention's D = 192 with Dv = 128 where both are accepted and the class reaches 192)
    gqa            whether to draw grouped-query cases (Hkv < Hq): 1 .. 3 query heads per KV head or one of
                   :data:`GROUPS` up to ``limits.max_group``, ``B * Hq`` within ``limits.max_batch_heads``
    block_m/n      tile sizes the kernel accepts (None: not tunable; the case carries no blocks)
    causal         fix the causal flag (None: draw it; the tile classes and ``decode`` then choose causal)
    alignment      the kernel's causal alignment (``bottom_right`` or ``top_left``): the case's spec carries it
    magnitudes     magnitude classes to draw from (the first is what failures shrink to)
    layouts        memory layouts to draw from
    shape_classes  the shape classes to draw from (``plain`` first: what failures shrink to)
    min_len_k      the fewest keys (0 allows ``no_keys``; a property that needs keys passes 1)
    min_len_q      the fewest queries (above 1 leaves ``decode`` out)
    min_group      the fewest query heads per KV head (above 1: grouped-query cases only; needs ``gqa``)
    longer         ``"len_q"`` or ``"len_k"``: that length exceeds the other by 1..``max_extra`` (drawn);
                   leaves out the class it contradicts (``decode``, ``no_keys``)

    These constraints are part of the draw: the case a property runs is the case Hypothesis drew.

    A kernel's declared limits (``flashverify_kernels.declaration.Implementation``) are constraints of the same kind:
    equal_lengths     Nq == Nk (Nk is the drawn Nq)
    len_q/k_multiple  Nq (Nk) a multiple of this: the drawn length rounded up to one (a monotone map, so
                      failures shrink to the smallest conforming length), at least one multiple
    min_len           every sequence's Nq and Nk at least this (the first one's come from ``min_len_q``
                      and ``min_len_k``)
    Variable-length sequences keep all three per sequence: every sequence's lengths equal, multiples and at
    least ``min_len`` (an empty sequence, 0 queries and 0 keys, is a multiple of anything).
    scale_choices     the scales to draw from (the first is what failures shrink to; None: the default)
    max_batch_heads   B * Hq at most
    max_len_q         Nq at most this (a decoding kernel's few queries): the drawn Nq capped (monotone)
    windows           also draw sliding windows (each side unbounded, -1, first: failures shrink to no
                      window, then to window 0; else a narrow 0 .. 4 or any 0 .. max(Nq, Nk) + 1, so widths
                      0, 1, a few and >= N all occur)
    softcap           also draw a logit softcap (none first; else one of 30, 1, 5, 50 or any float32 in
                      [0.25, 64]: small caps saturate the drawn magnitudes, large ones barely change them)
    alibi             also draw ALiBi slopes, one per query head (none first; else all 0, the geometric
                      2^(-8 (h + 1) / Hq) of the ALiBi paper rounded to float32, or any float32 in [0, 2])
    chunks            also draw chunked local attention (none first; else chunks of 1 .. 4 or up to N + 1)
    sinks             also draw attention sinks, one logit per query head (none first; else all 0, one that
                      dominates every score, or any float32 in [-8, 8])
    splits            also draw split-KV (one split first; else 2 .. 5 splits or one of :data:`SPLITS`, up
                      to ``limits.max_splits``: 128, more splits than key tiles and than keys)
    sequences         the sequence conventions to draw from (``dense`` first when listed: failures shrink to
                      one dense batch): ``packed``, ``padded`` or ``paged`` cases keep the drawn lengths as
                      their first sequence and add up to ``MORE_SEQUENCES`` more (each length 0 .. a short
                      one: failures shrink to the fewest and shortest sequences); a paged cache keeps one
                      query length for every sequence and draws its page size (``page_sizes``, else
                      :data:`PAGE_SIZES`, the smallest first) and the page order (in order first)
    The classes a limit contradicts are left out (``no_keys`` with equal lengths or a minimum key count,
    ``decode`` with a query multiple above 1, the tile classes with any length limit).

    The shape class comes first, then batch, heads and head dim, then block sizes and the lengths they
    allow (at most sqrt(max_tiles) tiles per axis), then the flags, the magnitude class, the layout, the
    scale and the seed; every class makes the same draws and maps them onto its constraints.
    Cost: a dozen small integers per case; tensors are only built when the test calls ``build``.
    """
    if not magnitudes or not layouts or not shape_classes:
        raise ValueError("magnitudes, layouts and shape_classes should not be empty")
    unknown = sorted(set(shape_classes) - set(SHAPE_CLASSES))
    if unknown:
        raise ValueError(f"shape_classes {unknown} are unknown; known: {SHAPE_CLASSES}")
    if longer not in (None, "len_q", "len_k"):
        raise ValueError(f"longer={longer!r}, but should be None, 'len_q' or 'len_k'")
    if min_len_q < 1 or max_extra < 1:
        raise ValueError(f"min_len_q={min_len_q}, max_extra={max_extra}, but both should be at least 1")
    if min_group > 1 and not gqa:
        raise ValueError(f"min_group={min_group} needs gqa=True (grouped-query cases)")
    if min_group > limits.max_group:
        raise ValueError(f"min_group={min_group}, but limits.max_group={limits.max_group}")
    if equal_lengths and longer is not None:
        raise ValueError(f"longer={longer!r} contradicts equal_lengths=True")
    if len_q_multiple < 1 or len_k_multiple < 1:
        raise ValueError(f"len_q_multiple={len_q_multiple}, len_k_multiple={len_k_multiple}: both should be >= 1")
    if scale_choices is not None and len(scale_choices) == 0:
        raise ValueError("scale_choices should not be empty (None: any scale)")
    if max_len_q is not None and max_len_q < min_len_q:
        raise ValueError(f"max_len_q={max_len_q} is below min_len_q={min_len_q}")
    if limits.max_batch_heads < min_group:
        raise ValueError(f"min_group={min_group}, but limits.max_batch_heads={limits.max_batch_heads}")
    if max_batch_heads is not None and max_batch_heads < min_group:
        raise ValueError(f"max_batch_heads={max_batch_heads} leaves no room for min_group={min_group}")
    if equal_lengths:
        len_q_multiple = len_k_multiple = math.lcm(len_q_multiple, len_k_multiple)
    length_limited = equal_lengths or len_q_multiple > 1 or len_k_multiple > 1
    classes = list(shape_classes)
    no_decode = min_len_q > 1 or longer == "len_q" or len_q_multiple > 1
    for name, excluded in (("no_keys", min_len_k > 0 or longer == "len_k" or equal_lengths),
                           ("decode", no_decode),
                           ("long_context", no_decode or equal_lengths or limits.context_len <= limits.max_len),
                           ("kv_tiles_wider", length_limited), ("k_aligned_q_ragged", length_limited),
                           ("masked_q_tiles", length_limited)):
        if excluded and name in classes and len(classes) > 1:
            classes.remove(name)
    first, rest = classes[0], classes[1:]
    kind = draw(st.one_of(st.just(first), st.sampled_from(rest)) if rest else st.just(first), label="shape class")
    pool = compile_pool(limits.compile_pool) if limits.compile_pool else None
    row = draw(st.sampled_from(pool), label="compile configuration") if pool else None

    # Every class makes the same draws in the same order and maps them onto its constraints (monotone
    # maps, so that smaller draws give smaller cases): the shrinker can then move a failure from any
    # class to ``plain`` and keep the values it has, and shrinks towards the smallest case of the class.
    tile_class = kind in ("kv_tiles_wider", "k_aligned_q_ragged", "masked_q_tiles")
    long_class = kind == "long"
    wide = kind == "wide_head"
    # long sequences stay cheap with B = Hkv = 1 (a long KV cache: one KV head and its group)
    one_head = long_class or tile_class or kind == "long_context"
    batch = draw(st.integers(1, limits.max_batch), label="batch")
    heads_kv = draw(st.integers(1, limits.max_heads_kv), label="heads_kv")
    group = draw(_groups(min_group, limits.max_group), label="group") if gqa else 1
    if one_head:
        batch, heads_kv = 1, 1
    decode_like = kind in ("decode", "long_context")
    if decode_like and gqa:  # decode fast paths are grouped-query paths
        group = max(group, min(2, limits.max_group))
    # B * Hq within the declared cap and the limits' (monotone: smaller draws stay smaller; the group
    # is kept and the batch and KV heads give way)
    cap = min(max_batch_heads or limits.max_batch_heads, limits.max_batch_heads)
    batch = min(batch, max(1, cap // (heads_kv * group)))
    heads_kv = min(heads_kv, max(1, cap // (batch * group)))
    group = max(min_group, min(group, cap // (batch * heads_kv)))
    heads = batch * heads_kv * group
    row_len = limits.max_len if heads <= ROW_HEADS else max(1, limits.max_len * ROW_HEADS // heads)
    # The longest length of this class that keeps B * Hq * N * N within max_scores.
    max_len = min(limits.plain_len, row_len)
    if long_class or tile_class:
        max_len = max(1, min(row_len, math.isqrt(limits.max_scores // heads)))
    elif kind == "decode":  # one query against a KV cache of any length
        max_len = max(1, min(row_len, limits.max_scores // heads))
    elif kind == "long_context":  # past max_len; the rows are capped once the head dim is drawn
        max_len = max(1, min(limits.context_len, limits.max_scores // heads))

    top_d = limits.max_head_dim if wide else limits.plain_head_dim
    if head_dims is None:
        near = _wide_head_dims(top_d) if wide else []
        if row is not None:
            head_dim = draw(_pooled_head_dims(row, near or range(1, top_d + 1)), label="head_dim")
        else:
            head_dim = draw(st.sampled_from(near) if near else st.integers(1, top_d), label="head_dim")
    else:
        allowed = sorted(d for d in head_dims if d <= top_d) or [min(head_dims)]
        if wide:
            allowed = [d for d in allowed if any(abs(d - p) <= 8 for p in (64, 128, 256))] or allowed[-1:]
        head_dim = draw(st.sampled_from(allowed) if row is None else _pooled_head_dims(row, allowed), label="head_dim")
    value_dim = head_dim
    if head_dim_v:
        head_dim, value_dim = draw(_value_head_dims(head_dim, head_dims, top_d, row=row), label="head_dim_v")
    widest = max(head_dim, value_dim)  # what the memory caps below size a row by

    # Blocks before lengths, and lengths capped so that each axis has at most sqrt(max_tiles) tiles:
    # shrinking a length then never changes a block.
    per_axis = limits.tiles_per_axis
    if row is None:
        bm = draw(st.sampled_from(_blocks_for(block_m, per_axis, long_class)), label="block_m") if block_m else None
        bn = draw(st.sampled_from(_blocks_for(block_n, per_axis, long_class)), label="block_n") if block_n else None
    else:
        bm, bn = row.pick("tiles", [(m, n) for m in (_blocks_for(block_m, per_axis, long_class) if block_m else [None])
                                    for n in (_blocks_for(block_n, per_axis, long_class) if block_n else [None])])
    if kind == "long_context":  # B * Hq * (1 + Nk) * D within half the rows, as the decode class's (Nk at
        # row_len): K and V, their gradients and a group's copies of them are what a decode step holds
        max_len = max(1, min(max_len, limits.max_rows // (2 * heads * widest) - 1))
    edges = _near_powers_of_two(1, max_len) if (long_class or decode_like) else []
    top_q = min(max_len, per_axis * bm) if bm else max_len
    len_q = draw(_lengths(near=sorted(set(_near_blocks(block_m, top_q) + edges)), max_len=top_q), label="len_q")
    top_k = max(1, min(max_len, limits.max_scores // (heads * max(1, len_q))))
    if decode_like:
        top_k = max_len
    top_k = min(top_k, per_axis * bn) if bn else top_k
    least_k = max(1, min_len_k)
    if kind == "long_context":  # past max_len where the rows and the tiles leave room
        least_k = max(least_k, min(top_k, limits.max_len + 1))
    len_k = draw(_lengths(near=sorted(set(_near_blocks(block_n, top_k) + edges)), max_len=top_k,
                          min_len=least_k), label="len_k")
    is_causal = causal
    if is_causal is None:
        is_causal = draw(st.booleans(), label="causal") if row is None else _pooled_switch(draw, row, "causal")
        if decode_like or tile_class:
            is_causal = True
    if decode_like:
        len_q = 1
    elif kind == "no_keys":
        len_k = 0
    elif tile_class:
        tm, tn = draw(_tile_pair(block_m, block_n, max_len, per_axis, kind=kind, row=row), label="tiles")
        bm, bn = (tm if block_m else None), (tn if block_n else None)
        # Declared (tunable) tiles keep the tile count bounded; nominal ones cost nothing.
        max_q = min(max_len, per_axis * tm) if block_m else max_len
        max_kt = min(max_len, per_axis * tn) if block_n else max_len
        len_q, len_k = _tile_lengths(kind, tm, tn, len_q, len_k, max_q=max_q, max_k=max_kt, min_len_k=min_len_k)
    len_q = max(len_q, min_len_q)
    if max_len_q is not None:
        len_q = min(len_q, max_len_q)
    if length_limited:  # the declared multiples (and equal lengths), before any ``longer``
        cap_q = min(top_q, math.isqrt(max(1, limits.max_scores // heads))) if equal_lengths else top_q
        len_q = conform_length(len_q, len_q_multiple, low=max(1, min_len_q), cap=cap_q)
        len_k = len_q if equal_lengths else conform_length(len_k, len_k_multiple, low=min_len_k, cap=top_k)
    if longer is not None:
        extra = draw(st.integers(1, max_extra), label=f"{longer} longer by")
        # The other length leaves room for the longer one within max_scores (B * Hq * Nq * Nk): the
        # longer one is set from it, past the class's own cap on the product.
        mult = len_q_multiple if longer == "len_q" else len_k_multiple
        room = max(1, math.isqrt(limits.max_scores // heads) - max_extra * mult)
        if longer == "len_q" and len_k > room:
            len_k = conform_length(room, len_k_multiple, low=min_len_k, cap=room)
        if longer == "len_k" and len_q > room:
            len_q = conform_length(room, len_q_multiple, low=max(1, min_len_q), cap=room)
        # the next multiple above the other length, then ``extra - 1`` multiples more (multiple 1: + extra)
        if longer == "len_q":
            if max_len_q is not None:  # room for Nq > Nk under the cap
                len_k = min(len_k, max(0, max_len_q - extra))
            len_q = (len_k // len_q_multiple + extra) * len_q_multiple
        else:
            len_k = (len_q // len_k_multiple + extra) * len_k_multiple
    magnitude = draw(st.sampled_from(list(magnitudes)), label="magnitude")
    layout = draw(st.sampled_from(list(layouts)), label="layout") if row is None else row.pick("layout", list(layouts))
    scale = draw(scales() if scale_choices is None else st.sampled_from(list(scale_choices)), label="scale")
    if row is not None:
        variants = _pooled_variants(draw, row, len_q=len_q, len_k=len_k, heads=heads_kv * group, limits=limits,
                                    windows=windows, softcap=softcap, alibi=alibi, chunks=chunks, sinks=sinks,
                                    splits=splits)
        window, cap, slopes, chunk, sink, num_splits = variants
    else:
        window = (-1, -1)
        if windows:
            side = st.one_of(st.just(-1), st.integers(0, 4), st.integers(0, max(len_q, len_k) + 1))
            window = (draw(side, label="window_left"), draw(side, label="window_right"))
        cap = draw(_softcaps(), label="softcap") if softcap else None
        slopes = draw(_alibi_slopes(heads_kv * group), label="alibi_slopes") if alibi else None
        chunk = draw(st.one_of(st.just(0), st.one_of(st.integers(1, 4), st.integers(1, max(len_q, len_k) + 1))),
                     label="attention_chunk") if chunks else 0
        sink = draw(_sink_logits(heads_kv * group), label="sinks") if sinks else None
        num_splits = draw(_splits(limits.max_splits), label="num_splits") if splits else 1
    sequence_fields: dict = {}
    conventions = _conventions(sequences)
    if conventions != ["dense"]:
        first, *rest = conventions  # the first half the time (dense when listed), as the shape classes
        if row is None:
            convention = draw(st.one_of(st.just(first), st.sampled_from(rest)) if rest else st.just(first),
                              label="sequences")
        elif first != "dense":  # no dense batch declared: any of the others, as without a pool
            convention = draw(st.sampled_from(conventions), label="sequences")
        else:
            convention = draw(st.sampled_from(rest), label="sequences")
            convention = convention if _pooled_switch(draw, row, "varlen") else "dense"
        if convention != "dense":
            # The scores the references hold grow with the totals: the sequences after the first stay short.
            short = max(0, min(limits.plain_len, math.isqrt(limits.max_scores // heads) // (MORE_SEQUENCES + 1)))
            # the further sequences keep the lengths' lower limits (0 queries allowed unless one is asked for)
            sequence_fields = _sequence_fields(
                draw, convention, len_q, len_k, short=short, page_sizes=page_sizes,
                least_q=max(min_len_q if min_len_q > 1 else 0, min_len), least_k=max(min_len_k, min_len),
                multiples=(len_q_multiple, len_k_multiple), equal=equal_lengths)
            sequence_fields = _sequences_within(sequence_fields, heads=heads_kv * group, head_dim=widest,
                                                limits=limits)
            batch = 1
            len_q, len_k = sum(sequence_fields["seqlens_q"]), sum(sequence_fields["seqlens_k"])
    if num_splits > 1:
        queries = (_laid_out(sequence_fields["sequences"], sequence_fields["seqlens_q"]) if sequence_fields
                   else batch * len_q)
        num_splits = _splits_within(num_splits, queries=queries, heads=heads_kv * group, head_dim=widest,
                                    limits=limits)
    descaled = ((draw(st.booleans(), label="descale") if row is None else _pooled_switch(draw, row, "descale"))
                if descale and dtype in FP8_NAMES and not sequence_fields else False)
    seed = draw(st.integers(0, 2 ** 16), label="seed")
    return AttentionCase(batch=batch, heads_q=heads_kv * group, heads_kv=heads_kv, len_q=len_q,
                         len_k=len_k, head_dim=head_dim, dtype=dtype,
                         spec=AttentionSpec(causal=is_causal, alignment=alignment, window_left=window[0],
                                            window_right=window[1], softcap=cap, alibi_slopes=slopes,
                                            attention_chunk=chunk, sinks=sink, num_splits=num_splits,
                                            **sequence_fields),
                         magnitude=magnitude, seed=seed, layout=layout, scale=scale,
                         block_m=bm, block_n=bn, head_dim_v=value_dim, descale=descaled)


# Multi-head latent attention (DeepSeek-V2/V3) as FlashAttention-3 runs its prefill: q and k 192 wide
# (128 + 64 rotary), v 128.
MLA_HEAD_DIMS = (192, 128)


def _value_head_dims(head_dim: int, head_dims: Sequence[int] | None, top_d: int, *, row: Row | None = None):
    """``(head_dim, head_dim_v)``: the drawn head dim kept, with v's the same (first: what failures shrink
    to) or any accepted up to ``top_d``; or :data:`MLA_HEAD_DIMS` where both are accepted and within
    ``top_d``. With a compile pool ``row``: the one of these the row takes (for v's own head dim, one class
    of them: :func:`strategies.compile_pool.head_dim_classes`)."""
    accepted = (lambda d: d <= top_d) if head_dims is None else (lambda d: d <= top_d and d in head_dims)
    if row is not None:
        dims = [d for d in (range(1, top_d + 1) if head_dims is None else head_dims) if accepted(d)] or [min(head_dims)]
        options = ["same", *head_dim_classes(dims), *(["mla"] if all(accepted(d) for d in MLA_HEAD_DIMS) else [])]
        chosen = row.pick("head_dim_v", options)
        if chosen == "same":
            return st.just((head_dim, head_dim))
        if chosen == "mla":
            return st.just(MLA_HEAD_DIMS)
        # v's own head dim (not q's by chance: Dv = D is the "same" row's, and kernels compile for it apart)
        return _one_of_class([d for d in chosen if d != head_dim] or chosen).map(lambda dv: (head_dim, dv))
    others = (st.integers(1, top_d) if head_dims is None
              else st.sampled_from(sorted(d for d in head_dims if d <= top_d) or [min(head_dims)]))
    choices = [others.map(lambda dv: (head_dim, dv))]
    if all(accepted(d) for d in MLA_HEAD_DIMS):
        choices.append(st.just(MLA_HEAD_DIMS))
    return st.one_of(st.just((head_dim, head_dim)), *choices)


def _pooled_head_dims(row: Row, dims: Sequence[int]):
    """A head dim of the class (padded power of two, and whether it is one) the compile pool ``row`` takes
    among ``dims``."""
    return _one_of_class(row.pick("head_dim", head_dim_classes(dims)))


# Whether a switch a compile pool row turns on stays on: nearly always (255 in 256) as drawn, and off as the
# shrinker leaves it (the first element), so that a failure shrinks to the variants it needs. (A sampled
# element, not an integer: Hypothesis draws an integer's bounds far more often than the rest.)
_KEPT = st.sampled_from((False,) + (True,) * 255)


def _pooled_switch(draw, row: Row, name: str) -> bool:
    """Whether the compile pool ``row`` switches ``name`` on, and the drawn bit (:data:`_KEPT`) keeps it."""
    return draw(_KEPT, label=f"{name} kept") and name in row.on


def _one_of_class(dims: Sequence[int]):
    """Any of ``dims`` (the smallest first), through one draw whose range is the same for every class: every
    row of a compile pool makes the same draws, so the shrinker can move a failure to a smaller row and keep
    the rest of its choices."""
    return st.sampled_from(range(256)).map(lambda i: dims[i % len(dims)])


def _pooled_variants(draw, row: Row, *, len_q: int, len_k: int, heads: int, limits: Limits, windows: bool,
                     softcap: bool, alibi: bool, chunks: bool, sinks: bool, splits: bool) -> tuple:
    """``(window, softcap, slopes, chunk, sinks, num_splits)`` with the variants the compile pool ``row``
    switches on (and the case's declaration and property allow) drawn as without a pool, less their "off"
    value, and the others off."""
    # Every variant the case may have is drawn whether the row switches it on or not, with a bit that keeps
    # it (:data:`_KEPT`): every row makes the same draws, and the shrinker switches off what a failure does
    # not need.
    def kept(name: str, allowed: bool, strategy, label: str, off):
        if not allowed:
            return off
        value = draw(strategy, label=label)
        return value if _pooled_switch(draw, row, name) else off

    bounded = st.one_of(st.integers(0, 4), st.integers(0, max(len_q, len_k) + 1))
    window = kept("window", windows, st.tuples(st.sampled_from(("left", "right", "both")), bounded, bounded)
                  .map(lambda w: (w[1] if w[0] != "right" else -1, w[2] if w[0] != "left" else -1)),
                  "window (one side or both bounded)", (-1, -1))
    many = [n for n in SPLITS if n <= limits.max_splits]
    return (window, kept("softcap", softcap, _SOFTCAP_VALUES, "softcap", None),
            kept("alibi", alibi, _alibi_slopes(heads, off=False), "alibi_slopes", None),
            kept("chunk", chunks, st.one_of(st.integers(1, 4), st.integers(1, max(len_q, len_k) + 1)),
                 "attention_chunk", 0),
            kept("sinks", sinks, _sink_values(heads), "sinks", None),
            kept("splits", splits and limits.max_splits >= 2,
                 st.one_of(st.integers(2, max(2, min(5, limits.max_splits))),
                           *([st.sampled_from(many)] if many else [])),
                 "num_splits", 1))


def _conventions(sequences: Sequence[str]) -> list[str]:
    """The conventions to draw, ``dense`` first when listed (what failures shrink to)."""
    unknown = sorted(set(sequences) - set(SEQUENCES))
    if unknown or not sequences:
        raise ValueError(f"sequences={tuple(sequences)!r}, but should be a non-empty selection of {SEQUENCES}")
    return sorted(set(sequences), key=SEQUENCES.index)


def _sequence_fields(draw, convention: str, len_q: int, len_k: int, *, short: int,
                     page_sizes: Sequence[int] | None, least_q: int = 0, least_k: int = 0,
                     multiples: tuple[int, int] = (1, 1), equal: bool = False) -> dict:
    """The spec's sequence fields: the drawn lengths as the first sequence, then up to MORE_SEQUENCES more
    of lengths ``least .. short``, empty and length-1 ones as often as any other (a paged cache: one query
    length for all; its page size and order), each mapped onto the declared ``multiples`` (rounded up, at
    least ``least``: monotone) and with ``equal`` its keys as many as its queries."""
    def lengths(least: int):
        top = max(least, short)
        edges = [n for n in (0, 1) if n >= least]
        return st.one_of(st.sampled_from(edges), st.integers(least, top)) if edges else st.integers(least, top)

    def conform(n: int, axis: int, least: int) -> int:
        m = multiples[axis]
        return n if m == 1 else conform_length(n, m, low=least, cap=max(short, -(-max(least, 1) // m) * m))

    if convention == "paged":
        more_k = draw(st.lists(lengths(least_k), max_size=MORE_SEQUENCES), label="more cache lengths")
        more_k = [len_q if equal else conform(n, 1, least_k) for n in more_k]
        lens_k = (len_k, *more_k)
        fields = {"seqlens_q": (len_q,) * len(lens_k), "seqlens_k": lens_k}
        fields["page_size"] = draw(st.sampled_from(sorted(page_sizes) if page_sizes else PAGE_SIZES),
                                   label="page_size")
        fields["page_seed"] = draw(st.one_of(st.just(0), st.integers(1, 64)), label="page order")
    else:
        more = draw(st.lists(st.tuples(lengths(least_q), lengths(least_k)), max_size=MORE_SEQUENCES),
                    label="more sequences (Nq, Nk)")
        if equal:  # one length per sequence, within both axes' least
            more = [(n, n) for n in (conform(a, 0, max(least_q, least_k)) for a, _ in more)]
        else:
            more = [(conform(a, 0, least_q), conform(b, 1, least_k)) for a, b in more]
        fields = {"seqlens_q": (len_q, *(a for a, _ in more)), "seqlens_k": (len_k, *(b for _, b in more))}
    return {"sequences": convention, **fields}


def _sequences_within(fields: dict, *, heads: int, head_dim: int, limits: Limits) -> dict:
    """``fields`` with the sequences after the first dropped, the last first, until the tensors the
    convention lays out fit the limits as a dense case's do: ``heads * Q * K`` within ``max_scores`` and
    ``heads * (Q + K) * head_dim`` within ``limits.max_rows``, where Q and K are the totals (a padded
    batch: the sequences times the longest). A paged cache repeats its query length for every sequence,
    and a long first sequence beside others pads them all to its length: without this, large groups and
    long caches would pass what a worker's budget holds. The first sequence alone is a drawn dense case,
    which fits."""
    lens_q, lens_k = list(fields["seqlens_q"]), list(fields["seqlens_k"])

    def fits() -> bool:
        total_q, total_k = _laid_out(fields["sequences"], lens_q), _laid_out(fields["sequences"], lens_k)
        return (heads * total_q * total_k <= limits.max_scores
                and heads * (total_q + total_k) * head_dim <= limits.max_rows)

    while len(lens_q) > 1 and not fits():
        lens_q.pop()
        lens_k.pop()
    return {**fields, "seqlens_q": tuple(lens_q), "seqlens_k": tuple(lens_k)}


def _laid_out(convention: str, lengths: Sequence[int]) -> int:
    """The rows per head a convention lays ``lengths`` out in: a padded batch pads every sequence to the
    longest, the others pack them."""
    return len(lengths) * max(lengths) if convention == "padded" else sum(lengths)


def _splits_within(num_splits: int, *, queries: int, heads: int, head_dim: int, limits: Limits) -> int:
    """``num_splits`` cut (to 2 at least) so that the split-KV partial outputs, one ``[B, Hq, Nq, D]`` per
    split, hold no more than ``limits.max_rows`` elements: a split-KV kernel keeps them all until it merges
    them (FlashAttention-2's ``out_accum``), and a worker's budget holds that beside the suite's own work
    (``verify/gpu.py``). A decode step (one query) keeps every split count up to 128; a long prefill keeps
    a few."""
    return max(2, min(num_splits, limits.max_rows // max(1, heads * queries * head_dim)))


def _sink_logits(heads: int):
    """None first, then :func:`_sink_values`."""
    return st.one_of(st.none(), _sink_values(heads))


def _sink_values(heads: int):
    """One logit per query head: all 0, one far above any drawn score (the sink takes almost all the weight),
    or any float32 in [-8, 8]."""
    return st.one_of(st.just((0.0,) * heads), st.just((30.0,) * heads),
                     st.tuples(*[st.floats(-8.0, 8.0, width=32)] * heads))


def _float32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _softcaps():
    """None first (what failures shrink to), then the caps of real models and any float32 cap."""
    return st.one_of(st.none(), *_SOFTCAP_CHOICES)


_SOFTCAP_CHOICES = (st.sampled_from((30.0, 1.0, 5.0, 50.0)), st.floats(0.25, 64.0, width=32))
_SOFTCAP_VALUES = st.one_of(*_SOFTCAP_CHOICES)


def _alibi_slopes(heads: int, *, off: bool = True):
    """None first (``off``), then per-head slopes: all 0 (plain attention), the ALiBi paper's geometric
    sequence rounded to float32 (a kernel takes float32 slopes: the case holds exactly what it gets), or any."""
    geometric = tuple(_float32(2.0 ** (-8.0 * (h + 1) / heads)) for h in range(heads))
    return st.one_of(*([st.none()] if off else []), st.just((0.0,) * heads), st.just(geometric),
                     st.tuples(*[st.floats(0.0, 2.0, width=32)] * heads))


def conform_length(length: int, multiple: int, *, low: int, cap: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` and at least ``low``, at most ``cap`` rounded
    down to a multiple but never below the smallest conforming length (monotone in ``length``)."""
    smallest = -(-max(low, 0) // multiple) * multiple
    up = max(smallest, -(-length // multiple) * multiple)
    return max(smallest, min(up, cap // multiple * multiple))


def _tile_lengths(kind: str, bm: int, bn: int, len_q: int, len_k: int, *, max_q: int, max_k: int,
                  min_len_k: int) -> tuple[int, int]:
    """Map drawn lengths (monotonely: the smallest draws give the smallest case) onto a tile class."""
    len_q, len_k = min(len_q, max_q), min(len_k, max_k)
    if kind == "kv_tiles_wider":  # at least two key tiles, the last one possibly partial
        return len_q, min(max_k, max(2 * bn, min_len_k) + len_k - 1)
    if kind == "k_aligned_q_ragged":  # Nk a multiple of block_n, Nq not a multiple of block_m
        len_k = max(bn, min(max_k - max_k % bn, -(-max(len_k, min_len_k) // bn) * bn))
        return (len_q if len_q % bm or len_q == 1 else len_q - 1), len_k
    # masked_q_tiles: Nq - Nk >= block_m (bottom-right: the first Nq - Nk rows see no key)
    len_k = max(min_len_k, min(len_k - 1, max_q - bm))
    return min(max(max_q, len_k + bm), len_k + bm + len_q - 1), len_k


def boundary_classes(case: AttentionCase) -> list[str]:
    """The boundary classes ``case`` reaches (a fact of the case, whichever shape class drew it).

    Tile classes are judged with the case's block sizes; a case without them (a kernel that declares
    no tiles) reaches a tile class when it does so for some pair of :data:`NOMINAL_BLOCKS`."""
    pairs = ([(case.block_m, case.block_n)] if case.block_m and case.block_n
             else [(m, n) for m in NOMINAL_BLOCKS for n in NOMINAL_BLOCKS])
    nq, nk, causal = case.len_q, case.len_k, case.causal
    lens = (nq, nk)
    checks = {
        "decode": nq == 1,
        "decode_causal_gqa": nq == 1 and causal and case.group > 1,
        "no_keys": nk == 0,
        "gqa": case.group > 1,
        **_group_classes(case),
        "len_over_64": max(lens) > 64,
        "len_over_128": max(lens) > 128,
        "len_at_power_of_two_edge": any(n in _POW2_EDGES for n in lens),
        "context_over_8k": nq <= 16 and nk > 8192,
        "context_over_64k": nq <= 16 and nk > 65536,
        "head_dim_over_64": case.head_dim > 64,
        "head_dim_over_128": case.head_dim > 128,
        "head_dim_not_power_of_two": case.head_dim & (case.head_dim - 1) != 0,
        "head_dim_v_wider": case.value_dim > case.head_dim,
        "head_dim_v_narrower": case.value_dim < case.head_dim,
        "head_dim_v_mla": (case.head_dim, case.value_dim) == MLA_HEAD_DIMS,
        "fp8_descaled": case.descale,
        "kv_tiles_wider": causal and any(n > m and nk >= 2 * n for m, n in pairs),
        "k_aligned_q_ragged": causal and nk > 0 and any(nk % n == 0 and nq % m != 0 for m, n in pairs),
        "masked_q_tiles": causal and any(nq - nk >= m for m, _ in pairs),
        "fully_masked_rows": bool((case.spec.counts(nq, nk)[0] == 0).any()) if nq else False,
        "storage_offset": case.layout == "packed",
        "scale_zero": case.scale == 0,
        "scale_negative": case.scale is not None and case.scale < 0,
        "scale_above_one": case.scale is not None and case.scale > 1,
        "scale_tiny": case.scale is not None and 0 < abs(case.scale) < 1e-4,
        "scale_not_float16": case.scale is not None and _not_float16(case.scale),
        "window_zero": case.spec.window_left == 0 or case.spec.window_right == 0,
        "window_narrow": any(0 < w < max(nq, nk) for w in (case.spec.window_left, case.spec.window_right)),
        "window_at_least_n": any(w >= max(nq, nk) for w in (case.spec.window_left, case.spec.window_right)),
        "softcap": case.spec.softcap is not None,
        "softcap_below_one": case.spec.softcap is not None and case.spec.softcap < 1,
        "alibi": case.spec.alibi_slopes is not None and any(case.spec.alibi_slopes),
        "alibi_causal_gqa": case.spec.alibi_slopes is not None and any(case.spec.alibi_slopes) and causal
                            and case.group > 1,
        **_variant_classes(case),
    }
    return [name for name, hit in checks.items() if hit]


def _group_classes(case: AttentionCase) -> dict[str, bool]:
    """The classes of the query heads per KV head real models use (:data:`GROUPS`)."""
    g, nq = case.group, case.len_q
    return {"group_4": g == 4, "group_5_or_7": g in (5, 7), "group_8": g == 8, "group_16": g == 16,
            "group_over_16": g > 16, "decode_causal_group_over_4": nq == 1 and case.causal and g > 4,
            "prefill_group_over_4": nq > 1 and g > 4}


def _variant_classes(case: AttentionCase) -> dict[str, bool]:
    """The boundary classes of chunks, sinks, split-KV and variable-length sequences."""
    spec = case.spec
    lens_q, lens_k = spec.seqlens_q or (), spec.seqlens_k or ()
    lens = lens_q + lens_k
    paged = spec.sequences == "paged"
    nq = lens_q[0] if paged else 0
    page = spec.page_size or 0
    return {
        "chunks": spec.attention_chunk > 0,
        "chunks_narrower_than_n": 0 < spec.attention_chunk < max(case.len_q, case.len_k),
        "sinks": spec.sinks is not None,
        "sinks_on_rows_without_keys": spec.sinks is not None and case.len_q > 0 and bool(
            (spec.counts(case.len_q, case.len_k)[0] == 0).any()),
        "split_kv": spec.num_splits > 1,
        "split_kv_more_splits_than_keys": spec.num_splits > 1 and any(
            n < spec.num_splits for n in (lens_k or (case.len_k,))),
        "split_kv_more_splits_than_key_tiles": spec.num_splits > 1 and any(
            -(-n // bn) < spec.num_splits <= n for n in (lens_k or (case.len_k,))
            for bn in ((case.block_n,) if case.block_n else NOMINAL_BLOCKS)),
        "split_kv_over_64": spec.num_splits > 64,
        "varlen_packed": spec.sequences == "packed",
        "varlen_padded": spec.sequences == "padded",
        "varlen_empty_sequence": spec.varlen and 0 in lens,
        "varlen_length_one": spec.varlen and 1 in lens,
        "varlen_nq_differs_from_nk": spec.varlen and any(a != b for a, b in zip(lens_q, lens_k)),
        "varlen_total_below_sequences_gqa": spec.varlen and case.len_q < len(lens_q) and case.group > 1,
        "paged": paged,
        "paged_page_size_1": paged and page == 1,
        "paged_page_not_power_of_two": paged and page & (page - 1) != 0,
        "paged_pages_permuted": paged and spec.page_seed > 0,
        "paged_decode": paged and nq == 1,
        "paged_speculative": paged and 2 <= nq <= 16,
    }


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def allowed_classes(limits: Limits, *, head_dims: Sequence[int] | None = None, gqa: bool = False,
                    causal: bool | None = None, alignment: str = "bottom_right", layouts: Sequence[str] = LAYOUTS,
                    min_len_k: int = 0, min_len_q: int = 1, equal_lengths: bool = False, len_q_multiple: int = 1,
                    len_k_multiple: int = 1, scale_choices: Sequence[float | None] | None = None,
                    windows: bool = False, softcap: bool = False, alibi: bool = False, chunks: bool = False,
                    sinks: bool = False, splits: bool = False, sequences: Sequence[str] = ("dense",),
                    page_sizes: Sequence[int] | None = None, max_len_q: int | None = None,
                    max_batch_heads: int | None = None, min_len: int = 0, head_dim_v: bool = False,
                    descale: bool = False, **_other) -> list[str]:
    """The boundary classes :func:`attention_cases` can draw with these arguments (a declaration's draws:
    ``verify.runner.declared_draws``): a class a declaration rules out (GQA without ``gqa``, a window without
    ``windows``, a head dim above 128 past its limit) is not owed by a run of that kernel."""
    can_causal = causal is not False
    top_d = max(head_dims) if head_dims else limits.max_head_dim
    varlen = bool(set(sequences) - {"dense"})
    paged = "paged" in sequences
    scales = [x for x in (scale_choices or ()) if x is not None]
    any_scale = scale_choices is None
    decode = min_len_q <= 1 and len_q_multiple == 1 and (not equal_lengths or len_k_multiple == 1)
    unequal = not equal_lengths
    top_group = min(limits.max_group, limits.max_batch_heads, max_batch_heads or limits.max_batch_heads) if gqa else 1
    facts = {
        "decode": decode,
        "decode_causal_gqa": decode and can_causal and gqa,
        "no_keys": min_len_k == 0 and unequal,
        "gqa": gqa,
        "group_4": top_group >= 4, "group_5_or_7": top_group >= 5, "group_8": top_group >= 8,
        "group_16": top_group >= 16, "group_over_16": top_group >= 32,
        "decode_causal_group_over_4": decode and can_causal and top_group >= 5, "prefill_group_over_4": top_group >= 5,
        "len_over_64": limits.max_len > 64,
        "len_over_128": limits.max_len > 128,
        "len_at_power_of_two_edge": limits.max_len >= 15,
        "context_over_8k": decode and not equal_lengths and limits.context_len > 8192,
        "context_over_64k": decode and not equal_lengths and limits.context_len > 65536,
        "head_dim_over_64": top_d > 64,
        "head_dim_over_128": top_d > 128,
        "head_dim_not_power_of_two": head_dims is None or any(not _power_of_two(d) for d in head_dims),
        "head_dim_v_wider": head_dim_v and (head_dims is None or len(head_dims) > 1),
        "head_dim_v_narrower": head_dim_v and (head_dims is None or len(head_dims) > 1),
        "head_dim_v_mla": head_dim_v and limits.max_head_dim >= MLA_HEAD_DIMS[0] and (
            head_dims is None or all(d in head_dims for d in MLA_HEAD_DIMS)),
        "fp8_descaled": descale and "dense" in sequences,
        "kv_tiles_wider": can_causal,
        "k_aligned_q_ragged": can_causal,
        "masked_q_tiles": can_causal and unequal and alignment == "bottom_right",
        "fully_masked_rows": (can_causal and unequal and alignment == "bottom_right") or windows or chunks or varlen,
        "storage_offset": "packed" in layouts,
        "scale_zero": any_scale or 0 in scales,
        "scale_negative": any_scale or any(x < 0 for x in scales),
        "scale_above_one": any_scale or any(x > 1 for x in scales),
        "scale_tiny": any_scale or any(0 < abs(x) < 1e-4 for x in scales),
        "scale_not_float16": any_scale or any(_not_float16(x) for x in scales),
        "window_zero": windows, "window_narrow": windows, "window_at_least_n": windows,
        "softcap": softcap, "softcap_below_one": softcap,
        "alibi": alibi, "alibi_causal_gqa": alibi and can_causal and gqa,
        "chunks": chunks, "chunks_narrower_than_n": chunks,
        "sinks": sinks, "sinks_on_rows_without_keys": sinks and (can_causal or windows or chunks or varlen),
        "split_kv": splits, "split_kv_more_splits_than_keys": splits,
        "split_kv_more_splits_than_key_tiles": splits and limits.max_splits >= 8,
        "split_kv_over_64": splits and limits.max_splits > 64,
        "varlen_packed": "packed" in sequences, "varlen_padded": "padded" in sequences,
        "varlen_empty_sequence": varlen and min_len == 0 and (min_len_k == 0 or (min_len_q <= 1 and unequal)),
        "varlen_length_one": varlen and min_len <= 1 and ((len_q_multiple == 1 and min_len_q <= 1)
                                                          or (len_k_multiple == 1 and min_len_k <= 1)),
        "varlen_nq_differs_from_nk": varlen and unequal, "varlen_total_below_sequences_gqa": varlen and gqa,
        "paged": paged,
        "paged_page_size_1": paged and (page_sizes is None or 1 in page_sizes),
        "paged_page_not_power_of_two": paged and (page_sizes is None or any(not _power_of_two(p) for p in page_sizes)),
        "paged_pages_permuted": paged, "paged_decode": paged and decode,
        "paged_speculative": paged and (max_len_q is None or max_len_q >= 2),
    }
    return [name for name in BOUNDARY_CLASSES if facts.get(name, True)]


def _not_float16(x: float) -> bool:
    return float(torch.tensor(x, dtype=torch.float16)) != x


_POW2_EDGES = frozenset(_near_powers_of_two(16, 2 ** 16))
BOUNDARY_CLASSES = ("decode", "decode_causal_gqa", "no_keys", "gqa", "group_4", "group_5_or_7", "group_8",
                    "group_16", "group_over_16", "decode_causal_group_over_4", "prefill_group_over_4", "len_over_64", "len_over_128",
                    "len_at_power_of_two_edge", "context_over_8k", "context_over_64k", "head_dim_over_64", "head_dim_over_128",
                    "head_dim_not_power_of_two", "head_dim_v_wider", "head_dim_v_narrower", "head_dim_v_mla",
                    "fp8_descaled", "kv_tiles_wider", "k_aligned_q_ragged", "masked_q_tiles",
                    "fully_masked_rows", "storage_offset", "scale_zero", "scale_negative", "scale_above_one",
                    "scale_tiny", "scale_not_float16", "window_zero", "window_narrow", "window_at_least_n",
                    "softcap", "softcap_below_one", "alibi", "alibi_causal_gqa", "chunks", "chunks_narrower_than_n",
                    "sinks", "sinks_on_rows_without_keys", "split_kv", "split_kv_more_splits_than_keys",
                    "split_kv_more_splits_than_key_tiles", "split_kv_over_64",
                    "varlen_packed", "varlen_padded", "varlen_empty_sequence", "varlen_length_one",
                    "varlen_nq_differs_from_nk", "varlen_total_below_sequences_gqa", "paged", "paged_page_size_1",
                    "paged_page_not_power_of_two", "paged_pages_permuted", "paged_decode", "paged_speculative")
