"""``python -m reports summarise DIR``: (re)write the report of a directory, a pytest verify run's (finished or
killed) or an accuracy sweep's; ``python -m reports merge OUT DIR...``: one report from the report folders of
a run's shards (``pytest verify --shard K/N``). The sweep itself runs with ``python -m verify.accuracy``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reports import accuracy, merge
from reports.summary import status_line
from reports.write import write_summary


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
    s.set_defaults(run=_summarise)
    m = sub.add_parser("merge", help="one report from the report folders of the shards of a run",
                       description="Merge the report folders of a run split with pytest verify --shard K/N into "
                                   "one report folder (summary.json, report.md, report.html).")
    m.add_argument("out", help="the merged report folder (created)")
    m.add_argument("dirs", nargs="+", help="the shards' report folders")
    m.add_argument("--no-html", action="store_true", help="write summary.json and report.md only")
    m.set_defaults(run=_merge)
    return parser


def _merge(args) -> int:
    try:
        out = merge.merge(args.out, args.dirs)
    except merge.MergeError as exc:
        print(exc, file=sys.stderr)
        return 2
    summary = write_summary(out, html=not args.no_html)
    print(f"merged {len(args.dirs)} report folders into {out}")
    print(status_line(summary))
    print(f"{summary['measurements']} measurements ({summary['failed_measurements']} failed), "
          f"{len(summary['failures'])} failing tests")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return args.run(args)
