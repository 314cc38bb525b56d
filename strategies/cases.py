"""Attention cases: plain data that describe one input, and the tensors they build.

A case holds shapes, dtype, the attention spec (:class:`references.spec.AttentionSpec`: the mask, score
modifications, sinks, sequences, splits), block sizes, a magnitude class, a memory layout and a seed,
nothing else. A case of variable-length sequences is the references' packed problem: ``batch = 1``,
``len_q`` and ``len_k`` the sums of the spec's ``seqlens_q`` and ``seqlens_k``; its tensors are built as
one ``[1, H, N, D]`` batch, and :mod:`flashverify_kernels.conventions` lays them out as the kernel takes them. Tensors are generated from the seed by :meth:`AttentionCase.build`, so a case is small,
JSON-serialisable, replayable with one command, and shrinks the way Hypothesis shrinks its parts:
to small shapes, seed 0, the ``normal`` magnitude class and the contiguous layout.

Magnitude classes (DESIGN.md, "Adversarial inputs"), applied to float64 draws before rounding:

``normal``         q, k, v ~ N(0, 1)
``large_logits``   q, k x 100: |scale q.k| ~ 1e4 (q.k itself beyond float16's range)
``sparse_outliers`` exactly 0.1% of the entries of q, k, v (at least one per tensor) get an extra N(0, 30^2)
``fa3_outliers``   the FlashAttention-3 paper's accuracy protocol: every entry of q, k, v is
                   N(0, 1) + N(0, 100) x Bernoulli(0.001) (an extra std-10 term with probability 0.001)
``all_negative``   q >= 0, k <= -1 element-wise, x8: every score is large and negative (exp underflows)
``ties``           keys drawn from two distinct rows: exact ties within each query row
``dominant_key``   q >= 0 and one key is 8 in every coordinate: it takes almost all the weight
``row_shift``      k + w with one large common w (|w_d| ~ 50): each row's scores shift by q_i.w
``v_offset``       v = 1000 + N(0, 1): a large common offset (cancellation in the output)
``v_wide_range``   each key's v row scaled by 10^U(-4, 4)
``near_subnormal`` v and dout scaled to 8x the smallest normal of the dtype

Layouts: ``contiguous``; ``bnhd`` (stored as [B, N, H, D], passed as a transposed view); ``padded``
(a view into a buffer with extra rows and head-dim columns, the padding filled with NaN, so a kernel
that reads past a tensor's end produces NaN); ``packed`` (q, k, v and dout are [B, N, H, D]-ordered views
at non-zero storage offsets into one shared buffer, NaN between and around them, as ``qkv.unbind`` of a
packed projection gives: a kernel that ignores ``storage_offset()`` reads the wrong tensor or NaN).

Scales (the contract's ``scale`` takes any finite float; None means ``1/sqrt(D)``): :data:`SCALES` holds
0 (uniform weights over the visible keys), negative scales, scales above 1, a tiny one (below float16's
smallest subnormal) and ones float16 cannot represent (0.1, 1/3).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import torch

from references.fp8 import FP8_DTYPES, out_dtype, quantise
from references.spec import AttentionSpec

MAGNITUDES = ("normal", "large_logits", "sparse_outliers", "all_negative", "ties", "dominant_key",
              "row_shift", "v_offset", "v_wide_range", "near_subnormal", "fa3_outliers")
# Names a case file written before may hold, and what they are called now.
RENAMED_MAGNITUDES = {"outliers": "sparse_outliers"}
LAYOUTS = ("contiguous", "bnhd", "padded", "packed")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
FP8_NAMES = tuple(name for name, dtype in DTYPES.items() if dtype in FP8_DTYPES)
SCALES = (0.5, 0.125, 0.0, -0.5, 1.0, 2.5, 1e-8, 0.1, 1 / 3, -1 / 3)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CaseError(ValueError):
    """A case description is not valid (bad field, inconsistent shapes, unknown class)."""


def case_from_dict(cls, data: Any, *, what: str = "case"):
    """Build a case dataclass (or a part of one, ``what``) from parsed JSON: an object with the known
    fields only, validated by the class."""
    if not isinstance(data, dict):
        article = "an" if what[0] in "aeiou" else "a"
        raise CaseError(f"{article} {what} should be a JSON object, got {type(data).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise CaseError(f"unknown {what} fields {unknown}; known: {sorted(fields)}")
    try:
        return cls(**data)
    except CaseError:
        raise
    except (TypeError, ValueError) as exc:
        raise CaseError(f"{'incomplete' if isinstance(exc, TypeError) else 'invalid'} {what}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Tensors:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    # float8 cases with descales: (q_descale, k_descale, v_descale), each float32 [B, Hkv] (references/fp8.py).
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    head_dim: int
    dtype: str
    spec: AttentionSpec = AttentionSpec()
    magnitude: str = "normal"
    seed: int = 0
    layout: str = "contiguous"
    scale: float | None = None
    block_m: int | None = None
    block_n: int | None = None
    # The value head dim when it is not head_dim (v, out and dout are [..., head_dim_v]: multi-head latent
    # attention's 192/128); None when v shares q's and k's head dim (it is stored so: equal means None).
    head_dim_v: int | None = None
    # float8 inputs with descales (references/fp8.py): q, k and v each quantised with one factor per batch
    # entry and key/value head, handed to the kernel as q_descale, k_descale, v_descale. False: no descales
    # (always, for the other dtypes).
    descale: bool = False

    def __post_init__(self) -> None:
        if self.head_dim_v is not None and self.head_dim_v == self.head_dim:
            object.__setattr__(self, "head_dim_v", None)
        if self.head_dim_v is not None and (isinstance(self.head_dim_v, bool) or not isinstance(self.head_dim_v, int)
                                            or self.head_dim_v < 1):
            raise CaseError(f"head_dim_v={self.head_dim_v!r}, but should be a positive int or null (v shares the "
                            "head dim of q and k)")
        for name in ("batch", "heads_q", "heads_kv", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CaseError(f"{name}={value!r}, but should be a positive int")
        for name in ("len_q", "len_k", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CaseError(f"{name}={value!r}, but should be a non-negative int")
        if self.heads_q % self.heads_kv:
            raise CaseError(f"heads_q={self.heads_q} is not a multiple of heads_kv={self.heads_kv}")
        if self.dtype not in DTYPES:
            raise CaseError(f"dtype={self.dtype!r}, but should be one of {tuple(DTYPES)}")
        if not isinstance(self.descale, bool):
            raise CaseError(f"descale={self.descale!r}, but should be true or false")
        if self.descale and self.dtype not in FP8_NAMES:
            raise CaseError(f"descale=true with dtype={self.dtype!r}: descales come with float8 inputs only "
                            f"({', '.join(FP8_NAMES)})")
        if not isinstance(self.spec, AttentionSpec):
            raise CaseError(f"spec={self.spec!r}, but should be a references.spec.AttentionSpec")
        if self.spec.varlen:  # the references' frame: the sequences packed one after another in one batch
            if self.batch != 1:
                raise CaseError(f"batch={self.batch}, but a case of {self.spec.sequences} sequences is one packed "
                                "batch (batch=1; the sequences are the spec's seqlens_q and seqlens_k)")
            try:
                self.spec.check_lengths(self.len_q, self.len_k)
            except ValueError as exc:
                raise CaseError(str(exc)) from None
        if self.magnitude not in MAGNITUDES:
            raise CaseError(f"magnitude={self.magnitude!r}, but should be one of {MAGNITUDES}")
        if self.layout not in LAYOUTS:
            raise CaseError(f"layout={self.layout!r}, but should be one of {LAYOUTS}")
        if self.scale is not None and (isinstance(self.scale, bool) or not isinstance(self.scale, (int, float))
                                       or not math.isfinite(self.scale)):
            raise CaseError(f"scale={self.scale!r}, but should be a finite float or null")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CaseError(f"{name}={value!r}, but should be a positive int or null")

    # ----------------------------------------------------------------------------- description
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype of ``out``: the inputs' own, bfloat16 for float8 inputs."""
        return out_dtype(self.torch_dtype)

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8_NAMES

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def causal(self) -> bool:
        return self.spec.causal

    @property
    def value_dim(self) -> int:
        """The head dim of v, out and dout: ``head_dim_v``, else ``head_dim``."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def describe(self) -> str:
        blocks = f" blocks={self.block_m}x{self.block_n}" if self.block_m is not None else ""
        scale = "" if self.scale is None else f" scale={self.scale}"
        n = self.spec.num_sequences
        batch = f"{n} sequence{'s' * (n != 1)}" if self.spec.varlen else f"B={self.batch}"
        return (f"{batch} Hq={self.heads_q} Hkv={self.heads_kv} Nq={self.len_q} Nk={self.len_k} "
                f"D={self.head_dim}{'' if self.head_dim_v is None else f' Dv={self.head_dim_v}'} {self.dtype}"
                f"{' descaled' if self.descale else ''} {self.spec.describe()}{blocks}{scale} "
                f"magnitude={self.magnitude} layout={self.layout} seed={self.seed}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON; the spec holds only its fields that differ from their defaults (and causal, alignment);
        ``head_dim_v`` only when v has a head dim of its own, ``descale`` only when true."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.head_dim_v is None:
            del fields["head_dim_v"]
        if not self.descale:
            del fields["descale"]
        return {**fields, "spec": self.spec.to_dict()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AttentionCase":
        """From parsed JSON; ``spec`` is an object (a case written before the spec existed has a bare
        ``causal`` flag instead: bottom-right, as then); a magnitude class renamed since
        (:data:`RENAMED_MAGNITUDES`) reads under its new name."""
        if isinstance(data, dict) and "causal" in data and "spec" not in data:
            data = {**{k: v for k, v in data.items() if k != "causal"}, "spec": {"causal": data["causal"]}}
        if isinstance(data, dict) and data.get("magnitude") in RENAMED_MAGNITUDES:
            data = {**data, "magnitude": RENAMED_MAGNITUDES[data["magnitude"]]}
        if isinstance(data, dict) and "spec" in data:
            data = {**data, "spec": case_from_dict(AttentionSpec, data["spec"], what="attention spec")}
        return case_from_dict(cls, data)

    @classmethod
    def from_json(cls, text: str) -> "AttentionCase":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CaseError(f"case is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def replace(self, **changes) -> "AttentionCase":
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------- tensors
    def rounded(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A float64 draw ``x`` ``[B, H, N, D]`` as the case's inputs hold it, and its descale (None without):
        cast to the dtype, or quantised to float8 (:func:`references.fp8.quantise`, with descales when the case
        has them)."""
        if not self.fp8:
            return x.to(self.torch_dtype), None
        return quantise(x, self.torch_dtype, heads_kv=self.heads_kv, descaled=self.descale)

    def build(self, device: str | torch.device = "cpu") -> Tensors:
        """Generate q, k, v, dout (deterministic in the case), cast to the dtype and laid out. Float8 inputs
        are quantised (:func:`references.fp8.quantise`: with descales when the case has them) and dout, which
        a float8 forward has no use for, is drawn in the output's dtype (bfloat16)."""
        gen = torch.Generator().manual_seed(self.seed)
        b, hq, hkv, nq, nk, d = self.batch, self.heads_q, self.heads_kv, self.len_q, self.len_k, self.head_dim
        dv = self.value_dim

        def normal(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64)

        q, k, v, do = normal(b, hq, nq, d), normal(b, hkv, nk, d), normal(b, hkv, nk, dv), normal(b, hq, nq, dv)
        q, k, v, do = _MAGNITUDE_BUILDERS[self.magnitude](q, k, v, do, gen, self.torch_dtype)
        dtype = self.torch_dtype
        if not self.fp8:
            if self.layout == "packed":
                return Tensors(*_pack([t.to(dtype) for t in (q, k, v, do)], device))
            return Tensors(*(_lay_out(t.to(dtype), self.layout, device) for t in (q, k, v, do)))
        (q, qd), (k, kd), (v, vd) = (self.rounded(t) for t in (q, k, v))
        descales = tuple(d.to(device) for d in (qd, kd, vd)) if self.descale else None
        do = _lay_out(do.to(self.out_dtype), "contiguous", device)  # its own buffer: another dtype
        if self.layout == "packed":
            return Tensors(*_pack([q, k, v], device), do, descales)
        return Tensors(*(_lay_out(t, self.layout, device) for t in (q, k, v)), do, descales)


