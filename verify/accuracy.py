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
``python -m verify.replay``. This module runs the sweep (``python -m verify.accuracy``); :mod:`reports.accuracy` renders what it
recorded and :mod:`strategies.sweep` holds its cases.

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

import argparse
import dataclasses
import json
import shlex
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from reports.accuracy import (OUTPUTS, RUN_FILE, STREAM, UNROUNDED_KIND, read_stream, results_words, status_words,
                              write_report)
from reports.session import device_name, versions
from strategies.cases import dtype_name
from strategies.sweep import (FA3_MAGNITUDE, PEERS, PRESETS, VARIANTS, Sweep, alignment_matters, as_computed_by,
                              case_key, preset, torch_device_type, variant_of)

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
    device), computed with the kernel's own causal alignment (:func:`as_computed_by`)."""
    if impl.kind != "attention":
        return f"{impl.name} is a {impl.kind} kernel"
    why = impl.unsupported_spec(as_computed_by(case, impl.causal_alignment).spec)
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


# ------------------------------------------------------------------------------------ the sweep
def _impl_info(impl) -> dict:
    return {"name": impl.name, "spec": impl.cli_name, "description": impl.description,
            "causal_alignment": impl.causal_alignment, "returns_lse": impl.returns_lse,
            "dtypes": [dtype_name(d) for d in impl.dtypes], "devices": list(impl.devices)}


def run(sweep: Sweep, impls: list, *, device: str, out_dir: str | Path, command: str, resume: bool = False,
        time_limit: float | None = None, progress: bool | None = None, log: Callable[[str], None] = print,
        baselines: tuple[str, ...] = ()) -> dict:
    """Run the sweep, streaming measurements into ``out_dir``, then write the report; return its data.
    ``baselines``: implementations measured to be compared with, not judged (the report says so of their
    failed criteria)."""
    from reports.progress import Progress
    from reports.session import dumps, write_atomic
    from verify import measure
    from verify.faults import OutOfMemoryError, exception_line, release_out_of_memory

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stream_path = out_dir / STREAM
    cases = sweep.cases()
    done: set[str] = set()
    if resume:
        for item in read_stream(out_dir)[0]:
            if item.get("kind") == "done":
                done.add(case_key(str(item.get("spec")), item.get("case") or {}))
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
            if case_key(impl.cli_name, as_computed_by(case, impl.causal_alignment).to_dict()) not in done:
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
        "baselines": [i.name for i in impls if i.name in baselines],
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
                kcase = as_computed_by(case, impl.causal_alignment)
                if time_limit is not None and time.monotonic() - started > time_limit:
                    stopped_early = True
                    break
                label = f"{impl.name} {kcase.dtype} N={kcase.len_k} D={kcase.head_dim} {kcase.magnitude}" \
                        f"{' causal' if kcase.causal else ''}{f' {variant_of(kcase.spec)}' if sweep.variants else ''}"
                bar.show(label)
                key = impl.causal_alignment if alignment_matters(kcase) else "any"
                tic = time.monotonic()
                if key not in truths:
                    truths[key] = measure.Truth(kcase, t.q, t.k, t.v, dout=t.dout if sweep.backward else None,
                                                 descales=t.descales)
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


class UnroundedInputs:
    """The float64 reference of a case's draws before they were rounded to its dtype, used by the
    FlashAttention-3 protocol's table alone (its column "against the unrounded inputs").

    Every other number of the report compares with the float64 reference of the rounded inputs (the
    suite's convention: a kernel's own error). This one takes the case's float64 twin,
    ``case.replace(dtype="float64").build()``: :mod:`strategies.cases` draws every magnitude class in
    float64 and rounds last, so the twin holds the same draws unrounded (:attr:`out` checks that they
    round to the case's inputs; a float8 case's, quantised with its descales). The RMSE against it adds the
    error of rounding q, k and v to the kernel's own; no criterion uses it."""

    def __init__(self, case, t, *, device: str):
        self.case, self.t, self.device = case, t, device

    @cached_property
    def out(self):
        """The float64 O of the unrounded draws."""
        import torch

        from references import attention as reference

        twin = self.case.replace(dtype="float64", descale=False).build(self.device)
        for name in ("q", "k", "v"):
            if not torch.equal(self.case.rounded(getattr(twin, name))[0], getattr(self.t, name)):
                raise ValueError(f"the float64 twin of {self.case.describe()} does not round to its {name}: "
                                 f"the magnitude class {self.case.magnitude!r} draws differently per dtype")
        return reference.attention(twin.q, twin.k, twin.v, spec=self.case.spec, scale=self.case.scale).out

    def rmse(self, out) -> float:
        """The RMSE of the kernel's ``out`` against :attr:`out` (the records' measure)."""
        from references.metrics import error_stats

        return error_stats(out, self.out).rmse


