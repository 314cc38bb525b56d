"""Softmax rows for the online-softmax properties: cases as data, tensors built from a seed.

Magnitude classes: ``normal`` (N(0, 1)), ``large`` (N(0, 1e4^2): differences far beyond exp's range),
``ties`` (values from {0, 1}), ``neg_inf_entries`` (about a third of the entries -inf),
``all_neg_inf_rows`` (every other row entirely -inf), ``tiny`` (values near 0: all weights nearly equal).
"""

from __future__ import annotations

import dataclasses
import json

import torch
from hypothesis import strategies as st

from strategies.cases import DTYPES, CaseError, case_from_dict

SOFTMAX_MAGNITUDES = ("normal", "large", "ties", "neg_inf_entries", "all_neg_inf_rows", "tiny")


@dataclasses.dataclass(frozen=True)
class SoftmaxCase:
    rows: int
    n: int
    dtype: str
    magnitude: str = "normal"
    seed: int = 0
    block_n: int | None = None

    def __post_init__(self) -> None:
        for name in ("rows", "n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CaseError(f"{name}={value!r}, but should be a positive int")
        if self.dtype not in DTYPES:
            raise CaseError(f"dtype={self.dtype!r}, but should be one of {tuple(DTYPES)}")
        if self.magnitude not in SOFTMAX_MAGNITUDES:
            raise CaseError(f"magnitude={self.magnitude!r}, but should be one of {SOFTMAX_MAGNITUDES}")

    def describe(self) -> str:
        block = f" block_n={self.block_n}" if self.block_n is not None else ""
        return f"rows={self.rows} n={self.n} {self.dtype} magnitude={self.magnitude} seed={self.seed}{block}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "SoftmaxCase":
        return case_from_dict(cls, data)

    def build(self, device="cpu") -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.rows, self.n, generator=gen, dtype=torch.float64)
        if self.magnitude == "large":
            x = x * 1e4
        elif self.magnitude == "ties":
            x = torch.randint(0, 2, x.shape, generator=gen).to(torch.float64)
        elif self.magnitude == "neg_inf_entries":
            hide = torch.rand(x.shape, generator=gen) < 1 / 3
            x = torch.where(hide, float("-inf"), x)
        elif self.magnitude == "all_neg_inf_rows":
            x[::2] = float("-inf")
        elif self.magnitude == "tiny":
            x = x * 1e-6
        return x.to(DTYPES[self.dtype]).to(device)


@st.composite
def softmax_cases(draw, *, dtype: str, max_rows: int = 4, max_n: int = 40,
                  block_n=None):
    """Return a strategy for :class:`SoftmaxCase` values (rows, length, magnitude class, seed, block)."""
    rows = draw(st.integers(1, max_rows), label="rows")
    n = draw(st.integers(1, max_n), label="n")
    magnitude = draw(st.sampled_from(SOFTMAX_MAGNITUDES), label="magnitude")
    block = draw(st.sampled_from(list(block_n)), label="block_n") if block_n is not None else None
    seed = draw(st.integers(0, 2 ** 16), label="seed")
    return SoftmaxCase(rows=rows, n=n, dtype=dtype, magnitude=magnitude, seed=seed, block_n=block)


@st.composite
def partitions(draw, n: int, *, max_parts: int = 6):
    """Return a strategy for a partition of ``range(n)`` into contiguous pieces, as cut points."""
    cuts = draw(st.lists(st.integers(1, max(1, n - 1)), max_size=max_parts - 1, unique=True), label="cuts")
    cuts = sorted(c for c in cuts if 0 < c < n)
    return [0, *cuts, n]
