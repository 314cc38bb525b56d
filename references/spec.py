"""The attention a call computes, as one value: which keys each query may see, and what the scores are.

An :class:`AttentionSpec` is a value (hashable, comparable, plain JSON) that the case carries and the
float64 and mpmath references, the eager baseline, the bounds, the measurements and the kernel
declarations all take. Its fields, each a variant a kernel declares or not:

* the mask: ``causal`` and its ``alignment``, a sliding window ``(window_left, window_right)``, local
  attention in chunks of ``attention_chunk`` positions;
* the score modifications: a logit ``softcap`` and ALiBi ``alibi_slopes``;
* attention ``sinks``: one logit per query head that joins every row's softmax denominator;
* the sequences: a dense batch, or variable-length sequences (``seqlens_q``, ``seqlens_k``) passed
  ``packed`` (``[total, H, D]`` with ``cu_seqlens``), ``padded`` (``[B, H, N_max, D]`` with per-sequence
  lengths) or ``paged`` (a KV cache in pages of ``page_size`` keys, read through a block table);
* ``num_splits``: split-KV, the keys cut into splits whose partial outputs and LSEs are merged.

Score modifications (flash_attn's conventions) act on the scaled scores ``s = scale * q . k``, in this
order, before any masking: a softcap ``c`` gives ``c * tanh(s / c)``; ALiBi adds
``-slope_h * |diag_i - j|`` (one slope per query head ``h``; ``diag_i`` the causal diagonal of row ``i``).
:meth:`AttentionSpec.modify` applies both to a chunk of rows, :meth:`AttentionSpec.modify_grad` gives
``ds'/ds`` for the backward (softcap's ``1 - tanh^2``; ALiBi's bias is a constant).

A sink ``t_h`` is a logit with no value: ``lse_i = log(exp(t_h) + sum_j exp(s'_ij))`` over the visible
keys, ``out_i = sum_j exp(s'_ij - lse_i) v_j``; it is not scaled, capped or biased, and it is in every
row's denominator, so a row that sees no key gives ``out = 0`` and ``lse = t_h``. The LSE a kernel
returns is that normaliser, the sink included (what its backward needs).

Variable-length sequences live, for the references, in one packed problem: ``B = 1``, the sequences'
queries one after another (``Nq = sum seqlens_q``), their keys likewise (``Nk = sum seqlens_k``), and a
block-diagonal mask: query ``i`` of sequence ``s`` sees only keys of sequence ``s``, with the causal
diagonal, the window and the chunks placed per sequence. Every row still sees one range of keys, and the
ranges only move forward, so the references, bounds and properties need nothing else; how the tensors
reach a kernel (packed, padded, paged) is :mod:`flashverify_kernels.conventions`' business.

``bottom_right`` (FlashAttention's convention) puts query ``i``'s diagonal at key ``i + Nk - Nq`` (per
sequence), so the last query sees every key and, when ``Nq > Nk``, the first ``Nq - Nk`` queries see none
under a causal mask; ``top_left`` (PyTorch's ``is_causal``) at key ``i``. The float64 and mpmath
references, the eager baseline and the bounds ask the spec which keys a query sees
(:meth:`AttentionSpec.key_range`, :meth:`AttentionSpec.rows` on chunks of rows, :meth:`AttentionSpec.counts`
for whole-problem answers), so a new kind of mask is written here once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

ALIGNMENTS = ("bottom_right", "top_left")
# How the sequences reach a kernel: one dense batch, or variable-length sequences packed, padded or paged.
SEQUENCES = ("dense", "packed", "padded", "paged")
# The fields a spec's JSON always holds; the others only when they differ from their defaults.
_ALWAYS = ("causal", "alignment")


def require_spec(spec) -> None:
    """Refuse anything but an :class:`AttentionSpec` (the references' first check, before any work)."""
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec={spec!r}, but should be a references.spec.AttentionSpec")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The attention one call computes (module docstring).

    ``causal`` and its ``alignment``; a sliding window ``(window_left, window_right)`` in the flash_attn
    convention: -1 is unbounded, and query ``i`` sees the keys ``j`` with ``diag_i - window_left <= j <=
    diag_i + window_right``, intersected with the causal mask when causal; ``attention_chunk`` (0: none):
    query ``i`` sees only keys of its own chunk of that many positions, ``floor(j / C) == floor(diag_i /
    C)`` (positions counted per sequence), intersected with the rest. The keys a query sees are always one
    contiguous range, and both its ends grow with the row: :meth:`key_range` gives the ranges, :meth:`rows`
    the mask, :meth:`counts` the counts.

    ``softcap`` (a float > 0, or None) and ``alibi_slopes`` (one float per query head, or None) modify the
    scores; ``sinks`` (one float per query head, or None) join the denominators. ``sequences`` is
    ``"dense"`` or, with ``seqlens_q`` and ``seqlens_k`` (one length per sequence, 0 allowed),
    ``"packed"``, ``"padded"`` or ``"paged"`` (every sequence then has the same number of queries, and the
    keys sit in pages of ``page_size`` in the order ``page_seed`` gives: 0 keeps the pages in order).
    ``num_splits`` (1: none) cuts each sequence's keys into that many splits for split-KV. Sequences of
    numbers are tuples (a JSON list reads as one)."""

    causal: bool = False
    alignment: str = "bottom_right"
    window_left: int = -1
    window_right: int = -1
    softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    attention_chunk: int = 0
    sinks: tuple[float, ...] | None = None
    sequences: str = "dense"
    seqlens_q: tuple[int, ...] | None = None
    seqlens_k: tuple[int, ...] | None = None
    page_size: int | None = None
    page_seed: int = 0
    num_splits: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal={self.causal!r}, but should be a bool")
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment={self.alignment!r}, but should be one of {ALIGNMENTS}")
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if not _is_int(value) or value < -1:
                raise ValueError(f"{name}={value!r}, but should be an int >= -1 (-1: unbounded)")
        if not _is_int(self.attention_chunk) or self.attention_chunk < 0:
            raise ValueError(f"attention_chunk={self.attention_chunk!r}, but should be an int >= 0 (0: no chunks; "
                             "C > 0: a query sees only the keys of its own chunk of C positions)")
        cap = self.softcap
        if cap is not None and (not _is_number(cap) or not math.isfinite(cap) or cap <= 0):
            raise ValueError(f"softcap={cap!r}, but should be a finite number > 0 (None: no softcap)")
        for name, words in (("alibi_slopes", "no ALiBi"), ("sinks", "no sinks")):
            values = self._as_tuple(name)
            ok = values is None or (isinstance(values, tuple) and len(values) > 0
                                    and all(_is_number(x) and math.isfinite(x) for x in values))
            if not ok:
                raise ValueError(f"{name}={values!r}, but should be a non-empty sequence of finite numbers, "
                                 f"one per query head (None: {words})")
        self._check_sequences()
        if not _is_int(self.num_splits) or self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits!r}, but should be an int >= 1 (1: no split-KV)")

    def _as_tuple(self, name: str):
        """The field ``name`` as a tuple (a JSON list read back), stored as one."""
        value = getattr(self, name)
        if isinstance(value, list):
            value = tuple(value)
            object.__setattr__(self, name, value)
        return value

    def _check_sequences(self) -> None:
        if self.sequences not in SEQUENCES:
            raise ValueError(f"sequences={self.sequences!r}, but should be one of {SEQUENCES}")
        lens_q, lens_k = self._as_tuple("seqlens_q"), self._as_tuple("seqlens_k")
        if self.sequences == "dense":
            for name in ("seqlens_q", "seqlens_k", "page_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)!r}, but a dense batch has none: set "
                                     f"sequences to one of {SEQUENCES[1:]} for variable-length sequences")
            return
        for name, lens in (("seqlens_q", lens_q), ("seqlens_k", lens_k)):
            if not isinstance(lens, tuple) or not lens or not all(_is_int(n) and n >= 0 for n in lens):
                raise ValueError(f"{name}={lens!r}, but should be a non-empty sequence of ints >= 0, one length "
                                 f"per sequence (sequences={self.sequences!r})")
        if len(lens_q) != len(lens_k):
            raise ValueError(f"seqlens_q has {len(lens_q)} sequences and seqlens_k {len(lens_k)}: one length of "
                             "each per sequence")
        if self.sequences == "paged":
            if not _is_int(self.page_size) or self.page_size < 1:
                raise ValueError(f"page_size={self.page_size!r}, but should be an int >= 1 (the keys per page of "
                                 "a paged KV cache)")
            if len(set(lens_q)) != 1:
                raise ValueError(f"seqlens_q={lens_q!r}, but a paged KV cache takes one query tensor [B, Hq, Nq, "
                                 "D]: every sequence has the same number of queries")
        elif self.page_size is not None:
            raise ValueError(f"page_size={self.page_size!r}, but only a paged KV cache (sequences='paged') has "
                             "pages")
        if not _is_int(self.page_seed) or self.page_seed < 0:
            raise ValueError(f"page_seed={self.page_seed!r}, but should be an int >= 0 (0: pages in order)")

    # ------------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: ``causal`` and ``alignment`` always, every other field where it is not its default."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _ALWAYS or value != f.default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    # ------------------------------------------------------------------------------------- modifications
    @property
    def modified(self) -> bool:
        """Whether a softcap or ALiBi modifies the scores."""
        return self.softcap is not None or self.alibi_slopes is not None

    def _per_head(self, name: str, heads: int, *, device, dtype) -> torch.Tensor:
        values, word = getattr(self, name), {"alibi_slopes": "slopes", "sinks": "sink logits"}[name]
        if len(values) != heads:
            raise ValueError(f"{name} has {len(values)} {word}, but the attention has {heads} query heads: one "
                             "per query head")
        return torch.tensor(values, dtype=dtype, device=device)

    def alibi_bias(self, len_q: int, len_k: int, *, heads: int, device=None, dtype=torch.float64,
                   rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``[heads, r1 - r0, Nk]``: ALiBi's ``-slope_h * |diag_i - j|`` (the distance is exact; one rounding
        of the product in ``dtype``). Requires ``alibi_slopes``."""
        diag, _, _ = self._geometry(len_q, len_k, rows=rows, device=device)
        dist = (diag[:, None] - torch.arange(len_k, device=device)[None, :]).abs().to(dtype)
        return -self._per_head("alibi_slopes", heads, device=device, dtype=dtype)[:, None, None] * dist

    def modify(self, scores: torch.Tensor, len_q: int, len_k: int, *,
               rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The scores the softmax sees, from the scaled scores ``[..., Hq, r1 - r0, Nk]`` of rows ``r0 ..
        r1 - 1`` (default all): softcap, then ALiBi, in ``scores``' dtype. Unmodified: ``scores`` itself."""
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if self.alibi_slopes is not None:
            scores = scores + self.alibi_bias(len_q, len_k, heads=scores.shape[-3], device=scores.device,
                                              dtype=scores.dtype, rows=rows)
        return scores

    def modify_grad(self, scores: torch.Tensor) -> torch.Tensor | None:
        """``ds'/ds`` at the scaled scores ``scores`` (softcap's ``1 - tanh(s / c)^2``), or None where it is
        1 everywhere (no softcap: ALiBi adds a constant)."""
        if self.softcap is None:
            return None
        return 1.0 - torch.tanh(scores / self.softcap) ** 2

    def sink_logits(self, heads: int, *, device=None, dtype=torch.float64) -> torch.Tensor | None:
        """``[heads]``: each query head's sink logit, or None without sinks."""
        if self.sinks is None:
            return None
        return self._per_head("sinks", heads, device=device, dtype=dtype)

    # ------------------------------------------------------------------------------------- sequences
    @property
    def varlen(self) -> bool:
        """Whether the sequences have their own lengths (packed, padded or paged), not one dense batch."""
        return self.sequences != "dense"

    @property
    def num_sequences(self) -> int | None:
        """The number of variable-length sequences (None for a dense batch)."""
        return len(self.seqlens_q) if self.varlen else None

    @staticmethod
    def _cumulative(lens) -> tuple[int, ...]:
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return tuple(out)

    @property
    def cu_seqlens_q(self) -> tuple[int, ...] | None:
        """``(0, Nq_0, Nq_0 + Nq_1, ...)``: where each sequence's queries start in the packed rows."""
        return self._cumulative(self.seqlens_q) if self.varlen else None

    @property
    def cu_seqlens_k(self) -> tuple[int, ...] | None:
        return self._cumulative(self.seqlens_k) if self.varlen else None

    def check_lengths(self, len_q: int, len_k: int) -> None:
        """Refuse lengths that are not this spec's packed problem (variable-length sequences only)."""
        if self.varlen and (len_q, len_k) != (sum(self.seqlens_q), sum(self.seqlens_k)):
            raise ValueError(f"len_q={len_q}, len_k={len_k}, but the sequences {self.seqlens_q} x {self.seqlens_k} "
                             f"pack into {sum(self.seqlens_q)} queries and {sum(self.seqlens_k)} keys")

    def sequence_spans(self) -> list[tuple[int, int, int, int]]:
        """``[(q0, q1, k0, k1), ...]``: each sequence's rows and keys in the packed problem."""
        if not self.varlen:
            raise ValueError("sequence_spans: a dense batch has no variable-length sequences")
        cq, ck = self.cu_seqlens_q, self.cu_seqlens_k
        return [(cq[s], cq[s + 1], ck[s], ck[s + 1]) for s in range(len(self.seqlens_q))]

    def one_sequence(self, s: int) -> AttentionSpec:
        """The same attention on sequence ``s`` alone (the same convention, one sequence)."""
        spans = self.sequence_spans()
        if not 0 <= s < len(spans):
            raise ValueError(f"s={s}, but should be in 0 .. {len(spans) - 1}")
        return dataclasses.replace(self, seqlens_q=(self.seqlens_q[s],), seqlens_k=(self.seqlens_k[s],))

    # ------------------------------------------------------------------------------------- the mask
    @property
    def windowed(self) -> bool:
        """Whether a sliding window bounds either side."""
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def masked(self) -> bool:
        """Whether any mask (causal, a window, chunks, other sequences) hides keys from some query."""
        return self.causal or self.windowed or self.attention_chunk > 0 or self.varlen

    def offset(self, len_q: int, len_k: int) -> int:
        """The diagonal's shift in a dense batch: query ``i``'s diagonal is key ``i + offset`` (the causal
        mask's last key). Variable-length sequences have one per sequence: :meth:`diagonal`."""
        if self.varlen:
            raise ValueError("offset: variable-length sequences have one diagonal offset per sequence; use "
                             "AttentionSpec.diagonal")
        return len_k - len_q if self.alignment == "bottom_right" else 0

    def _geometry(self, len_q: int, len_k: int, *, rows: tuple[int, int] | None, device):
        """``(diag, lo, hi)`` int64 ``[r1 - r0]``: each row's causal diagonal (a key index, possibly outside
        ``[lo, hi)``) and the keys of its sequence, ``lo <= j < hi``."""
        r0, r1 = (0, len_q) if rows is None else rows
        if not 0 <= r0 <= r1 <= len_q:
            raise ValueError(f"rows=({r0}, {r1}), but should satisfy 0 <= r0 <= r1 <= len_q={len_q}")
        r = torch.arange(r0, r1, device=device)
        if not self.varlen:
            return r + self.offset(len_q, len_k), torch.zeros_like(r), torch.full_like(r, len_k)
        self.check_lengths(len_q, len_k)
        cq = torch.tensor(self.cu_seqlens_q, device=device)
        ck = torch.tensor(self.cu_seqlens_k, device=device)
        seq = torch.searchsorted(cq[1:], r, right=True)  # the sequence of each row
        lo, hi = ck[seq], ck[seq + 1]
        local = r - cq[seq]
        shift = (hi - lo) - (cq[seq + 1] - cq[seq]) if self.alignment == "bottom_right" else torch.zeros_like(r)
        return lo + local + shift, lo, hi

    def diagonal(self, len_q: int, len_k: int, *, device=None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Int64 ``[r1 - r0]``: the key index of each row's causal diagonal (per sequence when variable-length)."""
        return self._geometry(len_q, len_k, rows=rows, device=device)[0]

    def key_range(self, len_q: int, len_k: int, *, device=None,
                  rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(first, end)`` int64 ``[r1 - r0]``: query ``i`` sees keys ``first[i] <= j < end[i]`` (``end =
        first`` when it sees none); both are non-decreasing in ``i``."""
        diag, lo, hi = self._geometry(len_q, len_k, rows=rows, device=device)
        first, end = lo, hi
        if self.window_left >= 0:
            first = torch.maximum(first, diag - self.window_left)
        if self.window_right >= 0:
            end = torch.minimum(end, diag + self.window_right + 1)
        if self.causal:
            end = torch.minimum(end, diag + 1)
        if self.attention_chunk > 0:  # the chunk of the diagonal's position within the sequence
            start = lo + torch.div(diag - lo, self.attention_chunk, rounding_mode="floor") * self.attention_chunk
            first, end = torch.maximum(first, start), torch.minimum(end, start + self.attention_chunk)
        first = torch.minimum(torch.maximum(first, lo), hi)
        end = torch.minimum(torch.maximum(end, first), hi)
        return first, end

    def visible(self, i: int, j: int, len_q: int, len_k: int) -> bool:
        """Whether query ``i`` may see key ``j`` (one pair)."""
        first, end = self.key_range(len_q, len_k, rows=(i, i + 1))
        return int(first[0]) <= j < int(end[0])

    def rows(self, len_q: int, len_k: int, *, device=None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Bool ``[r1 - r0, Nk]``: True where query ``i`` (``r0 <= i < r1``, default all rows) may see key
        ``j``. Use it on chunks of rows: the whole mask is an ``Nq x Nk`` matrix."""
        first, end = self.key_range(len_q, len_k, device=device, rows=rows)
        j = torch.arange(len_k, device=device)[None, :]
        return (j >= first[:, None]) & (j < end[:, None])

    def counts(self, len_q: int, len_k: int, *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per_row [Nq], per_key [Nk])`` int64: the keys each query sees and the queries that see each
        key, without forming the mask (the rows that see key ``j`` are one range too: those whose range
        ends after ``j``, up to the last whose range starts at or before it)."""
        first, end = self.key_range(len_q, len_k, device=device)
        j = torch.arange(len_k, device=device)
        from_row = torch.searchsorted(end, j, right=True)  # the first row whose range ends after j
        to_row = torch.searchsorted(first, j, right=True)  # the rows whose range starts at or before j
        return end - first, (to_row - from_row).clamp(min=0)

    # ------------------------------------------------------------------------------------- split-KV
    def key_splits(self, len_k: int, *, device=None) -> torch.Tensor:
        """Int64 ``[Nk]``: the split of each key under split-KV, each sequence's keys cut into ``num_splits``
        contiguous splits of ``ceil(n / num_splits)`` keys (the last ones possibly shorter or empty)."""
        j = torch.arange(len_k, device=device)
        if not self.varlen:
            lo, n = torch.zeros_like(j), torch.full_like(j, len_k)
        else:
            ck = torch.tensor(self.cu_seqlens_k, device=device)
            seq = torch.searchsorted(ck[1:], j, right=True)
            lo, n = ck[seq], ck[seq + 1] - ck[seq]
        width = torch.div(n + self.num_splits - 1, self.num_splits, rounding_mode="floor").clamp(min=1)
        return torch.div(j - lo, width, rounding_mode="floor")

    # ------------------------------------------------------------------------------------- words
    def describe(self) -> str:
        """``causal`` / ``causal top_left`` / ``non-causal``, then what else the spec holds (window, chunks,
        modifications, sinks, sequences, splits): the spec in a case's one-line description."""
        if not self.causal:
            words = "non-causal"
        else:
            words = "causal" if self.alignment == "bottom_right" else f"causal {self.alignment}"
        if self.windowed:
            words += f" window ({self.window_left}, {self.window_right})"
        if self.attention_chunk:
            words += f" chunks of {self.attention_chunk}"
        if (self.windowed or self.attention_chunk) and not self.causal and self.alignment != "bottom_right":
            words += f" {self.alignment}"
        if self.softcap is not None:
            words += f" softcap={self.softcap:g}"
        if self.alibi_slopes is not None:
            words += " alibi=(" + ", ".join(f"{x:g}" for x in self.alibi_slopes) + ")"
        if self.sinks is not None:
            words += " sinks=(" + ", ".join(f"{x:g}" for x in self.sinks) + ")"
        if self.varlen:
            pairs = ", ".join(f"{a}x{b}" for a, b in zip(self.seqlens_q, self.seqlens_k))
            words += f" {self.sequences} sequences (Nq x Nk: {pairs})"
            if self.sequences == "paged":
                words += f" pages of {self.page_size}" + (f" order {self.page_seed}" if self.page_seed else "")
        if self.num_splits > 1:
            words += f" num_splits={self.num_splits}"
        return words
