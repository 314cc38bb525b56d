"""Adapters: the eager baseline as a kernel, PyTorch's SDPA backends and FlexAttention.

Each function here has the kernel contract (README.md, "The contract") and wraps something that is
not a FlashAttention kernel of this suite, so that the suite can check it like one; the declarations
are in :mod:`flashverify_kernels.registry`.

``eager_forward`` is the baseline of pass criterion 1 run as a kernel (so the suite checks its own
baseline). ``sdpa_math_forward`` wraps ``torch.nn.functional.scaled_dot_product_attention`` pinned to
its math backend: it returns ``out`` alone and aligns causal masks top-left. ``sdpa_flash_forward``,
``sdpa_efficient_forward``, ``sdpa_cudnn_forward`` and ``flex_attention_forward`` are the GPU backends
(below), for the accuracy report and for ``pytest verify --impl``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashverify_kernels import _validate
from flashverify_kernels.pytorch.blocked import _Sequences
from flashverify_kernels.declaration import ALL_DTYPES
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


def _per_head_slopes(var: _validate.Variant, q, *, kernel: str) -> None:
    """These adapters take one ALiBi slope per query head (no per-batch ``[B, Hq]`` slopes)."""
    if var.alibi_slopes is not None and var.alibi_slopes.dim() != 1:
        raise ValueError(f"{kernel}: alibi_slopes.shape={tuple(var.alibi_slopes.shape)}, but {kernel} takes per-head "
                         f"slopes only: a float32 torch.Tensor of shape [Hq]=[{q.shape[1]}] (no per-batch [B, Hq] "
                         "slopes)")


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
    sequences take the keywords of :func:`flashverify_kernels.pytorch.blocked.fa2_forward` (packed, padded, paged): they are
    gathered into the baseline's one packed batch and its results laid back out."""
    sequences = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, seqlens_q=seqlens_q, seqlens_k=seqlens_k, block_table=block_table)
    seqs = _Sequences(q, k, v, kernel="eager", **sequences) if any(x is not None for x in sequences.values()) else None
    qr, kr, vr = (q, k, v) if seqs is None else (
        torch.cat(seqs.queries(q), dim=2), torch.cat(seqs.keys(k), dim=2), torch.cat(seqs.keys(v), dim=2))
    _validate.check_attention_inputs(qr, kr, vr, kernel="eager", dtypes=ALL_DTYPES, scale=scale, head_dim_v=True)
    var = _validate.variant(qr, kernel="eager", window_size=window_size, attention_chunk=attention_chunk,
                            softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, num_splits=num_splits)
    _per_head_slopes(var, q, kernel="eager")
    packed = {} if seqs is None else dict(sequences="packed", seqlens_q=tuple(seqs.lens_q),
                                          seqlens_k=tuple(seqs.lens_k))
    spec = AttentionSpec(causal=causal, window_left=var.window[0], window_right=var.window[1],
                         attention_chunk=var.chunk, softcap=var.softcap or None,
                         alibi_slopes=None if var.alibi_slopes is None else tuple(var.alibi_slopes.tolist()),
                         sinks=None if var.sinks is None else tuple(var.sinks.tolist()),
                         num_splits=var.splits, **packed)
    out, lse = _Eager.apply(qr, kr, vr, var.sinks, spec, scale)
    if seqs is None:
        return out, lse
    return (seqs.join_queries(list(out.split(seqs.lens_q, dim=2)), q, dim=v.shape[-1]),
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
# "No available kernel"), it never falls back to another backend silently. The SDPA backends align causal
# masks top-left (is_causal) and return out alone; FlexAttention (below) takes every variant it can express
# and returns the LSE. The dtypes and head dims each one checks are the ones its backend documents (the
# declarations reuse them).
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

# ------------------------------------------------------------------------------------ FlexAttention
# FlexAttention computes softmax(score_mod(scale * q k^T)) V over the pairs its mask_mod keeps, both written
# as functions of (batch, head, query index, key index). The adapter writes the attention spec's variants
# as such functions (_flex_mods):
#   mask_mod   every row's causal diagonal (bottom-right: row i of a sequence of Nq queries and Nk keys at
#              key i + Nk - Nq; top-left: key i), the causal mask and the sliding window as bounds around it,
#              chunks of attention_chunk positions, and for packed sequences (one B = 1 batch, a document
#              mask) the keys of the row's own sequence, the diagonal placed within it;
#   score_mod  the softcap c * tanh(s / c) on the scaled score, then ALiBi's -slope_h * |diagonal - j|;
#   sinks      one more key, of value 0, after the last: the mask shows it to every row and the score_mod
#              sets its score to the head's sink logit, so it joins every denominator and adds nothing to
#              the output; the logits are a tensor the score_mod reads, and FlexAttention's backward
#              returns their gradient (its gradients of captured tensors).
#   no keys    FlexAttention cannot reduce over zero keys: a call with none (and no sink) gets one key of
#              value 0 that the mask hides from every row, and FlexAttention gives those rows 0 and -inf.
#              A call with no queries has nothing to compute: empty results, without FlexAttention.
# The numbers (offsets, bounds, chunk, cap, slopes, logits, the packed rows' diagonals) are tensors the
# functions read, not Python constants, so that the compiled kernel is not recompiled for each value.
# The LSE: FlexAttention's kernels keep it in base 2, and its public entry multiplies it by ln 2 before
# returning it (torch/nn/attention/flex_attention.py): it is the natural-log LSE the contract asks for, in
# float32; the adapter casts it to float64 for float64 inputs and lays it out as [Hq, total_q] when packed.
# Not expressible through FlexAttention's own API: padded sequences (a mask over the padding would still
# read it, and NaN there reaches the gradients), a paged KV cache and split-KV (num_splits).
FLEX_DTYPES = (*HALF, torch.float32)
FLEX_HEAD_DIMS = (16, 32, 64, 128, 256)
FLEX_SEQUENCES = ("dense", "packed")
# A bound that does not bound: farther from any diagonal than any key index (int32 arithmetic).
_FAR = 2 ** 30
# Block masks kept for reuse (an accuracy sweep runs one shape many times), at most this many.
_FLEX_MASKS_KEPT = 64
_flex_compiled = None
_flex_masks: dict = {}


def _flex_packed(q, k, v, *, kernel, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Packed sequences as one ``[1, H, total, D]`` batch, and ``(cu_q, cu_k)`` as lists (validated)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError(f"{kernel}: packed sequences take both cu_seqlens_q and cu_seqlens_k (int32 [S + 1]); got "
                         f"cu_seqlens_q={'None' if cu_seqlens_q is None else 'a tensor'}, "
                         f"cu_seqlens_k={'None' if cu_seqlens_k is None else 'a tensor'}")
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kernel}: {label} is a {type(t).__name__}, but should be a torch.Tensor")
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"{kernel}: packed sequences take q [total_q, Hq, D] and k, v [total_k, Hkv, D]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    cq = _validate.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total=q.shape[0], device=q.device, kernel=kernel)
    ck = _validate.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total=k.shape[0], device=q.device, kernel=kernel)
    if len(cq) != len(ck):
        raise ValueError(f"{kernel}: cu_seqlens_q has {len(cq) - 1} sequences and cu_seqlens_k {len(ck) - 1}; both "
                         "should describe the same sequences")
    _validate.check_max_seqlen("max_seqlen_q", max_seqlen_q, [b - a for a, b in zip(cq, cq[1:])], kernel=kernel)
    _validate.check_max_seqlen("max_seqlen_k", max_seqlen_k, [b - a for a, b in zip(ck, ck[1:])], kernel=kernel)
    return q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], (tuple(cq), tuple(ck))


