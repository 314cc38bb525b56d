"""Blocked PyTorch FlashAttention: FA1 (inner-scaled) and FA2 (outer-scaled) forward, FA2 backward.

These are the algorithms of the FlashAttention papers written with PyTorch tensor ops over tiles, so
that every step a GPU kernel takes is visible and checkable on a CPU. They keep a GPU kernel's
precision behaviour:

* scores ``s = scale * q k^T`` and the softmax statistics ``m`` (running max) and ``l`` (running sum)
  in float32 (float64 for float64 inputs); products of float16/bfloat16 operands are exact in float32,
  so a float32 matmul of up-cast tiles is what a tensor-core dot computes;
* the probabilities ``p`` are cast to the input dtype before ``p @ v`` (as a kernel feeds them back to
  the tensor cores), and ``p @ v`` is accumulated in float32;
* the output is rounded to the input dtype once, at the end.

FA2 forward (Q blocks outer, KV blocks inner), for a Q tile with running ``m, l, acc``::

    s     = scale * q_tile @ k_tile^T, masked to -inf where a key is not visible
    m_new = max(m, rowmax(s));  alpha = exp(m - m_new);  p = exp(s - m_new)
    l     = alpha * l + rowsum(p);  acc = alpha * acc + p @ v_tile
    out   = acc / l;  lse = m + log(l)                      (one division at the end)

FA1 forward (KV blocks outer, Q blocks inner) keeps the output normalised after every KV step::

    out = (alpha * l_old * out + p @ v_tile) / l_new

Backward (KV blocks outer, Q blocks inner) recomputes ``P = exp(s - lse)`` from the saved LSE::

    Delta = rowsum(dO * O);  dV += P^T dO;  dP = dO V^T;  dS = P * (dP - Delta)
    dK += scale * dS^T Q;    dQ += scale * dS K

Score modifications (flash_attn's keywords and order) act on every tile's scaled scores, in the
accumulator dtype, before the masks: ``softcap=c`` (0.0: none) gives ``s = c * tanh(s / c)``;
``alibi_slopes`` (float32, ``[Hq]`` or ``[B, Hq]``: the query head's slope, also under GQA) then adds
``-slope_h * |i + Nk - Nq - j|`` (the distance is exact, the slope is held in the accumulator dtype). The
LSE is that of the modified scores. The backward recomputes the same modified scores for ``P``; ALiBi's
bias is a constant, and a softcap multiplies ``dS`` by its derivative ``1 - tanh(s_raw / c)^2`` (in the
accumulator dtype, before ``dS`` is cast to the input dtype for dQ and dK)::

    dS = P * (dP - Delta) * (1 - tanh(s_raw / c)^2)

Causal masking is bottom-right aligned: key ``j`` is visible to query ``i`` iff ``j <= i + Nk - Nq``.
A sliding window ``window_size=(left, right)`` (flash_attn's convention, -1 unbounded) also hides the
keys outside ``i + Nk - Nq - left .. i + Nk - Nq + right``; it only masks, the tile loops are unchanged.
Key blocks that no query of a Q tile can see are skipped; a row that sees no key at all gets
``out = 0`` and ``lse = -inf``. Grouped-query attention maps query head ``h`` to key/value head
``h // (Hq // Hkv)``; dK and dV sum over the query heads of a group.
"""

from __future__ import annotations

import functools
import math

import torch

from kernels import _autograd, _validate
from kernels.declaration import ALL_DTYPES

