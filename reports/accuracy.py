"""The accuracy report: a sweep of shapes x magnitude classes x dtypes x causal over chosen
implementations, measured against the float64 reference.

What is measured, per implementation and case, for ``out``, ``lse`` (when returned), ``dQ``, ``dK`` and
``dV``: the RMSE against float64 (the FlashAttention-3 paper's measure), the max abs and max relative
error, the max error in ULPs of the stored dtype, error/bound (criterion 2, the componentwise
rounding-error bound of :mod:`references.bounds`) and error/eager (criterion 1, against the
same-precision eager baseline of :mod:`references.baseline`). Every number comes from the suite's own
code: cases are :class:`strategies.cases.AttentionCase` (inputs from the seed, magnitude classes
included), and each kernel runs and is measured by :mod:`verify.measure`, the code the properties
measure with (reference, baseline, bounds and criteria), so a case passes or fails here exactly as in
``pytest verify``. Each measurement is recorded under the property that checks it
(``out_matches_reference``, ``lse_matches_reference``, ``gradients_match_reference``) and replays with
``python -m verify.replay``. This module runs the sweep and renders what it recorded.

The reference follows each implementation's declared causal alignment (SDPA's backends align top-left); with ``Nq = Nk``, as in the dense sweep, both alignments give the same mask (kernels of both
alignments then share one reference: :func:`_alignment_matters`).

The FlashAttention-3 paper's accuracy protocol (``--preset fa3``; :data:`FA3_PAPER_SETUP`): a sweep whose
cases include the ``fa3_outliers`` magnitude class gets a section "FlashAttention-3 accuracy protocol"
(:func:`fa3_protocol`), the RMSE of O per implementation and dtype from the same records as every other
table, beside the paper's Table 3 figures, and, for that table alone, the RMSE of the same O against the
float64 reference of the draws before they were rounded (:class:`UnroundedInputs`).

Variants (``--preset variants``; :data:`VARIANTS`): a sweep with ``variants`` measures, instead of the dense
grid, each variant's case (:func:`variant_case`: packed variable-length sequences, a sliding window, a logit
softcap, decoding from a paged KV cache, and the dense case beside them) through the same
:func:`verify.measure.sweep_case`, and gets a per-variant table (:func:`variant_rows`) that also names each
implementation that was not measured on a variant and why (its declaration's ``unsupported_spec``).

Fault tolerance: measurements stream to ``accuracy-measurements.jsonl`` as they are taken, with a
``done`` line after each (implementation, case); ``--resume`` skips what is done, ``--time-limit``
stops starting new cases and writes a partial report, and ``python -m reports summarise DIR``
re-renders the report of an interrupted sweep.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from reports.session import device_name, read_jsonl, versions
from reports.summary import RECORD_COLUMNS, fmt, largest, num
from strategies.cases import dtype_name

SWEEP_MAGNITUDES = ("normal", "sparse_outliers", "large_logits")
OPS = ("out", "lse", "dq", "dk", "dv")
METRICS = tuple(RECORD_COLUMNS)
# Adapters to peers measured by default next to the shipped kernels, where they run on the device.
PEERS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_attention")

# ------------------------------------------------------------------ the FlashAttention-3 paper's protocol
FA3_TITLE = "FlashAttention-3 accuracy protocol"
FA3_MAGNITUDE = "fa3_outliers"
FA3_SOURCE = ("the FlashAttention-3 paper (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao; arXiv 2407.08608), "
              "section 4.3 \"Numerical error validation\", Table 3")
# Table 3's FP16 RMSE of O, by the method the paper names. (Its FP8 rows have no counterpart here: the
# suite has no FP8 kernel.)
FA3_PAPER_FP16 = {"standard attention": 3.2e-4, "FlashAttention-2": 1.9e-4, "FlashAttention-3": 1.9e-4}
# The paper's method each implementation here computes: the same algorithm and precision, not the same code.
FA3_PAPER_METHOD = {"standard": "standard attention", "fa2_blocked": "FlashAttention-2",
                    "triton_fa2": "FlashAttention-2", "sdpa_flash": "FlashAttention-2"}
# What the paper states of its setup, and what it leaves out.
FA3_PAPER_SETUP = ("The paper states the input distribution (every entry of Q, K, V is N(0, 1) + N(0, 100) x "
                   "Bernoulli(0.001)), the float64 reference and the measure (RMSE of O). It does not state the "
                   "sequence length, head dim, batch size, number of heads or causal masking of Table 3. The "
                   "shapes here are a choice: the configuration of the paper's speed benchmarks (section 4.1: "
                   "hidden dimension 2048, i.e. 16 heads of dim 128, and 16k tokens per batch), without a "
                   "causal mask.")
# The implementations of the protocol's table: the paper's baseline (flashverify_kernels/pytorch/standard.py), criterion 1's
# eager attention, the suite's FlashAttention-2 and, where they run, the Triton FA2 and the peers.
FA3_IMPLEMENTATIONS = ("flashverify_kernels.pytorch.standard:STANDARD", "eager", "fa2_blocked")
FA3_IMPLEMENTATIONS_CUDA = (*FA3_IMPLEMENTATIONS, "triton_fa2", *PEERS)

# ------------------------------------------------------------------ variants
VARIANTS_TITLE = "Variants"
# The variants the report measures (:func:`variant_case`), the dense case first as the point of comparison.
VARIANTS = ("dense", "packed", "window", "softcap", "paged_decode")
VARIANT_SOFTCAP = 30.0  # Grok-1's attention logit cap (Gemma 2's is 50)
VARIANT_PAGE_SEED = 1  # pages out of order in the cache, as a serving engine hands them out
VARIANT_WORDS = {
    "dense": "one dense batch, none of the variants (the point of comparison)",
    "packed": "variable-length sequences packed one after another (flash_attn's varlen layout, cu_seqlens): "
              "4 sequences of N, N/2 + 3, N/4 + 1 and 1 tokens, each with as many keys as queries",
    "window": "a sliding window of N/4 keys before the diagonal (and N/4 after it without a causal mask)",
    "softcap": f"a logit softcap of {VARIANT_SOFTCAP:g} (scores s -> {VARIANT_SOFTCAP:g} tanh(s / "
               f"{VARIANT_SOFTCAP:g}))",
    "paged_decode": "decoding from a paged KV cache: one query per sequence (Nq = 1), 4 sequences with N, N/2 + 3, "
                    "N/4 + 1 and 1 cached keys, in pages of page_size keys out of order (flash_attn_with_kvcache's "
                    "block table), grouped-query attention with Hkv = H/4 (1 when H < 4)",
}
# The variants preset's implementations: the blocked kernels and eager (every variant), the Triton FA2/FA1
# kernels (dense and packed sequences, windows, softcaps) and Triton's paged decoding (paged_decode only,
# forward only); the report names, variant by variant, each one that was not measured and why.
VARIANT_IMPLEMENTATIONS = ("fa2_blocked", "fa1_blocked", "eager", "triton_fa2", "triton_fa1", "triton_decode")

PRESETS = {
    # Small enough for a CPU in about a minute (the Triton kernels too, in the interpreter).
    "quick": {"lengths": (64, 128), "head_dims": (32,)},
    # The GPU report in docs/: the sequence lengths and head dims of the FlashAttention papers' plots.
    "gpu": {"lengths": (512, 1024, 2048, 4096), "head_dims": (64, 128)},
    # The FlashAttention-3 paper's accuracy protocol (FA3_PAPER_SETUP): its magnitude class, no causal
    # mask, float16 (the paper's) and bfloat16, the forward only (Table 3 measures O), three draws of the
    # inputs, 16 heads of dim 128. On a GPU B=4 x N=4096 (16k tokens); on a CPU one sequence of 1024, to
    # run in a minute. ``baselines``: selected to be compared with, not judged: their failed criteria are
    # reported, but do not set the exit status.
    "fa3": {"magnitudes": (FA3_MAGNITUDE,), "causal": (False,), "dtypes": ("float16", "bfloat16"),
            "head_dims": (128,), "heads": 16, "seeds": (0, 1, 2), "backward": False,
            "lengths": (1024,), "batch": 1, "implementations": FA3_IMPLEMENTATIONS, "baselines": ("standard",),
            "cuda": {"lengths": (4096,), "batch": 4, "implementations": FA3_IMPLEMENTATIONS_CUDA}},
    # The variants real kernels compute (VARIANTS), causal, float16 and bfloat16, forward and backward, inputs
    # N(0, 1) and with large logits (where the softcap bites). ``list_all``: the preset's implementations are
    # listed even where they do not run (the Triton kernels on a CPU), each variant's reason in the report.
    "variants": {"variants": VARIANTS, "magnitudes": ("normal", "large_logits"), "causal": (True,),
                 "lengths": (96,), "head_dims": (32,), "heads": 4, "page_size": 16,
                 "implementations": VARIANT_IMPLEMENTATIONS, "list_all": True,
                 "cuda": {"lengths": (4096,), "head_dims": (128,), "heads": 16, "page_size": 256}},
}


def preset(name: str, *, device: str) -> dict:
    """The fields of preset ``name`` on ``device`` (a preset may set other values on a GPU)."""
    fields = dict(PRESETS[name])
    on_device = fields.pop("cuda", {})
    if torch_device_type(device) == "cuda":
        fields.update(on_device)
    return fields


def torch_device_type(device: str) -> str:
    import torch

    return torch.device(device).type


STREAM = "accuracy-measurements.jsonl"
RUN_FILE = "accuracy-run.json"
OUTPUTS = ("accuracy.json", "accuracy.md", "accuracy.html")


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The cases of a sweep: every combination, ``Nq = Nk = N``, ``Hq = Hkv = heads``; with ``variants``,
    each variant's case (:func:`variant_case`, ``page_size`` for the paged ones) for every combination."""

    lengths: tuple[int, ...]
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...] = ("float16", "bfloat16")
    magnitudes: tuple[str, ...] = SWEEP_MAGNITUDES
    causal: tuple[bool, ...] = (False, True)
    batch: int = 1
    heads: int = 2
    seeds: tuple[int, ...] = (0,)
    backward: bool = True
    variants: tuple[str, ...] = ()
    page_size: int = 16

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"variants={unknown}, but should be among {VARIANTS}")

    def cases(self):
        from references.spec import AttentionSpec
        from strategies.cases import AttentionCase

        if self.variants:
            return [variant_case(variant, length=n, head_dim=d, dtype=dtype, magnitude=magnitude, causal=causal,
                                 seed=seed, batch=self.batch, heads=self.heads, page_size=self.page_size)
                    for n in self.lengths for d in self.head_dims for variant in self.variants
                    for dtype in self.dtypes for magnitude in self.magnitudes for causal in self.causal
                    for seed in self.seeds]
        return [AttentionCase(batch=self.batch, heads_q=self.heads, heads_kv=self.heads, len_q=n, len_k=n,
                              head_dim=d, dtype=dtype, spec=AttentionSpec(causal=causal), magnitude=magnitude,
                              seed=seed)
                for n in self.lengths for d in self.head_dims for dtype in self.dtypes
                for magnitude in self.magnitudes for causal in self.causal for seed in self.seeds]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def select_implementations(specs: list[str], *, device: str, defaults: tuple[str, ...] | None = None,
                           list_all: bool = False) -> list:
    """``--impl`` values plus ``eager`` (the criterion-1 baseline, for comparison). Without ``specs``: the
    ``defaults`` (``--impl`` values, a preset's) that exist and run on ``device`` (with ``list_all``: also
    those that do not run there, which the report lists as not measured, with the reason), or else every
    shipped attention kernel that runs on ``device``, ``eager`` and the peers of :data:`PEERS` that run there."""
    from flashverify_kernels import registry

    shipped = registry.registry()
    dev = torch_device_type(device)
    if specs:
        impls = [registry.load(spec, device=device) for spec in specs]
    elif defaults is not None:
        impls = [registry.load(spec, device=device) for spec in defaults if spec in shipped or ":" in spec]
        impls = [i for i in impls if list_all or dev in i.devices]
    else:
        impls = [i for i in registry.default_selection(device=device) if i.kind == "attention"]
        impls += [shipped[p] for p in PEERS if p in shipped and dev in shipped[p].devices]
    if not any(i.name == "eager" for i in impls):
        impls.append(shipped["eager"])
    seen, unique = set(), []
    for impl in impls:
        if impl.cli_name not in seen:
            seen.add(impl.cli_name)
            unique.append(impl)
    return unique


