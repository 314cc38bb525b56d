"""The attention a call computes, as one value: which keys each query may see, and what the scores are.

An :class:`AttentionSpec` is a value (hashable, comparable, plain JSON) that the case carries and the
float64 and mpmath references, the eager baseline, the bounds, the measurements and the kernel
declarations all take: ``causal`` and its ``alignment``, a sliding window, and two score modifications
(a logit softcap and ALiBi biases); sequence lengths or another modification is a new field here, read
by those same consumers.

Score modifications (flash_attn's conventions) act on the scaled scores ``s = scale * q . k``, in this
order, before any masking: a softcap ``c`` gives ``c * tanh(s / c)``; ALiBi adds
``-slope_h * |i + offset - j|`` (one slope per query head ``h``; ``offset`` as for the causal diagonal).
:meth:`AttentionSpec.modify` applies both to a chunk of rows, :meth:`AttentionSpec.modify_grad` gives
``ds'/ds`` for the backward (softcap's ``1 - tanh^2``; ALiBi's bias is a constant).

``bottom_right`` (FlashAttention's convention) lets query ``i`` see key ``j`` when ``j <= i + Nk - Nq``,
so the last query sees every key and, when ``Nq > Nk``, the first ``Nq - Nk`` queries see none;
``top_left`` (PyTorch's ``is_causal``) when ``j <= i``. The float64 and mpmath references, the eager
baseline and the bounds ask the spec which keys a query sees (:meth:`AttentionSpec.rows` on chunks of
rows, :meth:`AttentionSpec.counts` for whole-problem answers), so a new kind of mask is written here once.
"""

from __future__ import annotations

import dataclasses
import math

import torch

ALIGNMENTS = ("bottom_right", "top_left")


def require_spec(spec) -> None:
    """Refuse anything but an :class:`AttentionSpec` (the references' first check, before any work)."""
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec={spec!r}, but should be a references.spec.AttentionSpec")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The attention one call computes. ``causal`` and its ``alignment``; a sliding window
    ``(window_left, window_right)`` in the flash_attn convention: -1 is unbounded, and query ``i`` sees the
    keys ``j`` with ``i + offset - window_left <= j <= i + offset + window_right`` (``offset``: the
    alignment's diagonal, ``Nk - Nq`` bottom-right, 0 top-left), intersected with the causal mask when
    causal. The keys a query sees are always one contiguous range, and both its ends grow with the row:
    :meth:`key_range` gives the ranges, :meth:`rows` the mask, :meth:`counts` the counts.

    ``softcap`` (a float > 0, or None for none) and ``alibi_slopes`` (one float per query head, or None)
    modify the scores (module docstring); the slopes are a tuple (a JSON list reads as one)."""

    causal: bool = False
    alignment: str = "bottom_right"
    window_left: int = -1
    window_right: int = -1
    softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal={self.causal!r}, but should be a bool")
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment={self.alignment!r}, but should be one of {ALIGNMENTS}")
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise ValueError(f"{name}={value!r}, but should be an int >= -1 (-1: unbounded)")
        cap = self.softcap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                or not math.isfinite(cap) or cap <= 0):
            raise ValueError(f"softcap={cap!r}, but should be a finite number > 0 (None: no softcap)")
        slopes = self.alibi_slopes
        if slopes is not None:
            if isinstance(slopes, list):
                slopes = tuple(slopes)
                object.__setattr__(self, "alibi_slopes", slopes)
            ok = isinstance(slopes, tuple) and len(slopes) > 0 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in slopes)
            if not ok:
                raise ValueError(f"alibi_slopes={slopes!r}, but should be a non-empty sequence of finite numbers, "
                                 "one per query head (None: no ALiBi)")

    @property
    def modified(self) -> bool:
        """Whether a softcap or ALiBi modifies the scores."""
        return self.softcap is not None or self.alibi_slopes is not None

    def _slopes(self, heads: int, *, device, dtype) -> torch.Tensor:
        if len(self.alibi_slopes) != heads:
            raise ValueError(f"alibi_slopes has {len(self.alibi_slopes)} slopes, but the attention has {heads} "
                             "query heads: one slope per query head")
        return torch.tensor(self.alibi_slopes, dtype=dtype, device=device)

    def alibi_bias(self, len_q: int, len_k: int, *, heads: int, device=None, dtype=torch.float64,
                   rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``[heads, r1 - r0, Nk]``: ALiBi's ``-slope_h * |i + offset - j|`` (the distance is exact; one
        rounding of the product in ``dtype``). Requires ``alibi_slopes``."""
        r0, r1 = (0, len_q) if rows is None else rows
        diag = torch.arange(r0, r1, device=device) + self.offset(len_q, len_k)
        dist = (diag[:, None] - torch.arange(len_k, device=device)[None, :]).abs().to(dtype)
        return -self._slopes(heads, device=device, dtype=dtype)[:, None, None] * dist

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

    @property
    def windowed(self) -> bool:
        """Whether a sliding window bounds either side."""
        return self.window_left >= 0 or self.window_right >= 0

    def offset(self, len_q: int, len_k: int) -> int:
        """The diagonal's shift: query ``i``'s diagonal is key ``i + offset`` (the causal mask's last key)."""
        return len_k - len_q if self.alignment == "bottom_right" else 0

    def key_range(self, len_q: int, len_k: int, *, device=None,
                  rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(first, end)`` int64 ``[r1 - r0]``: query ``i`` sees keys ``first[i] <= j < end[i]`` (``end =
        first`` when it sees none); both are non-decreasing in ``i``."""
        r0, r1 = (0, len_q) if rows is None else rows
        if not 0 <= r0 <= r1 <= len_q:
            raise ValueError(f"rows=({r0}, {r1}), but should satisfy 0 <= r0 <= r1 <= len_q={len_q}")
        diag = torch.arange(r0, r1, device=device) + self.offset(len_q, len_k)
        first = (diag - self.window_left).clamp(min=0, max=len_k) if self.window_left >= 0 else torch.zeros_like(diag)
        end = torch.full_like(diag, len_k)
        if self.window_right >= 0:
            end = torch.minimum(end, diag + self.window_right + 1)
        if self.causal:
            end = torch.minimum(end, diag + 1)
        return first, torch.maximum(end.clamp(min=0), first)

    def visible(self, i: int, j: int, len_q: int, len_k: int) -> bool:
        """Whether query ``i`` may see key ``j`` (one pair: the mpmath reference's loop)."""
        diag = i + self.offset(len_q, len_k)
        if self.causal and j > diag:
            return False
        if self.window_right >= 0 and j > diag + self.window_right:
            return False
        return not (self.window_left >= 0 and j < diag - self.window_left)

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

    def describe(self) -> str:
        """``causal`` / ``causal top_left`` / ``non-causal``, with ``window (left, right)`` when windowed:
        the spec in a case's one-line description."""
        if not self.causal:
            words = "non-causal"
        else:
            words = "causal" if self.alignment == "bottom_right" else f"causal {self.alignment}"
        if self.windowed:
            words += f" window ({self.window_left}, {self.window_right})"
            if not self.causal and self.alignment != "bottom_right":
                words += f" {self.alignment}"
        if self.softcap is not None:
            words += f" softcap={self.softcap:g}"
        if self.alibi_slopes is not None:
            words += " alibi=(" + ", ".join(f"{x:g}" for x in self.alibi_slopes) + ")"
        return words