NEG_INF = float("-inf")
NO_WINDOW = (-1, -1)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator and statistics dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _expand_kv(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """Repeat each key/value head for the query heads of its group: head h reads h // group."""
    group = heads_q // t.shape[1]
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _reduce_group(grad: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """Sum a per-query-head gradient over the query heads of each key/value group."""
    b, hq, n, d = grad.shape
    return grad.view(b, heads_kv, hq // heads_kv, n, d).sum(dim=2)


def _visible(m0: int, m1: int, n0: int, n1: int, len_q: int, len_k: int, device) -> torch.Tensor:
    """Bottom-right causal visibility of keys n0:n1 to queries m0:m1 (bool [m1-m0, n1-n0])."""
    rows = torch.arange(m0, m1, device=device)[:, None]
    cols = torch.arange(n0, n1, device=device)[None, :]
    return cols <= rows + (len_k - len_q)


def _kv_end(m1: int, len_q: int, len_k: int, causal: bool) -> int:
    """One past the last key any query of rows < m1 can see."""
    if not causal:
        return len_k
    return max(0, min(len_k, m1 + len_k - len_q))


def _q_start(n0: int, len_q: int, len_k: int, block_m: int, causal: bool) -> int:
    """Start of the first Q tile whose rows can see key n0."""
    if not causal:
        return 0
    first_row = max(0, n0 - (len_k - len_q))
    return (first_row // block_m) * block_m


def _scores(q_tile, k_tile, scale, acc_dtype):
    return (q_tile.to(acc_dtype) @ k_tile.to(acc_dtype).transpose(-1, -2)) * scale


def _in_window(m0: int, m1: int, n0: int, n1: int, len_q: int, len_k: int, window, device) -> torch.Tensor:
    """Keys n0:n1 inside the sliding window ``(left, right)`` of queries m0:m1 (flash_attn's convention:
    around the bottom-right diagonal, -1 unbounded; bool [m1-m0, n1-n0])."""
    rows = torch.arange(m0, m1, device=device)[:, None] + (len_k - len_q)
    cols = torch.arange(n0, n1, device=device)[None, :]
    left, right = window
    inside = torch.ones(m1 - m0, n1 - n0, dtype=torch.bool, device=device)
    if left >= 0:
        inside &= cols >= rows - left
    if right >= 0:
        inside &= cols <= rows + right
    return inside


def _slope_view(alibi_slopes, acc_dtype):
    """The validated ``[Hq]`` or ``[B, Hq]`` slopes as ``[1 or B, Hq, 1, 1]`` in the accumulator dtype (or None)."""
    if alibi_slopes is None:
        return None
    slopes = alibi_slopes.to(acc_dtype)
    return (slopes[None] if slopes.dim() == 1 else slopes)[:, :, None, None]


def _modify(s, m0, m1, n0, n1, len_q, len_k, softcap=0.0, slopes=None):
    """The scores the softmax sees, from the scaled scores of queries m0:m1 and keys n0:n1: softcap
    ``c * tanh(s / c)``, then ALiBi's ``-slope_h * |i + Nk - Nq - j|`` (``slopes``: :func:`_slope_view`),
    in ``s``'s dtype. Unmodified: ``s`` itself."""
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        rows = torch.arange(m0, m1, device=s.device)[:, None] + (len_k - len_q)
        cols = torch.arange(n0, n1, device=s.device)[None, :]
        s = s + -slopes * (rows - cols).abs().to(s.dtype)
    return s


def _mask(s, causal, m0, m1, n0, n1, len_q, len_k, window=NO_WINDOW):
    if causal:
        visible = _visible(m0, m1, n0, n1, len_q, len_k, s.device)
        s = s.masked_fill(~visible, NEG_INF)
    if window != NO_WINDOW:  # the tile loops' bounds stay the causal ones: a window only narrows them
        s = s.masked_fill(~_in_window(m0, m1, n0, n1, len_q, len_k, window, s.device), NEG_INF)
    return s


def _check(q, k, v, *, kernel, scale, block_m, block_n):
    """Validate the inputs and return the softmax scale (``1/sqrt(head_dim)`` when None)."""
    _validate.check_block("block_m", block_m, kernel=kernel)
    _validate.check_block("block_n", block_n, kernel=kernel)
    _validate.check_attention_inputs(q, k, v, kernel=kernel, dtypes=ALL_DTYPES, scale=scale)
    return _default_scale(q.shape[-1]) if scale is None else float(scale)


def _check_mods(q, softcap, alibi_slopes, *, kernel, acc_dtype):
    """Validate the score modifications: ``(softcap, slopes)``, slopes as :func:`_slope_view` gives them."""
    softcap = _validate.check_softcap(softcap, kernel=kernel)
    slopes = _validate.check_alibi_slopes(alibi_slopes, q, kernel=kernel)
    return softcap, _slope_view(slopes, acc_dtype)


def _outputs(q, k, v, out, lse, *, kernel):
    """The ``(out, lse)`` tensors to write: the caller's buffers where given (validated), else new ones."""
    _validate.check_out_buffers(q, k, v, out, lse, kernel=kernel, lse_dtypes=(_acc_dtype(q.dtype),))
    b, hq, len_q, d = q.shape
    if out is None:
        out = torch.empty(b, hq, len_q, d, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(b, hq, len_q, dtype=_acc_dtype(q.dtype), device=q.device)
    return out, lse


def fa2_forward_raw(q, k, v, *, causal: bool = False, scale: float | None = None,
                    block_m: int = 64, block_n: int = 64, out=None, lse=None, window_size=NO_WINDOW,
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None):
    """FA2 forward without autograd: returns ``(out, lse)``. ``out``/``lse`` given: the results are
    written into them (any strides) and they are returned."""
    scale = _check(q, k, v, kernel="fa2_blocked", scale=scale, block_m=block_m, block_n=block_n)
    window = _validate.check_window(window_size, kernel="fa2_blocked")
    out, lse = _outputs(q, k, v, out, lse, kernel="fa2_blocked")
    b, hq, len_q, d = q.shape
    len_k = k.shape[2]
    acc_dtype = _acc_dtype(q.dtype)
    softcap, slopes = _check_mods(q, softcap, alibi_slopes, kernel="fa2_blocked", acc_dtype=acc_dtype)
    k_all, v_all = _expand_kv(k, hq), _expand_kv(v, hq)
    for m0 in range(0, len_q, block_m):
        m1 = min(m0 + block_m, len_q)
        q_tile = q[:, :, m0:m1]
        m_i = torch.full((b, hq, m1 - m0), NEG_INF, dtype=acc_dtype, device=q.device)
        l_i = torch.zeros((b, hq, m1 - m0), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((b, hq, m1 - m0, d), dtype=acc_dtype, device=q.device)
        kv_end = _kv_end(m1, len_q, len_k, causal)
        for n0 in range(0, kv_end, block_n):
            n1 = min(n0 + block_n, len_k)
            s = _scores(q_tile, k_all[:, :, n0:n1], scale, acc_dtype)
            s = _modify(s, m0, m1, n0, n1, len_q, len_k, softcap, slopes)
            s = _mask(s, causal, m0, m1, n0, n1, len_q, len_k, window)
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            # Rows that have seen no visible key yet keep m = -inf; subtract 0 there instead.
            m_ref = torch.where(m_new == NEG_INF, 0.0, m_new)
            alpha = torch.exp(m_i - m_ref)
            p = torch.exp(s - m_ref[..., None])
            l_i = l_i * alpha + p.sum(dim=-1)
            pv = p.to(q.dtype).to(acc_dtype) @ v_all[:, :, n0:n1].to(acc_dtype)
            acc = acc * alpha[..., None] + pv
            m_i = m_new
        empty = l_i == 0
        out[:, :, m0:m1] = (acc / torch.where(empty, 1.0, l_i)[..., None]).to(q.dtype)
        lse[:, :, m0:m1] = torch.where(empty, NEG_INF, m_i + torch.log(l_i))
    return out, lse


def fa1_forward_raw(q, k, v, *, causal: bool = False, scale: float | None = None,
                    block_m: int = 64, block_n: int = 64, out=None, lse=None, window_size=NO_WINDOW,
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None):
    """FA1 forward without autograd: returns ``(out, lse)``; the output is renormalised every step.
    ``out``/``lse`` given: the results are written into them (any strides) and they are returned."""
    scale = _check(q, k, v, kernel="fa1_blocked", scale=scale, block_m=block_m, block_n=block_n)
    window = _validate.check_window(window_size, kernel="fa1_blocked")
    out, lse = _outputs(q, k, v, out, lse, kernel="fa1_blocked")
    b, hq, len_q, d = q.shape
    len_k = k.shape[2]
    acc_dtype = _acc_dtype(q.dtype)
    softcap, slopes = _check_mods(q, softcap, alibi_slopes, kernel="fa1_blocked", acc_dtype=acc_dtype)
    k_all, v_all = _expand_kv(k, hq), _expand_kv(v, hq)
    o = torch.zeros((b, hq, len_q, d), dtype=acc_dtype, device=q.device)
    m = torch.full((b, hq, len_q), NEG_INF, dtype=acc_dtype, device=q.device)
    l = torch.zeros((b, hq, len_q), dtype=acc_dtype, device=q.device)
    for n0 in range(0, len_k, block_n):
        n1 = min(n0 + block_n, len_k)
        k_tile, v_tile = k_all[:, :, n0:n1], v_all[:, :, n0:n1].to(acc_dtype)
        for m0 in range(_q_start(n0, len_q, len_k, block_m, causal), len_q, block_m):
            m1 = min(m0 + block_m, len_q)
            s = _scores(q[:, :, m0:m1], k_tile, scale, acc_dtype)
            s = _modify(s, m0, m1, n0, n1, len_q, len_k, softcap, slopes)
            s = _mask(s, causal, m0, m1, n0, n1, len_q, len_k, window)
            m_old, l_old = m[:, :, m0:m1], l[:, :, m0:m1]
            m_new = torch.maximum(m_old, s.amax(dim=-1))
            m_ref = torch.where(m_new == NEG_INF, 0.0, m_new)
            alpha = torch.exp(m_old - m_ref)
            p = torch.exp(s - m_ref[..., None])
            l_new = alpha * l_old + p.sum(dim=-1)
            pv = p.to(q.dtype).to(acc_dtype) @ v_tile
            numer = (alpha * l_old)[..., None] * o[:, :, m0:m1] + pv
            o[:, :, m0:m1] = numer / torch.where(l_new == 0, 1.0, l_new)[..., None]
            m[:, :, m0:m1], l[:, :, m0:m1] = m_new, l_new
    lse.copy_(torch.where(l == 0, NEG_INF, m + torch.log(l)))
    out.copy_(o.to(q.dtype))
    return out, lse


def fa2_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale: float | None = None,
                 block_m: int = 64, block_n: int = 64, window_size=NO_WINDOW,
                 softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None):
    """Blocked FA2 backward: returns ``(dq, dk, dv, delta)`` with ``delta = rowsum(dO * O)``."""
    scale = _check(q, k, v, kernel="fa2_blocked backward", scale=scale, block_m=block_m, block_n=block_n)
    window = _validate.check_window(window_size, kernel="fa2_blocked backward")
    _validate.check_backward_inputs(q, k, v, out, lse, dout, kernel="fa2_blocked backward")
    b, hq, len_q, d = q.shape
    hkv, len_k = k.shape[1], k.shape[2]
    acc_dtype = _acc_dtype(q.dtype)
    softcap, slopes = _check_mods(q, softcap, alibi_slopes, kernel="fa2_blocked backward", acc_dtype=acc_dtype)
    k_all, v_all = _expand_kv(k, hq), _expand_kv(v, hq)
    do = dout.to(acc_dtype)
    delta = (do * out.to(acc_dtype)).sum(dim=-1)
    # Rows that see no key have lse = -inf; exp(s - inf) = 0 gives them P = 0 without NaN.
    lse_ref = torch.where(lse == NEG_INF, float("inf"), lse.to(acc_dtype))
    dq = torch.zeros((b, hq, len_q, d), dtype=acc_dtype, device=q.device)
    dk = torch.zeros((b, hq, len_k, d), dtype=acc_dtype, device=q.device)
    dv = torch.zeros((b, hq, len_k, d), dtype=acc_dtype, device=q.device)
    for n0 in range(0, len_k, block_n):
        n1 = min(n0 + block_n, len_k)
        k_tile, v_tile = k_all[:, :, n0:n1], v_all[:, :, n0:n1].to(acc_dtype)
        dk_acc = torch.zeros((b, hq, n1 - n0, d), dtype=acc_dtype, device=q.device)
        dv_acc = torch.zeros((b, hq, n1 - n0, d), dtype=acc_dtype, device=q.device)
        for m0 in range(_q_start(n0, len_q, len_k, block_m, causal), len_q, block_m):
            m1 = min(m0 + block_m, len_q)
            q_tile, do_tile = q[:, :, m0:m1], do[:, :, m0:m1]
            raw = _scores(q_tile, k_tile, scale, acc_dtype)
            s = _modify(raw, m0, m1, n0, n1, len_q, len_k, softcap, slopes)
            s = _mask(s, causal, m0, m1, n0, n1, len_q, len_k, window)
            p = torch.exp(s - lse_ref[:, :, m0:m1, None])
            dv_acc += p.to(q.dtype).to(acc_dtype).transpose(-1, -2) @ do_tile
            dp = do_tile @ v_tile.transpose(-1, -2)
            ds = p * (dp - delta[:, :, m0:m1, None])
            if softcap:  # the chain rule through c * tanh(s / c); ALiBi's bias has derivative 1
                # only where P > 0: a hidden key may hold NaN, and its dS (0) must stay 0
                ds = torch.where(p > 0, ds * (1.0 - torch.tanh(raw / softcap) ** 2), 0.0)
            ds_low = ds.to(q.dtype).to(acc_dtype)
            dk_acc += ds_low.transpose(-1, -2) @ q_tile.to(acc_dtype)
            dq[:, :, m0:m1] += (ds_low @ k_tile.to(acc_dtype)) * scale
        dk[:, :, n0:n1] = dk_acc * scale
        dv[:, :, n0:n1] = dv_acc
    dk, dv = _reduce_group(dk, hkv), _reduce_group(dv, hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), delta


def _apply(q, k, v, causal, scale, block_m, block_n, forward_raw, out, lse, kernel, window_size,
           softcap, alibi_slopes):
    buffers = None
    window = _validate.check_window(window_size, kernel=kernel)
    softcap = _validate.check_softcap(softcap, kernel=kernel)
    if out is not None or lse is not None or alibi_slopes is not None:
        _check(q, k, v, kernel=kernel, scale=scale, block_m=block_m, block_n=block_n)
        _validate.check_alibi_slopes(alibi_slopes, q, kernel=kernel)
    if out is not None or lse is not None:
        buffers = _outputs(q, k, v, out, lse, kernel=kernel)
    keywords = {}  # the forward's and the backward's own keywords beyond the contract's
    if window != NO_WINDOW:
        keywords["window_size"] = window
    if softcap:
        keywords["softcap"] = softcap
    if alibi_slopes is not None:
        keywords["alibi_slopes"] = alibi_slopes
    backward = fa2_backward
    if keywords:
        forward_raw = functools.partial(forward_raw, **keywords)
        backward = functools.partial(fa2_backward, **keywords)
    return _autograd.apply(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                           forward=forward_raw, backward=backward, buffers=buffers)


def fa2_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                block_m: int = 64, block_n: int = 64, out=None, lse=None, window_size=NO_WINDOW,
                softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None):
    """FA2 forward with autograd: ``(out, lse)``; gradients flow through ``out``.

    ``out=`` (q's shape and dtype) and ``lse=`` (``[B, Hq, Nq]``, float32; float64 for float64 inputs),
    views with any strides, receive the results, and are what is returned (see ``out_buffers`` in
    :class:`kernels.registry.Implementation`); gradients still flow to q, k, v through the returned out.
    """
    return _apply(q, k, v, causal, scale, block_m, block_n, fa2_forward_raw, out, lse, "fa2_blocked", window_size,
                  softcap, alibi_slopes)


def fa1_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                block_m: int = 64, block_n: int = 64, out=None, lse=None, window_size=NO_WINDOW,
                softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None):
    """FA1 forward with autograd (the backward is the blocked FA2 backward, which needs only O and LSE);
    ``out=``/``lse=`` as for :func:`fa2_forward`."""
    return _apply(q, k, v, causal, scale, block_m, block_n, fa1_forward_raw, out, lse, "fa1_blocked", window_size,
                  softcap, alibi_slopes)
