"""Float64 reference attention: forward, LSE, Delta and backward, in query-row chunks.

The reference mirrors the kernel API name for name (``forward``, ``backward``) and computes
everything in float64 from the exact (already low-precision) inputs, up-cast without rounding.
:func:`attention` returns a :class:`Reference` that holds only results of size ``O((Nq + Nk) D)``
per head (out, LSE, row max, Delta, the gradients and the float64 inputs); the score-level matrices
(scores, ``P``, ``dP``, ``dS``, the visible mask) are recomputed on demand, a chunk of query rows at a
time (:meth:`Reference.chunks`), so no ``Nq x Nk`` matrix of the whole problem is ever held.

Conventions (DESIGN.md): layout ``[B, H, N, D]``; grouped-query attention maps query head ``h`` to
key/value head ``h // (Hq // Hkv)``; which keys a query sees is the answer of the
:class:`~references.spec.AttentionSpec` (causal masks bottom-right aligned, key ``j`` visible to query
``i`` iff ``j <= i + Nk - Nq``, unless the spec's ``alignment`` is ``"top_left"``, ``j <= i``), and
the scores are the spec's modified ones (softcap, ALiBi: :meth:`AttentionSpec.modify`); a row
with no visible key has ``P = 0``, ``out = 0`` and ``lse = -inf``; the LSE is the natural-log
logsumexp of the (modified) scaled scores over the visible keys. With the spec's ``sinks`` each row's
LSE also holds its head's sink logit ``t_h`` (``lse = log(exp(t_h) + sum_j exp(s_j))``), so the keys' ``P``
sum to ``1 - P_sink`` with ``P_sink = exp(t_h - lse)``, a row that sees no key has ``lse = t_h``, and the
sink's gradient is ``dt_h = -sum_{b, i} P_sink Delta`` (its ``dS``: the sink's value is 0). The visible
keys of every row are one range of the keys (:meth:`AttentionSpec.key_range`), so per-row and per-key counts
(:meth:`AttentionSpec.counts`) replace the mask wherever a whole-problem answer is needed.

Memory model
------------
Everything row-wise (scores, softmax, ``out``, ``dQ``, the bounds' per-pair terms) is exact under
row chunking; ``dK`` and ``dV`` are sums over rows and are accumulated chunk by chunk (only their
float64 summation order changes). The suite's work on one example (this reference, the eager
baseline, the rounding bounds and the criteria's magnitudes) peaks at about::

    peak bytes ~ 8 * B * Hq * (SCORE_MATRICES * rows * Nk + VECTOR_ROWS * Nq * D + VECTOR_KEYS * Nk * D)
                 + 24 * (centred slice)

with ``rows = rows_per_chunk(Nk, D, B * Hq)`` query rows per chunk: the largest number whose
``SCORE_MATRICES`` float64 ``[B, Hq, rows, Nk]`` matrices fit ``DEFAULT_BUDGET_BYTES`` (at least one
row, at most ``Nq``), so the first term is at most ``max(budget, 8 B Hq (SCORE_MATRICES Nk + D))``.
The last term is the exact centred term of ``references.bounds``: three float64 ``[B, Hq, r, Nk, D]``
slices for ``r`` rows of the chunk, at most ``max(CENTRED_CHUNK_ELEMENTS, B Hq Nk D)`` elements (2^22,
32 MiB, for most problems).
:func:`peak_bytes` evaluates this as an upper bound that never decreases when a size grows; the
constants are measured (tests/test_chunking.py checks the estimate against the measured peak). With
the default budget of 256 MiB, a problem whose score matrices fit it runs as one chunk, exactly as an
unchunked computation (the Reference then keeps that one chunk, four ``[B, Hq, Nq, Nk]`` matrices, so
that the bounds and criteria need not recompute it). Not included: the case's input tensors and the
kernel's own memory. The estimate is per Reference: a property that holds two at once
(``gqa_gradients_sum_over_group``: the grouped case and its repeated-heads twin) needs up to twice it.

The budget is read at each call: a worker with more (or less) device memory sets
``references.attention.DEFAULT_BUDGET_BYTES`` (fewer, larger chunks cost less Python and kernel-launch
overhead). The chunk size can be forced (tests, memory experiments): :func:`forced_chunk_rows` as a
context manager, or the environment variable ``FLASHVERIFY_CHUNK_ROWS`` for a whole run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator

import torch

from references.spec import AttentionSpec, require_spec

F64 = torch.float64

# Score-level work per chunk (bytes): the float64 [B, Hq, rows, Nk] matrices of the heaviest step
# (the backward rounding bound) fit in it.
DEFAULT_BUDGET_BYTES = 256 * 2 ** 20
# Float64 [B, Hq, rows, Nk] matrices alive at once in the heaviest step (the backward bounds, two
# models), and [B, Hq, N, D] tensors held for the whole example (inputs, results, accumulators):
# measured upper bounds, see tests/test_chunking.py::test_peak_bytes_bounds_measured_peak.
SCORE_MATRICES = 32
VECTOR_ROWS = 16
VECTOR_KEYS = 40
# The bounds' centred term (references.bounds, term (A)) is computed exactly, in slices of at most
# CENTRED_CHUNK_ELEMENTS of a [B, Hq, rows, Nk, D] tensor, when B * Hq * Nq * Nk * D is at most
# EXACT_CENTRED_LIMIT; above it, a matmul bound centred at a column mean of V (never smaller) is used.
EXACT_CENTRED_LIMIT = 2 ** 25
CENTRED_CHUNK_ELEMENTS = 2 ** 22
CHUNK_ROWS_ENV = "FLASHVERIFY_CHUNK_ROWS"
_forced_rows: int | None = None


def rows_per_chunk(len_k: int, head_dim: int, heads: int, *, budget: int | None = None) -> int:
    """Query rows per chunk so that ``SCORE_MATRICES`` float64 ``[heads, rows, Nk]`` matrices (and a
    ``[heads, rows, D]`` slice per row) fit ``budget`` bytes (default ``DEFAULT_BUDGET_BYTES``); at
    least 1. ``heads`` is ``B * Hq``. A forced size (:func:`forced_chunk_rows`, ``FLASHVERIFY_CHUNK_ROWS``)
    wins."""
    forced = _forced()
    if forced is not None:
        return forced
    for name, value in (("len_k", len_k), ("head_dim", head_dim), ("heads", heads)):
        if value < 0:
            raise ValueError(f"{name}={value}, but should be >= 0")
    budget = DEFAULT_BUDGET_BYTES if budget is None else budget
    if budget <= 0:
        raise ValueError(f"budget={budget}, but should be a positive number of bytes")
    per_row = 8 * max(1, heads) * (SCORE_MATRICES * max(1, len_k) + max(1, head_dim))
    return max(1, budget // per_row)


def _forced() -> int | None:
    if _forced_rows is not None:
        return _forced_rows
    env = os.environ.get(CHUNK_ROWS_ENV)
    if not env:
        return None
    try:
        rows = int(env)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"{CHUNK_ROWS_ENV}={env!r}, but should be a positive number of query rows")
    return rows


@contextlib.contextmanager
def forced_chunk_rows(rows: int | None):
    """Within the block every chunked computation uses ``rows`` query rows per chunk (``None``: the
    budget decides)."""
    global _forced_rows
    if rows is not None and (not isinstance(rows, int) or rows < 1):
        raise ValueError(f"rows={rows!r}, but should be a positive int or None")
    previous, _forced_rows = _forced_rows, rows
    try:
        yield
    finally:
        _forced_rows = previous


def row_chunks(len_q: int, len_k: int, head_dim: int, heads: int) -> list[tuple[int, int]]:
    """``[(r0, r1), ...]`` covering ``range(len_q)`` in chunks of :func:`rows_per_chunk` rows."""
    step = rows_per_chunk(len_k, head_dim, heads)
    return [(r0, min(len_q, r0 + step)) for r0 in range(0, len_q, step)]


def peak_bytes(batch: int, heads_q: int, heads_kv: int, len_q: int, len_k: int, head_dim: int, *,
               budget: int | None = None) -> int:
    """An upper estimate of the peak bytes of the suite's own work on one example of this shape (the
    float64 reference with its backward, the eager baseline, the rounding bounds of both backward
    models and the criteria's magnitudes), following the module docstring's memory model, for the
    chunk size that ``budget`` (default ``DEFAULT_BUDGET_BYTES``) gives. It never decreases when a
    size grows. Not included: the case's input tensors and the kernel's own memory."""
    for name, value in (("batch", batch), ("heads_q", heads_q), ("heads_kv", heads_kv), ("len_q", len_q),
                        ("len_k", len_k), ("head_dim", head_dim)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r}, but should be an int >= 0")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} should be a positive multiple of heads_kv={heads_kv}")

    heads = batch * heads_q
    budget = DEFAULT_BUDGET_BYTES if budget is None else budget
    forced = _forced()
    per_row = heads * (SCORE_MATRICES * len_k + head_dim)  # float64 elements per query row of a chunk
    # rows * per_row <= max(budget, per_row) (at least one row); a forced size gives exactly its rows.
    chunk = (min(len_q, forced) * per_row if forced is not None else
             min(len_q * per_row, max(budget // 8, per_row)))
    vectors = heads * (VECTOR_ROWS * len_q * head_dim + VECTOR_KEYS * len_k * head_dim)
    # references.bounds' exact centred term: [B, Hq, step, Nk, D] slices, three alive at once (an upper
    # bound that also covers the problems large enough for the cheaper path, so it never decreases).
    # A chunk of rows holds at most chunk * Nk * D / (SCORE_MATRICES * Nk + D) elements of [rows, Nk, D].
    slice_max = chunk * len_k * head_dim // max(1, SCORE_MATRICES * len_k + head_dim)
    key_row = heads * len_k * head_dim
    centred = 3 * min(slice_max, max(CENTRED_CHUNK_ELEMENTS, min(key_row, EXACT_CENTRED_LIMIT)))
    return 8 * (chunk + vectors + centred)


def expand_kv(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """``[B, Hkv, N, D] -> [B, Hq, N, D]``: query head h reads key/value head h // (Hq // Hkv)."""
    heads_kv = t.shape[1]
    if heads_q % heads_kv:
        raise ValueError(f"q has {heads_q} heads, k/v have {heads_kv}: Hq should be a multiple of Hkv")
    return t.repeat_interleave(heads_q // heads_kv, dim=1)


def reduce_group(grad: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``[B, Hq, N, D] -> [B, Hkv, N, D]``: sum a gradient over the query heads of each group."""
    b, hq, n, d = grad.shape
    return grad.reshape(b, heads_kv, hq // heads_kv, n, d).sum(dim=2)


@dataclasses.dataclass
class Chunk:
    """Score-level quantities of query rows ``r0 .. r1 - 1`` (``[B, Hq, r1 - r0, Nk]`` float64)."""

    r0: int
    r1: int
    visible: torch.Tensor  # bool [r1 - r0, Nk]
    scores: torch.Tensor  # s = scale * q k^T, -inf where not visible
    p: torch.Tensor  # softmax probabilities, 0 where not visible
    dp: torch.Tensor | None = None  # dO V^T (keys no row of the chunk sees: 0)
    ds: torch.Tensor | None = None  # P * (dP - Delta): the gradient of the (modified) scores s


@dataclasses.dataclass
class Reference:
    """Float64 attention (query-head layout ``[B, Hq, ...]`` unless noted): only ``O((Nq + Nk) D)``
    results; score-level quantities come from :meth:`chunks`."""

    scale: float
    spec: AttentionSpec
    row_max: torch.Tensor  # max_j s_ij (-inf for rows with no visible key) [B, Hq, Nq]
    out: torch.Tensor  # [B, Hq, Nq, Dv] (Dv: v's head dim, D unless v has one of its own)
    lse: torch.Tensor  # [B, Hq, Nq]
    # The float64 inputs, K and V expanded to the query heads.
    q64: torch.Tensor
    k_expanded: torch.Tensor  # [B, Hq, Nk, D]
    v_expanded: torch.Tensor
    # With sinks: each query head's sink logit [Hq] and each row's sink probability exp(t_h - lse) [B, Hq, Nq].
    sink: torch.Tensor | None = None
    p_sink: torch.Tensor | None = None
    # Backward (present when dout was given); dk and dv are in key/value-head layout [B, Hkv, Nk, D].
    dout: torch.Tensor | None = None
    delta: torch.Tensor | None = None  # rowsum(dO * O)           [B, Hq, Nq]
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    dsinks: torch.Tensor | None = None  # [Hq], with sinks
    # The largest |dS| the contract's backward casts to the input dtype (dS of the raw scores with a softcap).
    ds_max: float | None = None
    _single: Chunk | None = dataclasses.field(default=None, repr=False)  # the only chunk, when it is one

    @property
    def len_q(self) -> int:
        return self.q64.shape[2]

    @property
    def len_k(self) -> int:
        return self.k_expanded.shape[2]

    @property
    def n_visible(self) -> torch.Tensor:
        """Int64 ``[Nq]``: visible keys per row."""
        return self.spec.counts(self.len_q, self.len_k, device=self.q64.device)[0]

    @property
    def rows_with_keys(self) -> torch.Tensor:
        """Bool ``[Nq]``: rows that see at least one key."""
        return self.n_visible > 0

    @property
    def keys_seen(self) -> torch.Tensor:
        """Bool ``[Nk]``: keys that at least one row sees."""
        return self.spec.counts(self.len_q, self.len_k, device=self.q64.device)[1] > 0

    def row_chunks(self) -> list[tuple[int, int]]:
        b, h, len_q, d = self.q64.shape
        return row_chunks(len_q, self.len_k, d, b * h)

    def chunk(self, r0: int, r1: int) -> Chunk:
        """Scores, ``P`` (and ``dP``, ``dS`` with a backward) of rows ``r0 .. r1 - 1``, recomputed."""
        if self._single is not None and (r0, r1) == (self._single.r0, self._single.r1):
            return self._single
        return _chunk(self, r0, r1)

    def chunks(self) -> Iterator[Chunk]:
        """The score-level quantities, one row chunk at a time (chunk size: :func:`rows_per_chunk`)."""
        for r0, r1 in self.row_chunks():
            yield self.chunk(r0, r1)

    def rowwise(self, fn: Callable[[Chunk], torch.Tensor]) -> torch.Tensor:
        """``fn`` of every chunk (a ``[B, Hq, r1 - r0, ...]`` tensor) concatenated over the rows."""
        parts = [fn(c) for c in self.chunks()]
        if not parts:
            return fn(self.chunk(0, 0))
        return torch.cat(parts, dim=2)

    def dense(self) -> Chunk:
        """Every row as one chunk: ``Nq x Nk`` matrices, for tests on small cases only."""
        return _chunk(self, 0, self.len_q)


def _chunk(ref: Reference, r0: int, r1: int) -> Chunk:
    visible = ref.spec.rows(ref.len_q, ref.len_k, device=ref.q64.device, rows=(r0, r1))
    raw = _raw_scores(ref.q64[:, :, r0:r1], ref.k_expanded, ref.scale)
    scores, p = _scores_and_p(ref.spec.modify(raw, ref.len_q, ref.len_k, rows=(r0, r1)), visible,
                              ref.lse[:, :, r0:r1])
    c = Chunk(r0=r0, r1=r1, visible=visible, scores=scores, p=p)
    if ref.dout is not None:
        c.dp, c.ds = _dp_and_ds(ref.dout[:, :, r0:r1], ref.v_expanded, ref.keys_seen, p, ref.delta[:, :, r0:r1])
    return c


def _raw_scores(q64, ke, scale):
    """The scaled scores ``scale * q k^T``, before the spec's modifications."""
    return (q64 @ ke.transpose(-1, -2)) * scale


def _scores_and_p(modified, visible, lse):
    # Mask with where(), never multiplication: values at hidden positions (even inf/NaN) stay out.
    scores = torch.where(visible, modified, -math.inf)
    p = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return scores, torch.where(visible, p, 0.0)


def _dp_and_ds(do, ve, keys_seen, p, delta):
    seen = keys_seen[:, None]  # keys some row sees; the others never enter a product
    dp = do @ torch.where(seen, ve, 0.0).transpose(-1, -2)
    return dp, p * (dp - delta[..., None])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, spec: AttentionSpec = AttentionSpec(),
              scale: float | None = None, dout: torch.Tensor | None = None) -> Reference:
    """Compute the float64 reference for one call (and its backward if ``dout`` is given), in row
    chunks (module docstring)."""
    require_spec(spec)
    q64, k64, v64 = q.to(F64), k.to(F64), v.to(F64)
    b, hq, len_q, d = q.shape
    hkv, len_k = k.shape[1], k.shape[2]
    if v.shape[:3] != k.shape[:3] or k.shape[-1] != d or (dout is not None and dout.shape[:3] != q.shape[:3]):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
                         f"{'' if dout is None else f', dout {tuple(dout.shape)}'} do not agree: q [B, Hq, Nq, D], "
                         "k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv], dout [B, Hq, Nq, Dv]")
    spec.check_lengths(len_q, len_k)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    sink = spec.sink_logits(hq, device=q.device)
    ke, ve = expand_kv(k64, hq), expand_kv(v64, hq)
    lse = torch.full(q.shape[:3], -math.inf, dtype=F64, device=q.device)
    row_max, out = lse.clone(), torch.zeros((*q.shape[:3], v.shape[-1]), dtype=F64, device=q.device)
    ref = Reference(scale=scale, spec=spec, row_max=row_max, out=out, lse=lse,
                    q64=q64, k_expanded=ke, v_expanded=ve, sink=sink)
    seen = spec.counts(len_q, len_k, device=q.device)[1][:, None] > 0
    if dout is not None:
        ref.dout = dout.to(F64)
        ref.delta = torch.zeros(q.shape[:3], dtype=F64, device=q.device)
        ref.dq = torch.zeros(q.shape, dtype=F64, device=q.device)
        # replaced by the first chunk
        dk_heads, dv_heads = torch.zeros(ke.shape, dtype=F64, device=q.device), torch.zeros(ve.shape, dtype=F64,
                                                                                            device=q.device)
        ds_max = torch.zeros((), dtype=F64, device=q.device)
    spans = ref.row_chunks()
    for n, (r0, r1) in enumerate(spans):
        rows = slice(r0, r1)
        visible = spec.rows(len_q, len_k, device=q.device, rows=(r0, r1))
        raw = _raw_scores(q64[:, :, rows], ke, scale)
        modified = spec.modify(raw, len_q, len_k, rows=(r0, r1))
        s = torch.where(visible, modified, -math.inf)
        if len_k:
            lse[:, :, rows] = torch.logsumexp(s, dim=-1)
            row_max[:, :, rows] = s.amax(dim=-1)
        if sink is not None:  # the sink joins every row's denominator
            lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], sink[:, None].expand_as(lse[:, :, rows]))
        scores, p = _scores_and_p(modified, visible, lse[:, :, rows])
        out[:, :, rows] = p @ torch.where(seen, ve, 0.0)
        c = Chunk(r0=r0, r1=r1, visible=visible, scores=scores, p=p)
        if dout is not None:
            ref.delta[:, :, rows] = (ref.dout[:, :, rows] * out[:, :, rows]).sum(dim=-1)
            c.dp, c.ds = _dp_and_ds(ref.dout[:, :, rows], ve, seen[:, 0], p, ref.delta[:, :, rows])
            chain = spec.modify_grad(raw)  # dS is the gradient of the modified scores; dQ, dK need the raw ones
            ds_raw = c.ds if chain is None else torch.where(visible, c.ds * chain, 0.0)
            if ds_raw.numel():
                ds_max = torch.maximum(ds_max, ds_raw.abs().amax())
            ref.dq[:, :, rows] = scale * (ds_raw @ torch.where(seen, ke, 0.0))
            if n == 0:
                dk_heads = scale * (ds_raw.transpose(-1, -2) @ q64[:, :, rows])
                dv_heads = p.transpose(-1, -2) @ ref.dout[:, :, rows]
            else:
                dk_heads += scale * (ds_raw.transpose(-1, -2) @ q64[:, :, rows])
                dv_heads += p.transpose(-1, -2) @ ref.dout[:, :, rows]
        if len(spans) == 1:
            ref._single = c  # it fits the budget: keep it for the bounds and criteria
    if sink is not None:
        ref.p_sink = torch.exp(sink[:, None] - lse)
    if dout is not None:
        ref.dk, ref.dv = reduce_group(dk_heads, hkv), reduce_group(dv_heads, hkv)
        ref.ds_max = float(ds_max)
        if sink is not None:  # dS of the sink: P_sink (dP_sink - Delta), and its value is 0
            ref.dsinks = -(ref.p_sink * ref.delta).sum(dim=(0, 2))
    return ref


def forward(q, k, v, *, spec: AttentionSpec = AttentionSpec(), scale: float | None = None):
    """Float64 ``(out, lse)``."""
    ref = attention(q, k, v, spec=spec, scale=scale)
    return ref.out, ref.lse


def backward(q, k, v, dout, *, spec: AttentionSpec = AttentionSpec(), scale: float | None = None):
    """Float64 ``(dq, dk, dv, delta)`` of ``out`` against the upstream gradient ``dout`` (the sinks'
    gradient, with sinks: :attr:`Reference.dsinks` of :func:`attention`)."""
    ref = attention(q, k, v, spec=spec, scale=scale, dout=dout)
    return ref.dq, ref.dk, ref.dv, ref.delta


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Float64 softmax; an all ``-inf`` row gives zeros (never NaN)."""
    x64 = x.to(F64)
    lse = torch.logsumexp(x64, dim=dim, keepdim=True)
    return torch.where(torch.isneginf(lse), 0.0, torch.exp(x64 - torch.where(torch.isneginf(lse), 0.0, lse)))


def logsumexp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Float64 natural-log logsumexp; ``-inf`` for an all ``-inf`` row."""
    return torch.logsumexp(x.to(F64), dim=dim)