# ------------------------------------------------------------------------------------ the command line
ACCURACY_EPILOG = """\
presets (the options given override them):
  quick  N in {64, 128}, D = 32: under a minute on a CPU, Triton interpreter included (the default
         without a GPU)
  gpu    N in {512, 1024, 2048, 4096}, D in {64, 128} (the default on a GPU)
  fa3    the FlashAttention-3 paper's accuracy protocol (its Table 3): q, k, v entries
         N(0, 1) + N(0, 100) x Bernoulli(0.001) (magnitude class fa3_outliers), no causal mask, float16
         and bfloat16, forward only, seeds 0 1 2, 16 heads of dim 128; B=4, N=4096 on a GPU, B=1,
         N=1024 on a CPU (about a minute on 2 cores). Measures standard attention with float16
         intermediates (flashverify_kernels/pytorch/standard.py), eager and fa2_blocked, on a GPU also triton_fa2 and the
         SDPA/FlexAttention adapters; accuracy.md gets a "FlashAttention-3 accuracy protocol" table with the
         paper's figures. The paper does not state its shapes: these are a choice, said in the report.
  variants  the variants real kernels compute, each against the dense case: packed variable-length
         sequences, a sliding window, a logit softcap, decoding from a paged KV cache (Nq = 1, four
         sequences of different cache lengths, grouped-query heads); causal, float16 and bfloat16,
         inputs normal and large_logits, forward and backward; N = 96, D = 32, H = 4, pages of 16 on a
         CPU (about 30 s on 2 cores), N = 4096, D = 128, H = 16, pages of 256 on a GPU. Measures
         fa2_blocked, fa1_blocked, eager, and on a GPU triton_fa2 and triton_fa1 (all but paged
         decoding) and triton_decode (paged decoding, forward only); each one not measured on a
         variant is listed with the reason; accuracy.md gets a "Variants" table.
         Choose variants with --variant.

the GPU report in docs/ is made with:
  python -m verify.accuracy --device cuda --preset gpu --out docs/accuracy
which measures float16 and bfloat16 x {normal, sparse_outliers, large_logits} x causal {no, yes}, B=1, H=2, for
every shipped kernel that runs on the GPU: fa2_blocked, fa1_blocked, triton_fa2, triton_fa1, eager and
the SDPA backends sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math and flex_attention. A backend the
GPU or the torch build lacks is listed under "Not measured" with torch's reason. Choose others with
--impl (registry names, package.module:attr, path/to/file.py:attr; eager is always added).
Under a per-command time limit add --time-limit SECONDS and rerun the same command with --resume
until it says complete; `python -m reports summarise DIR` re-renders an interrupted sweep.
On a CPU the Triton kernels take part only with TRITON_INTERPRET=1 set (bfloat16 then skipped: the
interpreter's tl.dot does not support it).
"""


def _positive_ints(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} should be a positive integer")
    return value


def _accuracy(args, parser) -> int:
    import torch

    from flashverify_kernels.registry import ImplementationError
    from strategies.cases import DTYPES, MAGNITUDES

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        parser.error(f"--device {device!r}: {exc}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch sees no CUDA device")
    chosen = preset(args.preset or ("gpu" if parsed.type == "cuda" else "quick"), device=device)
    for v in args.variant or []:
        if v not in VARIANTS:
            parser.error(f"--variant {v!r} is not a variant; known: {', '.join(VARIANTS)}")
    for m in args.magnitude or []:
        if m not in MAGNITUDES:
            parser.error(f"--magnitude {m!r} is not a magnitude class; known: {', '.join(MAGNITUDES)}")
    for d in args.dtype or []:
        if d not in DTYPES:
            parser.error(f"--dtype {d!r}; known: {', '.join(DTYPES)}")
    # The preset's sweep (the Sweep defaults for what it leaves out), each option given overriding it.
    fields = {f.name: chosen[f.name] for f in dataclasses.fields(Sweep) if f.name in chosen}
    given = {"lengths": args.len, "head_dims": args.head_dim, "dtypes": args.dtype, "magnitudes": args.magnitude,
             "causal": {"both": (False, True), "yes": (True,), "no": (False,)}.get(args.causal),
             "batch": args.batch, "heads": args.heads, "seeds": args.seed, "backward": args.backward,
             "variants": args.variant}
    fields.update({k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None})
    sweep = Sweep(**fields)
    try:
        impls = select_implementations(args.impl or [], device=device,
                                                defaults=chosen.get("implementations"),
                                                list_all=chosen.get("list_all", False))
    except ImplementationError as exc:
        parser.error(str(exc))
    command = " ".join(shlex.quote(a) for a in ["python", "-m", "verify.accuracy", *args.argv])
    names = ", ".join(i.name for i in impls)
    print(f"accuracy sweep on {device}: {len(sweep.cases())} cases x {len(impls)} implementations ({names})",
          file=sys.stderr)
    baselines = () if args.impl else tuple(chosen.get("baselines", ()))
    result = run(sweep, impls, device=device, out_dir=args.out, command=command, resume=args.resume,
                 time_limit=args.time_limit, log=lambda s: print(s, file=sys.stderr), baselines=baselines)
    print(status_words(result))
    print(f"{results_words(result)}; {sum(s['cases'] for s in result['not_measured'])} not measured")
    print(f"wrote {', '.join(str(Path(args.out) / n) for n in OUTPUTS)}")
    if result.get("html_error"):
        print(f"accuracy.html not written: {result['html_error']}", file=sys.stderr)
    return accuracy_exit_status(result, asked=[i.name for i in impls if args.impl and i.cli_name in args.impl])