def _flex_rows(spans, bottom_right: bool, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int32 ``(diag, lo, hi)`` ``[total_q]`` of packed sequences: each row's causal diagonal as a packed key
    index (possibly outside its sequence's keys) and its sequence's keys ``lo <= j < hi``."""
    cq, ck = (torch.tensor(c, dtype=torch.int64) for c in spans)
    lens_q, lens_k = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    seq = torch.repeat_interleave(torch.arange(lens_q.numel()), lens_q)
    local = torch.arange(seq.numel()) - cq[seq]
    diag = ck[seq] + local + ((lens_k - lens_q)[seq] if bottom_right else 0)
    return tuple(t.to(device=device, dtype=torch.int32) for t in (diag, ck[seq], ck[seq + 1]))


def _flex_mods(len_q: int, len_k: int, *, spans, causal: bool, bottom_right: bool, window: tuple[int, int],
               chunk: int, softcap: float, slopes: torch.Tensor | None, sinks: torch.Tensor | None, heads: int,
               device, working: torch.dtype):
    """``(mask_mod, score_mod)`` for FlexAttention (the section's comment). ``spans``: ``(cu_q, cu_k)`` of
    packed sequences or None (dense); with ``sinks`` the sink is key ``len_k``. ``working``: the dtype of the
    scores the score_mod sees (float64 for float64 inputs, else float32). With no keys and no sink, key 0 is
    one the adapter adds and the mask hides.

    Both functions are made whatever the call holds, and read the same tensors and bools every time (a tensor
    the call does not use is a placeholder the flags keep unread): the compiled function's guards then never
    meet a None where an earlier call had a tensor, which Dynamo's recompilation diagnostics cannot evaluate
    (a TypeError instead of a recompilation, pytorch/pytorch#176211). Without any mask, mask_mod's bounds
    are ``_FAR`` and every key is visible; without modifications score_mod returns the score unchanged."""
    packed, capped, biased, has_sink, chunked = spans is not None, bool(softcap), slopes is not None, \
        sinks is not None, chunk > 0
    hidden_key = len_k == 0 and not has_sink  # the key of a call without keys (the section's comment)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    offset = len_k - len_q if (bottom_right and not packed) else 0
    ints = torch.tensor([offset, left if left >= 0 else _FAR, right if right >= 0 else _FAR, max(chunk, 1), len_k],
                        dtype=torch.int32, device=device)
    if packed:
        diag_t, lo_t, hi_t = _flex_rows(spans, bottom_right, device)
    else:
        diag_t, lo_t, hi_t = (torch.zeros(1, dtype=torch.int32, device=device) for _ in range(3))
    cap = torch.tensor([softcap if capped else 1.0], dtype=working, device=device)
    bias = slopes.to(working) if biased else torch.zeros(heads, dtype=working, device=device)
    logits = sinks if has_sink else torch.zeros(heads, dtype=working, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        diag = diag_t[q_idx] if packed else q_idx + ints[0]
        seen = (kv_idx >= diag - ints[1]) & (kv_idx <= diag + ints[2])
        lo = lo_t[q_idx] if packed else 0
        if packed:
            seen = seen & (kv_idx >= lo) & (kv_idx < hi_t[q_idx])
        if chunked:  # the chunk of the diagonal's position within the sequence (none before its start)
            start = diag - lo
            seen = seen & (start >= 0) & (start // ints[3] == (kv_idx - lo) // ints[3])
        if has_sink:
            seen = seen | (kv_idx == ints[4])
        if hidden_key:
            seen = seen & (kv_idx < ints[4])
        return seen

    # The score_mod reads copies of the tensors the mask_mod reads: a block mask is reused for a later call
    # of the same geometry (_flex_block_mask) with that call's score_mod, and had the two functions shared a
    # tensor in one call and not in the next, Dynamo's guard on that sharing would fail and recompile.
    score_ints, score_diag = ints.clone(), diag_t.clone()

    def score_mod(score, b, h, q_idx, kv_idx):
        if capped:
            score = cap[0] * torch.tanh(score / cap[0])
        if biased:
            diag = score_diag[q_idx] if packed else q_idx + score_ints[0]
            score = score - bias[h] * (diag - kv_idx).abs()
        if has_sink:
            score = torch.where(kv_idx == score_ints[4], logits[h], score)
        return score

    return mask_mod, score_mod


def _flex_block_mask(mask_mod, key: tuple, len_q: int, len_kv: int, device):
    """The block mask of ``mask_mod`` over ``len_q x len_kv``, reused for an equal ``key`` (the geometry)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = _flex_masks.get(key)
    if mask is None:
        if len(_flex_masks) >= _FLEX_MASKS_KEPT:
            _flex_masks.clear()
        mask = _flex_masks[key] = create_block_mask(mask_mod, B=None, H=None, Q_LEN=len_q, KV_LEN=len_kv,
                                                    device=device)
    return mask


def _flex_compiled_function():
    """``torch.compile(flex_attention)``, made once. One compiled function serves every call; Dynamo's
    recompilation caps are raised so that a sweep over dtypes, head dims, heads and variants keeps compiling,
    and reaching them raises instead of falling back to the unfused path (which would be checked instead of
    the fused kernel, silently)."""
    global _flex_compiled
    if _flex_compiled is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), 1024))
        if hasattr(config, "fail_on_recompile_limit_hit"):
            config.fail_on_recompile_limit_hit = True
        _flex_compiled = torch.compile(flex_attention)
    return _flex_compiled


def _flex_uncompiled(call, q, k, v):
    """Run ``call`` (uncompiled flex_attention) without its warning that it is not compiled. On CPU,
    FlexAttention's entry refuses inputs that require grad (its fused CPU kernel has no backward); the
    uncompiled path's backward is FlexAttention's math backward, which runs on any device, so for this call
    its device check is given detached inputs (every other check it makes still applies)."""
    import warnings

    from torch.nn.attention import flex_attention as flex_module

    check = getattr(flex_module, "_validate_device", None)
    lift = (check is not None and q.device.type == "cpu" and torch.is_grad_enabled()
            and any(t.requires_grad for t in (q, k, v)))
    if lift:
        flex_module._validate_device = lambda query, key, value: check(query.detach(), key.detach(), value.detach())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return call()
    finally:
        if lift:
            flex_module._validate_device = check


def _flex(q, k, v, *, kernel: str, compiled: bool, devices, dtypes, head_dims, causal, scale, window_size,
          attention_chunk, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
          causal_alignment):
    """The FlexAttention adapter (the section's comment): validate, write the mods, run, lay the results out."""
    from torch.nn.attention import flex_attention as flex_module

    from references.spec import ALIGNMENTS

    spans = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        q, k, v, spans = _flex_packed(q, k, v, kernel=kernel, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    elif isinstance(q, torch.Tensor) and q.dim() == 3:
        raise ValueError(f"{kernel}: q.shape={tuple(q.shape)} is packed [total_q, Hq, D], but no cu_seqlens_q and "
                         "cu_seqlens_k were given (dense inputs are [B, H, N, D])")
    scale = _validate.check_attention_inputs(q, k, v, kernel=kernel, dtypes=dtypes, devices=devices, gqa=True,
                                             head_dims=head_dims, scale=scale)
    if not isinstance(causal, bool):
        raise ValueError(f"{kernel}: causal={causal!r}, but should be a bool")
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"{kernel}: causal_alignment={causal_alignment!r}, but should be one of {ALIGNMENTS}")
    var = _validate.variant(q, kernel=kernel, window_size=window_size, attention_chunk=attention_chunk,
                            softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    _per_head_slopes(var, q, kernel=kernel)
    window, chunk, cap, slopes, sinks = var.window, var.chunk, var.softcap, var.alibi_slopes, var.sinks
    len_q, len_k = q.shape[2], k.shape[2]
    working = torch.float64 if q.dtype == torch.float64 else torch.float32
    if len_q == 0:  # nothing to compute (FlexAttention fails on it)
        out, lse = q.new_zeros(q.shape), torch.zeros(q.shape[:3], dtype=working, device=q.device)
        return (out, lse) if spans is None else (out[0].transpose(0, 1), lse[0])
    bottom_right = causal_alignment == "bottom_right"
    mask_mod, score_mod = _flex_mods(len_q, len_k, spans=spans, causal=causal, bottom_right=bottom_right,
                                     window=window, chunk=chunk, softcap=cap, slopes=slopes, sinks=sinks,
                                     heads=q.shape[1], device=q.device, working=working)
    if sinks is not None or len_k == 0:  # the sink, or a hidden key: one more key of value 0
        k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[3])], dim=2)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)
    key = (len_q, len_k, str(q.device), spans, causal, bottom_right, window, chunk, sinks is not None)
    block_mask = _flex_block_mask(mask_mod, key, len_q, k.shape[2], q.device)
    keywords = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if hasattr(flex_module, "AuxRequest"):
        keywords["return_aux"] = flex_module.AuxRequest(lse=True)
    else:  # before AuxRequest, return_lse=True
        keywords["return_lse"] = True
    if compiled:
        out, aux = _flex_compiled_function()(q, k, v, **keywords)
    else:
        out, aux = _flex_uncompiled(lambda: flex_module.flex_attention(q, k, v, **keywords), q, k, v)
    lse = (aux.lse if hasattr(aux, "lse") else aux).detach().to(working)
    if spans is None:
        return out, lse
    return out[0].transpose(0, 1).contiguous(), lse[0]


