"""What a kernel under test declares: :class:`Implementation`, its errors and its allowed values.

Only the declaration type lives here; it imports no kernel module. The declarations of the shipped
kernels are in :mod:`flashverify_kernels.registry` (``SHIPPED``), which re-exports everything defined here: users
write ``from flashverify_kernels.registry import Implementation``. What each field unlocks is described in
:mod:`flashverify_kernels.registry`'s docstring.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from flashverify_kernels import conventions
from flashverify_kernels._validate import dtype_name, dtype_names
from references.fp8 import DESCALES, FP8_DTYPES, is_fp8
from references.spec import ALIGNMENTS, SEQUENCES, AttentionSpec, require_spec

ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# What a declaration's dtypes may hold: the four above (a plain callable's default) and the float8 formats.
DECLARABLE_DTYPES = (*ALL_DTYPES, *FP8_DTYPES)
KINDS = ("attention", "softmax")
# The scales drawn for a kernel that declares ``scales="power_of_two"`` (the first is what failures shrink to).
POWER_OF_TWO_SCALES = (0.125, 0.5, 0.25, 1.0, 2.0, 0.0625, 0.03125)
# The attribute :func:`declare` sets on a plain callable.
DECLARED = "__flashverify_declaration__"


@dataclasses.dataclass(frozen=True)
class Capability:
    """One variant of attention a kernel may declare, described once: the :class:`Implementation` field that
    declares it (also the strategies' flag that draws it: ``strategies.attention.attention_cases``), what it
    is called, whether a spec asks for it, and the keyword and value it reaches the kernel as. The
    declaration's refusals, the kernel's keywords, what a report lists as not covered, the runner's
    requirements and skip reasons and the draws a declaration allows all derive from :data:`CAPABILITIES`."""

    field: str
    noun: str  # "a sliding window": what the skip reason says a kernel "declares no" of
    words: str  # "sliding windows": what a report lists as not covered
    keyword: str
    asked: Callable[[AttentionSpec], bool]
    value: Callable[[AttentionSpec, str, Any, torch.dtype], Any]  # (spec, kernel name, device, dtype)


CAPABILITIES = (
    Capability("windows", "sliding window", "sliding windows", "window_size", lambda s: s.windowed,
               lambda s, name, device, dtype: (s.window_left, s.window_right)),
    Capability("softcap", "logit softcap", "logit softcap", "softcap", lambda s: s.softcap is not None,
               lambda s, name, device, dtype: s.softcap),
    Capability("alibi", "ALiBi", "ALiBi", "alibi_slopes", lambda s: s.alibi_slopes is not None,
               lambda s, name, device, dtype: _alibi_tensor(name, s.alibi_slopes, device)),
    Capability("chunks", "chunked local attention", "chunked local attention", "attention_chunk",
               lambda s: s.attention_chunk > 0, lambda s, name, device, dtype: s.attention_chunk),
    Capability("sinks", "attention sinks", "attention sinks", "sinks", lambda s: s.sinks is not None,
               lambda s, name, device, dtype: sinks_tensor(name, s, device=device, dtype=dtype)),
    Capability("splits", "split-KV", "split-KV (num_splits)", "num_splits", lambda s: s.num_splits > 1,
               lambda s, name, device, dtype: s.num_splits),
)


class ImplementationError(ValueError):
    """An implementation declaration or an ``--impl`` specification is invalid."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One kernel under test and what it declares it supports.

    Attention kernels (``kind="attention"``):
      forward(q, k, v, *, causal, scale[, window_size][, attention_chunk][, softcap][, alibi_slopes][, sinks]
              [, num_splits][, <the sequences' keywords>][, block_m, block_n][, out, lse]) -> (out, lse) or out
      backward(q, k, v, out, lse, dout, *, <the forward's keywords but out, lse>) -> (dq, dk, dv, delta), and
               dsinks fifth with sinks
    Float8 inputs (``dtypes`` holding ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``; forward only): ``out``
    is bfloat16, and with ``descale`` the forward also takes ``q_descale``, ``k_descale``, ``v_descale``
    (float32 ``[B, Hkv]``, FlashAttention-3's) whenever the case has them (``references/fp8.py``).
    ``window_size``, ``attention_chunk``, ``softcap``, ``alibi_slopes``, ``sinks`` and ``num_splits`` are
    passed only when the case has them (and the declaration has ``windows``, ``chunks``, ``softcap``,
    ``alibi``, ``sinks``, ``splits``); the tensors and keywords of variable-length sequences (``packed``,
    ``padded``, ``paged``: :mod:`flashverify_kernels.conventions`) only for a convention listed in ``sequences``.
    Softmax kernels (``kind="softmax"``):
      forward(x[, block_n=...]) -> (y, lse) over the last dimension of a 2-D float tensor.
    """

    name: str
    forward: Callable[..., Any]
    kind: str = "attention"
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    devices: tuple[str, ...] = ("cpu", "cuda")
    # Head dims accepted: None means any positive head dim.
    head_dims: Sequence[int] | None = None
    # A value head dim of its own: v is [B, Hkv, Nk, Dv] and out, dout [B, Hq, Nq, Dv] with Dv other than q's
    # and k's D (multi-head latent attention's 192/128, FlashAttention-3's headdim_v); head_dims bound both.
    head_dim_v: bool = False
    gqa: bool = False
    # Float8 inputs with descales: the forward takes q_descale, k_descale, v_descale (float32 [B, Hkv]: the
    # factor each batch entry's key/value head, and its group of query heads, is multiplied by).
    descale: bool = False
    causal: bool = True
    causal_alignment: str = "bottom_right"
    # Sliding windows (flash_attn's convention): the forward takes window_size=(left, right), -1 unbounded.
    windows: bool = False
    # Logit softcap (flash_attn's convention): the forward takes softcap=c > 0, scores s -> c * tanh(s / c).
    softcap: bool = False
    # ALiBi (flash_attn's convention): the forward takes alibi_slopes, a float32 tensor [Hq] on q's device.
    alibi: bool = False
    # Local attention in chunks (FlashAttention-3's attention_chunk=C > 0): a query sees only its own chunk.
    chunks: bool = False
    # Attention sinks: the forward takes sinks, a tensor [Hq] (float32; float64 for float64 inputs) of logits
    # that join every row's softmax denominator; its gradient flows back to that tensor.
    sinks: bool = False
    # Split-KV: the forward takes num_splits=S > 1 and merges the S splits of the keys by their LSEs.
    splits: bool = False
    # The conventions of the sequences it takes (flashverify_kernels/conventions.py): "dense", and variable-length
    # "packed", "padded", "paged"; page_sizes: the page sizes of a paged cache it takes (None: any).
    sequences: tuple[str, ...] = ("dense",)
    page_sizes: tuple[int, ...] | None = None
    # Tunable tiles: the block sizes the suite may draw (None: not tunable).
    block_m: Sequence[int] | None = None
    block_n: Sequence[int] | None = None
    returns_lse: bool = True
    autograd: bool = True
    backward: Callable[..., Any] | None = None
    # Repeated calls on the same inputs give bitwise identical results (see flashverify_kernels/registry.py's docstring).
    deterministic: bool = True
    # The forward accepts out= and lse= views into caller buffers and writes its results there.
    out_buffers: bool = False
    # Largest sequence length and head dim the suite should try (None: no limit of the kernel's own).
    max_seq_len: int | None = None
    # Most (query tiles) x (key tiles) per head the suite should draw, for a kernel whose tile loop
    # runs in Python (one launch per tile: its time grows with the tile count, not the work); None: the
    # profile's own cap (verify/profiles.py).
    max_tiles: int | None = None
    # Cap on Hypothesis examples per property (for slow environments such as the Triton interpreter).
    max_examples: int | None = None
    # Dtypes for which the environment, not the kernel, makes results meaningless, with the reason
    # (for example the Triton interpreter's bfloat16 tl.dot). Properties skip these with the reason.
    environment_limits: tuple[tuple[torch.dtype, str], ...] = ()
    description: str = ""
    # Name of an implementation computing the same function another way (FA1 vs FA2): the suite
    # checks that the two agree when both are selected.
    sibling: str | None = None
    # How the user named it with --impl (for replay commands); None for registry names.
    selector: str | None = None
    # --- Limits: the suite draws only cases within them (never filters) and the report lists what they
    # leave out (:meth:`not_covered`). README.md, "Declaring a kernel's limits".
    equal_lengths: bool = False  # Nq == Nk only
    len_q_multiple: int = 1  # Nq a multiple of this
    len_k_multiple: int = 1  # Nk a multiple of this
    min_len: int = 0  # Nq and Nk at least this
    non_causal: bool = True  # False: causal only (with causal=True)
    # The scale values the kernel takes (None in it: the default 1/sqrt(D)); "power_of_two"; None: any.
    scales: tuple[float | None, ...] | str | None = None
    # Largest head dim, for every dtype (an int) or per dtype ({torch.float32: 128, ...}); None: no limit.
    max_head_dim: int | Mapping[torch.dtype, int] | None = None
    contiguous_only: bool = False  # contiguous q, k, v (and dout) only
    max_batch_heads: int | None = None  # B * Hq at most
    max_len_q: int | None = None  # Nq at most this (a decoding kernel's few queries)
    max_splits: int | None = None  # num_splits at most this (with splits=True; a workspace sized for so many)
    # Smallest block_m and block_n it runs, for every dtype (an int) or per dtype ({torch.float8_e4m3fn: 32, ...}:
    # float8 matrix instructions step through 32 products); the suite draws only declared sizes at or above it.
    min_block: int | Mapping[torch.dtype, int] | None = None
    # Part of the default selection (shipped kernels); adapters to peers run when named.
    in_default: bool = True
    # A plain callable given to --impl with no declaration: what it leaves out was assumed, not declared.
    plain: bool = False

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ImplementationError(f"name={self.name!r}, but should be a non-empty string")
        if not callable(self.forward):
            raise ImplementationError(f"{self.name}: forward={self.forward!r} is not callable")
        if self.kind not in KINDS:
            raise ImplementationError(f"{self.name}: kind={self.kind!r}, but should be one of {KINDS}")
        if self.causal_alignment not in ALIGNMENTS:
            raise ImplementationError(
                f"{self.name}: causal_alignment={self.causal_alignment!r}, but should be one of {ALIGNMENTS}"
            )
        bad = [d for d in self.dtypes if d not in DECLARABLE_DTYPES]
        if bad or not self.dtypes:
            raise ImplementationError(f"{self.name}: dtypes={self.dtypes!r}; allowed: {DECLARABLE_DTYPES}")
        if self.descale is True and not any(is_fp8(d) for d in self.dtypes):
            raise ImplementationError(f"{self.name}: descale=True, but dtypes={dtype_names(self.dtypes)} holds no "
                                      f"float8 format ({dtype_names(FP8_DTYPES)}): descales come with float8 inputs")
        for field in ("block_m", "block_n"):
            sizes = getattr(self, field)
            if sizes is not None and (len(sizes) == 0 or any(int(s) < 1 for s in sizes)):
                raise ImplementationError(f"{self.name}: {field}={sizes!r} must hold positive ints")
        for field in ("max_seq_len", "max_tiles"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ImplementationError(f"{self.name}: {field}={value!r}, but should be a positive int or None")
        if self.backward is not None and not callable(self.backward):
            raise ImplementationError(f"{self.name}: backward={self.backward!r} is not callable")
        self._check_limits()

    def _check_limits(self) -> None:
        """A clear error for a nonsensical limit (each names the field, its value and what is allowed)."""
        def positive_int(field: str, value, *, zero: bool = False) -> None:
            low = 0 if zero else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ImplementationError(f"{self.name}: {field}={value!r}, but should be an int >= {low}")

        for field in ("len_q_multiple", "len_k_multiple"):
            positive_int(field, getattr(self, field))
        positive_int("min_len", self.min_len, zero=True)
        for field in ("equal_lengths", "non_causal", "contiguous_only", "causal", "windows", "softcap",
                      "alibi", "chunks", "sinks", "splits", "head_dim_v", "descale"):
            if not isinstance(getattr(self, field), bool):
                raise ImplementationError(f"{self.name}: {field}={getattr(self, field)!r}, but should be a bool")
        bad = [s for s in self.sequences if s not in SEQUENCES] if isinstance(self.sequences, tuple) else None
        if bad is None or bad or not self.sequences:
            raise ImplementationError(f"{self.name}: sequences={self.sequences!r}, but should be a non-empty tuple of "
                                      f"{SEQUENCES} (the conventions of the sequences it takes)")
        if self.page_sizes is not None and (not isinstance(self.page_sizes, tuple) or not self.page_sizes or any(
                isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in self.page_sizes)):
            raise ImplementationError(f"{self.name}: page_sizes={self.page_sizes!r}, but should be None (any) or a "
                                      "non-empty tuple of ints >= 1")
        if not self.causal and not self.non_causal:
            raise ImplementationError(f"{self.name}: causal=False and non_causal=False leave no mask to run: a "
                                      "kernel runs causal attention (causal=True), non-causal (non_causal=True) "
                                      "or both")
        if self.max_batch_heads is not None:
            positive_int("max_batch_heads", self.max_batch_heads)
        if self.max_len_q is not None:
            positive_int("max_len_q", self.max_len_q)
        if self.max_splits is not None:
            positive_int("max_splits", self.max_splits)
        if self.scales is not None and self.scales != "power_of_two":
            ok = isinstance(self.scales, (tuple, list)) and len(self.scales) > 0 and all(
                s is None or (not isinstance(s, bool) and isinstance(s, (int, float)) and math.isfinite(s))
                for s in self.scales)
            if not ok:
                raise ImplementationError(f"{self.name}: scales={self.scales!r}, but should be None (any scale), "
                                          "'power_of_two', or a non-empty tuple of finite floats and None "
                                          "(None: the default 1/sqrt(D))")
        def per_dtype(field: str) -> None:
            """A limit of one int for every dtype, or a mapping from declarable dtypes to ints."""
            limits = getattr(self, field)
            if isinstance(limits, Mapping):
                for dtype, value in limits.items():
                    if dtype not in DECLARABLE_DTYPES:
                        raise ImplementationError(f"{self.name}: {field} has key {dtype!r}; keys should be "
                                                  f"among {dtype_names(DECLARABLE_DTYPES)}")
                    positive_int(f"{field}[{dtype_name(dtype)}]", value)
            elif limits is not None:
                positive_int(field, limits)

        per_dtype("max_head_dim")
        per_dtype("min_block")
        self._check_min_block()
        if self.head_dims is not None and self.max_head_dim is not None:
            for dtype in self.dtypes:
                top = self.head_dim_limit(dtype)
                if top is not None and min(self.head_dims) > top:
                    raise ImplementationError(
                        f"{self.name}: head_dims {sorted(self.head_dims)} are all above max_head_dim={top} in "
                        f"{dtype_name(dtype)}: drop {dtype_name(dtype)} from dtypes or allow a head dim")

    def _check_min_block(self) -> None:
        """``min_block`` (its values checked by :meth:`_check_limits`) leaves tiles to draw in every dtype."""
        if self.min_block is None:
            return
        if not self.tunable:
            raise ImplementationError(f"{self.name}: min_block={self.min_block!r}, but the kernel declares no "
                                      "block_m and block_n to draw from: declare both, or leave min_block None")
        for dtype in self.dtypes:
            block_m, block_n = self.blocks_for(dtype)
            for field, sizes in (("block_m", block_m), ("block_n", block_n)):
                if not sizes:
                    raise ImplementationError(
                        f"{self.name}: every {field} {sorted(getattr(self, field))} is below min_block="
                        f"{self.block_floor(dtype)} in {dtype_name(dtype)}: declare a larger size or drop "
                        f"{dtype_name(dtype)} from dtypes")

    # ----------------------------------------------------------------------------- limits
    def block_floor(self, dtype: torch.dtype) -> int | None:
        """The smallest block_m and block_n declared for ``dtype`` (None: any declared size)."""
        return _for_dtype(self.min_block, dtype)

    def blocks_for(self, dtype: torch.dtype | str | None) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """``(block_m, block_n)``: the declared sizes the kernel runs in ``dtype`` (a torch dtype or its name;
        None: every declared size), each None when the kernel declares no tunable tiles."""
        if not self.tunable:
            return None, None
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        floor = self.block_floor(dtype) if dtype is not None else None
        return tuple(b for b in self.block_m if floor is None or b >= floor), \
            tuple(b for b in self.block_n if floor is None or b >= floor)

    def head_dim_limit(self, dtype: torch.dtype) -> int | None:
        """The largest head dim declared for ``dtype`` (None: no limit)."""
        return _for_dtype(self.max_head_dim, dtype)

    @property
    def scale_choices(self) -> tuple[float | None, ...] | None:
        """The scales to draw (None: any, the suite's own choice)."""
        if self.scales is None:
            return None
        return POWER_OF_TWO_SCALES if self.scales == "power_of_two" else tuple(self.scales)

    @property
    def length_multiples(self) -> tuple[int, int]:
        """``(Nq multiple, Nk multiple)``; with equal lengths both are their least common multiple."""
        if self.equal_lengths:
            both = math.lcm(self.len_q_multiple, self.len_k_multiple)
            return both, both
        return self.len_q_multiple, self.len_k_multiple

    def not_covered(self) -> list[str]:
        """What the declaration leaves out of the suite's cases, in words (the report lists these, so a
        narrow declaration is visible rather than a silent pass)."""
        out = []
        why = ("not covered, a plain callable is assumed not to support it (declare it to have it drawn)"
               if self.plain else "not covered, declared unsupported")
        if self.kind != "attention":
            return out
        left = [d for d in ALL_DTYPES if d not in self.dtypes]
        if left:
            out.append(f"{dtype_names(left)}: {why}")
        if self.equal_lengths:
            out.append(f"Nq != Nk: {why}")
        mq, mk = self.length_multiples
        if mq == mk and mq > 1:
            out.append(f"lengths that are not a multiple of {mq}: {why}")
        else:
            if mq > 1:
                out.append(f"Nq not a multiple of {mq}: {why}")
            if mk > 1:
                out.append(f"Nk not a multiple of {mk}: {why}")
        if self.min_len > 0:
            out.append(f"lengths below {self.min_len}: {why}")
        if self.max_len_q is not None:
            out.append(f"more than {self.max_len_q} queries per sequence: {why}")
        if self.splits and self.max_splits is not None:
            out.append(f"more than {self.max_splits} KV splits: {why}")
        if not self.causal:
            out.append(f"causal masks: {why}")
        if not self.non_causal:
            out.append(f"non-causal attention: {why}")
        if self.scales == "power_of_two":
            out.append(f"scales that are not a power of two: {why}")
        elif self.scales is not None:
            shown = ", ".join("1/sqrt(D)" if s is None else f"{s:g}" for s in self.scales)
            out.append(f"scales other than {shown}: {why}")
        if isinstance(self.max_head_dim, Mapping):
            for dtype, d in self.max_head_dim.items():
                out.append(f"head dims above {d} in {dtype_name(dtype)}: {why}")
        elif self.max_head_dim is not None:
            out.append(f"head dims above {self.max_head_dim}: {why}")
        if self.tunable and isinstance(self.min_block, Mapping):
            for dtype, b in self.min_block.items():
                if dtype in self.dtypes:
                    out.append(f"tiles below {b} in {dtype_name(dtype)}: {why}")
        elif self.tunable and self.min_block is not None:
            out.append(f"tiles below {self.min_block}: {why}")
        if self.contiguous_only:
            out.append(f"non-contiguous inputs (transposed, padded and packed views): {why}")
        if self.max_batch_heads is not None:
            out.append(f"B x Hq above {self.max_batch_heads}: {why}")
        if not self.gqa:
            out.append(f"grouped-query attention (Hkv < Hq): {why}")
        if not self.head_dim_v:
            out.append(f"a value head dim of its own (v's head dim other than q's and k's): {why}")
        out += [f"{cap.words}: {why}" for cap in CAPABILITIES if not getattr(self, cap.field)]
        for convention, words in (("dense", "a dense batch"), ("packed", "variable-length sequences, packed"),
                                  ("padded", "variable-length sequences, padded"), ("paged", "a paged KV cache")):
            if convention not in self.sequences:
                out.append(f"{words}: {why}")
        if "paged" in self.sequences and self.page_sizes is not None:
            out.append(f"pages of other sizes than {', '.join(map(str, self.page_sizes))}: {why}")
        formats = [d for d in FP8_DTYPES if d not in self.dtypes]
        if formats:
            out.append(f"float8 inputs ({dtype_names(formats)}): {why}")
        if any(is_fp8(d) for d in self.dtypes) and not self.descale:
            out.append(f"float8 inputs with descales (q_descale, k_descale, v_descale): {why}")
        return out

    @property
    def tunable(self) -> bool:
        return self.block_m is not None and self.block_n is not None

    @property
    def exposes_delta(self) -> bool:
        return self.backward is not None

    @property
    def cli_name(self) -> str:
        """What to pass to --impl to select this implementation again."""
        return self.selector or self.name

    def environment_limit(self, dtype: torch.dtype) -> str | None:
        for d, why in self.environment_limits:
            if d == dtype:
                return why
        return None

    def supports_head_dim(self, d: int) -> bool:
        return self.head_dims is None or d in self.head_dims

    def unsupported(self, *, dtype: torch.dtype | None = None, device: str | None = None) -> str | None:
        """The reason this implementation cannot run with these settings, or None if it can."""
        if dtype is not None and dtype not in self.dtypes:
            return f"{self.name} declares dtypes {dtype_names(self.dtypes)}; {dtype_name(dtype)} is not among them"
        if device is not None and torch.device(device).type not in self.devices:
            return f"{self.name} declares devices {', '.join(self.devices)}; {device} is not among them"
        return None

    def unsupported_spec(self, spec: AttentionSpec) -> str | None:
        """The reason this implementation cannot compute the attention ``spec`` describes, or None."""
        if spec.causal and not self.causal:
            return f"{self.name} declares no causal masking"
        if not spec.causal and not self.non_causal:
            return f"{self.name} declares causal attention only"
        for cap in CAPABILITIES:
            if cap.asked(spec) and not getattr(self, cap.field):
                return f"{self.name} declares no {cap.noun}"
        if spec.sequences not in self.sequences:
            return f"{self.name} declares sequences {self.sequences}; the case's are {spec.sequences}"
        if spec.sequences == "paged" and self.page_sizes is not None and spec.page_size not in self.page_sizes:
            return f"{self.name} declares pages of {self.page_sizes} keys; the case's hold {spec.page_size}"
        if spec.causal and spec.alignment != self.causal_alignment:
            return (f"{self.name} aligns causal masks {self.causal_alignment}; the case asks for "
                    f"{spec.alignment}")
        return None

    def kernel_keywords(self, spec: AttentionSpec, scale, block_m, block_n, *, device=None,
                        dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The kernel's own keywords for ``spec`` (refused when the declaration does not support it);
        ``device``, ``dtype``: where the inputs are and their dtype (the ALiBi slopes and sinks tensors are
        made there; the sinks in float32, float64 for float64 inputs). Not the sequences' keywords: those
        come with the tensors (:func:`flashverify_kernels.conventions.layout`)."""
        require_spec(spec)
        why = self.unsupported_spec(spec)
        if why is not None:
            raise ImplementationError(why)
        kwargs: dict[str, Any] = {"causal": spec.causal, "scale": scale}
        kwargs.update({cap.keyword: cap.value(spec, self.name, device, dtype)
                       for cap in CAPABILITIES if cap.asked(spec)})
        if self.tunable and block_m is not None:
            kwargs["block_m"] = block_m
        if self.tunable and block_n is not None:
            kwargs["block_n"] = block_n
        return kwargs

    def call_backward(self, q, k, v, out, lse, dout, *, spec: AttentionSpec, scale: float | None = None,
                      block_m: int | None = None, block_n: int | None = None):
        """Run the declared backward on ``spec``'s attention, the tensors in the references' frame (as
        :meth:`call` takes them): ``(dq, dk, dv, delta)`` in that frame, and ``dsinks`` fifth with sinks."""
        if self.backward is None:
            raise ImplementationError(f"{self.name} declares no backward")
        kwargs = self.kernel_keywords(spec, scale, block_m, block_n, device=q.device, dtype=q.dtype)
        lay = conventions.layout(spec)
        qk, kk, vk, sequences = lay.inputs(q, k, v)
        grads = self.backward(qk, kk, vk, lay.queries_in(out), lay.rows_in(lse), lay.queries_in(dout),
                              **kwargs, **sequences)
        wanted = 5 if spec.sinks is not None else 4
        if not isinstance(grads, (tuple, list)) or len(grads) != wanted:
            raise conventions.ContractError(
                f"{self.name}'s backward returned {type(grads).__name__}"
                f"{f' of length {len(grads)}' if isinstance(grads, (tuple, list)) else ''}, but should return "
                f"(dq, dk, dv, delta{', dsinks' if wanted == 5 else ''})")
        hq, hkv, d, dv_dim = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
        dq = lay.queries_out(grads[0], what="dq", heads=hq, head_dim=d)
        dk = lay.keys_out(grads[1], what="dk", heads=hkv, head_dim=d)
        dv = lay.keys_out(grads[2], what="dv", heads=hkv, head_dim=dv_dim)
        return (dq, dk, dv, lay.rows_out(grads[3], what="delta", heads=hq), *grads[4:])

    def call(self, q, k, v, *, spec: AttentionSpec, scale: float | None = None,
             block_m: int | None = None, block_n: int | None = None,
             out: torch.Tensor | None = None, lse: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
             handed: Callable[[dict[str, Any]], None] | None = None, descales=None):
        """Run the forward on the attention ``spec`` describes and normalise the result to
        ``(out, lse_or_None)``. ``q, k, v`` are in the references' frame (``[B, H, N, D]``; variable-length
        sequences packed into one batch) and so are the results: the spec's convention
        (:mod:`flashverify_kernels.conventions`) lays the tensors out for the kernel and its results back. The spec
        becomes the kernel's own keywords (``causal``, ...); a spec the declaration does not support is
        refused. ``out``/``lse`` are passed on as the forward's ``out=``/``lse=`` buffers; only for a
        declaration with ``out_buffers`` and a dense batch. ``sinks``: the sinks tensor to pass (a leaf
        whose gradient the caller reads), instead of one made from the spec's values. ``descales``: float8
        inputs' ``(q_descale, k_descale, v_descale)``, passed as those keywords (a dense batch only, and only to
        a declaration with ``descale``). ``handed``: called with
        what the kernel is handed, just before the call (``q``, ``k``, ``v`` in its convention and the
        convention's keywords: ``cu_seqlens_q``, ``block_table``, ...)."""
        kwargs = self.kernel_keywords(spec, scale, block_m, block_n, device=q.device, dtype=q.dtype)
        if sinks is not None:
            kwargs["sinks"] = sinks
        if descales is not None:
            if not self.descale:
                raise ImplementationError(f"{self.name} declares no descale: its forward takes no q_descale, "
                                          "k_descale, v_descale")
            if spec.varlen:
                raise ImplementationError(f"{self.name}: descales are passed for a dense batch only")
            kwargs.update(zip(DESCALES, descales))
        if out is not None or lse is not None:
            if spec.varlen:
                raise ImplementationError(f"{self.name}: out=/lse= buffers are passed for a dense batch only")
            if not self.out_buffers:
                raise ImplementationError(f"{self.name} declares no out_buffers: its forward takes no "
                                          "out=/lse= buffers")
            if out is not None:
                kwargs["out"] = out
            if lse is not None:
                kwargs["lse"] = lse
        lay = conventions.layout(spec)
        qk, kk, vk, sequences = lay.inputs(q, k, v)
        if handed is not None:
            handed({"q": qk, "k": kk, "v": vk, **sequences})
        result = self.forward(qk, kk, vk, **kwargs, **sequences)
        if isinstance(result, torch.Tensor):
            out_k, lse_k = result, None
        elif isinstance(result, (tuple, list)) and len(result) in (1, 2):
            out_k, lse_k = result[0], (result[1] if len(result) == 2 else None)
        else:
            raise conventions.ContractError(
                f"{self.name} returned {type(result).__name__}"
                f"{f' of length {len(result)}' if isinstance(result, (tuple, list)) else ''}, "
                "but should return out or (out, lse)"
            )
        out_r = lay.queries_out(out_k, what="out", heads=q.shape[1], head_dim=v.shape[3])
        return out_r, (None if lse_k is None else lay.rows_out(lse_k, what="lse", heads=q.shape[1]))


def _for_dtype(limit: int | Mapping[torch.dtype, int] | None, dtype: torch.dtype) -> int | None:
    """A per-dtype limit's value for ``dtype``: the int itself, the mapping's entry, or None."""
    return limit.get(dtype) if isinstance(limit, Mapping) else limit


def _alibi_tensor(name: str, slopes: tuple[float, ...], device) -> torch.Tensor:
    """The spec's slopes as the float32 tensor flash_attn's ``alibi_slopes`` is, on ``device``; refused when
    float32 cannot hold a slope exactly (the reference would then use a different slope than the kernel)."""
    exact = torch.tensor(slopes, dtype=torch.float64)
    held = exact.to(torch.float32)
    inexact = [x for x, y in zip(slopes, held.tolist()) if x != y]
    if inexact:
        raise ImplementationError(f"{name}: alibi_slopes={tuple(slopes)!r} holds {inexact!r}, which float32 cannot "
                                  "hold exactly: the kernel would run a different slope than the reference; "
                                  "use slopes that are float32 values (e.g. powers of two)")
    return held.to(device) if device is not None else held


def sinks_tensor(name: str, spec: AttentionSpec, *, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The spec's sink logits as the tensor a kernel takes: ``[Hq]``, float32 (float64 for float64 inputs),
    on ``device``; refused when float32 cannot hold a logit exactly (the reference would use another)."""
    values = torch.tensor(spec.sinks, dtype=torch.float64)
    if dtype != torch.float64:
        inexact = [x for x, y in zip(spec.sinks, values.to(torch.float32).tolist()) if x != y]
        if inexact:
            raise ImplementationError(f"{name}: sinks={tuple(spec.sinks)!r} holds {inexact!r}, which float32 cannot "
                                      "hold exactly: the kernel would use another logit than the reference")
    return values.to(device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)


def declare(**fields: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a plain callable's limits (and any other :class:`Implementation` field but ``name`` and
    ``forward``) where it is written; ``--impl path.py:fn`` then runs it with them::

        @declare(equal_lengths=True, len_q_multiple=128, len_k_multiple=128, dtypes=(torch.float16,))
        def attention(q, k, v, *, causal, scale): ...

    The fields are checked when the suite loads the callable, as those of an ``Implementation``."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(Implementation)})
    if unknown or "name" in fields or "forward" in fields:
        known = sorted({f.name for f in dataclasses.fields(Implementation)} - {"name", "forward"})
        raise ImplementationError(f"declare() got {sorted(set(unknown) | (set(fields) & {'name', 'forward'}))}; "
                                  f"it takes the Implementation fields {known}")

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, DECLARED, dict(fields))
        return fn

    return mark