def accuracy_exit_status(result: dict, *, asked: list[str] = ()) -> int:
    """2 when nothing was measured for an implementation named with ``--impl`` (``asked``; by default:
    for any implementation at all), 1 when a measured case fails a criterion, else 0. A sweep that
    judged nothing, or judged a failure, does not exit 0. The run's baselines (``meta["baselines"]``: a preset's
    points of comparison, such as the FlashAttention-3 paper's standard attention) are reported when they fail,
    not counted."""
    measured = {r["implementation"] for r in result["results"]}
    unmeasured = [name for name in asked if name not in measured] if asked else ([] if measured else ["any"])
    if unmeasured:
        why = ("the sweep stopped before measuring it (rerun with --resume)" if result["status"] != "complete"
               else "every case was skipped: see 'Not measured' in accuracy.md")
        print(f"nothing was measured for {', '.join(unmeasured)}: {why}", file=sys.stderr)
        return 2
    baselines = set((result.get("meta") or {}).get("baselines") or ())
    failed = [c for c in result["criteria"] if c.get("failed_cases", 0) and c["implementation"] not in baselines]
    expected = [c for c in result["criteria"] if c.get("failed_cases", 0) and c["implementation"] in baselines]
    if expected:
        print("a criterion failed for a baseline the preset compares with (not counted in the exit status): "
              + ", ".join(f"{c['implementation']} {c['dtype']} ({c['failed_cases']} cases)" for c in expected),
              file=sys.stderr)
    if failed:
        print("a criterion failed: " + ", ".join(f"{c['implementation']} {c['dtype']} ({c['failed_cases']} cases)" for c in failed),
              file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    a = argparse.ArgumentParser(
        prog="python -m verify.accuracy",
        description="Measure implementations against the float64 reference over a sweep of shapes x magnitude "
                    "classes x dtypes x causal and write accuracy.md, accuracy.json and accuracy.html (RMSE, max "
                    "error, ULP, error/bound, error/eager for O, LSE, dQ, dK, dV). Exits 1 when a measured case fails "
                    "a criterion, 2 when nothing was measured.",
        epilog=ACCURACY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--impl", action="append", metavar="IMPL",
                   help="implementation (repeatable): registry name, package.module:attr or path/file.py:attr, "
                        "...:attr@CONVENTION for a function in flash_attn's or xformers' calling convention "
                        "(default: every shipped attention kernel that runs on the device)")
    a.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    a.add_argument("--preset", choices=sorted(PRESETS),
                   help="sequence lengths and head dims; fa3: the FlashAttention-3 paper's accuracy protocol; "
                        "variants: packed, window, softcap, paged decode (see below) (default: gpu on a GPU, quick "
                        "otherwise)")
    a.add_argument("--len", type=_positive_ints, nargs="+", metavar="N", help="sequence lengths (Nq = Nk = N)")
    a.add_argument("--head-dim", type=_positive_ints, nargs="+", metavar="D", help="head dims")
    a.add_argument("--dtype", nargs="+", metavar="DTYPE",
                   help="float16 bfloat16 float32 float64 (default: float16 bfloat16)")
    a.add_argument("--magnitude", nargs="+", metavar="CLASS",
                   help="magnitude classes of strategies/cases.py (default: normal sparse_outliers large_logits; "
                        "fa3: fa3_outliers)")
    a.add_argument("--causal", choices=("both", "yes", "no"), help="causal masking (default: both; fa3: no)")
    a.add_argument("--batch", type=_positive_ints, help="batch size (default 1; fa3: 4 on a GPU)")
    a.add_argument("--heads", type=_positive_ints, help="heads (default 2; fa3: 16)")
    a.add_argument("--seed", type=int, nargs="+", metavar="SEED", help="input seeds (default: 0; fa3: 0 1 2)")
    a.add_argument("--variant", nargs="+", metavar="VARIANT",
                   help=f"measure these variants instead of the dense grid: {', '.join(VARIANTS)} "
                        "(default: none; variants: all)")
    a.add_argument("--backward", action=argparse.BooleanOptionalAction,
                   help="--no-backward: measure the forward only, no dQ, dK, dV (default: --backward; fa3: "
                        "--no-backward)")
    a.add_argument("--out", default="flashverify-report/accuracy", metavar="DIR",
                   help="output directory (default: flashverify-report/accuracy, git-ignored)")
    a.add_argument("--resume", action="store_true", help="keep the measurements already in --out and do the rest")
    a.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="start no new case after this long; write a partial report (continue with --resume)")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    return _accuracy(args, parser)


if __name__ == "__main__":
    sys.exit(main())
