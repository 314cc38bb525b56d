"""Run one property over Hypothesis-drawn cases for one implementation and dtype.

The test modules stay one line per property; this module decides what a declaration makes
unsupported (a skip with the declaration's words), which cases a property needs (causal only,
grouped-query only, ...), how many examples the profile and the implementation allow, and turns a
case a property cannot use into a rejected example.

Coverage, not repetition: under a derandomized profile (``ci``, ``gpu``) every test draws from its own
seed, derived from the property, the dtype and the test's fixed arguments (and ``--hypothesis-seed``
when given), so N properties explore N times as many inputs at the same cost and every run still draws
the same ones. Every implementation gets the same cases for the same property and dtype, so kernels
(and the mutation self-check's broken ones) are compared on equal terms. Each example labels the
boundary classes it reaches (``event()``, :func:`strategies.attention.boundary_classes`) and reports its
worst error/bound and error/eager ratios to ``target()``, so Hypothesis's search climbs toward the inputs
where a kernel is closest to failing; the classes reached are written to the report (one coverage
record per test).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import math
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import event, given, reject, seed, settings, strategies as st, target

from flashverify_kernels.declaration import CAPABILITIES, Implementation
from references.spec import AttentionSpec
from strategies.attention import Limits, attention_cases, boundary_classes, conform_length
from strategies.cases import DTYPES, FP8_NAMES, AttentionCase
from strategies.softmax import softmax_cases
from verify import properties
from verify.gpu import sticky_cuda_error
from verify.context import Context, Recorder, StickyDeviceError, running
from verify.faults import release_example_memory, release_failed_example
from verify.properties import NotForThisCase, NotForThisKernel
from verify.watchdog import end_if_interrupted

# The dtypes every property is parametrised over; float8 inputs (forward only) have their own module.
DTYPE_NAMES = tuple(name for name in DTYPES if name not in FP8_NAMES)


def _ignore(_: dict[str, Any]) -> None:
    return None


@dataclasses.dataclass
class Env:
    device: str
    profile: str
    limits: Limits
    record: Recorder
    seed: int | str | None = None  # --hypothesis-seed: mixed into every derandomized test's seed
    coverage: Recorder = _ignore  # receives one record per test: the boundary classes its examples reached
    margin: Recorder = _ignore  # receives one record per metamorphic comparison (verify.asserts.assert_close)

    def context(self, impl: Implementation, prop: str, case) -> Context:
        """The :class:`Context` of one example of ``prop`` on ``impl``, recording into this run's report."""
        return Context(impl=impl, prop=prop, device=self.device, record=self.record, case=case, margin=self.margin)


def seed_for(*parts: Any) -> int:
    """A stable 64-bit seed for the test identified by ``parts`` (the same in every run and process)."""
    text = "|".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _own_seed(run, *parts: Any):
    """Give a derandomized test its own seed (Hypothesis would seed every test from the one inner
    function's source, so every property would draw the same examples)."""
    if not settings().derandomize:
        return run
    return seed(seed_for(*parts))(run)


# target() wants finite observations; a ratio past this is a failure anyway.
_TARGET_CAP = 1e12


def _aim(observations: dict[str, float]) -> None:
    """Hand each ratio the example measured (NaN left out by ``Context.observe``) to ``target()``."""
    for label, value in observations.items():
        target(min(float(value), _TARGET_CAP), label=label)


