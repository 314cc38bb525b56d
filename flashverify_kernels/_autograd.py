"""The autograd glue shared by the shipped FlashAttention kernels (blocked PyTorch and Triton).

``forward(q, k, v, *, causal, scale, block_m, block_n[, sinks][, out, lse]) -> (out, lse)`` is a kernel's
raw forward and ``backward(q, k, v, out, lse, dout, *, causal, scale, block_m, block_n[, sinks]) -> (dq, dk,
dv, delta[, dsinks])`` its raw backward; :func:`apply` runs them under autograd, with or without caller
buffers. ``sinks`` (attention sinks, a tensor ``[Hq]``) is passed only when given, and gets its gradient.
"""

from __future__ import annotations

import torch


def _sinks(sinks) -> dict:
    return {} if sinks is None else {"sinks": sinks}


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, scale, block_m, block_n, forward, backward):
        out, lse = forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, **_sinks(sinks))
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.settings = (causal, scale, block_m, block_n, backward)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return (*_gradients(ctx, dout), None, None, None, None, None, None)


class _AttentionInto(torch.autograd.Function):
    """The forward writing into caller buffers. Autograd lets a Function that writes into a view in
    place (``mark_dirty``) return one tensor only: ``out``, the first input, is that one; ``lse`` is
    written in place too and is not differentiable."""

    @staticmethod
    def forward(ctx, out, lse, q, k, v, sinks, causal, scale, block_m, block_n, forward, backward):
        forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, out=out, lse=lse,
                **_sinks(sinks))
        ctx.mark_dirty(out)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.settings = (causal, scale, block_m, block_n, backward)
        return out

    @staticmethod
    def backward(ctx, dout):
        return (None, None, *_gradients(ctx, dout), None, None, None, None, None, None)


def _gradients(ctx, dout):
    """``(dq, dk, dv, dsinks)``; dsinks is None without sinks."""
    q, k, v, out, lse, sinks = ctx.saved_tensors
    causal, scale, block_m, block_n, backward = ctx.settings
    grads = backward(q, k, v, out, lse, dout, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                     **_sinks(sinks))
    return grads[0], grads[1], grads[2], (grads[4] if sinks is not None else None)


def apply(q, k, v, *, causal, scale, block_m, block_n, forward, backward, buffers=None, sinks=None):
    """``(out, lse)`` with gradients flowing through ``out`` (to ``sinks`` too, when given); ``buffers``: the
    validated ``(out, lse)`` views the forward writes into (they are what is returned)."""
    if buffers is None:
        return _Attention.apply(q, k, v, sinks, causal, scale, block_m, block_n, forward, backward)
    out, lse = buffers
    return _AttentionInto.apply(out, lse, q, k, v, sinks, causal, scale, block_m, block_n, forward, backward), lse
