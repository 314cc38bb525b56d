"""Float64 reference attention: forward, LSE, P, Delta and backward.

The reference mirrors the kernel API name for name (``forward``, ``backward``) and computes
everything in float64 from the exact (already low-precision) inputs, up-cast without rounding.
:func:`attention` returns every intermediate the properties and the error bounds need, so one
example computes the reference once.

Conventions (DESIGN.md): layout ``[B, H, N, D]``; grouped-query attention maps query head ``h`` to
key/value head ``h // (Hq // Hkv)``; causal masking is bottom-right aligned (key ``j`` visible to query
``i`` iff ``j <= i + Nk - Nq``) unless ``alignment="top_left"`` (``j <= i``); a row with no visible key
has ``P = 0``, ``out = 0`` and ``lse = -inf``; the LSE is the natural-log logsumexp of the scaled scores
over the visible keys.
"""

from __future__ import annotations

import dataclasses
import math

import torch

F64 = torch.float64
ALIGNMENTS = ("bottom_right", "top_left")


def visible_mask(len_q: int, len_k: int, *, causal: bool, alignment: str = "bottom_right",
                 device=None) -> torch.Tensor:
    """Bool ``[Nq, Nk]``: True where query ``i`` may attend to key ``j``."""
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment={alignment!r}, but should be one of {ALIGNMENTS}")
    if not causal:
        return torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    offset = len_k - len_q if alignment == "bottom_right" else 0
    rows = torch.arange(len_q, device=device)[:, None]
    cols = torch.arange(len_k, device=device)[None, :]
    return cols <= rows + offset


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
class Reference:
    """Float64 attention and its intermediates (query-head layout ``[B, Hq, ...]`` unless noted)."""

    scale: float
    visible: torch.Tensor  # bool [Nq, Nk]
    scores: torch.Tensor  # s = scale * q k^T, -inf where not visible   [B, Hq, Nq, Nk]
    row_max: torch.Tensor  # max_j s_ij (-inf for rows with no visible key) [B, Hq, Nq]
    p: torch.Tensor  # softmax probabilities, 0 where not visible       [B, Hq, Nq, Nk]
    out: torch.Tensor  # [B, Hq, Nq, D]
    lse: torch.Tensor  # [B, Hq, Nq]
    # Backward (present when dout was given); dk and dv are in key/value-head layout [B, Hkv, Nk, D].
    dout: torch.Tensor | None = None
    dp: torch.Tensor | None = None  # dO V^T                   [B, Hq, Nq, Nk]
    delta: torch.Tensor | None = None  # rowsum(dO * O)           [B, Hq, Nq]
    ds: torch.Tensor | None = None  # P * (dP - Delta)          [B, Hq, Nq, Nk]
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    # The float64 inputs, K and V expanded to the query heads.
    q64: torch.Tensor | None = None
    k_expanded: torch.Tensor | None = None
    v_expanded: torch.Tensor | None = None

    @property
    def rows_with_keys(self) -> torch.Tensor:
        """Bool ``[Nq]``: rows that see at least one key."""
        return self.visible.any(dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, alignment: str = "bottom_right",
              dout: torch.Tensor | None = None) -> Reference:
    """Compute the float64 reference for one call (and its backward if ``dout`` is given)."""
    q64, k64, v64 = q.to(F64), k.to(F64), v.to(F64)
    hq, hkv = q.shape[1], k.shape[1]
    len_q, len_k, d = q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    ke, ve = expand_kv(k64, hq), expand_kv(v64, hq)
    visible = visible_mask(len_q, len_k, causal=causal, alignment=alignment, device=q.device)
    # Mask with where(), never multiplication: values at hidden positions (even inf/NaN) stay out.
    scores = torch.where(visible, (q64 @ ke.transpose(-1, -2)) * scale, -math.inf)
    lse = torch.logsumexp(scores, dim=-1) if len_k else torch.full(q.shape[:3], -math.inf, dtype=F64,
                                                                   device=q.device)
    row_max = scores.amax(dim=-1) if len_k else lse.clone()
    empty = torch.isneginf(lse)
    p = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
    p = torch.where(visible, p, 0.0)
    out = p @ torch.where(visible.any(dim=0)[:, None], ve, 0.0)
    ref = Reference(scale=scale, visible=visible, scores=scores, row_max=row_max, p=p, out=out, lse=lse,
                    q64=q64, k_expanded=ke, v_expanded=ve)
    if dout is None:
        return ref
    do = dout.to(F64)
    seen = visible.any(dim=0)[:, None]  # keys some row sees; the others never enter a product
    vt = torch.where(seen, ve, 0.0).transpose(-1, -2)
    dp = do @ vt
    delta = (do * out).sum(dim=-1)
    ds = p * (dp - delta[..., None])
    ref.dout, ref.dp, ref.delta, ref.ds = do, dp, delta, ds
    ref.dq = scale * (ds @ torch.where(seen, ke, 0.0))
    ref.dk = reduce_group(scale * (ds.transpose(-1, -2) @ q64), hkv)
    ref.dv = reduce_group(p.transpose(-1, -2) @ do, hkv)
    return ref


def forward(q, k, v, *, causal: bool = False, scale: float | None = None,
            alignment: str = "bottom_right"):
    """Float64 ``(out, lse)``."""
    ref = attention(q, k, v, causal=causal, scale=scale, alignment=alignment)
    return ref.out, ref.lse


def backward(q, k, v, dout, *, causal: bool = False, scale: float | None = None,
             alignment: str = "bottom_right"):
    """Float64 ``(dq, dk, dv, delta)`` of ``out`` against the upstream gradient ``dout``."""
    ref = attention(q, k, v, causal=causal, scale=scale, alignment=alignment, dout=dout)
    return ref.dq, ref.dk, ref.dv, ref.delta


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Float64 softmax; an all ``-inf`` row gives zeros (never NaN)."""
    x64 = x.to(F64)
    lse = torch.logsumexp(x64, dim=dim, keepdim=True)
    return torch.where(torch.isneginf(lse), 0.0, torch.exp(x64 - torch.where(torch.isneginf(lse), 0.0, lse)))


def logsumexp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Float64 natural-log logsumexp; ``-inf`` for an all ``-inf`` row."""
    return torch.logsumexp(x.to(F64), dim=dim)
