"""The attention a call computes, as one value: today which keys each query may see.

An :class:`AttentionSpec` is a value (hashable, comparable, plain JSON) that the case carries and the
float64 and mpmath references, the eager baseline, the bounds, the measurements and the kernel
declarations all take: today ``causal`` and its ``alignment``; a window, sequence lengths or a score
modification is a new field here, read by those same consumers.

``bottom_right`` (FlashAttention's convention) lets query ``i`` see key ``j`` when ``j <= i + Nk - Nq``,
so the last query sees every key and, when ``Nq > Nk``, the first ``Nq - Nk`` queries see none;
``top_left`` (PyTorch's ``is_causal``) when ``j <= i``. The float64 and mpmath references, the eager
baseline and the bounds ask the spec which keys a query sees (:meth:`AttentionSpec.rows` on chunks of
rows, :meth:`AttentionSpec.counts` for whole-problem answers), so a new kind of mask is written here once.
"""

from __future__ import annotations

import dataclasses

import torch

ALIGNMENTS = ("bottom_right", "top_left")


def require_spec(spec) -> None:
    """Refuse anything but an :class:`AttentionSpec` (the references' first check, before any work)."""
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec={spec!r}, but should be a references.spec.AttentionSpec")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    causal: bool = False
    alignment: str = "bottom_right"

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal={self.causal!r}, but should be a bool")
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment={self.alignment!r}, but should be one of {ALIGNMENTS}")

    def offset(self, len_q: int, len_k: int) -> int:
        """The diagonal's shift: query ``i`` sees keys ``j <= i + offset`` (when causal)."""
        return len_k - len_q if self.alignment == "bottom_right" else 0

    def visible(self, i: int, j: int, len_q: int, len_k: int) -> bool:
        """Whether query ``i`` may see key ``j`` (one pair: the mpmath reference's loop)."""
        return not self.causal or j <= i + self.offset(len_q, len_k)

    def rows(self, len_q: int, len_k: int, *, device=None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Bool ``[r1 - r0, Nk]``: True where query ``i`` (``r0 <= i < r1``, default all rows) may see key
        ``j``. Use it on chunks of rows: the whole mask is an ``Nq x Nk`` matrix."""
        r0, r1 = (0, len_q) if rows is None else rows
        if not 0 <= r0 <= r1 <= len_q:
            raise ValueError(f"rows=({r0}, {r1}), but should satisfy 0 <= r0 <= r1 <= len_q={len_q}")
        if not self.causal:
            return torch.ones(r1 - r0, len_k, dtype=torch.bool, device=device)
        i = torch.arange(r0, r1, device=device)[:, None]
        j = torch.arange(len_k, device=device)[None, :]
        return j <= i + self.offset(len_q, len_k)

    def counts(self, len_q: int, len_k: int, *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per_row [Nq], per_key [Nk])`` int64: the keys each query sees (keys ``0 .. per_row - 1``)
        and the queries that see each key, without forming the mask."""
        if not self.causal:
            return (torch.full((len_q,), len_k, dtype=torch.int64, device=device),
                    torch.full((len_k,), len_q, dtype=torch.int64, device=device))
        offset = self.offset(len_q, len_k)
        i = torch.arange(len_q, device=device)
        j = torch.arange(len_k, device=device)
        per_row = (i + offset + 1).clamp(min=0, max=len_k)
        per_key = (len_q - (j - offset).clamp(min=0)).clamp(min=0, max=len_q)
        return per_row, per_key

    def describe(self) -> str:
        """``causal`` / ``causal top_left`` / ``non-causal``: the spec in a case's one-line description."""
        if not self.causal:
            return "non-causal"
        return "causal" if self.alignment == "bottom_right" else f"causal {self.alignment}"