def skip_reason(impl, case, *, device: str) -> str | None:
    """Why ``impl`` does not run ``case`` here, in the words of its declaration (None: it runs). The
    attention the case asks for comes first (a variant the kernel does not declare is the reason on any
    device), computed with the kernel's own causal alignment (:func:`_as_computed_by`)."""
    if impl.kind != "attention":
        return f"{impl.name} is a {impl.kind} kernel"
    why = impl.unsupported_spec(_as_computed_by(case, impl.causal_alignment).spec)
    if why:
        return why
    why = impl.unsupported(dtype=case.torch_dtype, device=device)
    if why:
        return why
    limit = impl.environment_limit(case.torch_dtype)
    if limit:
        return f"environment limit: {limit}"
    if not impl.supports_head_dim(case.head_dim):
        dims = list(impl.head_dims)
        return (f"{impl.name} declares head dims {dims[0]}..{dims[-1]} ({len(dims)} values); "
                f"D={case.head_dim} is not among them")
    if impl.max_seq_len is not None and max(case.len_q, case.len_k) > impl.max_seq_len:
        return f"{impl.name} declares sequences up to {impl.max_seq_len}"
    return None


# ------------------------------------------------------------------------------------ variants
def _sequence_lengths(n: int) -> tuple[int, ...]:
    """Four sequence lengths from ``n``: ``n``, ``n/2 + 3``, ``n/4 + 1`` and 1 (lengths that are not
    multiples of a tile or a page, and the shortest; all different for ``n > 6``)."""
    return n, n // 2 + 3, n // 4 + 1, 1


def decode_kv_heads(heads: int) -> int:
    """The key/value heads of the paged decode variant: a grouped-query group of 4 (1 head when fewer)."""
    return heads // 4 if heads % 4 == 0 else 1