# --------------------------------------------------------------------------------- magnitudes
def _normal(q, k, v, do, gen, dtype):
    return q, k, v, do


def _large_logits(q, k, v, do, gen, dtype):
    return q * 100.0, k * 100.0, v, do


def _sparse_outliers(q, k, v, do, gen, dtype):
    def add(t):
        n = t.numel()
        if n == 0:
            return t
        count = max(1, round(0.001 * n))
        idx = torch.randperm(n, generator=gen)[:count]
        flat = t.reshape(-1).clone()
        flat[idx] += 30.0 * torch.randn(count, generator=gen, dtype=torch.float64)
        return flat.view_as(t)

    return add(q), add(k), add(v), do


def _fa3_outliers(q, k, v, do, gen, dtype):
    """N(0, 1) + N(0, 100) x Bernoulli(0.001), entry by entry (the FlashAttention-3 paper's protocol)."""
    def add(t):
        extra = 10.0 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
        hit = torch.rand(t.shape, generator=gen, dtype=torch.float64) < 0.001
        return t + torch.where(hit, extra, 0.0)

    return add(q), add(k), add(v), do


def _all_negative(q, k, v, do, gen, dtype):
    return 8.0 * q.abs(), -8.0 * (k.abs() + 1.0), v, do


def _ties(q, k, v, do, gen, dtype):
    b, hkv, nk, d = k.shape
    pool = torch.randn(b, hkv, 2, d, generator=gen, dtype=torch.float64)
    pick = torch.randint(0, 2, (nk,), generator=gen)
    return q, pool[:, :, pick], v, do


