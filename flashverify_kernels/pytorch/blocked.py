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

Attention sinks (``sinks``, a logit ``t_h`` per query head, float32 or float64 for float64 inputs) join
every row's denominator: the running state starts at the sink, ``m = t_h, l = 1, acc = 0``, so ``out =
acc / l`` and ``lse = m + log(l)`` include it and a row that sees no key gives ``out = 0``, ``lse = t_h``.
The backward is unchanged (``P`` from that LSE); the sink's own gradient is its ``dS``,
``dt_h = sum_{b, i} P_sink (0 - Delta)`` with ``P_sink = exp(t_h - lse)``.

Split-KV (``num_splits=S``): the key tiles are cut into ``S`` runs of ``ceil(tiles / S)`` tiles; each run
keeps its own ``m, l, acc`` (the sink starts the first), gives a float32 partial ``out_t = acc / l`` and
``lse_t = m + log(l)``, and the runs are merged by their LSEs::

    lse = top + log(sum_t exp(lse_t - top)),  top = max_t lse_t;   out = sum_t exp(lse_t - lse) out_t

Causal masking is bottom-right aligned: key ``j`` is visible to query ``i`` iff ``j <= i + Nk - Nq``.
A sliding window ``window_size=(left, right)`` (flash_attn's convention, -1 unbounded) also hides the
keys outside ``i + Nk - Nq - left .. i + Nk - Nq + right``, and ``attention_chunk=C`` (FlashAttention-3's
local attention) the keys outside the chunk of ``C`` positions that holds ``i + Nk - Nq``; they only
mask, the tile loops are unchanged.
Key blocks that no query of a Q tile can see are skipped; a row that sees no key at all gets
``out = 0`` and ``lse = -inf``. Grouped-query attention maps query head ``h`` to key/value head
``h // (Hq // Hkv)``; dK and dV sum over the query heads of a group.

Variable-length sequences (:mod:`flashverify_kernels.conventions` has the layouts) run as one dense problem per
sequence, as a kernel's grid runs one program per (sequence, query tile): ``cu_seqlens_q``,
``cu_seqlens_k`` (with ``max_seqlen_q``, ``max_seqlen_k``) for packed ``[total, H, D]`` tensors;
``seqlens_q``, ``seqlens_k`` for padded ``[S, H, N, D]`` ones; ``block_table`` and ``seqlens_k`` for a
paged KV cache ``[pages, page_size, Hkv, D]``, whose pages each sequence reads through its row of the
block table.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from flashverify_kernels import _autograd, _validate
from flashverify_kernels.declaration import ALL_DTYPES
from references.fp8 import FP8_DTYPES, is_fp8, out_dtype, per_head

NEG_INF = float("-inf")
NO_WINDOW = _validate.NO_WINDOW


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


def _in_chunk(m0: int, m1: int, n0: int, n1: int, len_q: int, len_k: int, chunk: int, device) -> torch.Tensor:
    """Keys n0:n1 in the same chunk of ``chunk`` positions as the diagonal of queries m0:m1 (bool)."""
    position = torch.arange(m0, m1, device=device)[:, None] + len_k - len_q
    cols = torch.arange(n0, n1, device=device)[None, :]
    return torch.div(cols, chunk, rounding_mode="floor") == torch.div(position, chunk, rounding_mode="floor")


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


def _mask(s, causal, m0, m1, n0, n1, len_q, len_k, window=NO_WINDOW, chunk=0):
    if causal:
        visible = _visible(m0, m1, n0, n1, len_q, len_k, s.device)
        s = s.masked_fill(~visible, NEG_INF)
    if window != NO_WINDOW:  # the tile loops' bounds stay the causal ones: a window only narrows them
        s = s.masked_fill(~_in_window(m0, m1, n0, n1, len_q, len_k, window, s.device), NEG_INF)
    if chunk:
        s = s.masked_fill(~_in_chunk(m0, m1, n0, n1, len_q, len_k, chunk, s.device), NEG_INF)
    return s


@dataclasses.dataclass(frozen=True)
class _Variant:
    """The call's :class:`flashverify_kernels._validate.Variant` as the tile loops use it: the slopes as
    :func:`_slope_view` and the sinks in the accumulator dtype."""

    window: tuple[int, int] = NO_WINDOW
    chunk: int = 0
    softcap: float = 0.0
    slopes: torch.Tensor | None = None
    sink: torch.Tensor | None = None
    splits: int = 1


def _variant(q, *, kernel, acc_dtype, window_size, attention_chunk, softcap, alibi_slopes, sinks, num_splits):
    var = _validate.variant(q, kernel=kernel, window_size=window_size, attention_chunk=attention_chunk,
                            softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, num_splits=num_splits)
    return _Variant(window=var.window, chunk=var.chunk, softcap=var.softcap,
                    slopes=_slope_view(var.alibi_slopes, acc_dtype),
                    sink=None if var.sinks is None else var.sinks.detach().to(acc_dtype), splits=var.splits)


def _check(q, k, v, *, kernel, scale, block_m, block_n, dtypes=ALL_DTYPES):
    """Validate the inputs and return the softmax scale (``1/sqrt(head_dim)`` when None)."""
    _validate.check_block("block_m", block_m, kernel=kernel)
    _validate.check_block("block_n", block_n, kernel=kernel)
    _validate.check_attention_inputs(q, k, v, kernel=kernel, dtypes=dtypes, scale=scale, head_dim_v=True)
    return _default_scale(q.shape[-1]) if scale is None else float(scale)


def _outputs(q, k, v, out, lse, *, kernel):
    """The ``(out, lse)`` tensors to write: the caller's buffers where given (validated), else new ones."""
    _validate.check_out_buffers(q, k, v, out, lse, kernel=kernel, lse_dtypes=(_acc_dtype(q.dtype),))
    b, hq, len_q = q.shape[:3]
    if out is None:
        out = torch.empty(b, hq, len_q, v.shape[-1], dtype=out_dtype(q.dtype), device=q.device)
    if lse is None:
        lse = torch.empty(b, hq, len_q, dtype=_acc_dtype(q.dtype), device=q.device)
    return out, lse


def _key_runs(len_k: int, block_n: int, splits: int) -> list[tuple[int, int]]:
    """The keys of each KV split: ``splits`` runs of ``ceil(tiles / splits)`` whole tiles (trailing runs may
    be empty)."""
    per = -(-(-(-len_k // block_n)) // splits) * block_n
    return [(min(len_k, t * per), min(len_k, (t + 1) * per)) for t in range(splits)]


def _start(shape, sink, acc_dtype, device):
    """A running state ``(m, l)`` of rows ``shape`` (``[B, Hq, rows]``): empty, or the sink's
    ``(t_h, 1)`` (the sink joins the denominator as a key of value 0 would)."""
    if sink is None:
        return (torch.full(shape, NEG_INF, dtype=acc_dtype, device=device),
                torch.zeros(shape, dtype=acc_dtype, device=device))
    return sink[None, :, None].expand(shape).clone(), torch.ones(shape, dtype=acc_dtype, device=device)


def _merge(parts):
    """Split-KV's merge of the splits' ``[(out_t, lse_t), ...]`` (partial outputs normalised, in the
    accumulator dtype): ``(out, lse)``; one split is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse_t for _, lse_t in parts])
    top = lses.amax(dim=0)
    top_ref = torch.where(top == NEG_INF, 0.0, top)
    total = torch.exp(lses - top_ref).sum(dim=0)
    lse = torch.where(total == 0, NEG_INF, top_ref + torch.log(total))
    lse_ref = torch.where(lse == NEG_INF, 0.0, lse)
    out = sum(torch.exp(lse_t - lse_ref)[..., None] * out_t for out_t, lse_t in parts)
    return out, lse


def _descale_heads(descale, hq: int, device) -> torch.Tensor | float:
    """A float8 input's ``[B, Hkv]`` descale as float32 ``[B, Hq, 1, 1]``; 1.0 without one."""
    if descale is None:
        return 1.0
    return per_head(descale, hq, dtype=torch.float32, device=device)


def fa2_forward_raw(q, k, v, *, causal: bool = False, scale: float | None = None,
                    block_m: int = 64, block_n: int = 64, out=None, lse=None, window_size=NO_WINDOW,
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, attention_chunk: int = 0,
                    sinks: torch.Tensor | None = None, num_splits: int = 1, descales=(None, None, None)):
    """FA2 forward without autograd: returns ``(out, lse)``. ``out``/``lse`` given: the results are
    written into them (any strides) and they are returned. Float8 inputs (``references/fp8.py``), with
    ``descales`` ``(q_descale, k_descale, v_descale)``: the scores are the float32 dots times
    ``scale q_descale k_descale`` (one float32 factor per head), ``p`` is cast to v's float8 format, the
    accumulator is divided by ``l`` and multiplied by ``v_descale``, and out is bfloat16."""
    scale = _check(q, k, v, kernel="fa2_blocked", scale=scale, block_m=block_m, block_n=block_n,
                   dtypes=_FORWARD_DTYPES)
    b, hq, len_q, d = q.shape
    len_k = k.shape[2]
    acc_dtype = _acc_dtype(q.dtype)
    qd, kd, vd = _validate.check_descales(q, k, descales, kernel="fa2_blocked")
    if is_fp8(q.dtype):  # one float32 score factor per head; v's descale multiplies the normalised output
        scale = (torch.tensor(scale, dtype=acc_dtype, device=q.device) * _descale_heads(qd, hq, q.device)
                 ) * _descale_heads(kd, hq, q.device)
    v_factor = _descale_heads(vd, hq, q.device)
    var = _variant(q, kernel="fa2_blocked", acc_dtype=acc_dtype, window_size=window_size,
                   attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                   num_splits=num_splits)
    out, lse = _outputs(q, k, v, out, lse, kernel="fa2_blocked")
    k_all, v_all = _expand_kv(k, hq), _expand_kv(v, hq)
    for m0 in range(0, len_q, block_m):
        m1 = min(m0 + block_m, len_q)
        q_tile = q[:, :, m0:m1]
        kv_end = _kv_end(m1, len_q, len_k, causal)
        parts = []
        for run, (k0, k1) in enumerate(_key_runs(len_k, block_n, var.splits)):
            m_i, l_i = _start((b, hq, m1 - m0), var.sink if run == 0 else None, acc_dtype, q.device)
            acc = torch.zeros((b, hq, m1 - m0, v.shape[-1]), dtype=acc_dtype, device=q.device)
            for n0 in range(k0, min(k1, kv_end), block_n):
                n1 = min(n0 + block_n, len_k)
                s = _scores(q_tile, k_all[:, :, n0:n1], scale, acc_dtype)
                s = _modify(s, m0, m1, n0, n1, len_q, len_k, var.softcap, var.slopes)
                s = _mask(s, causal, m0, m1, n0, n1, len_q, len_k, var.window, var.chunk)
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
            parts.append((acc / torch.where(empty, 1.0, l_i)[..., None],
                          torch.where(empty, NEG_INF, m_i + torch.log(l_i))))
        o, lse_tile = _merge(parts)
        out[:, :, m0:m1] = (o * v_factor).to(out.dtype)
        lse[:, :, m0:m1] = lse_tile
    return out, lse


def fa1_forward_raw(q, k, v, *, causal: bool = False, scale: float | None = None,
                    block_m: int = 64, block_n: int = 64, out=None, lse=None, window_size=NO_WINDOW,
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, attention_chunk: int = 0,
                    sinks: torch.Tensor | None = None, num_splits: int = 1):
    """FA1 forward without autograd: returns ``(out, lse)``; the output is renormalised every step.
    ``out``/``lse`` given: the results are written into them (any strides) and they are returned."""
    scale = _check(q, k, v, kernel="fa1_blocked", scale=scale, block_m=block_m, block_n=block_n)
    b, hq, len_q, d = q.shape
    len_k = k.shape[2]
    acc_dtype = _acc_dtype(q.dtype)
    var = _variant(q, kernel="fa1_blocked", acc_dtype=acc_dtype, window_size=window_size,
                   attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                   num_splits=num_splits)
    out, lse = _outputs(q, k, v, out, lse, kernel="fa1_blocked")
    k_all, v_all = _expand_kv(k, hq), _expand_kv(v, hq)
    parts = []
    for run, (k0, k1) in enumerate(_key_runs(len_k, block_n, var.splits)):
        o = torch.zeros((b, hq, len_q, v.shape[-1]), dtype=acc_dtype, device=q.device)
        m, l = _start((b, hq, len_q), var.sink if run == 0 else None, acc_dtype, q.device)
        for n0 in range(k0, k1, block_n):
            n1 = min(n0 + block_n, len_k)
            k_tile, v_tile = k_all[:, :, n0:n1], v_all[:, :, n0:n1].to(acc_dtype)
            for m0 in range(_q_start(n0, len_q, len_k, block_m, causal), len_q, block_m):
                m1 = min(m0 + block_m, len_q)
                s = _scores(q[:, :, m0:m1], k_tile, scale, acc_dtype)
                s = _modify(s, m0, m1, n0, n1, len_q, len_k, var.softcap, var.slopes)
                s = _mask(s, causal, m0, m1, n0, n1, len_q, len_k, var.window, var.chunk)
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
        parts.append((o, torch.where(l == 0, NEG_INF, m + torch.log(l))))
    o, lse_all = _merge(parts)
    lse.copy_(lse_all)
    out.copy_(o.to(q.dtype))
    return out, lse


def fa2_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale: float | None = None,
                 block_m: int = 64, block_n: int = 64, window_size=NO_WINDOW,
                 softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, attention_chunk: int = 0,
                 sinks: torch.Tensor | None = None, num_splits: int = 1, **sequences):
    """Blocked FA2 backward: returns ``(dq, dk, dv, delta)`` with ``delta = rowsum(dO * O)``, and with
    ``sinks`` the sinks' gradient ``dsinks`` fifth. ``num_splits`` is the forward's (the backward does not
    split). Variable-length sequences: the forward's keywords (:func:`fa2_forward`), the tensors in the
    same convention."""
    if any(value is not None for value in sequences.values()):
        return _sequences_backward(q, k, v, out, lse, dout, causal=causal, scale=scale, block_m=block_m,
                                   block_n=block_n, window_size=window_size, softcap=softcap,
                                   alibi_slopes=alibi_slopes, attention_chunk=attention_chunk, sinks=sinks,
                                   num_splits=num_splits, **sequences)
    scale = _check(q, k, v, kernel="fa2_blocked backward", scale=scale, block_m=block_m, block_n=block_n)
    _validate.check_backward_inputs(q, k, v, out, lse, dout, kernel="fa2_blocked backward")
    b, hq, len_q, d = q.shape
    hkv, len_k = k.shape[1], k.shape[2]
    acc_dtype = _acc_dtype(q.dtype)
    var = _variant(q, kernel="fa2_blocked backward", acc_dtype=acc_dtype, window_size=window_size,
                   attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                   num_splits=num_splits)
    k_all, v_all = _expand_kv(k, hq), _expand_kv(v, hq)
    do = dout.to(acc_dtype)
    delta = (do * out.to(acc_dtype)).sum(dim=-1)
    # Rows that see no key have lse = -inf; exp(s - inf) = 0 gives them P = 0 without NaN.
    lse_ref = torch.where(lse == NEG_INF, float("inf"), lse.to(acc_dtype))
    dq = torch.zeros((b, hq, len_q, d), dtype=acc_dtype, device=q.device)
    dk = torch.zeros((b, hq, len_k, d), dtype=acc_dtype, device=q.device)
    dv = torch.zeros((b, hq, len_k, v.shape[-1]), dtype=acc_dtype, device=q.device)
    for n0 in range(0, len_k, block_n):
        n1 = min(n0 + block_n, len_k)
        k_tile, v_tile = k_all[:, :, n0:n1], v_all[:, :, n0:n1].to(acc_dtype)
        dk_acc = torch.zeros((b, hq, n1 - n0, d), dtype=acc_dtype, device=q.device)
        dv_acc = torch.zeros((b, hq, n1 - n0, v.shape[-1]), dtype=acc_dtype, device=q.device)
        for m0 in range(_q_start(n0, len_q, len_k, block_m, causal), len_q, block_m):
            m1 = min(m0 + block_m, len_q)
            q_tile, do_tile = q[:, :, m0:m1], do[:, :, m0:m1]
            raw = _scores(q_tile, k_tile, scale, acc_dtype)
            s = _modify(raw, m0, m1, n0, n1, len_q, len_k, var.softcap, var.slopes)
            s = _mask(s, causal, m0, m1, n0, n1, len_q, len_k, var.window, var.chunk)
            p = torch.exp(s - lse_ref[:, :, m0:m1, None])
            dv_acc += p.to(q.dtype).to(acc_dtype).transpose(-1, -2) @ do_tile
            dp = do_tile @ v_tile.transpose(-1, -2)
            ds = p * (dp - delta[:, :, m0:m1, None])
            if var.softcap:  # the chain rule through c * tanh(s / c); ALiBi's bias has derivative 1
                # only where P > 0: a hidden key may hold NaN, and its dS (0) must stay 0
                ds = torch.where(p > 0, ds * (1.0 - torch.tanh(raw / var.softcap) ** 2), 0.0)
            ds_low = ds.to(q.dtype).to(acc_dtype)
            dk_acc += ds_low.transpose(-1, -2) @ q_tile.to(acc_dtype)
            dq[:, :, m0:m1] += (ds_low @ k_tile.to(acc_dtype)) * scale
        dk[:, :, n0:n1] = dk_acc * scale
        dv[:, :, n0:n1] = dv_acc
    dk, dv = _reduce_group(dk, hkv), _reduce_group(dv, hkv)
    grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), delta)
    if var.sink is None:
        return grads
    # The sink's dS: P_sink (dP_sink - Delta), with dP_sink = 0 (its value is 0), summed over batch and rows.
    p_sink = torch.exp(var.sink[None, :, None] - lse_ref)
    return (*grads, (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype))


# What the forwards' shared checks accept; each forward then checks its own (fa1's: no float8).
_FORWARD_DTYPES = (*ALL_DTYPES, *FP8_DTYPES)


def _dense(q, k, v, causal, scale, block_m, block_n, forward_raw, out, lse, kernel, variant_keywords, sinks):
    """One dense call under autograd: the forward and backward with the variant's keywords, the sinks as a
    differentiable input."""
    buffers = None
    if out is not None or lse is not None:
        _check(q, k, v, kernel=kernel, scale=scale, block_m=block_m, block_n=block_n, dtypes=_FORWARD_DTYPES)
        buffers = _outputs(q, k, v, out, lse, kernel=kernel)
    keywords = {key: value for key, value in variant_keywords.items() if not _is_default(key, value)}
    backward = fa2_backward
    if keywords:
        forward_raw = functools.partial(forward_raw, **keywords)
        backward = functools.partial(fa2_backward, **keywords)
    return _autograd.apply(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                           forward=forward_raw, backward=backward, buffers=buffers, sinks=sinks)


# The variant keywords the forward and backward share, and their defaults (left out of the call).
_DEFAULTS = {"window_size": NO_WINDOW, "softcap": 0.0, "alibi_slopes": None, "attention_chunk": 0, "num_splits": 1}


def _is_default(key: str, value) -> bool:
    if key == "alibi_slopes":
        return value is None
    return tuple(value) == NO_WINDOW if key == "window_size" else value == _DEFAULTS[key]


def _apply(q, k, v, *, causal, scale, block_m, block_n, forward_raw, out, lse, kernel, sinks, sequences,
           **variant_keywords):
    """Validate what is cheap to validate once, then run a dense batch, or every sequence of a
    variable-length one (:class:`_Sequences`) as its own dense batch."""
    variant_keywords["window_size"] = _validate.check_window(variant_keywords["window_size"], kernel=kernel)
    variant_keywords["softcap"] = _validate.check_softcap(variant_keywords["softcap"], kernel=kernel)
    if not any(value is not None for value in sequences.values()):
        if out is not None or lse is not None or variant_keywords["alibi_slopes"] is not None or sinks is not None:
            _check(q, k, v, kernel=kernel, scale=scale, block_m=block_m, block_n=block_n, dtypes=_FORWARD_DTYPES)
            _validate.check_alibi_slopes(variant_keywords["alibi_slopes"], q, kernel=kernel)
            _validate.check_sinks(sinks, q, kernel=kernel)
        return _dense(q, k, v, causal, scale, block_m, block_n, forward_raw, out, lse, kernel, variant_keywords,
                      sinks)
    if out is not None or lse is not None:
        raise ValueError(f"{kernel}: out=/lse= buffers are taken for a dense batch only, not with "
                         f"{', '.join(name for name, value in sequences.items() if value is not None)}")
    seqs = _Sequences(q, k, v, kernel=kernel, **sequences)
    _validate.check_sinks(sinks, seqs.example_q, kernel=kernel)
    slopes = seqs.slopes(variant_keywords["alibi_slopes"])
    outs, lses = [], []
    for s, (qs, ks, vs) in enumerate(zip(seqs.queries(q), seqs.keys(k), seqs.keys(v))):
        one = {**variant_keywords, "alibi_slopes": slopes[s]}
        o, l_s = _dense(qs, ks, vs, causal, scale, block_m, block_n, forward_raw, None, None, kernel, one, sinks)
        outs.append(o)
        lses.append(l_s)
    return seqs.join_queries(outs, q, dim=v.shape[-1]), seqs.join_rows(lses)


def _sequences_backward(q, k, v, out, lse, dout, *, causal, scale, block_m, block_n, sinks, **keywords):
    """The declared backward of variable-length sequences: each sequence's dense backward, joined."""
    names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqlens_q", "seqlens_k", "block_table")
    sequences = {name: keywords.pop(name, None) for name in names}
    seqs = _Sequences(q, k, v, kernel="fa2_blocked backward", **sequences)
    slopes = seqs.slopes(keywords.pop("alibi_slopes"))
    parts = []
    for s, (qs, ks, vs, os_, ls, dos) in enumerate(zip(seqs.queries(q), seqs.keys(k), seqs.keys(v),
                                                       seqs.queries(out), seqs.rows(lse), seqs.queries(dout))):
        parts.append(fa2_backward(qs, ks, vs, os_, ls, dos, causal=causal, scale=scale, block_m=block_m,
                                  block_n=block_n, alibi_slopes=slopes[s], sinks=sinks, **keywords))
    dq = seqs.join_queries([p[0] for p in parts], q)
    dk, dv = (seqs.join_keys([p[i] for p in parts], t) for i, t in ((1, k), (2, v)))
    grads = (dq, dk, dv, seqs.join_rows([p[3] for p in parts]))
    if sinks is None:
        return grads
    return (*grads, sum((p[4] for p in parts), torch.zeros_like(sinks)))


class _Sequences:
    """The sequences of a variable-length call, each as a dense ``[1, H, n, D]`` batch (views, or the
    keys gathered from their pages), and the joins of per-sequence results back into the call's layout."""

    def __init__(self, q, k, v, *, kernel, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, seqlens_q=None, seqlens_k=None, block_table=None):
        for label, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{kernel}: {label} is a {type(t).__name__}, but should be a torch.Tensor")
        device = q.device
        if block_table is not None:
            self.kind = "paged"
            if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:-1] != v.shape[:-1]:
                raise ValueError(f"{kernel}: a paged KV cache takes q [S, Hq, Nq, D], k [pages, page_size, Hkv, D] and "
                                 f"v [pages, page_size, Hkv, Dv]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                                 f"{tuple(v.shape)}")
            pages, self.page_size = k.shape[0], k.shape[1]
            self.lens_q = [q.shape[2]] * q.shape[0]
            self.lens_k = _validate.check_seqlens("seqlens_k", seqlens_k, batch=q.shape[0],
                                                  most=pages * self.page_size, device=device, kernel=kernel)
            self.table = _validate.check_block_table(block_table, batch=q.shape[0], num_pages=pages,
                                                     page_size=self.page_size, seqlens_k=self.lens_k, device=device,
                                                     kernel=kernel)
        elif cu_seqlens_q is not None or cu_seqlens_k is not None:
            self.kind = "packed"
            if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:-1] != v.shape[:-1]:
                raise ValueError(f"{kernel}: packed sequences take q [total_q, Hq, D], k [total_k, Hkv, D] and v "
                                 f"[total_k, Hkv, Dv]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
            self.cq = _validate.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total=q.shape[0], device=device,
                                                 kernel=kernel)
            self.ck = _validate.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total=k.shape[0], device=device,
                                                 kernel=kernel)
            if len(self.cq) != len(self.ck):
                raise ValueError(f"{kernel}: cu_seqlens_q has {len(self.cq) - 1} sequences and cu_seqlens_k "
                                 f"{len(self.ck) - 1}; both should describe the same sequences")
            self.lens_q = [b - a for a, b in zip(self.cq, self.cq[1:])]
            self.lens_k = [b - a for a, b in zip(self.ck, self.ck[1:])]
            _validate.check_max_seqlen("max_seqlen_q", max_seqlen_q, self.lens_q, kernel=kernel)
            _validate.check_max_seqlen("max_seqlen_k", max_seqlen_k, self.lens_k, kernel=kernel)
        else:
            self.kind = "padded"
            if (q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:-1] != v.shape[:-1]
                    or k.shape[0] != q.shape[0]):
                raise ValueError(f"{kernel}: padded sequences take q [S, Hq, Nq, D], k [S, Hkv, Nk, D] and v [S, Hkv, "
                                 f"Nk, Dv]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
            self.lens_q = _validate.check_seqlens("seqlens_q", seqlens_q, batch=q.shape[0], most=q.shape[2],
                                                  device=device, kernel=kernel)
            self.lens_k = _validate.check_seqlens("seqlens_k", seqlens_k, batch=q.shape[0], most=k.shape[2],
                                                  device=device, kernel=kernel)
        self.width_q = q.shape[2] if self.kind != "packed" else None  # rows per sequence of a batched layout
        self.example_q = self.queries(q)[0]

    @property
    def count(self) -> int:
        return len(self.lens_q)

    def slopes(self, alibi_slopes):
        """Each sequence's ALiBi slopes: the ``[Hq]`` ones, or its row of ``[S, Hq]``."""
        if alibi_slopes is None or alibi_slopes.dim() == 1:
            return [alibi_slopes] * self.count
        return list(alibi_slopes)

    def queries(self, t) -> list[torch.Tensor]:
        """A query-like tensor (q, out, dout) of the call: each sequence's rows as ``[1, H, n, D]``."""
        if self.kind == "packed":
            return [t[a:b].transpose(0, 1)[None] for a, b in zip(self.cq, self.cq[1:])]
        return [t[s:s + 1, :, :n] for s, n in enumerate(self.lens_q)]

    def rows(self, t) -> list[torch.Tensor]:
        """A row-like tensor (lse) of the call: each sequence's rows as ``[1, H, n]``."""
        if self.kind == "packed":
            return [t[:, a:b][None] for a, b in zip(self.cq, self.cq[1:])]
        return [t[s:s + 1, :, :n] for s, n in enumerate(self.lens_q)]

    def keys(self, t) -> list[torch.Tensor]:
        """A key-like tensor (k, v) of the call: each sequence's keys as ``[1, H, n, D]`` (gathered from its
        pages through the block table)."""
        if self.kind == "packed":
            return [t[a:b].transpose(0, 1)[None] for a, b in zip(self.ck, self.ck[1:])]
        if self.kind == "padded":
            return [t[s:s + 1, :, :n] for s, n in enumerate(self.lens_k)]
        out = []
        for s, n in enumerate(self.lens_k):
            used = -(-n // self.page_size)
            pages = torch.tensor(self.table[s][:used], dtype=torch.long, device=t.device)
            rows = t[pages].reshape(used * self.page_size, *t.shape[2:])[:n]
            out.append(rows.transpose(0, 1)[None])
        return out

    def join_queries(self, parts, like, *, dim: int | None = None) -> torch.Tensor:
        """Per-sequence ``[1, H, n, D]`` results in the layout of the query-like tensor ``like`` (padding rows 0);
        ``dim``: the results' head dim when it is not ``like``'s (the output has v's)."""
        if self.kind == "packed":
            if not parts:
                return like.new_zeros((*like.shape[:-1], like.shape[-1] if dim is None else dim), dtype=out_dtype(like.dtype))
            return torch.cat([p[0].transpose(0, 1) for p in parts], dim=0)
        width = like.shape[2]
        return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, width - p.shape[2])) for p in parts], dim=0)

    def join_rows(self, parts) -> torch.Tensor:
        """Per-sequence ``[1, H, n]`` row results (lse, Delta) in the call's layout: ``[H, total_q]`` packed,
        ``[S, H, N]`` padded (padding rows -inf) or paged."""
        if self.kind == "packed":
            return torch.cat([p[0] for p in parts], dim=1)
        return torch.cat([torch.nn.functional.pad(p, (0, self.width_q - p.shape[2]), value=NEG_INF) for p in parts],
                         dim=0)

    def join_keys(self, parts, like) -> torch.Tensor:
        """Per-sequence ``[1, Hkv, n, D]`` key gradients in the layout of ``like`` (k or v): padding keys and
        unused page slots get 0."""
        if self.kind == "packed":
            if not parts:
                return like.new_zeros(like.shape)
            return torch.cat([p[0].transpose(0, 1) for p in parts], dim=0)
        if self.kind == "padded":
            width = like.shape[2]
            return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, width - p.shape[2])) for p in parts], dim=0)
        flat = like.new_zeros((like.shape[0] * self.page_size, *like.shape[2:]))
        for s, (p, n) in enumerate(zip(parts, self.lens_k)):
            pages = torch.tensor(self.table[s][:-(-n // self.page_size)], dtype=torch.long, device=like.device)
            slots = (pages[:, None] * self.page_size + torch.arange(self.page_size, device=like.device)).flatten()[:n]
            flat[slots] = p[0].transpose(0, 1)
        return flat.view(like.shape)


def fa2_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                block_m: int = 64, block_n: int = 64, out=None, lse=None, window_size=NO_WINDOW,
                softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, attention_chunk: int = 0,
                sinks: torch.Tensor | None = None, num_splits: int = 1, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=None, max_seqlen_k=None, seqlens_q=None, seqlens_k=None, block_table=None,
                q_descale=None, k_descale=None, v_descale=None):
    """FA2 forward with autograd: ``(out, lse)``; gradients flow through ``out`` (to ``sinks`` too).

    ``out=`` (q's shape and dtype) and ``lse=`` (``[B, Hq, Nq]``, float32; float64 for float64 inputs),
    views with any strides, receive the results, and are what is returned (see ``out_buffers`` in
    :class:`flashverify_kernels.registry.Implementation`); gradients still flow to q, k, v through the returned out.
    Variable-length sequences (module docstring): ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``,
    ``max_seqlen_k`` (packed), ``seqlens_q``, ``seqlens_k`` (padded), ``block_table``, ``seqlens_k`` (paged).
    Float8 q, k, v (``float8_e4m3fn``, ``float8_e5m2``; forward only, no gradients), with ``q_descale``,
    ``k_descale``, ``v_descale`` (float32 ``[B, Hkv]``, each None for 1) in a dense batch: out is bfloat16
    (:func:`fa2_forward_raw`).
    """
    sequences = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, seqlens_q=seqlens_q, seqlens_k=seqlens_k, block_table=block_table)
    descales = (q_descale, k_descale, v_descale)
    if any(d is not None for d in descales) or (is_fp8(getattr(q, "dtype", None)) and _any_grad(q, k, v)):
        return _fp8_forward(q, k, v, descales, sequences, causal=causal, scale=scale, block_m=block_m,
                            block_n=block_n, out=out, lse=lse, window_size=window_size, softcap=softcap,
                            alibi_slopes=alibi_slopes, attention_chunk=attention_chunk, sinks=sinks,
                            num_splits=num_splits)
    return _apply(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, forward_raw=fa2_forward_raw,
                  out=out, lse=lse, kernel="fa2_blocked", sinks=sinks, sequences=sequences, window_size=window_size,
                  softcap=softcap, alibi_slopes=alibi_slopes, attention_chunk=attention_chunk, num_splits=num_splits)


def _any_grad(*tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _fp8_forward(q, k, v, descales, sequences, *, out, lse, window_size, softcap, alibi_slopes, sinks, **keywords):
    """The float8 forward of :func:`fa2_forward`: a dense batch, no autograd (the contract takes float8 in
    the forward only)."""
    kernel = "fa2_blocked"
    given = [name for name, value in sequences.items() if value is not None]
    if given:
        raise ValueError(f"{kernel}: descales are taken in a dense batch only, not with {', '.join(given)}")
    _validate.check_descales(q, k, descales, kernel=kernel)  # descales with other dtypes: refused here
    if _any_grad(q, k, v):
        raise ValueError(f"{kernel}: float8 inputs are taken in the forward only; q, k, v should not require grad")
    window = _validate.check_window(window_size, kernel=kernel)
    cap = _validate.check_softcap(softcap, kernel=kernel)
    _validate.check_alibi_slopes(alibi_slopes, q, kernel=kernel)
    _validate.check_sinks(sinks, q, kernel=kernel)
    return fa2_forward_raw(q, k, v, out=out, lse=lse, window_size=window, softcap=cap, alibi_slopes=alibi_slopes,
                           sinks=sinks, descales=descales, **keywords)


def fa1_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                block_m: int = 64, block_n: int = 64, out=None, lse=None, window_size=NO_WINDOW,
                softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, attention_chunk: int = 0,
                sinks: torch.Tensor | None = None, num_splits: int = 1, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=None, max_seqlen_k=None, seqlens_q=None, seqlens_k=None, block_table=None):
    """FA1 forward with autograd (the backward is the blocked FA2 backward, which needs only O and LSE);
    the keywords as for :func:`fa2_forward`."""
    sequences = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, seqlens_q=seqlens_q, seqlens_k=seqlens_k, block_table=block_table)
    return _apply(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, forward_raw=fa1_forward_raw,
                  out=out, lse=lse, kernel="fa1_blocked", sinks=sinks, sequences=sequences, window_size=window_size,
                  softcap=softcap, alibi_slopes=alibi_slopes, attention_chunk=attention_chunk, num_splits=num_splits)
