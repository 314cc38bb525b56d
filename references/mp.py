"""Arbitrary-precision (mpmath, 50 digits) attention reference for small cases.

The float64 reference in :mod:`references.attention` is itself rounded; this module checks it. Every
function converts its inputs to ``mpmath.mpf`` exactly (``float(x)`` is exact for float16, bfloat16,
float32 and float64 values), computes inside a local ``mpmath.workdps(50)`` context (the global mpmath
precision is never touched) and returns mpf values, or, for :func:`attention`, float64 tensors rounded
once from the 50-digit results. At 50 digits the result is exact to far below float64's resolution
for any input this suite draws (scores up to ~1e5 lose at most 6 of the 50 digits in ``exp``).

Functions

``softmax(row)``, ``logsumexp(row)``
    One row of floats; ``-inf`` entries are allowed and an all ``-inf`` (or empty) row gives zeros and
    ``-inf``.
``attention_row(q_i, keys, values, *, scale, dout_i=None)``
    One query row against its visible keys: the output row, the LSE, the probabilities and, given the
    upstream gradient ``dout_i``, ``Delta_i = dout_i . out_i``, ``dq_i`` and the per-key contributions
    ``dk_j``, ``dv_j`` of this row (summing them over the rows that see key ``j`` gives ``dK_j``, ``dV_j``).
``attention(q, k, v, *, spec, scale, dout, probabilities=False)``
    Whole tiny tensors in the ``[B, H, N, D]`` layout with grouped-query attention and the masking
    conventions of :mod:`references.attention` (the keys a query sees, variable-length sequences packed,
    the score modifications, softcap and ALiBi, and the sinks: the ``AttentionSpec``;
    a row with no visible key gives ``out = 0``, ``lse = -inf`` (the sink's logit with sinks), zero
    gradients). Only values that a
    visible (row, key) pair reads are converted, so inf or NaN elsewhere is allowed. Cost grows as
    ``B * Hq * Nq * Nk * D`` mpf operations: keep it to a few thousand. It works one query row at a
    time and holds ``O((Nq + Nk) D)`` values per head; the ``Nq x Nk`` probabilities are returned only
    when asked for (``probabilities=True``, for tests).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import mpmath
import torch

from references.spec import AttentionSpec, require_spec

DPS = 50


def _mpf(x) -> mpmath.mpf:
    """Exact conversion of one float (any torch float dtype, Python float or int) to mpf."""
    if isinstance(x, torch.Tensor):
        x = x.item()
    x = float(x)
    if math.isnan(x):
        raise ValueError("mpmath reference: NaN input has no reference value")
    return mpmath.mpf(x)


def _check_row(row) -> list:
    vals = [_mpf(x) for x in row]
    if any(mpmath.isinf(x) and x > 0 for x in vals):
        raise ValueError("mpmath reference: a row holds +inf; only -inf (masked) entries are allowed")
    return vals


def _lse(vals: list) -> mpmath.mpf:
    finite = [x for x in vals if mpmath.isfinite(x)]
    if not finite:
        return mpmath.mpf("-inf")
    m = max(finite)
    return m + mpmath.log(mpmath.fsum(mpmath.exp(x - m) for x in finite))


def logsumexp(row: Sequence[float]) -> mpmath.mpf:
    """Natural-log logsumexp of ``row`` at 50 digits; ``-inf`` for an all ``-inf`` or empty row."""
    with mpmath.workdps(DPS):
        return _lse(_check_row(row))


def softmax(row: Sequence[float]) -> list:
    """Softmax of ``row`` at 50 digits (list of mpf); zeros for an all ``-inf`` row."""
    with mpmath.workdps(DPS):
        vals = _check_row(row)
        lse = _lse(vals)
        if mpmath.isinf(lse):
            return [mpmath.mpf(0) for _ in vals]
        return [mpmath.exp(x - lse) if mpmath.isfinite(x) else mpmath.mpf(0) for x in vals]


@dataclasses.dataclass
class RowResult:
    """One query row at 50 digits (lists of mpf). Gradient fields are None without ``dout_i``."""

    out: list
    lse: mpmath.mpf
    p: list  # probability of each visible key, in the order given
    delta: mpmath.mpf | None = None  # dout_i . out_i
    p_sink: mpmath.mpf | None = None  # the sink's probability (with a sink)
    dq: list | None = None  # d<dout_i, out_i>/d q_i
    dk: list | None = None  # per visible key j: this row's contribution to dK_j
    dv: list | None = None  # per visible key j: this row's contribution to dV_j


def _dot(a: list, b: list) -> mpmath.mpf:
    return mpmath.fsum(x * y for x, y in zip(a, b))


def _row(q: list, keys: list, values: list, scale: mpmath.mpf, dout: list | None, *, cap=None,
         biases: list | None = None, sink: mpmath.mpf | None = None, value_dim: int | None = None) -> RowResult:
    d = len(q)
    dv = d if value_dim is None else value_dim  # v's head dim (a row with no key has no value to tell it)
    n = len(keys)
    scores = [scale * _dot(q, kj) for kj in keys]
    chain = [mpmath.mpf(1)] * n  # ds'/ds of each score
    if cap is not None:  # softcap: c tanh(s / c), derivative 1 - tanh^2
        tanh = [mpmath.tanh(x / cap) for x in scores]
        scores, chain = [cap * t for t in tanh], [1 - t * t for t in tanh]
    if biases is not None:  # ALiBi: a constant per key
        scores = [x + b for x, b in zip(scores, biases)]
    lse = _lse(scores + ([] if sink is None else [sink]))  # a sink joins the denominator only
    p_sink = None if sink is None else mpmath.exp(sink - lse)
    if n == 0:
        zeros = [mpmath.mpf(0)] * d
        if dout is None:
            return RowResult(out=[mpmath.mpf(0)] * dv, lse=lse, p=[], p_sink=p_sink)
        return RowResult(out=[mpmath.mpf(0)] * dv, lse=lse, p=[], delta=mpmath.mpf(0), dq=list(zeros), dk=[], dv=[],
                         p_sink=p_sink)
    p = [mpmath.exp(s - lse) for s in scores]
    out = [mpmath.fsum(p[j] * values[j][t] for j in range(n)) for t in range(dv)]
    res = RowResult(out=out, lse=lse, p=p, p_sink=p_sink)
    if dout is None:
        return res
    # <dout, out> with out = sum_j P_j v_j and P = softmax(s'_j), s'_j the modified scale q.k_j:
    #   dP_j = dout . v_j,  Delta = dout . out = sum_j P_j dP_j,  dS_j = P_j (dP_j - Delta) ds'_j/ds_j
    #   dq = scale sum_j dS_j k_j,  dk_j = scale dS_j q,  dv_j = P_j dout
    delta = _dot(dout, out)
    ds = [p[j] * (_dot(dout, values[j]) - delta) * chain[j] for j in range(n)]
    res.delta = delta
    res.dq = [scale * mpmath.fsum(ds[j] * keys[j][t] for j in range(n)) for t in range(d)]
    res.dk = [[scale * ds[j] * q[t] for t in range(d)] for j in range(n)]
    res.dv = [[p[j] * dout[t] for t in range(dv)] for j in range(n)]
    return res


def _vectors(rows) -> list:
    if isinstance(rows, torch.Tensor):
        rows = rows.detach().to("cpu").tolist()
    return [[_mpf(x) for x in r] for r in rows]


def attention_row(q_i, keys, values, *, scale: float, dout_i=None, softcap: float | None = None,
                  biases=None, value_dim: int | None = None) -> RowResult:
    """One query row against its visible ``keys`` (``[n, D]``) and ``values`` (``[n, Dv]``; ``n = 0``
    allowed; ``value_dim``: ``Dv`` when it is not ``D``).

    ``q_i`` is a length-``D`` and ``dout_i`` a length-``Dv`` sequence or 1-D tensor; ``softcap`` caps the scores
    (``c * tanh(s / c)``), then ``biases`` (one float per key, ALiBi's) are added. Returns a
    :class:`RowResult` of mpf values computed at 50 digits.
    """
    with mpmath.workdps(DPS):
        q = _vectors([q_i])[0]
        ks, vs = _vectors(keys), _vectors(values)
        if len(ks) != len(vs):
            raise ValueError(f"attention_row: {len(ks)} keys but {len(vs)} values; they should be equal")
        dv = len(q) if value_dim is None else value_dim
        for label, rows, width in (("keys", ks, len(q)), ("values", vs, dv)):
            if any(len(r) != width for r in rows):
                raise ValueError(f"attention_row: every row of {label} should have length {width}")
        do = None if dout_i is None else _vectors([dout_i])[0]
        if do is not None and len(do) != dv:
            raise ValueError(f"attention_row: dout_i has length {len(do)}, but should have the values' length {dv}")
        cap = None if softcap is None else _mpf(softcap)
        bias = None if biases is None else [_mpf(x) for x in biases]
        return _row(q, ks, vs, _mpf(scale), do, cap=cap, biases=bias, value_dim=dv)


@dataclasses.dataclass
class MpAttention:
    """50-digit attention rounded once to float64 tensors (layouts as in :mod:`references.attention`)."""

    out: torch.Tensor  # [B, Hq, Nq, D]
    lse: torch.Tensor  # [B, Hq, Nq]
    p: torch.Tensor | None = None  # [B, Hq, Nq, Nk], 0 where not visible (probabilities=True only)
    delta: torch.Tensor | None = None  # [B, Hq, Nq]
    dq: torch.Tensor | None = None  # [B, Hq, Nq, D]
    dk: torch.Tensor | None = None  # [B, Hkv, Nk, D], summed over the query heads of each group
    dv: torch.Tensor | None = None  # [B, Hkv, Nk, D]
    dsinks: torch.Tensor | None = None  # [Hq], with sinks: -sum over batch and rows of P_sink * Delta


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, spec: AttentionSpec = AttentionSpec(),
              scale: float | None = None, dout: torch.Tensor | None = None, probabilities: bool = False) -> MpAttention:
    """Whole-tensor attention at 50 digits; returns float64 tensors (gradients when ``dout`` is given,
    the ``[B, Hq, Nq, Nk]`` probabilities when ``probabilities``)."""
    require_spec(spec)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v should be 4-D [batch, heads, seq_len, head_dim]")
    b, hq, len_q, d = q.shape
    hkv, len_k, dv = k.shape[1], k.shape[2], v.shape[3]
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != d or hq % hkv:
        raise ValueError(f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
                         " do not fit the layout q [B, Hq, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] with Hq a "
                         "multiple of Hkv")
    if dout is not None and tuple(dout.shape) != (b, hq, len_q, dv):
        raise ValueError(f"dout.shape={tuple(dout.shape)}, but should be out's shape {(b, hq, len_q, dv)}")
    group = hq // hkv
    spec.check_lengths(len_q, len_k)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    f64 = dict(dtype=torch.float64)
    out = torch.zeros(b, hq, len_q, dv, **f64)
    lse = torch.full((b, hq, len_q), -math.inf, **f64)
    p = torch.zeros(b, hq, len_q, len_k, **f64) if probabilities else None
    grads = dout is not None
    if grads:
        delta = torch.zeros(b, hq, len_q, **f64)
        dq = torch.zeros(b, hq, len_q, d, **f64)
    # Convert lazily: values no visible (row, key) pair reads may be anything, even inf or NaN.
    qt, kt, vt = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    dt = dout.detach().to("cpu", torch.float64) if grads else None
    cache: dict = {}

    def row_of(name, t, bi, h, i):
        key = (name, bi, h, i)
        if key not in cache:
            cache[key] = [_mpf(x) for x in t[bi, h, i].tolist()]
        return cache[key]

    with mpmath.workdps(DPS):
        s = _mpf(scale)
        zero = mpmath.mpf(0)
        cap = None if spec.softcap is None else _mpf(spec.softcap)
        for name in ("alibi_slopes", "sinks"):
            values = getattr(spec, name)
            if values is not None and len(values) != hq:
                raise ValueError(f"{name} has {len(values)} values, but q has {hq} heads: one per query head")
        first, end = (x.tolist() for x in spec.key_range(len_q, len_k))  # the one definition of the mask
        diag = spec.diagonal(len_q, len_k).tolist()
        dsinks = [zero] * hq
        dk_acc = [[[[zero] * d for _ in range(len_k)] for _ in range(hkv)] for _ in range(b)]
        dv_acc = [[[[zero] * dv for _ in range(len_k)] for _ in range(hkv)] for _ in range(b)]
        for bi in range(b):
            for h in range(hq):
                g = h // group
                sink = None if spec.sinks is None else _mpf(spec.sinks[h])
                for i in range(len_q):
                    cols = list(range(first[i], end[i]))
                    if not cols and sink is None:  # out = 0, lse = -inf, zero gradients: already in place
                        continue
                    biases = None if spec.alibi_slopes is None else [
                        -_mpf(spec.alibi_slopes[h]) * abs(diag[i] - j) for j in cols]
                    r = _row(row_of("q", qt, bi, h, i), [row_of("k", kt, bi, g, j) for j in cols],
                             [row_of("v", vt, bi, g, j) for j in cols], s,
                             row_of("dout", dt, bi, h, i) if grads else None, cap=cap, biases=biases, sink=sink,
                             value_dim=dv)
                    out[bi, h, i] = torch.tensor([float(x) for x in r.out], **f64)
                    lse[bi, h, i] = float(r.lse)
                    if probabilities:
                        for j, pj in zip(cols, r.p):
                            p[bi, h, i, j] = float(pj)
                    if grads:
                        delta[bi, h, i] = float(r.delta)
                        if sink is not None:  # the sink's dS: P_sink (0 - Delta)
                            dsinks[h] -= r.p_sink * r.delta
                        dq[bi, h, i] = torch.tensor([float(x) for x in r.dq], **f64)
                        for n, j in enumerate(cols):
                            dk_acc[bi][g][j] = [a + c for a, c in zip(dk_acc[bi][g][j], r.dk[n])]
                            dv_acc[bi][g][j] = [a + c for a, c in zip(dv_acc[bi][g][j], r.dv[n])]
        res = MpAttention(out=out, lse=lse, p=p)
        if grads:
            res.delta, res.dq = delta, dq
            res.dk = torch.tensor([[[[float(x) for x in row] for row in hd] for hd in bd] for bd in dk_acc],
                                  **f64).reshape(b, hkv, len_k, d)
            res.dv = torch.tensor([[[[float(x) for x in row] for row in hd] for hd in bd] for bd in dv_acc],
                                  **f64).reshape(b, hkv, len_k, dv)
            if spec.sinks is not None:
                res.dsinks = torch.tensor([float(x) for x in dsinks], **f64)
    return res
