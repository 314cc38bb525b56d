"""Calling-convention adapters: a kernel written to flash_attn's or xformers' API, checked without glue.

A kernel whose function already has the signature of a well-known attention API is handed to one of the
functions below, which returns an :class:`~flashverify_kernels.declaration.Implementation` speaking the suite's
contract (README.md, "The contract"): its forward takes the suite's tensors and keywords (``[B, H, N, D]``
tensors, or the sequences of :mod:`flashverify_kernels.conventions`; ``causal``, ``scale``, ``window_size``, ...), moves
the tensors into the API's layout, renames the keywords to the API's, calls the function, checks the
shapes of what it returns and moves the results back. The adapter never changes a value: the LSE comes back
as the function computed it. flash_attn's ``softmax_lse`` is the natural-log logsumexp in float32, as the
contract's; an LSE in base 2 fails the LSE properties, whose message names the base. The one conversion of
the LSE is float32 to float64 for float64 inputs (the contract's dtype there; it adds no precision, so a
float32 LSE fails the float64 checks as it should).

=======================  ================================================================================
``--convention``         the function, as the adapter calls it, and what it declares by default
=======================  ================================================================================
``flash_attn``           ``fn(q, k, v, softmax_scale=, causal=[, window_size=][, softcap=][, alibi_slopes=]
                         [, deterministic=True], return_attn_probs=True)`` (flash_attn_func): ``q [B, Nq,
                         Hq, D]``, ``k``, ``v [B, Nk, Hkv, D]``; returns ``out [B, Nq, Hq, D]``, or with
                         ``return_attn_probs`` ``(out, softmax_lse [B, Hq, Nq], S_dmask)``. Declares a dense
                         batch, GQA, windows, softcap, ALiBi, bottom-right causal (flash_attn >= 2.1), the
                         LSE and autograd; no sinks, chunks or split-KV (not in the API).
``flash_attn_varlen``    ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=,
                         causal=, ...)`` (flash_attn_varlen_func, the same keywords): packed sequences ``q
                         [total_q, Hq, D]``, ``k``, ``v [total_k, Hkv, D]``, int32 ``cu_seqlens``; returns
                         ``out [total_q, Hq, D]`` or ``(out, softmax_lse [Hq, total_q], S_dmask)``. Declares
                         packed sequences and what ``flash_attn`` declares.
``flash_attn_kvcache``   ``fn(q, k_cache, v_cache, cache_seqlens=, block_table=, softmax_scale=, causal=[,
                         window_size=][, softcap=][, alibi_slopes=][, num_splits=], return_softmax_lse=True)``
                         (flash_attn_with_kvcache; ``k`` and ``v``, new keys to append, and the rotary
                         arguments are left to their defaults): ``q [B, Nq, Hq, D]``, a paged cache ``k_cache``,
                         ``v_cache [num_pages, page_size, Hkv, D]`` read through ``block_table [B, max pages]``
                         (int32) and ``cache_seqlens`` (int32 ``[B]``); returns ``out [B, Nq, Hq, D]`` or
                         ``(out, softmax_lse [B, Hq, Nq])``. Declares a paged KV cache (decoding and a few
                         queries per sequence), GQA, windows, softcap, ALiBi, split-KV, bottom-right causal,
                         the LSE; forward only (``autograd=False``: flash_attn_with_kvcache has no backward).
``xformers``             ``fn(query, key, value[, attn_bias=], scale=)`` (xformers' memory_efficient_attention):
                         ``[B, M, H, K]`` tensors; returns ``out [B, M, H, K]``, no LSE. Declares a dense
                         batch, no LSE, autograd, not deterministic; no GQA (xformers takes Hkv < Hq as 5-D
                         ``[B, M, G, H, K]`` tensors only), windows, softcap or ALiBi. Non-causal only unless
                         ``causal_bias`` is given (:func:`xformers_convention`): xformers expresses a causal
                         mask as an attention-bias object of its own classes, which the suite cannot make
                         without xformers.
=======================  ================================================================================

What the suite cannot know about a user's kernel has the contract's plain-callable defaults (README.md):
float16, bfloat16, float32 and float64, any head dim, on CPU and CUDA (with ``--impl ... --convention``:
on the suite's device), any page size. Every :class:`Implementation` field can be overridden as a keyword,
or with :func:`flashverify_kernels.declaration.declare` on the function; the keyword wins. The real flash_attn takes
float16 and bfloat16 on CUDA, head dims up to 256, and (flash_attn_with_kvcache) pages of a multiple of
256 keys::

    IMPL = flash_attn_convention(flash_attn_func, dtypes=(torch.float16, torch.bfloat16), devices=("cuda",),
                                 max_head_dim=256)

Fields that switch a keyword on or off: ``windows`` (``window_size``), ``softcap``, ``alibi``
(``alibi_slopes``), ``returns_lse`` (``return_attn_probs`` / ``return_softmax_lse``), ``splits``
(``num_splits``), ``deterministic`` (``deterministic=True``, flash_attn's deterministic backward; the
declaration is False by default because flash_attn's backward sums dQ with atomics otherwise), ``causal``
(xformers' ``attn_bias``). ``causal_alignment="top_left"`` declares a kernel that aligns causal masks
top-left (flash_attn before 2.1). ``contiguous_only=True`` makes the adapter pass tensors contiguous in the
API's layout; otherwise it passes the views the suite draws, moved into the API's layout (transposed), with
a copy only where the last dimension is strided (as flash_attn's own wrapper does). Fields the API fixes
(the sequences, a separate backward, tile sizes, variants the API has no keyword for) are refused.

Named on the command line, ``pytest verify --impl mypkg:flash_attn_varlen_func --convention
flash_attn_varlen`` (:func:`flashverify_kernels.registry.load`), or in a file, ``IMPL = flash_attn_convention(fn,
name="mine")`` and ``--impl path/to/file.py:IMPL``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from flashverify_kernels.conventions import ContractError
from flashverify_kernels.declaration import DECLARED, Implementation, ImplementationError

# The fields every convention fixes (the adapter's forward speaks the suite's contract, and nothing here
# converts a separate backward, tiles or out= buffers).
_FIXED_EVERYWHERE = {
    "kind": ("attention", "the conventions are attention APIs"),
    "backward": (None, "the adapter converts the forward only; gradients flow through autograd"),
    "block_m": (None, "the API takes no tile sizes"),
    "block_n": (None, "the API takes no tile sizes"),
    "out_buffers": (False, "the API takes no out= buffers"),
    "chunks": (False, "the API has no keyword for chunked local attention"),
    "sinks": (False, "the API has no keyword for attention sinks"),
}
# How a declaration drops a keyword the adapter would pass (the words of the error for a function without it).
_DROPPED_BY = {"window_size": "windows=False", "softcap": "softcap=False", "alibi_slopes": "alibi=False",
               "deterministic": "deterministic=False", "return_attn_probs": "returns_lse=False",
               "return_softmax_lse": "returns_lse=False", "num_splits": "splits=False", "attn_bias": "causal=False"}
_FIELDS = frozenset(f.name for f in dataclasses.fields(Implementation))


@dataclasses.dataclass(frozen=True)
class _Convention:
    """One API: its name for ``--convention``, the function it mirrors, the arguments the adapter passes
    positionally, the declaration's defaults and the fields it fixes (value, why)."""

    name: str
    api: str
    positional: tuple[str, ...]
    defaults: Mapping[str, Any]
    fixed: Mapping[str, tuple[Any, str]]