class _Coverage:
    """Counts, over one test's examples, the boundary classes reached; and the extremes of the shapes
    drawn: the longest sequence (by its keys, then its queries), the largest group, the most splits."""

    def __init__(self) -> None:
        self.examples = 0
        self.classes: collections.Counter[str] = collections.Counter()
        self.longest: tuple[int, int] | None = None  # (Nk, Nq) of one sequence
        self.max_group = 0
        self.max_splits = 0

    def add(self, case: AttentionCase, *, drawn: bool = True) -> None:
        """Count ``case``; a drawn one also as Hypothesis's ``event()`` (which only a drawn example has)."""
        self.examples += 1
        for name in boundary_classes(case):
            self.classes[name] += 1
            if drawn:
                event(name)
        spec = case.spec
        pairs = list(zip(spec.seqlens_k, spec.seqlens_q)) if spec.seqlens_k else [(case.len_k, case.len_q)]
        self.longest = max(pairs + ([self.longest] if self.longest else []))
        self.max_group = max(self.max_group, case.group)
        self.max_splits = max(self.max_splits, spec.num_splits)

    def emit(self, env: Env, *, impl: Implementation, prop: str, dtype: str) -> None:
        shapes = {} if self.longest is None else {
            "longest": {"len_k": self.longest[0], "len_q": self.longest[1]}, "max_group": self.max_group,
            "max_splits": self.max_splits}
        env.coverage({"kind": "coverage", "implementation": impl.name, "property": prop, "dtype": dtype,
                      "examples": self.examples, "classes": dict(sorted(self.classes.items())), **shapes})


def _declares(impl: Implementation, *, field: str) -> bool:
    return bool(getattr(impl, field))


REQUIREMENTS = {
    "autograd": (lambda impl: impl.autograd, "declares no autograd backward"),
    "backward": (lambda impl: impl.backward is not None, "does not expose its backward (and Delta)"),
    "tunable": (lambda impl: impl.tunable, "declares no tunable block sizes"),
    "gqa": (lambda impl: impl.gqa, "declares no grouped-query attention"),
    "causal": (lambda impl: impl.causal, "declares no causal masking"),
    "lse": (lambda impl: impl.returns_lse, "returns out alone (no LSE)"),
    "out_buffers": (lambda impl: impl.out_buffers,
                    "declares no out_buffers (its forward takes no out=/lse= buffers to write into)"),
    "strided": (lambda impl: not impl.contiguous_only, "declares contiguous inputs only"),
    # The variants (windows, softcap, alibi, chunks, sinks, splits): from the one table of them.
    **{cap.field: (functools.partial(_declares, field=cap.field), f"declares no {cap.noun}") for cap in CAPABILITIES},
    "varlen": (lambda impl: bool(set(impl.sequences) - {"dense"}),
               "declares no variable-length sequences (packed, padded or paged)"),
    "paged": (lambda impl: "paged" in impl.sequences, "declares no paged KV cache"),
    "dense": (lambda impl: "dense" in impl.sequences, "declares no dense batch (variable-length sequences only)"),
}


def skip_reason(impl: Implementation, dtype: str, env: Env, requires: Iterable[str] = ()) -> str | None:
    """Why this implementation cannot run a property here, in the declaration's own terms."""
    torch_dtype = DTYPES[dtype]
    reason = impl.unsupported(dtype=torch_dtype, device=env.device)
    if reason:
        return reason
    limit = impl.environment_limit(torch_dtype)
    if limit:
        return f"environment limit for {impl.name} in {dtype}: {limit}"
    for need in requires:
        ok, words = REQUIREMENTS[need]
        if not ok(impl):
            return f"{impl.name} {words}"
    return None


def limits_of(impl: Implementation, limits: Limits, dtype: str | None = None) -> Limits:
    """``limits`` narrowed by what ``impl`` declares: its longest sequence, its tile cap (``max_tiles``), its
    most splits (``max_splits``),
    its largest head dim in ``dtype`` (``max_head_dim``), and a head dim it accepts when the profile's
    largest is below its smallest."""
    top_d = impl.head_dim_limit(DTYPES[dtype]) if dtype is not None else None
    if top_d is not None and top_d < limits.max_head_dim:
        limits = dataclasses.replace(limits, max_head_dim=top_d)
    if impl.max_seq_len is not None and impl.max_seq_len < limits.context_len:
        limits = dataclasses.replace(limits, max_len=min(limits.max_len, impl.max_seq_len),
                                     max_context=min(limits.max_context, impl.max_seq_len))
    if impl.max_tiles is not None and impl.max_tiles < limits.max_tiles:
        limits = dataclasses.replace(limits, max_tiles=impl.max_tiles)
    if impl.max_splits is not None and impl.max_splits < limits.max_splits:
        limits = dataclasses.replace(limits, max_splits=impl.max_splits)
    if impl.head_dims is not None:
        smallest = min(impl.head_dims)
        if smallest > limits.max_head_dim:
            limits = dataclasses.replace(limits, max_head_dim=smallest)
    return limits


