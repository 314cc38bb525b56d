"""Adapters: the eager baseline as a kernel, PyTorch's SDPA backends and FlexAttention.

Each function here has the kernel contract (README.md, "The contract") and wraps something that is
not a FlashAttention kernel of this suite, so that the suite can check it like one; the declarations
are in :mod:`kernels.registry`.

``eager_forward`` is the baseline of pass criterion 1 run as a kernel (so the suite checks its own
baseline). ``sdpa_math_forward`` wraps ``torch.nn.functional.scaled_dot_product_attention`` pinned to
its math backend: it returns ``out`` alone and aligns causal masks top-left. ``sdpa_flash_forward``,
``sdpa_efficient_forward``, ``sdpa_cudnn_forward`` and ``flex_attention_forward`` are the GPU backends
(below), for the accuracy report and for ``pytest verify --impl``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _validate
from kernels.blocked import _Sequences
from kernels.declaration import ALL_DTYPES
from references import baseline
from references.spec import AttentionSpec


class _Eager(torch.autograd.Function):
    """Forward and backward exactly as the criterion-1 baseline defines them (references/baseline.py),
    so that the kernel checked here is the baseline the other kernels are measured against."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec, scale):
        out, lse = baseline.forward(q, k, v, spec=spec, scale=scale)
        ctx.save_for_backward(q, k, v, out)
        ctx.settings = (spec, scale, None if sinks is None else sinks.dtype)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out = ctx.saved_tensors
        spec, scale, sinks_dtype = ctx.settings
        grads = baseline.backward(q, k, v, dout, spec=spec, scale=scale, out=out)
        dsinks = grads[4].to(sinks_dtype) if sinks_dtype is not None else None
        return grads[0], grads[1], grads[2], dsinks, None, None


def eager_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                  window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  alibi_slopes: torch.Tensor | None = None, attention_chunk: int = 0,
                  sinks: torch.Tensor | None = None, num_splits: int = 1, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q=None, max_seqlen_k=None, seqlens_q=None, seqlens_k=None, block_table=None):
    """Eager attention at the inputs' precision, with the baseline's own backward; ``window_size``:
    a sliding window ``(left, right)`` in flash_attn's convention (-1 unbounded); ``attention_chunk``
    (0: none) local attention in chunks; ``softcap`` (0.0: none) and ``alibi_slopes`` (float32 ``[Hq]``,
    one slope per query head) modify the scores as flash_attn's keywords do; ``sinks`` (``[Hq]`` logits,
    float32 or float64 for float64 inputs) join the denominators; ``num_splits`` merges that many
    per-split eager attentions (the baseline applies all of these: references/spec.py). Variable-length
    sequences take the keywords of :func:`kernels.blocked.fa2_forward` (packed, padded, paged): they are
    gathered into the baseline's one packed batch and its results laid back out."""
    sequences = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, seqlens_q=seqlens_q, seqlens_k=seqlens_k, block_table=block_table)
    seqs = _Sequences(q, k, v, kernel="eager", **sequences) if any(x is not None for x in sequences.values()) else None
    qr, kr, vr = (q, k, v) if seqs is None else (
        torch.cat(seqs.queries(q), dim=2), torch.cat(seqs.keys(k), dim=2), torch.cat(seqs.keys(v), dim=2))
    _validate.check_attention_inputs(qr, kr, vr, kernel="eager", dtypes=ALL_DTYPES, scale=scale)
    left, right = _validate.check_window(window_size, kernel="eager")
    softcap = _validate.check_softcap(softcap, kernel="eager")
    slopes = _validate.check_alibi_slopes(alibi_slopes, qr, kernel="eager")
    if slopes is not None and slopes.dim() != 1:
        raise ValueError(f"eager: alibi_slopes.shape={tuple(slopes.shape)}, but eager takes per-head slopes only: "
                         f"a float32 torch.Tensor of shape [Hq]=[{q.shape[1]}] (no per-batch [B, Hq] slopes)")
    sinks = _validate.check_sinks(sinks, qr, kernel="eager")
    packed = {} if seqs is None else dict(sequences="packed", seqlens_q=tuple(seqs.lens_q),
                                          seqlens_k=tuple(seqs.lens_k))
    spec = AttentionSpec(causal=causal, window_left=left, window_right=right,
                         attention_chunk=_validate.check_attention_chunk(attention_chunk, kernel="eager"),
                         softcap=softcap or None,
                         alibi_slopes=None if slopes is None else tuple(float(x) for x in slopes.tolist()),
                         sinks=None if sinks is None else tuple(float(x) for x in sinks.tolist()),
                         num_splits=_validate.check_num_splits(num_splits, kernel="eager"), **packed)
    out, lse = _Eager.apply(qr, kr, vr, sinks, spec, scale)
    if seqs is None:
        return out, lse
    return (seqs.join_queries(list(out.split(seqs.lens_q, dim=2)), q),
            seqs.join_rows(list(lse.split(seqs.lens_q, dim=2))))


def sdpa_math_forward(q, k, v, *, causal: bool = False, scale: float | None = None):
    """``scaled_dot_product_attention`` with the math backend (top-left causal, no LSE)."""
    _validate.check_attention_inputs(q, k, v, kernel="sdpa_math", dtypes=ALL_DTYPES, scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


# ------------------------------------------------------------------------------------ GPU backends
# The other SDPA backends and FlexAttention, for the accuracy report and for `pytest verify --impl`.
# Each one is pinned to its backend: when that backend cannot run a call, the call raises (SDPA's
# "No available kernel"), it never falls back to another backend silently. All of them align causal
# masks top-left (SDPA's is_causal; the FlexAttention mask below) and return out alone. The dtypes and
# head dims each one checks are the ones its backend documents (the declarations reuse them).
HALF = (torch.float16, torch.bfloat16)
MULTIPLES_OF_8 = tuple(range(8, 257, 8))
CUDNN_HEAD_DIMS = tuple(range(8, 129, 8))


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


EFFICIENT_DTYPES = (*HALF, torch.float32)
sdpa_flash_forward = _sdpa_backend_forward("FLASH_ATTENTION", "sdpa_flash", HALF, False, MULTIPLES_OF_8)
sdpa_efficient_forward = _sdpa_backend_forward("EFFICIENT_ATTENTION", "sdpa_efficient", EFFICIENT_DTYPES, False,
                                               MULTIPLES_OF_8)
sdpa_cudnn_forward = _sdpa_backend_forward("CUDNN_ATTENTION", "sdpa_cudnn", HALF, False, CUDNN_HEAD_DIMS)

FLEX_DTYPES = (*HALF, torch.float32)
FLEX_HEAD_DIMS = (16, 32, 64, 128, 256)
_flex_compiled = None
_flex_masks: dict = {}


def _top_left_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None):
    """``torch.compile(flex_attention)`` (the fused Triton kernel; uncompiled FlexAttention would run an
    unfused float32 reference instead), causal by a top-left ``q_idx >= kv_idx`` block mask, no LSE."""
    global _flex_compiled
    _validate.check_attention_inputs(q, k, v, kernel="flex_attention", dtypes=FLEX_DTYPES, devices=("cuda",),
                                     gqa=True, head_dims=FLEX_HEAD_DIMS, scale=scale)
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
