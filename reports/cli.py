"""``python -m reports``: re-summarise a report directory, or run the accuracy sweep.

    python -m reports summarise DIR        # a pytest verify report dir (finished or killed) or an accuracy dir
    python -m reports accuracy [options]   # the fp16/bf16 accuracy report (see --help); exits 1 when a
                                           # measured case fails a criterion, 2 when nothing was measured
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from reports import accuracy

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
  python -m reports accuracy --device cuda --preset gpu --out docs/accuracy
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


def _summarise(args) -> int:
    root = Path(args.dir)
    if not root.is_dir():
        print(f"summarise: {root} is not a directory", file=sys.stderr)
        return 2
    if (root / accuracy.RUN_FILE).exists():
        result = accuracy.write_report(root)
        print(accuracy.status_words(result))
        print(f"{len(result['results'])} (implementation, case) results"
              + (f"; {result['unreadable_lines']} unreadable lines skipped" if result["unreadable_lines"] else ""))
        print(f"wrote {', '.join(str(root / n) for n in accuracy.OUTPUTS)}")
        return 0
    if not any(root.glob("measurements-*.jsonl")) and not any(root.glob("run-*.json")):
        print(f"summarise: {root} holds no report (no measurements-*.jsonl, run-*.json or {accuracy.RUN_FILE})",
              file=sys.stderr)
        return 2
    from reports.summary import status_line, write_summary

    summary = write_summary(root, html=not args.no_html)
    print(status_line(summary))
    print(f"{summary['measurements']} measurements ({summary['failed_measurements']} failed), "
          f"{len(summary['failures'])} failing tests"
          + (f"; {summary['unreadable_lines']} unreadable lines skipped" if summary["unreadable_lines"] else ""))
    written = ["summary.json", "report.md"] + ([] if args.no_html or summary.get("html_error") else ["report.html"])
    print(f"wrote {', '.join(str(root / n) for n in written)}")
    if summary.get("html_error"):
        print(f"report.html not written: {summary['html_error']}", file=sys.stderr)
    return 0


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
    preset = accuracy.preset(args.preset or ("gpu" if parsed.type == "cuda" else "quick"), device=device)
    for v in args.variant or []:
        if v not in accuracy.VARIANTS:
            parser.error(f"--variant {v!r} is not a variant; known: {', '.join(accuracy.VARIANTS)}")
    for m in args.magnitude or []:
        if m not in MAGNITUDES:
            parser.error(f"--magnitude {m!r} is not a magnitude class; known: {', '.join(MAGNITUDES)}")
    for d in args.dtype or []:
        if d not in DTYPES:
            parser.error(f"--dtype {d!r}; known: {', '.join(DTYPES)}")
    # The preset's sweep (the Sweep defaults for what it leaves out), each option given overriding it.
    fields = {f.name: preset[f.name] for f in dataclasses.fields(accuracy.Sweep) if f.name in preset}
    given = {"lengths": args.len, "head_dims": args.head_dim, "dtypes": args.dtype, "magnitudes": args.magnitude,
             "causal": {"both": (False, True), "yes": (True,), "no": (False,)}.get(args.causal),
             "batch": args.batch, "heads": args.heads, "seeds": args.seed, "backward": args.backward,
             "variants": args.variant}
    fields.update({k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None})
    sweep = accuracy.Sweep(**fields)
    try:
        impls = accuracy.select_implementations(args.impl or [], device=device,
                                                defaults=preset.get("implementations"),
                                                list_all=preset.get("list_all", False))
    except ImplementationError as exc:
        parser.error(str(exc))
    command = " ".join(shlex.quote(a) for a in ["python", "-m", "reports", *args.argv])
    names = ", ".join(i.name for i in impls)
    print(f"accuracy sweep on {device}: {len(sweep.cases())} cases x {len(impls)} implementations ({names})",
          file=sys.stderr)
    result = accuracy.run(sweep, impls, device=device, out_dir=args.out, command=command, resume=args.resume,
                          time_limit=args.time_limit, log=lambda s: print(s, file=sys.stderr))
    print(accuracy.status_words(result))
    failed = sum(c.get("failed_cases", 0) for c in result["criteria"])
    print(f"{len(result['results'])} (implementation, case) results, {failed} with a failed criterion; "
          f"{sum(s['cases'] for s in result['not_measured'])} not measured")
    print(f"wrote {', '.join(str(Path(args.out) / n) for n in accuracy.OUTPUTS)}")
    if result.get("html_error"):
        print(f"accuracy.html not written: {result['html_error']}", file=sys.stderr)
    return accuracy_exit_status(result, asked=[i.name for i in impls if args.impl and i.cli_name in args.impl],
                                baselines=() if args.impl else preset.get("baselines", ()))


def accuracy_exit_status(result: dict, *, asked: list[str] = (), baselines: tuple[str, ...] = ()) -> int:
    """2 when nothing was measured for an implementation named with ``--impl`` (``asked``; by default:
    for any implementation at all), 1 when a measured case fails a criterion, else 0. A sweep that
    judged nothing, or judged a failure, does not exit 0. ``baselines`` (a preset's points of comparison,
    such as the FlashAttention-3 paper's standard attention) are reported when they fail, not counted."""
    measured = {r["implementation"] for r in result["results"]}
    unmeasured = [name for name in asked if name not in measured] if asked else ([] if measured else ["any"])
    if unmeasured:
        why = ("the sweep stopped before measuring it (rerun with --resume)" if result["status"] != "complete"
               else "every case was skipped: see 'Not measured' in accuracy.md")
        print(f"nothing was measured for {', '.join(unmeasured)}: {why}", file=sys.stderr)
        return 2
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
    parser = argparse.ArgumentParser(prog="python -m reports", description="flashverify reports")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarise", aliases=["summarize"],
                       help="(re)write summary.json, report.md and report.html of a report directory",
                       description="Summarise a report directory: a pytest verify --report-dir (also one left by "
                                   "a killed run: truncated lines are skipped and the report says PARTIAL) or an "
                                   "accuracy sweep's --out directory.")
    s.add_argument("dir", help="the report directory")
    s.add_argument("--no-html", action="store_true", help="write summary.json and report.md only")
    a = sub.add_parser("accuracy",
                       help="sweep shapes x magnitude classes x dtypes x causal; write accuracy.md/.json/.html",
                       description="Measure implementations against the float64 reference over a sweep and write "
                                   "accuracy.md, accuracy.json and accuracy.html (RMSE, max error, ULP, "
                                   "error/bound, error/eager for O, LSE, dQ, dK, dV).",
                       epilog=ACCURACY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--impl", action="append", metavar="IMPL",
                   help="implementation (repeatable): registry name, package.module:attr or path/file.py:attr, "
                        "...:attr@CONVENTION for a function in flash_attn's or xformers' calling convention "
                        "(default: every shipped attention kernel that runs on the device)")
    a.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    a.add_argument("--preset", choices=sorted(accuracy.PRESETS),
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
                   help=f"measure these variants instead of the dense grid: {', '.join(accuracy.VARIANTS)} "
                        "(default: none; variants: all)")
    a.add_argument("--backward", action=argparse.BooleanOptionalAction,
                   help="--no-backward: measure the forward only, no dQ, dK, dV (default: --backward; fa3: "
                        "--no-backward)")
    a.add_argument("--out", default="flashverify-report/accuracy", metavar="DIR",
                   help="output directory (default: flashverify-report/accuracy, git-ignored)")
    a.add_argument("--resume", action="store_true", help="keep the measurements already in --out and do the rest")
    a.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="start no new case after this long; write a partial report (continue with --resume)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command in ("summarise", "summarize"):
        return _summarise(args)
    return _accuracy(args, parser)