def _max_examples(impl: Implementation, share: float = 1.0) -> int:
    n = settings().max_examples
    n = min(n, impl.max_examples) if impl.max_examples else n
    return max(1, round(n * share))


def _skip_unless_runnable(impl: Implementation, dtype: str, env: Env, requires: Iterable[str], *,
                          causal: bool | None, longer: str | None = None) -> None:
    """Skip, with the declaration's words, an attention property this implementation cannot run here
    (the report lists the same limits as not covered: ``Implementation.not_covered``)."""
    __tracebackhide__ = True
    if impl.kind != "attention":
        pytest.skip(f"{impl.name} is a {impl.kind} kernel")
    reason = skip_reason(impl, dtype, env, requires)
    if reason:
        pytest.skip(reason)
    if causal and not impl.causal:
        pytest.skip(f"{impl.name} declares no causal masking")
    if causal is False and not impl.non_causal:
        pytest.skip(f"{impl.name} declares causal attention only; the property needs non-causal cases")
    if longer is not None and impl.equal_lengths:
        pytest.skip(f"{impl.name} declares Nq == Nk only; the property needs {longer} longer than the other")


def declared_draws(impl: Implementation, causal: bool | None, draw: dict[str, Any], *,
                   dtype: str | None = None) -> dict[str, Any]:
    """The arguments of :func:`attention_cases` that keep every drawn case within ``impl``'s declaration
    (its limits are part of the draw, never a filter) merged with the property's own constraints; with
    ``dtype``, the tiles it runs in that dtype (``min_block``)."""
    mq, mk = impl.length_multiples
    block_m, block_n = impl.blocks_for(dtype)
    declared = {"gqa": impl.gqa, "block_m": block_m, "block_n": block_n,
                "alignment": impl.causal_alignment, "equal_lengths": impl.equal_lengths,
                "len_q_multiple": mq, "len_k_multiple": mk, "scale_choices": impl.scale_choices,
                "max_batch_heads": impl.max_batch_heads, "head_dims": impl.head_dims, "head_dim_v": impl.head_dim_v,
                "descale": impl.descale,
                **{cap.field: getattr(impl, cap.field) for cap in CAPABILITIES},
                "sequences": impl.sequences, "page_sizes": impl.page_sizes, "max_len_q": impl.max_len_q}
    if causal is None and not (impl.causal and impl.non_causal):
        causal = impl.causal  # the one mask the kernel runs
    declared["causal"] = causal if impl.causal else False
    if impl.contiguous_only:
        declared["layouts"] = ("contiguous",)
    out = {**declared, **draw}
    if impl.min_len:
        out["min_len_q"] = max(out.get("min_len_q", 1), impl.min_len)
        out["min_len_k"] = max(out.get("min_len_k", 0), impl.min_len)
        out["min_len"] = impl.min_len  # every sequence's, with variable-length sequences
    return out