def flex_attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                           window_size: tuple[int, int] = (-1, -1), attention_chunk: int = 0, softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                           cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           causal_alignment: str = "bottom_right"):
    """``torch.compile(flex_attention)``, the fused Triton kernel, on CUDA; returns ``(out, lse)``.

    Takes flash_attn's keywords: ``window_size`` ``(left, right)`` (-1 unbounded) around the causal diagonal,
    ``attention_chunk`` (0: none), ``softcap`` (0.0: none), ``alibi_slopes`` (float32 ``[Hq]``), ``sinks``
    (float32 ``[Hq]`` logits; their gradient flows), and packed sequences (``q [total_q, Hq, D]``, ``k``, ``v
    [total_k, Hkv, D]`` with int32 ``cu_seqlens_q``, ``cu_seqlens_k`` and ``max_seqlen_q``, ``max_seqlen_k``;
    then ``out [total_q, Hq, D]`` and ``lse [Hq, total_q]``). Causal masks, windows, chunks and ALiBi
    distances are aligned ``causal_alignment``: bottom-right (key ``j`` visible to query ``i`` iff ``j <= i + Nk
    - Nq``, per sequence) or top-left (``j <= i``). How each variant reaches FlexAttention: the comment above."""
    return _flex(q, k, v, kernel="flex_attention", compiled=True, devices=("cuda",), dtypes=FLEX_DTYPES,
                 head_dims=FLEX_HEAD_DIMS, causal=causal, scale=scale, window_size=window_size,
                 attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                 max_seqlen_k=max_seqlen_k, causal_alignment=causal_alignment)


def flex_attention_uncompiled_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                                      window_size: tuple[int, int] = (-1, -1), attention_chunk: int = 0,
                                      softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                                      sinks: torch.Tensor | None = None, cu_seqlens_q=None, cu_seqlens_k=None,
                                      max_seqlen_q=None, max_seqlen_k=None, causal_alignment: str = "bottom_right"):
    """:func:`flex_attention_forward`'s adapter through uncompiled ``flex_attention``, on any device and dtype
    (float64 too) and any head dim: FlexAttention's unfused math (scores in float32, float64 for float64
    inputs) with the same masks, score modifications, sinks and LSE, and its math backward (on CPU too). It
    checks the adapter's side of the work without a GPU; it does not check the fused kernel."""
    return _flex(q, k, v, kernel="flex_attention_uncompiled", compiled=False, devices=("cpu", "cuda"),
                 dtypes=ALL_DTYPES, head_dims=None, causal=causal, scale=scale, window_size=window_size,
                 attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                 max_seqlen_k=max_seqlen_k, causal_alignment=causal_alignment)