def variant_case(variant: str, *, length: int, head_dim: int, dtype: str, magnitude: str = "normal",
                 causal: bool = True, seed: int = 0, batch: int = 1, heads: int = 2, page_size: int = 16):
    """The case of ``variant`` (:data:`VARIANT_WORDS`) at length ``N`` = ``length``. Variable-length
    sequences are one packed batch (``batch = 1``, ``len_q``/``len_k`` the sums of the sequences' lengths,
    as :class:`strategies.cases.AttentionCase` holds them); the others have ``batch`` rows of ``N`` queries
    and keys."""
    from references.spec import AttentionSpec
    from strategies.cases import AttentionCase

    n, heads_kv = length, heads
    if variant == "dense":
        spec = AttentionSpec(causal=causal)
    elif variant == "packed":
        lens = _sequence_lengths(n)
        spec = AttentionSpec(causal=causal, sequences="packed", seqlens_q=lens, seqlens_k=lens)
    elif variant == "window":
        width = max(n // 4, 1)
        spec = AttentionSpec(causal=causal, window_left=width, window_right=0 if causal else width)
    elif variant == "softcap":
        spec = AttentionSpec(causal=causal, softcap=VARIANT_SOFTCAP)
    elif variant == "paged_decode":
        lens = _sequence_lengths(n)
        spec = AttentionSpec(causal=causal, sequences="paged", seqlens_q=(1,) * len(lens), seqlens_k=lens,
                             page_size=page_size, page_seed=VARIANT_PAGE_SEED)
        heads_kv = decode_kv_heads(heads)
    else:
        raise ValueError(f"variant={variant!r}, but should be one of {VARIANTS}")
    if spec.varlen:
        batch, len_q, len_k = 1, sum(spec.seqlens_q), sum(spec.seqlens_k)
    else:
        len_q = len_k = n
    return AttentionCase(batch=batch, heads_q=heads, heads_kv=heads_kv, len_q=len_q, len_k=len_k,
                         head_dim=head_dim, dtype=dtype, spec=spec, magnitude=magnitude, seed=seed)


def variant_of(spec) -> str:
    """The variant an :class:`references.spec.AttentionSpec` computes, in :data:`VARIANTS`' words ("dense"
    when none; parts joined with " + " for a spec that has several)."""
    parts = []
    if spec.sequences == "paged":
        parts.append("paged_decode" if set(spec.seqlens_q) == {1} else "paged")
    elif spec.varlen:
        parts.append(spec.sequences)
    for word, present in (("window", spec.windowed), ("chunks", spec.attention_chunk > 0),
                          ("softcap", spec.softcap is not None), ("alibi", spec.alibi_slopes is not None),
                          ("sinks", spec.sinks is not None), ("splits", spec.num_splits > 1)):
        if present:
            parts.append(word)
    return " + ".join(parts) or "dense"


# ------------------------------------------------------------------------------------ the sweep
def _impl_info(impl) -> dict:
    return {"name": impl.name, "spec": impl.cli_name, "description": impl.description,
            "causal_alignment": impl.causal_alignment, "returns_lse": impl.returns_lse,
            "dtypes": [dtype_name(d) for d in impl.dtypes], "devices": list(impl.devices)}


def _as_computed_by(case, alignment: str):
    """The sweep's case as a kernel with this causal ``alignment`` computes it (with Nq = Nk, as in the
    dense sweep, both alignments give the same mask: :func:`_alignment_matters`)."""
    return case.replace(spec=dataclasses.replace(case.spec, alignment=alignment))


def _alignment_matters(case) -> bool:
    """Whether the two causal alignments give ``case`` different attention: only through a diagonal (the
    causal mask, a window, chunks, ALiBi), and only where the two put it on different keys (``Nq != Nk``,
    in a dense batch or in a sequence)."""
    spec = case.spec
    if not (spec.causal or spec.windowed or spec.attention_chunk or spec.alibi_slopes is not None):
        return False
    bottom, top = (dataclasses.replace(spec, alignment=a).diagonal(case.len_q, case.len_k)
                   for a in ("bottom_right", "top_left"))
    return not bool((bottom == top).all())


def _case_key(spec: str, case: dict) -> str:
    return spec + " " + json.dumps(case, sort_keys=True, separators=(",", ":"))


def read_stream(out_dir: Path) -> tuple[list[dict], int]:
    """The lines of the sweep's stream (a truncated last line is skipped and counted)."""
    return read_jsonl(Path(out_dir) / STREAM)


def run(sweep: Sweep, impls: list, *, device: str, out_dir: str | Path, command: str, resume: bool = False,
        time_limit: float | None = None, progress: bool | None = None, log: Callable[[str], None] = print) -> dict:
    """Run the sweep, streaming measurements into ``out_dir``, then write the report; return its data."""
    from reports.progress import Progress
    from reports.session import dumps, write_atomic
    from verify import measure
    from verify.harness import OutOfMemoryError, exception_line, release_out_of_memory

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stream_path = out_dir / STREAM
    cases = sweep.cases()
    done: set[str] = set()
    if resume:
        for item in read_stream(out_dir)[0]:
            if item.get("kind") == "done":
                done.add(_case_key(str(item.get("spec")), item.get("case") or {}))
    else:
        stream_path.unlink(missing_ok=True)
        for name in OUTPUTS:
            (out_dir / name).unlink(missing_ok=True)
    # (implementation, reason, and in a sweep of variants the case's variant and dtype) -> cases
    skipped: dict[tuple, int] = defaultdict(int)
    plan = []  # (case, [impls still to run])
    planned_pairs = []  # every (spec, case index) the sweep measures, done or not
    for index, case in enumerate(cases):
        run_here = []
        for impl in impls:
            why = skip_reason(impl, case, device=device)
            if why:
                skipped[(impl.name, why, *((variant_of(case.spec), case.dtype) if sweep.variants else ()))] += 1
                continue
            planned_pairs.append([impl.cli_name, index])
            if _case_key(impl.cli_name, _as_computed_by(case, impl.causal_alignment).to_dict()) not in done:
                run_here.append(impl)
        plan.append((case, run_here))
    previous = {}
    if resume and (out_dir / RUN_FILE).exists():
        try:
            previous = json.loads((out_dir / RUN_FILE).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            previous = {}
    header = {
        "command": command, "commands": [*(previous.get("commands") or []), command],
        "device": device, "device_name": device_name(device), "versions": versions(),
        "sweep": sweep.as_dict(), "implementations": [_impl_info(i) for i in impls],
        "skipped": [{"implementation": n, "reason": r, "cases": c, **dict(zip(("variant", "dtype"), where))}
                    for (n, r, *where), c in sorted(skipped.items())],
        "started": previous.get("started") or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cases": len(cases), "planned": len(planned_pairs), "planned_pairs": planned_pairs,
    }
    write_atomic(out_dir / RUN_FILE, dumps(header, indent=2))
    total = sum(len(r) for _, r in plan)
    bar = Progress(total, enabled=progress)
    started = time.monotonic()
    stopped_early = False
    with open(stream_path, "a", encoding="utf-8") as stream:
        def emit(item: dict) -> None:
            stream.write(dumps(item) + "\n")
            stream.flush()

        for case, run_here in plan:
            if not run_here:
                continue
            if time_limit is not None and time.monotonic() - started > time_limit:
                stopped_early = True
                break
            t = case.build(device)
            truths: dict[str, measure.Truth] = {}
            unrounded: dict[str, UnroundedInputs] = {}
            for impl in run_here:
                kcase = _as_computed_by(case, impl.causal_alignment)
                if time_limit is not None and time.monotonic() - started > time_limit:
                    stopped_early = True
                    break
                label = f"{impl.name} {kcase.dtype} N={kcase.len_k} D={kcase.head_dim} {kcase.magnitude}" \
                        f"{' causal' if kcase.causal else ''}{f' {variant_of(kcase.spec)}' if sweep.variants else ''}"
                bar.show(label)
                key = impl.causal_alignment if _alignment_matters(kcase) else "any"
                tic = time.monotonic()
                if key not in truths:
                    truths[key] = measure.Truth(kcase, t.q, t.k, t.v, dout=t.dout if sweep.backward else None)
                outputs: dict = {}  # what the records measured, for the FlashAttention-3 table's second reference
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        records, problems = measure.sweep_case(impl, kcase, t, truths[key], device=device,
                                                               backward=sweep.backward, outputs=outputs)
                    except OutOfMemoryError as exc:  # in the suite's own work: start the case's truths afresh
                        truths.clear()
                        records, problems = [], [release_out_of_memory(exc)]
                    except Exception as exc:  # noqa: BLE001 - a kernel that raises is reported, not fatal
                        said = sorted({str(w.message).strip().splitlines()[0] for w in caught
                                       if str(w.message).strip()})[:3]
                        records, problems = [], [exception_line(exc) + "".join(f" [warning: {s}]" for s in said)]
                for r in records:
                    emit({"kind": "measurement", "spec": impl.cli_name, **r})
                if kcase.magnitude == FA3_MAGNITUDE and any(r["op"] == "out" for r in records):
                    # the same O against the float64 reference of the draws before rounding
                    if key not in unrounded:
                        unrounded[key] = UnroundedInputs(kcase, t, device=device)
                    emit({"kind": UNROUNDED_KIND, "implementation": impl.name, "spec": impl.cli_name,
                          "case": kcase.to_dict(), "op": "out", "rmse": unrounded[key].rmse(outputs["out"])})
                for p in problems:
                    emit({"kind": "error", "implementation": impl.name, "spec": impl.cli_name,
                          "case": kcase.to_dict(), "error": p})
                emit({"kind": "done", "implementation": impl.name, "spec": impl.cli_name, "case": kcase.to_dict(),
                      "seconds": round(time.monotonic() - tic, 3)})
                bar.update(label=label)
            del truths, unrounded, t
            if stopped_early:
                break
    bar.close()
    if stopped_early:
        log(f"stopped after --time-limit {time_limit:g} s; rerun the same command with --resume to continue")
    return write_report(out_dir)


# ------------------------------------------------------------------------------------ unrounded inputs
# The stream's lines of the FlashAttention-3 table's second column (:class:`UnroundedInputs`).
UNROUNDED_KIND = "against_unrounded_inputs"


class UnroundedInputs:
    """The float64 reference of a case's draws before they were rounded to its dtype, used by the
    FlashAttention-3 protocol's table alone (its column "against the unrounded inputs").

    Every other number of the report compares with the float64 reference of the rounded inputs (the
    suite's convention: a kernel's own error). This one takes the case's float64 twin,
    ``case.replace(dtype="float64").build()``: :mod:`strategies.cases` draws every magnitude class in
    float64 and rounds last, so the twin holds the same draws unrounded (:attr:`out` checks that they
    round to the case's inputs). The RMSE against it adds the error of rounding q, k and v to the
    kernel's own; no criterion uses it."""

    def __init__(self, case, t, *, device: str):
        self.case, self.t, self.device = case, t, device

    @cached_property
    def out(self):
        """The float64 O of the unrounded draws."""
        import torch

        from references import attention as reference

        twin = self.case.replace(dtype="float64").build(self.device)
        for name in ("q", "k", "v"):
            if not torch.equal(getattr(twin, name).to(self.case.torch_dtype), getattr(self.t, name)):
                raise ValueError(f"the float64 twin of {self.case.describe()} does not round to its {name}: "
                                 f"the magnitude class {self.case.magnitude!r} draws differently per dtype")
        return reference.attention(twin.q, twin.k, twin.v, spec=self.case.spec, scale=self.case.scale).out

    def rmse(self, out) -> float:
        """The RMSE of the kernel's ``out`` against :attr:`out` (the records' measure)."""
        from references.metrics import error_stats

        return error_stats(out, self.out).rmse


# ------------------------------------------------------------------------------------ aggregation
def geomean(values: list[float]) -> float | None:
    """Geometric mean of the positive values (an exact 0 says nothing about typical error: left out);
    ``inf`` or NaN if any value is (a non-finite error is never averaged away)."""
    if not values:
        return None
    if any(math.isnan(v) for v in values):
        return math.nan
    if any(math.isinf(v) for v in values):
        return math.inf
    positive = [v for v in values if v > 0]
    return statistics.geometric_mean(positive) if positive else 0.0


def aggregate(header: dict, lines: list[dict], bad_lines: int = 0) -> dict:
    """Turn the stream of a sweep into the report's data: one result per (implementation, case),
    the RMSE tables, the criteria table, what was not measured, and the sweep's status."""
    from reports.session import replay_command
    from reports.summary import describe_case

    sweep = header.get("sweep") or {}
    planned = _planned_keys(header)
    results: dict[str, dict] = {}
    order: list[str] = []
    errors: dict[tuple[str, str], int] = defaultdict(int)
    errors_by_variant: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    against_unrounded: dict[str, float] = {}
    done = set()
    for item in lines:
        kind = item.get("kind")
        case = item.get("case") if isinstance(item.get("case"), dict) else {}
        key = _case_key(str(item.get("spec")), case)
        if planned is not None and key not in planned:
            continue  # left in the stream by an earlier, different sweep resumed with other options
        if kind == "done":
            done.add(key)
            continue
        if kind == "error":
            errors[(str(item.get("implementation")), str(item.get("error")))] += 1
            errors_by_variant[(str(item.get("implementation")), _variant_of_case(case), str(case.get("dtype")))
                              ].append(str(item.get("error")))
            continue
        if kind == UNROUNDED_KIND:
            against_unrounded[key] = num(item.get("rmse"))
            continue
        if kind != "measurement":
            continue
        if key not in results:
            order.append(key)
            results[key] = {"implementation": item.get("implementation"), "spec": item.get("spec"),
                            "dtype": case.get("dtype"), "magnitude": case.get("magnitude"),
                            "causal": (case.get("spec") or {}).get("causal", case.get("causal")),
                            "variant": _variant_of_case(case),
                            "len": case.get("len_k"), "head_dim": case.get("head_dim"),
                            "seed": case.get("seed"), "case": case, "ops": {}}
        results[key]["ops"][str(item.get("op"))] = {
            **{m: num(item.get(m)) for m in METRICS}, "pass": item.get("pass"),
            "property": item.get("property")}
    rows = [results[k] for k in order]
    for k in order:
        r = results[k]
        r["pass"] = all(o.get("pass") is not False for o in r["ops"].values())
        if k in against_unrounded and "out" in r["ops"]:
            r["ops"]["out"][UNROUNDED_KIND] = against_unrounded[k]
    impl_names = [i["name"] for i in header.get("implementations") or []]
    columns = [(d, m) for d in sweep.get("dtypes", []) for m in sweep.get("magnitudes", [])]

    rmse: dict[str, dict[str, dict[str, float | None]]] = {}
    for op in OPS:
        per_impl = {}
        for name in impl_names:
            cells = {}
            for d, m in columns:
                vals = [r["ops"][op]["rmse"] for r in rows if r["implementation"] == name and r["dtype"] == d
                        and r["magnitude"] == m and op in r["ops"]]
                cells[f"{d} {m}"] = geomean(vals)
            if any(v is not None for v in cells.values()):
                per_impl[name] = cells
        if per_impl:
            rmse[op] = per_impl

    criteria = []
    for name in impl_names:
        for d in sweep.get("dtypes", []):
            mine = [r for r in rows if r["implementation"] == name and r["dtype"] == d]
            if not mine:
                continue
            entry = {"implementation": name, "dtype": d, "cases": len(mine),
                     "failed_cases": sum(1 for r in mine if not r["pass"])}
            for op in OPS:
                entry[f"{op}_error_over_bound"] = largest(
                    [r["ops"][op]["error_over_bound"] for r in mine if op in r["ops"]])
                entry[f"{op}_error_over_baseline"] = largest(
                    [r["ops"][op]["error_over_baseline"] for r in mine if op in r["ops"]])
            criteria.append(entry)

    worst = []
    device = str(header.get("device") or "cpu")
    for r in rows:
        for op, o in r["ops"].items():
            worst.append((o["error_over_bound"], r, op, o))
    worst.sort(key=lambda x: (x[3].get("pass") is False, math.inf if math.isnan(x[0]) else x[0]), reverse=True)
    worst_cases = [{"implementation": r["implementation"], "op": op, "case_text": describe_case(r["case"]),
                    **{m: o[m] for m in METRICS}, "pass": o.get("pass"),
                    "replay": replay_command(impl=str(r["spec"]), prop=str(o.get("property")), case=r["case"],
                                             device=device)}
                   for _, r, op, o in worst[:15]]

    missing = len(planned - done) if planned is not None else 0
    protocol = fa3_protocol(rows, device=device)
    variants = variant_rows(rows, header, errors_by_variant) if sweep.get("variants") else None
    return {
        "status": "complete" if not missing else "partial",
        "missing": missing,
        "meta": {k: header.get(k) for k in ("command", "commands", "device", "device_name", "versions", "sweep",
                                             "started", "cases", "planned")},
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "implementations": header.get("implementations") or [],
        "not_measured": [*_merged_dtypes(header.get("skipped", [])),
                         *({"implementation": n, "reason": e, "cases": c} for (n, e), c in sorted(errors.items()))],
        "unreadable_lines": bad_lines,
        "rmse": rmse, "rmse_columns": [f"{d} {m}" for d, m in columns],
        "criteria": criteria, "worst_cases": worst_cases,
        **({"fa3_protocol": protocol} if protocol else {}),
        **({"variants": variants} if variants else {}),
        "results": [{k: v for k, v in r.items() if k != "case"} for r in rows],
    }


def _variant_of_case(case: dict) -> str:
    """:func:`variant_of` a case's JSON ("?" for one whose spec does not read)."""
    from references.spec import AttentionSpec

    try:
        return variant_of(AttentionSpec(**(case.get("spec") or {})))
    except (TypeError, ValueError):
        return "?"


def _merged_dtypes(skipped: list[dict]) -> list[dict]:
    """The run header's skipped entries with their dtypes merged: one per implementation, reason and (in
    a sweep of variants) variant, with the number of cases."""
    merged: dict[tuple, dict] = {}
    for s in skipped:
        key = (s.get("implementation"), s.get("reason"), s.get("variant"))
        entry = merged.setdefault(key, {k: v for k, v in s.items() if k != "dtype"} | {"cases": 0})
        entry["cases"] += s.get("cases") or 0
    return list(merged.values())


RAISED = "it raised: "  # a variant's row for a kernel that raised instead of returning


def variant_rows(rows: list[dict], header: dict, errors: dict[tuple[str, str, str], list[str]]) -> dict:
    """The per-variant table of a sweep of variants. For each variant, magnitude class, dtype and
    implementation, from the sweep's records: the geometric-mean RMSE of O over the cases, the largest
    err/bound of each op and err/eager over all ops, and the cases failing a criterion. Then, per variant,
    each implementation that was not measured on it and why: the run header's skip reasons (its
    declaration's ``unsupported_spec`` first), with their dtypes; ``errors``: what a kernel raised, by
    implementation, variant and dtype."""
    sweep = header.get("sweep") or {}
    names = [str(i.get("name")) for i in header.get("implementations") or []]
    reasons: dict[tuple[str, str, str], list[str]] = defaultdict(list)  # (variant, implementation, reason): dtypes
    for s in header.get("skipped") or []:
        if "variant" in s:
            reasons[(s["variant"], s["implementation"], str(s["reason"]))].append(s["dtype"])
    for (name, variant, dtype), said in errors.items():
        reasons[(variant, name, f"{RAISED}{said[0]}")].append(dtype)
    table = []
    for variant in sweep.get("variants") or []:
        for magnitude in sweep.get("magnitudes") or []:
            for dtype in sweep.get("dtypes") or []:
                for name in names:
                    mine = [r for r in rows if r["implementation"] == name and r["variant"] == variant
                            and r["magnitude"] == magnitude and r["dtype"] == dtype]
                    if not mine:
                        continue
                    table.append({
                        "variant": variant, "magnitude": magnitude, "dtype": dtype, "implementation": name,
                        "cases": len(mine), "failed_cases": sum(1 for r in mine if not r["pass"]),
                        "rmse_out": geomean([r["ops"]["out"]["rmse"] for r in mine if "out" in r["ops"]]),
                        **{f"{op}_error_over_bound": largest([r["ops"][op]["error_over_bound"] for r in mine
                                                              if op in r["ops"]]) for op in OPS},
                        "error_over_baseline": largest([o["error_over_baseline"] for r in mine
                                                        for o in r["ops"].values()]),
                        "not_measured": None})
        for (v, name, why), dtypes in sorted(reasons.items(), key=lambda x: names.index(x[0][1])
                                             if x[0][1] in names else len(names)):
            if v == variant:
                table.append({"variant": variant, "magnitude": None,
                              "dtype": ", ".join(d for d in sweep.get("dtypes") or [] if d in dtypes),
                              "implementation": name, "cases": 0, "failed_cases": 0, "rmse_out": None,
                              **{f"{op}_error_over_bound": None for op in OPS}, "error_over_baseline": None,
                              "not_measured": why})
    shapes = {variant: [] for variant in sweep.get("variants") or []}
    for case in _sweep_of(header).cases():
        words = (f"B={case.batch} Hq={case.heads_q} Hkv={case.heads_kv} Nq={case.len_q} Nk={case.len_k} "
                 f"D={case.head_dim}, {case.spec.describe()}")
        if words not in shapes.setdefault(variant_of(case.spec), []):
            shapes[variant_of(case.spec)].append(words)
    return {"title": VARIANTS_TITLE, "variants": list(sweep.get("variants") or []),
            "words": {v: VARIANT_WORDS.get(v, v) for v in sweep.get("variants") or []}, "shapes": shapes,
            "rows": table}


def _shape_words(case: dict) -> str:
    return (f"B={case.get('batch')} H={case.get('heads_q')} N={case.get('len_k')} D={case.get('head_dim')}"
            + (" causal" if (case.get("spec") or {}).get("causal") else ""))


def fa3_protocol(rows: list[dict], *, device: str) -> dict | None:
    """The FlashAttention-3 paper's accuracy table, from the sweep's own records: the measurements of O on
    the cases of the ``fa3_outliers`` class (the paper's input distribution), one row per implementation,
    dtype and causal flag, next to the paper's FP16 figure for the method the implementation computes.
    None when the sweep measured no such case.

    The RMSE of a row is that of every element of O over its cases (each case's RMSE weighted by its
    number of elements: the paper's RMSE over more than one draw of the inputs). Beside it, the same O's
    RMSE against the float64 reference of the unrounded draws (:class:`UnroundedInputs`; None unless
    every case of the row has it), with the same ratios."""
    mine = [r for r in rows if r["magnitude"] == FA3_MAGNITUDE and "out" in r["ops"]]
    if not mine:
        return None
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in mine:
        groups[(r["implementation"], r["dtype"], bool(r["causal"]))].append(r)

    def pooled(group: list[dict], errors: list) -> float | None:
        sizes = [r["case"]["batch"] * r["case"]["heads_q"] * r["case"]["len_q"] * r["case"]["head_dim"]
                 for r in group]
        if None in errors or not sum(sizes):
            return None
        return math.sqrt(sum(n * e * e for n, e in zip(sizes, errors)) / sum(sizes))

    def ratio(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    table = []
    for (name, dtype, causal), group in groups.items():
        errors = [r["ops"]["out"]["rmse"] for r in group]
        rmse, unrounded = pooled(group, errors), pooled(group, [r["ops"]["out"].get(UNROUNDED_KIND) for r in group])
        method = FA3_PAPER_METHOD.get(str(name))
        paper = FA3_PAPER_FP16.get(method) if method and dtype == "float16" else None
        table.append({"implementation": name, "dtype": dtype, "causal": causal, "cases": len(group),
                      "failed_cases": sum(1 for r in group if not r["pass"]), "rmse": rmse,
                      "rmse_min": min(errors), "rmse_max": max(errors), "rmse_unrounded_inputs": unrounded,
                      "paper_method": method, "paper_rmse": paper, "ratio_to_paper": ratio(rmse, paper),
                      "unrounded_ratio_to_paper": ratio(unrounded, paper),
                      "seeds": sorted({r["seed"] for r in group}),
                      "shapes": sorted({_shape_words(r["case"]) for r in group})})
    for row in table:  # each RMSE over that of the suite's FlashAttention-2 on the same dtype and mask
        fa2 = next((t for t in table if t["implementation"] == "fa2_blocked" and t["dtype"] == row["dtype"]
                    and t["causal"] == row["causal"]), {})
        row["ratio_to_fa2_blocked"] = ratio(row["rmse"], fa2.get("rmse"))
        row["unrounded_ratio_to_fa2_blocked"] = ratio(row["rmse_unrounded_inputs"], fa2.get("rmse_unrounded_inputs"))
    from reports.plots import DTYPE_ORDER

    table.sort(key=lambda t: (t["causal"], DTYPE_ORDER.index(t["dtype"]) if t["dtype"] in DTYPE_ORDER else 9))
    shapes = sorted({_shape_words(r["case"]) for r in mine})
    gpu = preset("fa3", device="cuda")
    gpu_shape = f"B={gpu['batch']} H={gpu['heads']} N={gpu['lengths'][0]} D={gpu['head_dims'][0]}"
    protocol = {
        "title": FA3_TITLE, "source": FA3_SOURCE, "magnitude": FA3_MAGNITUDE, "inputs": MAGNITUDE_WORDS[FA3_MAGNITUDE],
        "paper_fp16_rmse": FA3_PAPER_FP16, "paper_setup": FA3_PAPER_SETUP,
        "shapes": shapes, "seeds": sorted({r["seed"] for r in mine}), "rows": table,
        "device": device, "gpu_preset_shape": gpu_shape,
    }
    return {**protocol, "text": fa3_words(protocol)}


def _sweep_of(header: dict) -> Sweep:
    """The sweep the run header ``header`` describes."""
    fields = {f.name for f in dataclasses.fields(Sweep)}
    return Sweep(**{k: tuple(v) if isinstance(v, list) else v for k, v in header["sweep"].items() if k in fields})


def _planned_keys(header: dict) -> set[str] | None:
    """The (implementation, case) keys the sweep of ``header`` measures, or None if it does not say."""
    pairs, sweep = header.get("planned_pairs"), header.get("sweep")
    if not isinstance(pairs, list) or not isinstance(sweep, dict):
        return None
    cases = _sweep_of(header).cases()
    alignment = {str(i.get("spec")): i.get("causal_alignment") for i in header.get("implementations") or []}
    return {_case_key(str(spec), _as_computed_by(cases[index], alignment.get(str(spec)) or "bottom_right").to_dict())
            for spec, index, *_ in pairs if 0 <= index < len(cases)}


def write_report(out_dir: str | Path) -> dict:
    """(Re)write ``accuracy.json``, ``accuracy.md`` and ``accuracy.html`` from the sweep's files."""
    from reports.session import dumps, write_atomic

    out_dir = Path(out_dir)
    header = json.loads((out_dir / RUN_FILE).read_text(encoding="utf-8"))
    lines, bad = read_stream(out_dir)
    result = aggregate(header, lines, bad)
    write_atomic(out_dir / "accuracy.json", dumps(result, indent=1))
    write_atomic(out_dir / "accuracy.md", markdown(result))
    try:
        from reports.html import accuracy_html

        write_atomic(out_dir / "accuracy.html", accuracy_html(result))
    except Exception as exc:  # noqa: BLE001 - the JSON and Markdown are written whatever the plots do
        result["html_error"] = f"{type(exc).__name__}: {exc}"
    return result


# ------------------------------------------------------------------------------------ tables
class Table(NamedTuple):
    """A table that accuracy.md and accuracy.html both show: its headers, its rows of values (each page
    formats them) and which rows failed."""

    headers: list[str]
    rows: list[list]
    failed: list[bool] | None = None


# The worst-measurements table: (key of a worst_cases entry, header).
WORST_COLUMNS = (("implementation", "implementation"), ("op", "op"), ("case_text", "case"),
                 *((k, RECORD_COLUMNS[k]) for k in ("rmse", "max_abs", "max_ulp", "error_over_bound",
                                                    "error_over_baseline")), ("pass", "pass"))


def rmse_tables(result: dict) -> dict[str, Table]:
    """Per op: the geometric-mean RMSE of each implementation per dtype and magnitude class."""
    cols = result.get("rmse_columns") or []
    return {op: Table(["implementation", *cols], [[name, *(cells.get(c) for c in cols)]
                                                  for name, cells in per_impl.items()])
            for op, per_impl in (result.get("rmse") or {}).items()}


def criteria_table(result: dict) -> Table:
    """Per implementation and dtype: the largest err/bound and err/eager of each op over the sweep."""
    crit = result.get("criteria") or []
    ops = [op for op in OPS if any(c.get(f"{op}_error_over_bound") is not None for c in crit)]
    keys = ("error_over_bound", "error_over_baseline")
    return Table(["implementation", "dtype", "cases", "failed",
                  *(f"{OP_WORDS[o]} {RECORD_COLUMNS[k]}" for k in keys for o in ops)],
                 [[c["implementation"], c["dtype"], c["cases"], c["failed_cases"],
                   *(c.get(f"{o}_{k}") for k in keys for o in ops)] for c in crit],
                 [bool(c["failed_cases"]) for c in crit])


def fa3_table(result: dict) -> Table:
    """The FlashAttention-3 protocol's table (:func:`fa3_protocol`); no rows when the sweep had no such case.
    Two measurements of one O: against the reference from the rounded inputs (the suite's, the verdicts')
    and against the unrounded inputs (:class:`UnroundedInputs`), each with its ratios."""
    rows = (result.get("fa3_protocol") or {}).get("rows") or []
    return Table(["implementation", "dtype", "causal", "cases", "RMSE of O (rounded inputs)", "lowest..highest case",
                  "RMSE of O against the unrounded inputs", "paper's method", "paper's FP16 RMSE",
                  "RMSE / paper's (rounded, unrounded)", "RMSE / fa2_blocked's (rounded, unrounded)",
                  "cases failing a criterion"],
                 [[r["implementation"], r["dtype"], "yes" if r["causal"] else "no", r["cases"], r["rmse"],
                   f"{fmt(r['rmse_min'])}..{fmt(r['rmse_max'])}", r.get("rmse_unrounded_inputs"),
                   r["paper_method"] or "-", paper_figure(r["paper_rmse"]),
                   _pair(r["ratio_to_paper"], r.get("unrounded_ratio_to_paper")),
                   _pair(r["ratio_to_fa2_blocked"], r.get("unrounded_ratio_to_fa2_blocked")),
                   r["failed_cases"]] for r in rows],
                 [bool(r["failed_cases"]) for r in rows])


def _pair(a: float | None, b: float | None) -> str:
    """Two ratios in one cell (``-`` for one not measured)."""
    return "-" if a is None and b is None else f"{fmt(a)}, {fmt(b)}"


def variant_table(result: dict) -> Table:
    """The per-variant table (:func:`variant_rows`); no rows for a sweep without variants."""
    rows = (result.get("variants") or {}).get("rows") or []
    ops = [op for op in OPS if any(r.get(f"{op}_error_over_bound") is not None for r in rows)]

    def verdict(r: dict) -> str:
        if r["not_measured"]:
            return "not measured: " + r["not_measured"]
        return "yes" if not r["failed_cases"] else f"no: {r['failed_cases']} of {r['cases']} cases fail a criterion"

    return Table(["variant", "magnitude", "dtype", "implementation", "cases", f"O {RECORD_COLUMNS['rmse']}",
                  *(f"{OP_WORDS[o]} {RECORD_COLUMNS['error_over_bound']}" for o in ops),
                  f"max {RECORD_COLUMNS['error_over_baseline']}", "pass"],
                 [[r["variant"], r["magnitude"] or "any", r["dtype"], r["implementation"], r["cases"], r["rmse_out"],
                   *(r[f"{o}_error_over_bound"] for o in ops), r["error_over_baseline"], verdict(r)] for r in rows],
                 [bool(r["failed_cases"]) or str(r["not_measured"]).startswith(RAISED) for r in rows])


def variant_words(variants: dict) -> list[str]:
    """The lines that say what each variant of the table is, and how the table reads."""
    lines = []
    for v in variants.get("variants") or []:
        shapes = "; ".join(variants.get("shapes", {}).get(v) or [])
        lines.append(f"`{v}`: {(variants.get('words') or {}).get(v, v)}. Measured: {shapes}.")
    lines.append("Each row pools the cases of one variant, magnitude class, dtype and implementation (causal flags, "
                 "lengths and seeds): the geometric-mean RMSE of O, the largest err/bound of each op and the largest "
                 "err/eager over all ops, measured as pytest verify measures them (verify/measure.py). An "
                 "implementation that does not declare a variant is not measured on it: its row says why, in the "
                 "words of its declaration (Implementation.unsupported_spec), and for which dtypes.")
    return lines


def paper_figure(x: float | None) -> str | None:
    """A figure of the paper as the paper prints it (``3.2e-4``)."""
    if x is None:
        return None
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def fa3_words(protocol: dict) -> list[str]:
    """The paragraphs around the protocol's table (each page formats them)."""
    paper = protocol.get("paper_fp16_rmse") or FA3_PAPER_FP16
    ratio = paper["standard attention"] / paper["FlashAttention-2"]
    shapes = "; ".join(protocol.get("shapes") or [])
    seeds = ", ".join(map(str, protocol.get("seeds") or []))
    gpu = protocol.get("gpu_preset_shape")
    on_gpu = str(protocol.get("device") or "").startswith("cuda")
    if protocol.get("shapes") == [gpu]:
        size = "the GPU preset's shape."
    elif on_gpu:
        size = f"not the GPU preset's shape ({gpu})."
    else:
        size = f"smaller than the GPU preset's shape ({gpu}), to run in minutes on a CPU."
    return [
        f"Source of the figures: {protocol.get('source') or FA3_SOURCE}. Its FP16 RMSE of O: standard attention "
        f"{paper_figure(paper['standard attention'])}, FlashAttention-2 {paper_figure(paper['FlashAttention-2'])}, "
        f"FlashAttention-3 {paper_figure(paper['FlashAttention-3'])} (no FlashAttention-3 kernel here: it is "
        "Hopper CUDA code). Table 3's FP8 rows are not reproduced: the suite has no FP8 kernel.",
        f"Inputs: magnitude class `{protocol.get('magnitude')}`: {protocol.get('inputs')}, drawn in float64 and "
        "rounded to the dtype. Each row's O is measured twice. \"RMSE of O (rounded inputs)\" compares it with "
        "the float64 reference computed from the inputs as rounded to the dtype, the kernel's own error: the "
        "suite's convention, the one every other table and the pass criteria use. \"RMSE of O against the "
        "unrounded inputs\" compares the same O with the float64 reference of the draws before they were rounded "
        "(the case's float64 twin: strategies/cases.py draws every magnitude class in float64 and rounds last): "
        "the kernel's error plus that of rounding q, k and v, which no kernel of that dtype can avoid. The RMSE "
        "of a row is over every element of O of all its cases.",
        "Which column the paper's figures correspond to is an inference: the paper does not say whether its "
        "float64 reference took the inputs before or after rounding them to FP16. Most likely the unrounded "
        "inputs: its FlashAttention-2 and FlashAttention-3 FP16 figures are equal (1.9e-4) although the two "
        "kernels compute differently, as when an error both share dominates, and rounding the inputs is such an "
        "error; and its standard attention is only 1.68x its FlashAttention-2, a gap that a shared input-rounding "
        "error narrows, where the kernels' own errors differ by more" + _fa3_measured_ratios(protocol) + ".",
        f"Setup: {protocol.get('paper_setup') or FA3_PAPER_SETUP}",
        f"Shapes measured: {shapes} (seeds: {seeds}), {size}",
        f"How to read it: the absolute RMSE depends on the shapes, which the paper does not give, so the ratio "
        f"is the comparable number: the paper's standard attention is {ratio:.2f}x its FlashAttention-2 "
        f"({paper_figure(paper['standard attention'])} / {paper_figure(paper['FlashAttention-2'])}); the column "
        "RMSE / fa2_blocked's divides each RMSE by that of fa2_blocked (the suite's FlashAttention-2) on the "
        "same dtype, against the rounded inputs and against the unrounded ones. The paper attributes the gap to "
        "where the intermediates live: the standard implementation "
        "holds the softmax in FP16, FlashAttention in FP32. `standard` (flashverify_kernels/pytorch/standard.py) holds the scores "
        "and the softmax in the input dtype; `eager` (criterion 1's baseline) holds both in float32 and rounds "
        "only P, as FlashAttention rounds P before P V. (PyTorch's softmax of a float16 tensor computes in "
        "float32 and rounds its result once, so what `standard` adds to eager's error is the rounding of the "
        "scores.) The last column counts the cases that fail criterion 1 or 2 (see the criteria table), which "
        "judge the error against the rounded inputs alone: the paper's baseline is expected to fail them.",
    ]


def _fa3_measured_ratios(protocol: dict) -> str:
    """``" (here, in float16: 4.03x against the rounded inputs, 1.46x against the unrounded ones)"``: the
    measured standard / fa2_blocked ratios of the table, or nothing when it lacks them."""
    row = next((r for r in protocol.get("rows") or [] if r["implementation"] == "standard"
                and r["dtype"] == "float16" and not r["causal"]), None)
    if row is None or row.get("ratio_to_fa2_blocked") is None or row.get("unrounded_ratio_to_fa2_blocked") is None:
        return ""
    return (f" (here standard / fa2_blocked in float16 is {row['ratio_to_fa2_blocked']:.2f}x against the rounded "
            f"inputs and {row['unrounded_ratio_to_fa2_blocked']:.2f}x against the unrounded ones)")


def not_measured_table(result: dict) -> Table:
    """What was not measured and why (with the variant, in a sweep of variants)."""
    skipped = result.get("not_measured") or []
    variants = any("variant" in s for s in skipped)
    return Table(["implementation", *(["variant"] if variants else []), "reason", "cases"],
                 [[s.get("implementation"), *([s.get("variant") or "-"] if variants else []), s.get("reason"),
                   s.get("cases")] for s in skipped])


def pooled_words(result: dict) -> str:
    """What the RMSE tables' geometric means pool."""
    variants = ((result.get("meta") or {}).get("sweep") or {}).get("variants")
    return "N, D, causal, seeds and variants" if variants else "N, D, causal and seeds"


def worst_table(result: dict) -> Table:
    worst = result.get("worst_cases") or []
    return Table([h for _, h in WORST_COLUMNS], [[w.get(k) for k, _ in WORST_COLUMNS] for w in worst],
                 [w.get("pass") is False for w in worst])


def case_table(result: dict) -> Table:
    """One row per (implementation, case): the RMSE of each op, O's max ULP, the largest err/bound and
    err/eager over its ops, and whether every op passed (in a sweep of variants: each case's variant, and
    Nk its keys in all)."""
    res = result.get("results") or []
    variants = bool(((result.get("meta") or {}).get("sweep") or {}).get("variants"))
    return Table(["implementation", "dtype", *(["variant"] if variants else []), "magnitude", "causal",
                  "Nk" if variants else "N", "D",
                  *(f"{OP_WORDS[o]} {RECORD_COLUMNS['rmse']}" for o in OPS), f"O {RECORD_COLUMNS['max_ulp']}",
                  f"max {RECORD_COLUMNS['error_over_bound']}", f"max {RECORD_COLUMNS['error_over_baseline']}", "pass"],
                 [[r["implementation"], r["dtype"], *([r.get("variant")] if variants else []), r["magnitude"],
                   "yes" if r["causal"] else "no", r["len"],
                   r["head_dim"], *(r["ops"][o]["rmse"] if o in r["ops"] else None for o in OPS),
                   r["ops"]["out"]["max_ulp"] if "out" in r["ops"] else None,
                   largest([o["error_over_bound"] for o in r["ops"].values()]),
                   largest([o["error_over_baseline"] for o in r["ops"].values()]), r["pass"]] for r in res],
                 [not r["pass"] for r in res])


# ------------------------------------------------------------------------------------ Markdown
MAGNITUDE_WORDS = {
    "normal": "q, k, v ~ N(0, 1)",
    "sparse_outliers": "N(0, 1), and exactly 0.1% of the entries of q, k, v get an extra N(0, 30^2)",
    "fa3_outliers": "the FlashAttention-3 paper's protocol: every entry of q, k, v is N(0, 1) + N(0, 100) x Bernoulli(0.001)",
    "large_logits": "q and k scaled by 100: |scale q.k| ~ 1e4 (q.k beyond float16's range)",
}
OP_WORDS = {"out": "O", "lse": "LSE", "dq": "dQ", "dk": "dK", "dv": "dV"}


def _fmt(x: Any) -> str:
    return fmt(x).replace("|", "\\|")


def _md_table(table: Table) -> list[str]:
    return ["| " + " | ".join(table.headers) + " |", "|" + "---|" * len(table.headers),
            *("| " + " | ".join(_fmt(v) for v in row) + " |" for row in table.rows)]


def _sweep_words(sweep: dict) -> list[str]:
    n = ", ".join(map(str, sweep.get("lengths", [])))
    d = ", ".join(map(str, sweep.get("head_dims", [])))
    causal = {(False, True): "both", (True, False): "both", (False,): "no", (True,): "yes"}.get(
        tuple(sweep.get("causal", [])), str(sweep.get("causal")))
    if sweep.get("variants"):
        shapes = (f"- variants: {', '.join(sweep['variants'])} (below), H={sweep.get('heads')}, N in {{{n}}}, "
                  f"D in {{{d}}}, pages of {sweep.get('page_size')} keys")
    else:
        shapes = f"- shapes: B={sweep.get('batch')}, H={sweep.get('heads')}, N = Nq = Nk in {{{n}}}, D in {{{d}}}"
    return [shapes,
            f"- dtypes: {', '.join(sweep.get('dtypes', []))}; causal: {causal}; seeds: "
            f"{', '.join(map(str, sweep.get('seeds', [])))}; backward: {'yes' if sweep.get('backward') else 'no'}",
            "- magnitude classes: " + "; ".join(f"`{m}` ({MAGNITUDE_WORDS.get(m, 'see strategies/cases.py')})"
                                                for m in sweep.get("magnitudes", []))]


def title(result: dict) -> str:
    """The report's title, naming the device (a CPU report must never pass for a GPU one)."""
    meta = result.get("meta") or {}
    device = str(meta.get("device") or "?")
    kind = "GPU" if device.startswith("cuda") else device.upper()
    return f"Attention accuracy against a float64 reference, {kind}: {meta.get('device_name') or device}"


def status_words(result: dict) -> str:
    if result["status"] == "complete":
        return "Status: complete."
    return (f"Status: PARTIAL: {result['missing']} of {result['meta'].get('planned')} (implementation, case) pairs "
            "were not measured (interrupted or stopped by --time-limit; rerun with --resume).")


def markdown(result: dict) -> str:
    meta = result["meta"]
    stack = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items() if v)
    lines = [f"# {title(result)}", "",
             status_words(result), "",
             f"- device: {meta.get('device')} ({meta.get('device_name')}); {stack}",
             f"- command: `{meta.get('command')}`",
             *(f"- earlier command of this sweep: `{c}`" for c in (meta.get("commands") or [])[:-1]),
             f"- started {meta.get('started')}, written {result.get('finished')}",
             *_sweep_words(meta.get("sweep") or {}), "",
             "How to read it: every input is rounded to the dtype first, and the float64 reference is computed from "
             "those rounded inputs, so the numbers are the kernels' own error. RMSE is sqrt(mean((x - ref)^2)) over "
             "all elements (the FlashAttention-3 paper's measure); ULP is the error in units of the stored dtype "
             "at the reference value, over the elements whose reference is a normal number (a zero or subnormal "
             "reference is left out: one ULP there is ~1e-45); err/bound is the largest error divided by the "
             "componentwise rounding-error bound of references/bounds.py (criterion 2: at most 1); err/eager is "
             "the max error divided by that of the same-precision eager attention, or by criterion 1's absolute "
             "floor where eager's error is below it (criterion 1: at most 2 for O and LSE, 3 for gradients, plus "
             "the floor). SDPA's backends return no LSE.", ""]
    protocol = result.get("fa3_protocol")
    if protocol:
        *before, after = fa3_words(protocol)
        lines += [f"## {FA3_TITLE}", "", *(x for w in before for x in (w, "")),
                  *_md_table(fa3_table(result)), "", after, ""]
    variants = result.get("variants")
    if variants:
        *before, after = variant_words(variants)
        lines += [f"## {VARIANTS_TITLE}", "", *(x for w in before for x in (f"- {w}", "")), after, "",
                  *_md_table(variant_table(result)), ""]
    for op, rmse in rmse_tables(result).items():
        lines += [f"## RMSE of {OP_WORDS.get(op, op)} (geometric mean over {pooled_words(result)})", "",
                  *_md_table(rmse), ""]
    crit = criteria_table(result)
    if crit.rows:
        lines += ["## Pass criteria: largest err/bound and err/eager over the sweep", "", *_md_table(crit), ""]
    worst = worst_table(result)
    if worst.rows:
        lines += ["## Worst measurements by err/bound", "", *_md_table(worst), "",
                  "Replay the worst one: `" + result["worst_cases"][0]["replay"].replace("`", "'") + "`", ""]
    skipped = not_measured_table(result)
    if skipped.rows:
        lines += ["## Not measured", "", *_md_table(skipped), ""]
    cases = case_table(result)
    if cases.rows:
        lines += ["## Every case", "", f"<details><summary>{len(cases.rows)} (implementation, case) results</summary>",
                  "", *_md_table(cases), "", "</details>", ""]
    return "\n".join(lines) + "\n"