def check_attention(prop: str, impl: Implementation, dtype: str, env: Env, *, requires: Iterable[str] = (),
                    causal: bool | None = None, limits: Limits | None = None,
                    magnitudes: Iterable[str] | None = None, layouts: Iterable[str] | None = None,
                    examples_share: float = 1.0, **draw: Any) -> None:
    """Check attention property ``prop`` on ``impl`` in ``dtype`` over drawn cases (``examples_share``:
    the fraction of the profile's examples to draw, for a property that makes several calls per case).
    ``draw``: constraints of :func:`strategies.attention.attention_cases` (``min_group``, ``min_len_q``,
    ``longer``); the case each example runs is the case drawn, never edited after."""
    __tracebackhide__ = True
    _skip_unless_runnable(impl, dtype, env, requires, causal=causal, longer=draw.get("longer"))
    fn = properties.PROPERTIES[prop]
    kwargs = dict(draw)
    if "sequences" in kwargs:  # the conventions the property can use, among those the kernel declares
        usable = tuple(s for s in impl.sequences if s in kwargs["sequences"])
        if not usable:
            pytest.skip(f"{impl.name} declares sequences {impl.sequences}; {prop} needs one of {kwargs['sequences']}")
        kwargs["sequences"] = usable
    if magnitudes is not None:
        kwargs["magnitudes"] = tuple(magnitudes)
    if layouts is not None:
        kwargs["layouts"] = tuple(layouts)
    strategy = attention_cases(dtype=dtype, limits=limits_of(impl, limits or env.limits, dtype),
                               **declared_draws(impl, causal, kwargs, dtype=dtype))
    coverage = _Coverage()

    @settings(max_examples=_max_examples(impl, examples_share))
    @given(data=st.data())
    def run(data):
        case = data.draw(strategy, label="case")
        coverage.add(case)
        ctx = env.context(impl, prop, case)
        try:
            run_example(fn, ctx, case, env)
        except NotForThisKernel as exc:
            pytest.skip(str(exc))
        except NotForThisCase:
            reject()
        _aim(ctx.observations)

    run = _own_seed(run, "attention", prop, dtype, causal, sorted(draw.items()), examples_share, limits, env.seed)
    try:
        run()
    finally:
        coverage.emit(env, impl=impl, prop=prop, dtype=dtype)


def run_example(fn, ctx: Context, case, env: Env) -> None:
    """Run one example of a property. On a GPU: a sticky CUDA error raised anywhere in it (the kernel's
    backward, or the suite's own work after the kernel broke the context) ends the test with this case
    (:class:`verify.context.StickyDeviceError`, which Hypothesis does not shrink: every later example in
    this process would fail the same way); and what the example left allocated is collected
    (:func:`verify.faults.release_example_memory`), so that the next one starts from what the worker's
    budget allows, also after a failure (:func:`verify.faults.release_failed_example`).

    Any exception leaving the example carries its context (:func:`verify.context.failing_context`): the
    failure file names the case that ran, exactly as drawn, and its replay command. A run a signal asked to
    end ends here if its interrupt was lost (:func:`verify.watchdog.end_if_interrupted`)."""
    end_if_interrupted()
    on_gpu = not env.device.startswith("cpu")
    try:
        with running(ctx):
            fn(ctx, case)
    except Exception as exc:
        if on_gpu and sticky_cuda_error(exc) is not None:
            raise StickyDeviceError(ctx, exc, where="property (its backward, or the checks after it)") from exc
        if on_gpu:  # the failure outlives the example (Hypothesis keeps it while it shrinks, pytest after
            release_failed_example(exc)  # the test): not the device memory its frames' tensors hold
        raise
    finally:
        if on_gpu:
            release_example_memory(env.device)