_FLASH_VARIANTS = dict(gqa=True, windows=True, softcap=True, alibi=True, causal_alignment="bottom_right",
                       returns_lse=True)
FLASH_ATTN = _Convention(
    "flash_attn", "flash_attn_func", ("q", "k", "v"),
    defaults=dict(_FLASH_VARIANTS, autograd=True, deterministic=False),
    fixed={**_FIXED_EVERYWHERE, "sequences": (("dense",), "flash_attn_func takes a dense batch [B, N, H, D]"),
           "splits": (False, "flash_attn_func has no num_splits")})
FLASH_ATTN_VARLEN = _Convention(
    "flash_attn_varlen", "flash_attn_varlen_func",
    ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
    defaults=dict(_FLASH_VARIANTS, autograd=True, deterministic=False),
    fixed={**_FIXED_EVERYWHERE,
           "sequences": (("packed",), "flash_attn_varlen_func takes packed sequences [total, H, D] + cu_seqlens"),
           "splits": (False, "flash_attn_varlen_func has no num_splits")})
FLASH_ATTN_KVCACHE = _Convention(
    "flash_attn_kvcache", "flash_attn_with_kvcache", ("q", "k_cache", "v_cache"),
    defaults=dict(_FLASH_VARIANTS, splits=True, autograd=False, deterministic=True),
    fixed={**_FIXED_EVERYWHERE,
           "sequences": (("paged",), "flash_attn_with_kvcache reads a paged cache through block_table"),
           "autograd": (False, "flash_attn_with_kvcache has no backward")})
