"""Pre-flight: call each selected attention implementation once on a tiny case before any property runs.

A kernel that cannot be called as the contract says would otherwise fail every property the same way,
dozens of identical failures that hide the one cause. The plugin calls :func:`preflight` once per selected
implementation; a :class:`PreflightError` becomes one usage error naming the problem (exit status 4).

Only a broken calling convention stops the run: a signature that does not take the contract's arguments,
a result of the wrong structure, shape, dtype or device, inputs modified in place, ``scale=None`` not
meaning ``1/sqrt(D)``. A kernel that raises (or fails to compile) on the tiny case is a failing case like
any other: :func:`preflight` returns a note saying so and the run goes on, so every other case is still
verified and the failing ones come back with their replay commands.

What is called, on the suite's device in the first dtype the implementation declares among float32,
float64, float16, bfloat16 (float32 for a plain callable): ``B=2, Hq=Hkv=3, Nq=5, Nk=7`` and the smallest
head dim it declares (8 for a plain callable), N(0, 1) inputs. Batch, heads, lengths and head dim all
differ, so a result laid out as ``[B, Nq, H, D]`` (or an LSE as ``[B, Nq, H]``) has the wrong shape.
Declared limits are kept (lengths rounded up to the declared multiples, equal when declared, at least
``min_len``; the head dim within ``max_head_dim``; at most ``max_batch_heads`` heads in all),

1. ``forward(q, k, v, causal=False, scale=None)``: must leave ``q, k, v`` as they were and return ``out``
   (q's shape, dtype and device) or ``(out, lse)`` (``lse`` ``[B, Hq, Nq]``, float32, float64 for float64
   inputs, on q's device);
2. the same with ``scale=1/sqrt(D)`` given: must agree with 1. (``scale=None`` means ``1/sqrt(D)``);
3. ``causal=True`` when the implementation declares causal masking.
A causal-only kernel is called with ``causal=True`` in 1. and 2.; one that declares its ``scales`` is
called with the first of them (1. and 3.), and 2. is left out.

Nothing here judges accuracy: the properties do that, with their bounds and replay commands.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import torch

from references.spec import AttentionSpec
from flashverify_kernels import conventions, registry as registry_module
from flashverify_kernels.conventions import ContractError
from flashverify_kernels.registry import Implementation, ImplementationError
from strategies.attention import conform_length
from strategies.cases import dtype_name

# The tiny case: every size differs from every other (Nq < Nk, so that a causal call has a visible key in
# every row).
BATCH, HEADS, LEN_Q, LEN_K, HEAD_DIM = 2, 3, 5, 7, 8
PREFERRED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class PreflightError(ValueError):
    """The implementation cannot be called as the contract says; the message names the problem."""


class _Raised(Exception):
    """The kernel raised on a call of the tiny case (not a calling-convention error by itself)."""

    def __init__(self, call: str, error: BaseException):
        super().__init__(f"{call} raised {_exception_text(error)}")
        self.error = error


def _batch_and_heads(sizes: set[int], most: int | None) -> tuple[int, int]:
    """``(B, H)``, both unlike ``sizes`` (the lengths and the head dim) and each other where possible, with
    ``B * H`` at most ``most``."""
    most = most or BATCH * HEADS
    for b, h in ((BATCH, HEADS), *((b, h) for h in range(2, 12) for b in range(1, 12))):
        if b * h <= most and b != h and not {b, h} & sizes:
            return b, h
    return 1, min(HEADS, most)


def tiny_case(impl: Implementation, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The inputs of the pre-flight call, or None when the implementation runs in no dtype here."""
    usable = [d for d in PREFERRED_DTYPES if d in impl.dtypes and impl.environment_limit(d) is None]
    if not usable or impl.unsupported(device=device):
        return None
    top = impl.head_dim_limit(usable[0])
    head_dim = min(impl.head_dims) if impl.head_dims else min(HEAD_DIM, top or HEAD_DIM)
    # The tiny lengths rounded up into the declared limits (the cap is never reached).
    (mq, mk), least = impl.length_multiples, max(1, impl.min_len)
    len_q = conform_length(LEN_Q, mq, low=least, cap=mq * max(LEN_Q, least))
    len_k = len_q if impl.equal_lengths else conform_length(LEN_K, mk, low=least, cap=mk * max(LEN_K, least))
    if impl.max_len_q is not None:
        len_q = min(len_q, impl.max_len_q)
    batch, heads = _batch_and_heads({len_q, len_k, head_dim}, impl.max_batch_heads)
    if "dense" not in impl.sequences:  # one sequence of a variable-length convention: a batch of one
        batch = 1
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=g, dtype=torch.float64)
               for n in (len_q, len_k, len_k))
    return tuple(t.to(device=device, dtype=usable[0]) for t in (q, k, v))


