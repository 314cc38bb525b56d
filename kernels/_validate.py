"""Input validation shared by the shipped kernels: clear exceptions before any work starts."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_block(name: str, value, *, kernel: str, allowed: Iterable[int] | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{kernel}: {name}={value!r}, but should be a positive int")
    if allowed is not None and value not in tuple(allowed):
        raise ValueError(f"{kernel}: {name}={value}, but should be one of {tuple(allowed)}")
    return value


def check_attention_inputs(q, k, v, *, kernel: str, dtypes: Iterable[torch.dtype],
                           devices: Iterable[str] = ("cpu", "cuda"), gqa: bool = True,
                           head_dims: Iterable[int] | None = None,
                           scale: float | None = None) -> float:
    """Validate ``q, k, v`` against the contract and return the softmax scale to use.

    Raises TypeError for non-tensors, ValueError for wrong ranks, shapes, dtypes, devices, head dims.
    """
    dtypes = tuple(dtypes)
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kernel}: {label} is a {type(t).__name__}, but should be a torch.Tensor")
        if t.dim() != 4:
            raise ValueError(
                f"{kernel}: {label}.shape={tuple(t.shape)}, but should be 4-D [batch, heads, seq_len, head_dim]"
            )
        if t.dtype not in dtypes:
            raise ValueError(
                f"{kernel}: {label}.dtype={str(t.dtype).removeprefix('torch.')}, "
                f"but should be one of {_dtype_names(dtypes)}"
            )
        if t.device.type not in tuple(devices):
            raise ValueError(
                f"{kernel}: {label} is on {t.device}, but this kernel runs on {', '.join(devices)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"{kernel}: q, k, v dtypes are {_dtype_names((q.dtype, k.dtype, v.dtype))}, but should be equal"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"{kernel}: q, k, v are on {q.device}, {k.device}, {v.device}, but should share a device")
    if k.shape != v.shape:
        raise ValueError(f"{kernel}: k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} should be equal")
    b, hq, _, d = q.shape
    bk, hkv, _, dk = k.shape
    if bk != b:
        raise ValueError(f"{kernel}: q has batch {b} but k and v have batch {bk}; they should be equal")
    if dk != d:
        raise ValueError(f"{kernel}: q has head_dim {d} but k and v have head_dim {dk}; they should be equal")
    if d < 1:
        raise ValueError(f"{kernel}: head_dim={d}, but should be at least 1")
    if head_dims is not None:
        allowed = tuple(head_dims)
        if d not in allowed:
            lo, hi = min(allowed), max(allowed)
            raise ValueError(f"{kernel}: head_dim={d} is not supported; supported head dims are {lo}..{hi}"
                             f" ({len(allowed)} values: {allowed[:6]}{'...' if len(allowed) > 6 else ''})")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(
            f"{kernel}: q has {hq} heads and k, v have {hkv}; the query heads should be a multiple of the key/value heads"
        )
    if hkv != hq and not gqa:
        raise ValueError(f"{kernel}: grouped-query attention (q has {hq} heads, k, v have {hkv}) is not supported")
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{kernel}: scale={scale!r}, but should be a finite float or None (1/sqrt(head_dim))")
    return float(scale)


def check_backward_inputs(q, k, v, out, lse, dout, *, kernel: str) -> None:
    """Validate the extra tensors of a direct backward call."""
    for label, t in (("out", out), ("lse", lse), ("dout", dout)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kernel}: {label} is a {type(t).__name__}, but should be a torch.Tensor")
        if t.device != q.device:
            raise ValueError(f"{kernel}: {label} is on {t.device}, but q is on {q.device}")
    if out.shape != q.shape or dout.shape != q.shape:
        raise ValueError(
            f"{kernel}: out.shape={tuple(out.shape)} and dout.shape={tuple(dout.shape)} should equal q.shape={tuple(q.shape)}"
        )
    if lse.shape != q.shape[:3]:
        raise ValueError(f"{kernel}: lse.shape={tuple(lse.shape)}, but should be {tuple(q.shape[:3])}")
    if dout.dtype != q.dtype or out.dtype != q.dtype:
        raise ValueError(f"{kernel}: out and dout should have q's dtype {q.dtype}, got {out.dtype} and {dout.dtype}")