XFORMERS = _Convention(
    "xformers", "memory_efficient_attention", ("query", "key", "value"),
    defaults=dict(gqa=False, returns_lse=False, autograd=True, deterministic=False),
    fixed={**_FIXED_EVERYWHERE,
           "sequences": (("dense",), "the adapter passes a dense batch (xformers' variable-length sequences are "
                                     "attention-bias objects of its own classes)"),
           "windows": (False, "memory_efficient_attention has no window keyword"),
           "softcap": (False, "memory_efficient_attention has no softcap keyword"),
           "alibi": (False, "memory_efficient_attention has no ALiBi keyword"),
           "splits": (False, "memory_efficient_attention has no num_splits"),
           "returns_lse": (False, "memory_efficient_attention returns out alone")})
CONVENTIONS: dict[str, _Convention] = {c.name: c for c in (FLASH_ATTN, FLASH_ATTN_VARLEN, FLASH_ATTN_KVCACHE, XFORMERS)}


# ------------------------------------------------------------------------------------ declarations
def _callable_words(fn) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    try:
        return f"{name}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return name


def _declaration(fn, convention: _Convention, name: str | None, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The declaration's fields: the convention's defaults, then what :func:`declare` put on ``fn``, then
    ``fields``; refused when one is not a field or changes what the API fixes."""
    if not callable(fn):
        raise ImplementationError(f"{convention.name} convention: {fn!r} is not callable; pass the function "
                                  f"written like {convention.api}")
    given = {**getattr(fn, DECLARED, {}), **fields}
    unknown = sorted(set(given) - _FIELDS | ({"forward"} & set(given)))
    if unknown:
        raise ImplementationError(f"{convention.name} convention: {unknown} are not fields of an Implementation "
                                  f"the adapter takes; it takes {sorted(_FIELDS - {'forward', 'name'})}")
    merged = {**convention.defaults, **given}
    label = name or merged.get("name") or getattr(fn, "__name__", None) or convention.name
    for field, (value, why) in convention.fixed.items():
        if field in merged and merged[field] != value:
            raise ImplementationError(f"{label}: {field}={merged[field]!r}, but the {convention.name} convention "
                                      f"fixes {field}={value!r} ({why})")
    merged.update({field: value for field, (value, _) in convention.fixed.items()})
    merged["name"] = label
    merged.setdefault("description", f"{label}, in {convention.api}'s calling convention")
    return merged


def _check_signature(fn, convention: _Convention, name: str, keywords: list[str]) -> None:
    """Refuse a function that cannot take the positional arguments and keywords the adapter passes (a
    function without an inspectable signature is found out when it is called)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    kind = inspect.Parameter
    call = ", ".join([*convention.positional, *(f"{k}=..." for k in keywords)])
    shown = f"{name}: {_callable_words(fn)} cannot be called in the {convention.name} convention, as {convention.api}"
    positional = [p for p in params if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)]
    if len(positional) < len(convention.positional) and not any(p.kind is kind.VAR_POSITIONAL for p in params):
        raise ImplementationError(f"{shown}: it takes {len(positional)} positional arguments, but the adapter "
                                  f"calls fn({call})")
    named = {p.name for p in params[len(convention.positional):]
             if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)}
    missing = [] if any(p.kind is kind.VAR_KEYWORD for p in params) else [k for k in keywords if k not in named]
    if missing:
        drops = [f"{k}: {_DROPPED_BY[k]}" for k in missing if k in _DROPPED_BY]
        hint = f"; to leave a keyword out, declare {', '.join(drops)}" if drops else ""
        raise ImplementationError(f"{shown}: it takes no keyword {', '.join(map(repr, missing))}; the adapter calls "
                                  f"fn({call}){hint}")
    required = [p.name for p in params[len(convention.positional):] if p.default is kind.empty
                and p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY) and p.name not in keywords]
    if required:
        raise ImplementationError(f"{shown}: it requires {', '.join(map(repr, required))}, which the adapter does "
                                  f"not pass; it calls fn({call})")