def _describe(q: torch.Tensor, k: torch.Tensor) -> str:
    b, h, nq, d = q.shape
    return f"B={b} Hq={h} Hkv={k.shape[1]} Nq={nq} Nk={k.shape[2]} D={d} {dtype_name(q.dtype)} on {q.device}"


def _spec(impl: Implementation, causal: bool, len_q: int, len_k: int) -> AttentionSpec:
    """The tiny case's attention: a dense batch, or one sequence of a kernel's first convention when it takes
    no dense batch (a decoding kernel's paged cache)."""
    if "dense" in impl.sequences:
        return AttentionSpec(causal=causal, alignment=impl.causal_alignment)
    convention = impl.sequences[0]
    page = (min(impl.page_sizes) if impl.page_sizes else 16) if convention == "paged" else None
    return AttentionSpec(causal=causal, alignment=impl.causal_alignment, sequences=convention, seqlens_q=(len_q,),
                         seqlens_k=(len_k,), page_size=page)


def _call(impl: Implementation, q, k, v, *, causal: bool, scale: float | None):
    """One call of the tiny case: ``(out, lse)``, checked against the contract. A calling-convention error
    raises :class:`PreflightError`; an exception of the kernel's own raises :class:`_Raised`."""
    call = f"{impl.name}(q, k, v, causal={causal}, scale={scale!r}) on the tiny case {_describe(q, k)}"
    spec = _spec(impl, causal, q.shape[2], k.shape[2])
    _check_signature(impl, call, (q, k, v), spec, scale)
    before = [t.clone() for t in (q, k, v)]
    try:
        with torch.no_grad():
            result = impl.call(q, k, v, spec=spec, scale=scale)
    except (ContractError, ImplementationError) as exc:  # a result of the wrong structure or shape
        raise PreflightError(f"pre-flight: {call}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - whatever the kernel raises is reported, and the run goes on
        raise _Raised(call, exc) from exc
    _check_untouched(call, (q, k, v), before)
    out, lse = result
    where = f"pre-flight: {call} returned"
    _check(where, "out", out, shape=tuple(q.shape), dtype=q.dtype, device=q.device)
    if lse is not None:
        _check(where, "lse", lse, shape=tuple(q.shape[:3]),
               dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=q.device)
    return out, lse


def _check_signature(impl: Implementation, call: str, inputs, spec: AttentionSpec, scale) -> None:
    """The forward takes ``q, k, v`` and the keywords the suite passes (a function whose signature Python
    cannot read is not checked)."""
    q = inputs[0]
    keywords = impl.kernel_keywords(spec, scale, None, None, device=q.device, dtype=q.dtype)
    keywords.update(conventions.layout(spec).inputs(*inputs)[3])
    try:
        signature = inspect.signature(impl.forward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(q, q, q, **keywords)
    except TypeError as exc:
        raise PreflightError(f"pre-flight: {call}: the forward cannot be called so: {exc} (the contract, README.md: "
                             f"forward(q, k, v, *, {', '.join(f'{k}=...' for k in keywords)}))") from None


def _check_untouched(call: str, inputs, before) -> None:
    for name, now, then in zip("qkv", inputs, before):
        same = (now == then) | (torch.isnan(now) & torch.isnan(then))
        if not bool(same.all()):
            idx = [int(i) for i in (~same).nonzero()[0]]
            raise PreflightError(
                f"pre-flight: {call} modified its input {name} in place ({int((~same).sum())} of {now.numel()} "
                f"values changed, first at {idx}: {float(then[tuple(idx)]):.6g} became {float(now[tuple(idx)]):.6g}); "
                "a kernel may read q, k and v but never write them (the caller's tensors, and every later "
                "property, would see the changed values)")


def _exception_text(exc: BaseException) -> str:
    """``Type: message`` and where the kernel raised it (the innermost frame)."""
    import traceback

    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    suite = (Path(__file__).parent, Path(registry_module.__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename).parent != suite[0] and Path(f.filename) != suite[1]]
    if frames:
        text += f" (at {frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})"
    return text


def _check(where: str, label: str, t, *, shape, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise PreflightError(f"{where} {label} as a {type(t).__name__}, but it should be a torch.Tensor "
                             "(the contract: out, or (out, lse))")
    problems = []
    if tuple(t.shape) != shape:
        problems.append(f"{label}.shape={tuple(t.shape)}, but should be {shape}")
    if t.dtype != dtype:
        problems.append(f"{label}.dtype={dtype_name(t.dtype)}, but should be {dtype_name(dtype)}")
    if t.device != device:
        problems.append(f"{label} is on {t.device}, but should be on {device} (the inputs' device)")
    if problems:
        raise PreflightError(f"{where} " + "; ".join(problems)
                             + ("\n  the contract (README.md): out has q's shape [B, Hq, Nq, D] and dtype; lse is "
                                "[B, Hq, Nq], float32 (float64 for float64 inputs), natural log"))


def describe_tiny_case(impl: Implementation, device: str) -> str:
    """The pre-flight's inputs for ``impl`` in words (``B=2 Hq=3 Hkv=3 Nq=5 Nk=7 D=8 float32 on cpu``), or
    that it is not called."""
    inputs = tiny_case(impl, device) if impl.kind == "attention" else None
    return "not called: no dtype it runs in here" if inputs is None else _describe(*inputs[:2])


def preflight(impl: Implementation, *, device: str) -> list[str]:
    """Call ``impl`` on the tiny case; raise :class:`PreflightError` naming the first calling-convention
    error found. Returns notes for the run (a kernel that raised on the tiny case: the run goes on).
    Implementations of kind ``softmax`` and ones that run in no dtype on ``device`` are not called."""
    if impl.kind != "attention":
        return []
    inputs = tiny_case(impl, device)
    if inputs is None:
        return []
    q, k, v = inputs
    causal = not impl.non_causal
    try:
        if impl.scale_choices is not None:  # a declared set of scales: call with the first, the rest is drawn
            _call(impl, q, k, v, causal=causal, scale=impl.scale_choices[0])
        else:
            _scale_none(impl, q, k, v, causal=causal)
        if impl.causal and not causal:
            first = impl.scale_choices[0] if impl.scale_choices is not None else None
            _call(impl, q, k, v, causal=True, scale=first)
    except _Raised as raised:
        return [f"pre-flight: {raised}; not a calling-convention error, so the run goes on: the properties "
                "report every case it raises on, each with its replay command" + _declare_hint(raised.error)]
    return []


def _scale_none(impl: Implementation, q, k, v, *, causal: bool) -> None:
    """Calls 1. and 2. (module docstring): ``scale=None`` means ``1/sqrt(D)``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    try:
        out_none, lse_none = _call(impl, q, k, v, causal=causal, scale=None)
    except _Raised as raised:
        try:  # raises with scale=None, not with the scale given: scale=None is what it mishandles
            _call(impl, q, k, v, causal=causal, scale=scale)
        except _Raised:
            raise raised from None
        raise PreflightError(f"pre-flight: {raised}\n  the suite passes scale=None, which means 1/sqrt(D) (the "
                             "contract in README.md): handle None in the kernel") from raised.error
    out_given, lse_given = _call(impl, q, k, v, causal=causal, scale=scale)
    tol = 64 * torch.finfo(q.dtype).eps
    differs = not torch.allclose(out_none.double(), out_given.double(), rtol=tol, atol=tol, equal_nan=True)
    if lse_none is not None and lse_given is not None:
        differs |= not torch.allclose(lse_none.double(), lse_given.double(), rtol=tol, atol=tol, equal_nan=True)
    if differs:
        gap = float((out_none.double() - out_given.double()).abs().nan_to_num(math.inf).max())
        raise PreflightError(
            f"pre-flight: {impl.name} gives different results for scale=None and scale=1/sqrt(D)={scale:.6g} "
            f"on the tiny case {_describe(q, k)} (out differs by up to {gap:.3g}): the contract (README.md) "
            "says scale=None means 1/sqrt(D)")


def _declare_hint(error: BaseException) -> str:
    from verify.faults import declare_hint

    return declare_hint(error, joiner="; ")
