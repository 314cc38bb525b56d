"""FP8 inputs: the two float8 formats the contract takes, their descales, and what they mean.

A kernel that takes float8 inputs (FlashAttention-3's fp8 forward) computes attention on the dequantised
values: ``q_deq[b, h] = float(q[b, h]) * q_descale[b, h // group]``, and the same for ``k`` and ``v`` with
``k_descale``, ``v_descale`` (each a float32 ``[B, Hkv]``: one factor per batch entry and key/value head;
query heads share their group's). Without descales every factor is 1. The output is bfloat16 (the
inputs' format cannot hold it usefully), the LSE float32, and the scale (``1/sqrt(D)`` by default)
multiplies the dequantised scores.

Everything the suite compares with (the float64 and mpmath references, the bounds' magnitudes) is computed
from the dequantised values, which float64 holds exactly (a float8 value has at most 4 significant bits, a
float32 descale 24), so a kernel is held to the attention of exactly the numbers it was handed.
"""

from __future__ import annotations

import torch

F64 = torch.float64
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The dtype of out for float8 inputs (FlashAttention-3 returns bfloat16).
FP8_OUT_DTYPE = torch.bfloat16
DESCALES = ("q_descale", "k_descale", "v_descale")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``out`` for inputs of ``dtype``: bfloat16 for float8, else the inputs' own."""
    return FP8_OUT_DTYPE if is_fp8(dtype) else dtype


def per_head(descale: torch.Tensor, heads: int, *, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A ``[B, Hkv]`` descale as ``[B, heads, 1, 1]`` in ``dtype`` (each query head of a group gets its KV head's)."""
    return descale.to(device=device if device is not None else descale.device, dtype=dtype).repeat_interleave(
        heads // descale.shape[1], dim=1)[:, :, None, None]


def quantise(x: torch.Tensor, dtype: torch.dtype, *, heads_kv: int | None, descaled: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (float64 ``[B, H, N, D]``) in float8 ``dtype``, and its descale ``[B, Hkv]`` (float32) or None.

    ``descaled``: one factor per batch entry and key/value head (the query heads of a group share it),
    ``amax / max(dtype)`` rounded to float32 (1 where the block is all zeros), so each block's largest entry
    lands at the format's largest finite value; then ``x / descale`` is rounded to ``dtype``. Without
    descales the entries are clamped to the finite range and rounded (a float8 value past it would be
    NaN or inf, not an input). ``heads_kv``: the number of descale heads (``x``'s heads are grouped by
    ``H // heads_kv``); None with ``descaled=False``."""
    top = torch.finfo(dtype).max
    if not descaled:
        return x.clamp(-top, top).to(dtype), None
    b, h, n, d = x.shape
    blocks = x.reshape(b, heads_kv, (h // heads_kv) * n * d)
    amax = blocks.abs().amax(dim=-1) if blocks.shape[-1] else torch.zeros(b, heads_kv, dtype=F64)
    descale = torch.where(amax > 0, amax / top, 1.0).to(torch.float32)
    return (x / per_head(descale, h, dtype=F64)).clamp(-top, top).to(dtype), descale


def dequantise(x: torch.Tensor, descale: torch.Tensor | None) -> torch.Tensor:
    """The float64 values a float8 ``x`` ``[B, H, N, D]`` stands for: ``x * descale[b, h // group]``
    (exact in float64); ``x`` itself in float64 without a descale."""
    x64 = x.to(F64)
    if descale is None:
        return x64
    b, h = x.shape[:2]
    if tuple(descale.shape) != (b, descale.shape[1]) or h % descale.shape[1]:
        raise ValueError(f"descale.shape={tuple(descale.shape)}, but should be [B, Hkv] = [{b}, Hkv] with "
                         f"Hkv dividing the {h} heads of x")
    return x64 * per_head(descale, h, dtype=F64, device=x.device)


__all__ = ["DESCALES", "FP8_DTYPES", "FP8_OUT_DTYPE", "dequantise", "is_fp8", "out_dtype", "per_head", "quantise"]
