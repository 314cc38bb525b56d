"""Adapters to peers: the same-precision eager attention and PyTorch's scaled_dot_product_attention.

``eager`` is the baseline of pass criterion 1 run as a kernel (so the suite checks its own baseline).
``sdpa_math`` wraps ``torch.nn.functional.scaled_dot_product_attention`` pinned to its math backend:
it returns ``out`` alone (the LSE properties are skipped) and aligns causal masks top-left.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _validate
from kernels.registry import ALL_DTYPES, Implementation, register
from references import baseline


class _Eager(torch.autograd.Function):
    """Forward and backward exactly as the criterion-1 baseline defines them (references/baseline.py),
    so that the kernel checked here is the baseline the other kernels are measured against."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = baseline.forward(q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out)
        ctx.settings = (causal, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out = ctx.saved_tensors
        causal, scale = ctx.settings
        dq, dk, dv, _ = baseline.backward(q, k, v, dout, causal=causal, scale=scale, out=out)
        return dq, dk, dv, None, None


def eager_forward(q, k, v, *, causal: bool = False, scale: float | None = None):
    """Eager attention at the inputs' precision, with the baseline's own backward."""
    _validate.check_attention_inputs(q, k, v, kernel="eager", dtypes=ALL_DTYPES, scale=scale)
    return _Eager.apply(q, k, v, causal, scale)


def sdpa_math_forward(q, k, v, *, causal: bool = False, scale: float | None = None):
    """``scaled_dot_product_attention`` with the math backend (top-left causal, no LSE)."""
    _validate.check_attention_inputs(q, k, v, kernel="sdpa_math", dtypes=ALL_DTYPES, scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


EAGER = register(Implementation(
    name="eager", forward=eager_forward, gqa=True,
    description="same-precision eager attention (the criterion-1 baseline)",
))
SDPA_MATH = register(Implementation(
    name="sdpa_math", forward=sdpa_math_forward, gqa=True, causal_alignment="top_left",
    returns_lse=False, in_default=False, description="torch scaled_dot_product_attention, math backend",
))


# ------------------------------------------------------------------------------------ GPU backends
# The other SDPA backends and FlexAttention, for the accuracy report and for `pytest verify --impl`.
# Each one is pinned to its backend: when that backend cannot run a call, the call raises (SDPA's
# "No available kernel"), it never falls back to another backend silently. All of them align causal
# masks top-left (SDPA's is_causal; the FlexAttention mask below) and return out alone. Declared
# conservatively: the backward of every fused backend sums with atomics or in a tiling-dependent
# order (not deterministic); the dtypes and head dims are the ones each backend documents. Like every
# adapter to a peer they run when named (--impl sdpa_flash), not in the default selection.
_HALF = (torch.float16, torch.bfloat16)
_MULTIPLES_OF_8 = tuple(range(8, 257, 8))


def _sdpa_backend_forward(backend: str, kernel: str, dtypes, gqa: bool, head_dims):
    def forward(q, k, v, *, causal: bool = False, scale: float | None = None):
        _validate.check_attention_inputs(q, k, v, kernel=kernel, dtypes=dtypes, devices=("cuda",), gqa=gqa,
                                         head_dims=head_dims, scale=scale)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend)):
            if q.shape[1] != k.shape[1]:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    forward.__name__ = f"{kernel}_forward"
    forward.__doc__ = f"``scaled_dot_product_attention`` pinned to SDPBackend.{backend} (top-left causal, no LSE)."
    return forward


sdpa_flash_forward = _sdpa_backend_forward("FLASH_ATTENTION", "sdpa_flash", _HALF, False, _MULTIPLES_OF_8)
sdpa_efficient_forward = _sdpa_backend_forward("EFFICIENT_ATTENTION", "sdpa_efficient", (*_HALF, torch.float32),
                                               False, _MULTIPLES_OF_8)
sdpa_cudnn_forward = _sdpa_backend_forward("CUDNN_ATTENTION", "sdpa_cudnn", _HALF, False, tuple(range(8, 129, 8)))

_FLEX_DTYPES = (*_HALF, torch.float32)
_FLEX_HEAD_DIMS = (16, 32, 64, 128, 256)
_flex_compiled = None
_flex_masks: dict = {}


def _top_left_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None):
    """``torch.compile(flex_attention)`` (the fused Triton kernel; uncompiled FlexAttention would run an
    unfused float32 reference instead), causal by a top-left ``q_idx >= kv_idx`` block mask, no LSE."""
    global _flex_compiled
    _validate.check_attention_inputs(q, k, v, kernel="flex_attention", dtypes=_FLEX_DTYPES, devices=("cuda",),
                                     gqa=True, head_dims=_FLEX_HEAD_DIMS, scale=scale)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        # One compiled function serves every shape; raise Dynamo's recompilation cap so that a sweep over
        # dtypes, head dims and masks never falls back to the unfused path.
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
        _flex_compiled = torch.compile(flex_attention)
    mask = None
    if causal:
        key = (q.shape[2], k.shape[2], str(q.device))
        mask = _flex_masks.get(key)
        if mask is None:
            mask = _flex_masks[key] = create_block_mask(_top_left_causal, B=None, H=None, Q_LEN=q.shape[2],
                                                        KV_LEN=k.shape[2], device=q.device)
    return _flex_compiled(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


SDPA_FLASH = register(Implementation(
    name="sdpa_flash", forward=sdpa_flash_forward, dtypes=_HALF, devices=("cuda",), head_dims=_MULTIPLES_OF_8,
    causal_alignment="top_left", returns_lse=False, deterministic=False, in_default=False,
    description="torch scaled_dot_product_attention, flash backend (FlashAttention-2)",
))
SDPA_EFFICIENT = register(Implementation(
    name="sdpa_efficient", forward=sdpa_efficient_forward, dtypes=(*_HALF, torch.float32), devices=("cuda",),
    head_dims=_MULTIPLES_OF_8, causal_alignment="top_left", returns_lse=False, deterministic=False,
    in_default=False, description="torch scaled_dot_product_attention, memory-efficient backend (xFormers kernel)",
))
SDPA_CUDNN = register(Implementation(
    name="sdpa_cudnn", forward=sdpa_cudnn_forward, dtypes=_HALF, devices=("cuda",),
    head_dims=tuple(range(8, 129, 8)), causal_alignment="top_left", returns_lse=False, deterministic=False,
    in_default=False, description="torch scaled_dot_product_attention, cuDNN backend",
))
FLEX_ATTENTION = register(Implementation(
    name="flex_attention", forward=flex_attention_forward, dtypes=_FLEX_DTYPES, devices=("cuda",),
    head_dims=_FLEX_HEAD_DIMS, gqa=True, causal_alignment="top_left", returns_lse=False, deterministic=False,
    in_default=False, description="torch FlexAttention, compiled (fused Triton kernel), top-left causal block mask",
))