def _dominant_key(q, k, v, do, gen, dtype):
    k = k.clone()
    if k.shape[2]:
        j = int(torch.randint(0, k.shape[2], (1,), generator=gen))
        k[:, :, j] = 8.0
    return q.abs(), k, v, do


def _row_shift(q, k, v, do, gen, dtype):
    w = 50.0 * torch.randn(k.shape[0], k.shape[1], 1, k.shape[3], generator=gen, dtype=torch.float64)
    return q, k + w, v, do


def _v_offset(q, k, v, do, gen, dtype):
    return q, k, v + 1000.0, do


def _v_wide_range(q, k, v, do, gen, dtype):
    exps = torch.empty(v.shape[:3] + (1,), dtype=torch.float64).uniform_(-4.0, 4.0, generator=gen)
    return q, k, v * torch.pow(10.0, exps), do


def _near_subnormal(q, k, v, do, gen, dtype):
    tiny = torch.finfo(dtype).tiny
    return q, k, v * (8.0 * tiny), do * (8.0 * tiny)


_MAGNITUDE_BUILDERS = {
    "normal": _normal, "large_logits": _large_logits, "sparse_outliers": _sparse_outliers,
    "all_negative": _all_negative, "ties": _ties, "dominant_key": _dominant_key,
    "row_shift": _row_shift, "v_offset": _v_offset, "v_wide_range": _v_wide_range,
    "near_subnormal": _near_subnormal, "fa3_outliers": _fa3_outliers,
}
assert set(_MAGNITUDE_BUILDERS) == set(MAGNITUDES)