def _flash_keywords(impl: Implementation, *, lse_keyword: str, splits: bool = False) -> list[str]:
    """The keywords a flash_attn-convention adapter may pass, given the declaration (``deterministic`` only
    for a declared-deterministic kernel with a backward, ``num_splits`` only where the API has it)."""
    words = ["softmax_scale", "causal"]
    words += [w for w, on in (("window_size", impl.windows), ("softcap", impl.softcap), ("alibi_slopes", impl.alibi),
                              ("deterministic", not splits and impl.autograd and impl.deterministic),
                              ("num_splits", splits and impl.splits), (lse_keyword, impl.returns_lse)) if on]
    return words


# ------------------------------------------------------------------------------------ layouts and results
def _into(t: torch.Tensor, *, contiguous: bool) -> torch.Tensor:
    """A tensor as the API takes it: contiguous when declared ``contiguous_only``, else the view itself
    with a copy only where its last dimension is strided (what flash_attn's wrapper does too)."""
    if contiguous:
        return t.contiguous()
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _expect(label: str, what: str, t, shape: tuple[int, ...], words: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ContractError(f"{label} returned {what} as a {type(t).__name__}, but should return a torch.Tensor "
                            f"{list(shape)} ({words})")
    if tuple(t.shape) != tuple(shape):
        raise ContractError(f"{label} returned {what}.shape={tuple(t.shape)}, but should return {tuple(shape)} "
                            f"({words})")


def _results(label: str, result, *, returns_lse: bool, lse_words: str, lengths: tuple[int, ...]):
    """``(out, lse or None)`` of a flash_attn-convention result: ``out``, or ``(out, lse[, S_dmask])``."""
    if not returns_lse:
        if not isinstance(result, torch.Tensor):
            raise ContractError(f"{label} returned a {type(result).__name__}, but declared returns_lse=False: it is "
                                "called without the LSE keyword and should return out alone")
        return result, None
    if isinstance(result, (tuple, list)) and len(result) in lengths:
        return result[0], result[1]
    got = type(result).__name__ + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
    raise ContractError(f"{label} returned {got}, but {lse_words}; declare returns_lse=False for a function that "
                        "returns out alone")


def _lse_dtype(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """flash_attn's float32 LSE as the contract's float64 for float64 inputs; any other dtype unchanged."""
    return lse.to(torch.float64) if dtype == torch.float64 and lse.dtype == torch.float32 else lse


def _variant_keywords(window_size, softcap, alibi_slopes) -> dict[str, Any]:
    """The suite's variant keywords (passed only when the case has them) under flash_attn's names."""
    kw: dict[str, Any] = {}
    if window_size is not None:
        kw["window_size"] = tuple(window_size)
    if softcap is not None:
        kw["softcap"] = softcap
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes
    return kw


# ------------------------------------------------------------------------------------ the conventions
def _finish(fn, convention: _Convention, fields: dict[str, Any], make_forward) -> Implementation:
    """Build the declaration with ``fn`` as a placeholder forward (so that its fields are validated), check
    ``fn`` against the keywords that declaration passes, and return it with the adapter's forward.
    ``make_forward(draft)`` returns ``(forward, keywords)``."""
    draft = Implementation(forward=fn, **fields)
    forward, keywords = make_forward(draft)
    _check_signature(fn, convention, draft.name, keywords)
    forward.__name__ = f"{convention.name}_adapter"
    forward.__doc__ = f"{draft.name} ({convention.api}'s calling convention) with the suite's contract."
    return dataclasses.replace(draft, forward=forward)


def flash_attn_convention(fn: Callable[..., Any], *, name: str | None = None, **fields: Any) -> Implementation:
    """The declaration of ``fn``, a function written like flash_attn's ``flash_attn_func`` (module docstring):
    its forward moves ``[B, H, N, D]`` to ``[B, N, H, D]`` and back. ``fields``: any other
    :class:`Implementation` field, over the convention's defaults."""
    fields = _declaration(fn, FLASH_ATTN, name, fields)

    def make(impl: Implementation):
        words = _flash_keywords(impl, lse_keyword="return_attn_probs")
        label, contiguous, returns_lse = impl.name, impl.contiguous_only, impl.returns_lse
        deterministic = "deterministic" in words

        def forward(q, k, v, *, causal: bool, scale: float | None, window_size=None, softcap=None,
                    alibi_slopes=None):
            b, hq, nq, d = q.shape
            kw = {"softmax_scale": scale, "causal": causal, **_variant_keywords(window_size, softcap, alibi_slopes)}
            if deterministic:
                kw["deterministic"] = True
            if returns_lse:
                kw["return_attn_probs"] = True
            qf, kf, vf = (_into(t.transpose(1, 2), contiguous=contiguous) for t in (q, k, v))
            out, lse = _results(label, fn(qf, kf, vf, **kw), returns_lse=returns_lse, lengths=(2, 3),
                                lse_words="with return_attn_probs=True flash_attn_func returns (out, softmax_lse, "
                                          "S_dmask)")
            _expect(label, "out", out, (b, nq, hq, d), "flash_attn_func's out is [B, Nq, Hq, D]")
            if lse is None:
                return out.transpose(1, 2)
            _expect(label, "softmax_lse", lse, (b, hq, nq), "flash_attn_func's softmax_lse is [B, Hq, Nq]")
            return out.transpose(1, 2), _lse_dtype(lse, q.dtype)

        return forward, words

    return _finish(fn, FLASH_ATTN, fields, make)


def flash_attn_varlen_convention(fn: Callable[..., Any], *, name: str | None = None,
                                 **fields: Any) -> Implementation:
    """The declaration of ``fn``, a function written like flash_attn's ``flash_attn_varlen_func`` (module
    docstring): packed sequences, whose layout is the suite's own ``packed`` convention
    (:mod:`flashverify_kernels.conventions`), passed on with ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``,
    ``max_seqlen_k`` as its positional arguments. ``fields``: any other :class:`Implementation` field."""
    fields = _declaration(fn, FLASH_ATTN_VARLEN, name, fields)

    def make(impl: Implementation):
        words = _flash_keywords(impl, lse_keyword="return_attn_probs")
        label, contiguous, returns_lse = impl.name, impl.contiguous_only, impl.returns_lse
        deterministic = "deterministic" in words

        def forward(q, k, v, *, causal: bool, scale: float | None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, window_size=None, softcap=None, alibi_slopes=None):
            total, hq, d = q.shape
            kw = {"softmax_scale": scale, "causal": causal, **_variant_keywords(window_size, softcap, alibi_slopes)}
            if deterministic:
                kw["deterministic"] = True
            if returns_lse:
                kw["return_attn_probs"] = True
            qf, kf, vf = (_into(t, contiguous=contiguous) for t in (q, k, v))
            result = fn(qf, kf, vf, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw)
            out, lse = _results(label, result, returns_lse=returns_lse, lengths=(2, 3),
                                lse_words="with return_attn_probs=True flash_attn_varlen_func returns (out, "
                                          "softmax_lse, S_dmask)")
            _expect(label, "out", out, (total, hq, d), "flash_attn_varlen_func's out is [total_q, Hq, D]")
            if lse is None:
                return out
            _expect(label, "softmax_lse", lse, (hq, total), "flash_attn_varlen_func's softmax_lse is [Hq, total_q]")
            return out, _lse_dtype(lse, q.dtype)

        return forward, words

    return _finish(fn, FLASH_ATTN_VARLEN, fields, make)


def flash_attn_kvcache_convention(fn: Callable[..., Any], *, name: str | None = None,
                                  **fields: Any) -> Implementation:
    """The declaration of ``fn``, a function written like flash_attn's ``flash_attn_with_kvcache`` (module
    docstring): ``q`` moved from ``[B, Hq, Nq, D]`` to ``[B, Nq, Hq, D]``, the paged cache (the suite's ``paged``
    convention is flash_attn's) passed as ``k_cache``, ``v_cache`` with ``block_table`` and ``cache_seqlens``.
    Forward only. ``fields``: any other :class:`Implementation` field."""
    fields = _declaration(fn, FLASH_ATTN_KVCACHE, name, fields)

    def make(impl: Implementation):
        words = ["cache_seqlens", "block_table", *_flash_keywords(impl, lse_keyword="return_softmax_lse",
                                                                  splits=True)]
        label, contiguous, returns_lse = impl.name, impl.contiguous_only, impl.returns_lse

        def forward(q, k, v, *, causal: bool, scale: float | None, block_table, seqlens_k, window_size=None,
                    softcap=None, alibi_slopes=None, num_splits=None):
            b, hq, nq, d = q.shape
            kw = {"cache_seqlens": seqlens_k, "block_table": block_table, "softmax_scale": scale, "causal": causal,
                  **_variant_keywords(window_size, softcap, alibi_slopes)}
            if num_splits is not None:
                kw["num_splits"] = num_splits
            if returns_lse:
                kw["return_softmax_lse"] = True
            qf = _into(q.transpose(1, 2), contiguous=contiguous)
            kf, vf = (_into(t, contiguous=contiguous) for t in (k, v))
            out, lse = _results(label, fn(qf, kf, vf, **kw), returns_lse=returns_lse, lengths=(2,),
                                lse_words="with return_softmax_lse=True flash_attn_with_kvcache returns "
                                          "(out, softmax_lse)")
            _expect(label, "out", out, (b, nq, hq, d), "flash_attn_with_kvcache's out is [B, Nq, Hq, D]")
            if lse is None:
                return out.transpose(1, 2)
            _expect(label, "softmax_lse", lse, (b, hq, nq), "flash_attn_with_kvcache's softmax_lse is [B, Hq, Nq]")
            return out.transpose(1, 2), _lse_dtype(lse, q.dtype)

        return forward, words

    return _finish(fn, FLASH_ATTN_KVCACHE, fields, make)


def xformers_convention(fn: Callable[..., Any], *, name: str | None = None,
                        causal_bias: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
                        **fields: Any) -> Implementation:
    """The declaration of ``fn``, a function written like xformers' ``memory_efficient_attention`` (module
    docstring): ``[B, H, N, D]`` moved to ``[B, M, H, K]`` and back; the scale passed as ``scale``.

    Causal masks: xformers takes them as attention-bias objects of its own classes, which this suite does not
    make. Without ``causal_bias`` the declaration is non-causal only (``causal=False``). With it,
    ``causal_bias(query, key)`` (the tensors as ``fn`` gets them) returns the ``attn_bias`` of a causal call,
    and ``causal_alignment`` must say which mask it is: xformers' ``LowerTriangularMask`` is ``"top_left"``
    (key ``j`` visible to query ``i`` iff ``j <= i``), ``LowerTriangularFromBottomRightMask`` is
    ``"bottom_right"`` (``j <= i + Nk - Nq``)::

        from xformers.ops import fmha
        IMPL = xformers_convention(fmha.memory_efficient_attention, causal_alignment="bottom_right",
                                   causal_bias=lambda query, key: fmha.attn_bias.LowerTriangularFromBottomRightMask())

    Non-causal calls pass no ``attn_bias``. ``fields``: any other :class:`Implementation` field."""
    label = name or getattr(fn, "__name__", None) or XFORMERS.name
    if causal_bias is None:
        if fields.get("causal"):
            raise ImplementationError(
                f"{label}: causal=True, but the xformers convention expresses a causal mask only through "
                "causal_bias=lambda query, key: <attn_bias> (an object of xformers' own classes), with "
                "causal_alignment saying which mask it is")
        fields = {"causal": False, "description": (
            f"{label}, in memory_efficient_attention's calling convention; non-causal only: xformers expresses "
            "causal masks as attention-bias objects of its own classes (declare them with causal_bias= and "
            "causal_alignment=)"), **fields}
    else:
        if not callable(causal_bias):
            raise ImplementationError(f"causal_bias={causal_bias!r}, but should be a function (query, key) -> "
                                      "the attn_bias of a causal call, e.g. lambda query, key: "
                                      "LowerTriangularFromBottomRightMask()")
        if "causal_alignment" not in {**getattr(fn, DECLARED, {}), **fields}:
            raise ImplementationError(
                "causal_bias is given without causal_alignment: say which mask it makes, causal_alignment="
                "'top_left' (xformers' LowerTriangularMask: j <= i) or 'bottom_right' "
                "(LowerTriangularFromBottomRightMask: j <= i + Nk - Nq)")
    fields = _declaration(fn, XFORMERS, name, fields)

    def make(impl: Implementation):
        words = ["scale", *(["attn_bias"] if impl.causal else [])]
        label, contiguous = impl.name, impl.contiguous_only

        def forward(q, k, v, *, causal: bool, scale: float | None):
            query, key, value = (_into(t.transpose(1, 2), contiguous=contiguous) for t in (q, k, v))
            kw: dict[str, Any] = {"scale": scale}
            if causal:
                kw["attn_bias"] = causal_bias(query, key)
            out = fn(query, key, value, **kw)
            if isinstance(out, (tuple, list)):
                raise ContractError(f"{label} returned a {type(out).__name__}, but memory_efficient_attention "
                                    "returns out alone, a tensor [B, M, H, K]")
            _expect(label, "out", out, tuple(query.shape[:3]) + (value.shape[3],),
                    "memory_efficient_attention's out is [B, M, H, K]")
            return out.transpose(1, 2)

        return forward, words

    return _finish(fn, XFORMERS, fields, make)


_ADAPTERS: dict[str, Callable[..., Implementation]] = {
    "flash_attn": flash_attn_convention, "flash_attn_varlen": flash_attn_varlen_convention,
    "flash_attn_kvcache": flash_attn_kvcache_convention, "xformers": xformers_convention}


def adapt(fn: Callable[..., Any], convention: str, *, name: str | None = None, **fields: Any) -> Implementation:
    """The declaration of ``fn`` in the calling convention named ``convention`` (one of :data:`CONVENTIONS`:
    ``flash_attn``, ``flash_attn_varlen``, ``flash_attn_kvcache``, ``xformers``), as ``--convention`` names it."""
    if convention not in _ADAPTERS:
        raise ImplementationError(f"convention {convention!r} is not a calling convention; known: "
                                  + ", ".join(f"{c.name} ({c.api})" for c in CONVENTIONS.values()))
    return _ADAPTERS[convention](fn, name=name, **fields)