def longest_case(impl: Implementation, dtype: str, limits: Limits, *, causal: bool,
                 context: bool = False) -> AttentionCase:
    """The largest case the limits allow, for one fixed example that drawing may never reach: Nk at
    ``max_len``, as many queries as ``max_scores`` leaves (at most Nk), one head, the largest head dim
    up to 128 the implementation accepts, N(0, 1) inputs, the implementation's own block sizes. With
    ``context``: one query against the longest KV cache the limits allow (``Limits.context_len``).

    A tunable kernel that declares ``max_tiles`` (its tile loop runs in Python) runs its largest
    declared tiles instead, and the lengths stop where the tile count would pass ``max_tiles``.
    Declared limits hold here too: lengths rounded down to the declared multiples (equal when declared),
    at least ``min_len``, the first declared scale."""
    limits = limits_of(impl, limits, dtype)
    len_k = limits.context_len if context else limits.max_len
    block_m = block_n = None
    if impl.max_tiles is not None and impl.tunable:
        block_m, block_n = (max(sizes) for sizes in impl.blocks_for(dtype))
        len_k = min(len_k, limits.tiles_per_axis * block_n)
    len_q = 1 if context else max(1, min(len_k, limits.max_scores // len_k))
    if block_m is not None:
        len_q = min(len_q, limits.tiles_per_axis * block_m)
    mq, mk = impl.length_multiples
    if impl.equal_lengths:  # the longest N with N * N within max_scores (and the query tiles' cap)
        len_q = len_k = max(1, min(len_k, math.isqrt(limits.max_scores),
                                   limits.tiles_per_axis * block_m if block_m is not None else len_k))
    if impl.max_len_q is not None:
        len_q = min(len_q, impl.max_len_q)
    len_q = conform_length(len_q, mq, low=max(1, impl.min_len), cap=len_q)  # rounded down, within the limits
    len_k = len_q if impl.equal_lengths else conform_length(len_k, mk, low=impl.min_len, cap=len_k)
    dims = [d for d in (impl.head_dims or range(1, limits.max_head_dim + 1))
            if d <= min(128, limits.max_head_dim) and d % 8 == 0] or sorted(impl.head_dims or [8])[:1]
    if context:  # its rows within those the worker's budget holds (as the long_context class draws them)
        len_k = max(1, min(len_k, limits.max_rows // max(dims) - 1))
        len_k = conform_length(len_k, mk, low=impl.min_len, cap=len_k)
    # A kernel that takes no dense batch gets the case as one sequence of its first convention.
    sequences = {} if "dense" in impl.sequences else dict(
        sequences=impl.sequences[0], seqlens_q=(len_q,), seqlens_k=(len_k,),
        page_size=(min(impl.page_sizes) if impl.page_sizes else 256) if impl.sequences[0] == "paged" else None)
    return AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=len_q, len_k=len_k, head_dim=max(dims),
                         dtype=dtype, spec=AttentionSpec(causal=causal, alignment=impl.causal_alignment, **sequences),
                         magnitude="normal", seed=0, layout="contiguous",
                         scale=impl.scale_choices[0] if impl.scale_choices else None,
                         block_m=block_m, block_n=block_n)


def check_longest(prop: str, impl: Implementation, dtype: str, env: Env, *, causal: bool,
                  requires: Iterable[str] = (), context: bool = False) -> None:
    """Check attention property ``prop`` on :func:`longest_case` (no drawing: one fixed example), and
    with ``context`` also on the one query against the longest KV cache, where the limits draw one
    past ``max_len`` (the gpu profile's ``long_context``) and the kernel takes a single query."""
    __tracebackhide__ = True
    _skip_unless_runnable(impl, dtype, env, requires, causal=causal)
    cases = [longest_case(impl, dtype, env.limits, causal=causal)]
    limits = limits_of(impl, env.limits, dtype)
    if (context and limits.context_len > limits.max_len and not impl.equal_lengths
            and impl.length_multiples[0] == 1 and impl.min_len <= 1):
        cases.append(longest_case(impl, dtype, env.limits, causal=causal, context=True))
    coverage = _Coverage()  # the longest cases count in the property's coverage (its longest sequence)
    try:
        for case in cases:
            coverage.add(case, drawn=False)
            ctx = env.context(impl, prop, case)
            try:
                run_example(properties.PROPERTIES[prop], ctx, case, env)
            except (NotForThisKernel, NotForThisCase) as exc:
                pytest.skip(f"{case.describe()}: {exc}")
    finally:
        if coverage.examples:
            coverage.emit(env, impl=impl, prop=prop, dtype=dtype)


def check_softmax(prop: str, impl: Implementation, dtype: str, env: Env) -> None:
    """Check softmax property ``prop`` on the softmax kernel ``impl`` in ``dtype``."""
    __tracebackhide__ = True
    reason = skip_reason(impl, dtype, env)
    if reason:
        pytest.skip(reason)
    fn = properties.SOFTMAX_PROPERTIES[prop]
    strategy = softmax_cases(dtype=dtype, block_n=impl.block_n, max_n=max(8, env.limits.max_len))

    @settings(max_examples=_max_examples(impl))
    @given(data=st.data())
    def run(data):
        case = data.draw(strategy, label="case")
        run_example(fn, env.context(impl, prop, case), case, env)

    _own_seed(run, "softmax", prop, dtype, env.seed)()


__all__ = ["DTYPE_NAMES", "FP8_NAMES", "Env", "check_attention", "check_longest", "check_softmax", "longest_case"]