# --------------------------------------------------------------------------------- layouts
# Gap, in elements, before and between the tensors of the ``packed`` layout: a multiple of 8 keeps each
# view 16-byte aligned for 16-bit dtypes, as packed projections of real models are.
PACKED_GAP = 8


def _pack(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """[B, H, N, D] tensors as [B, N, H, D]-ordered views into one NaN-filled buffer, each at a non-zero
    storage offset (``PACKED_GAP`` elements, rounded up, between them)."""
    step = PACKED_GAP
    sizes = [-(-t.numel() // step) * step for t in tensors]
    buf = torch.full((PACKED_GAP + sum(s + PACKED_GAP for s in sizes),), float("nan"), dtype=tensors[0].dtype,
                     device=device)
    views, offset = [], PACKED_GAP
    for t, size in zip(tensors, sizes):
        b, h, n, d = t.shape
        view = buf.as_strided((b, n, h, d), (n * h * d, h * d, d, 1), offset).transpose(1, 2)
        view.copy_(t.to(device))
        views.append(view)
        offset += size + PACKED_GAP
    return views


def _lay_out(t: torch.Tensor, layout: str, device) -> torch.Tensor:
    """Return a tensor equal to ``t`` on ``device`` with the given memory layout."""
    if layout == "contiguous":
        return t.to(device).contiguous()
    if layout == "bnhd":
        return t.transpose(1, 2).contiguous().to(device).transpose(1, 2)
    if layout == "padded":
        b, h, n, d = t.shape
        buf = torch.full((b, h, n + 3, d + 5), float("nan"), dtype=t.dtype, device=device)
        buf[:, :, :n, :d] = t.to(device)
        return buf[:, :, :n, :d]
    raise CaseError(f"layout={layout!r}, but should be one of {LAYOUTS}")
