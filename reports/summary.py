"""Summaries of a report directory: read every measurement stream, aggregate, write JSON, Markdown
and HTML.

Works on a finished run and on one killed half-way: a truncated or garbled line is counted and
skipped, a worker whose ``run-<worker>.json`` was never marked finished makes the report *partial*
(said at the top of every output), and failure files that cannot be read are listed, not fatal.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from reports import coverage, margins, memory, timing
from reports.session import read_runs, read_stream, replay_command

# How many of the worst measurements the summary lists (with their replay commands).
WORST_CASES = 25
PER_CHECK = 3


def num(value: Any) -> float:
    """A measurement field as a float: ``"inf"``/``"nan"`` strings (how JSON holds them) become floats,
    missing values NaN."""
    if isinstance(value, bool) or value is None:
        return math.nan
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def largest(values) -> float | None:
    """Largest value, NaN counting as the largest of all (a NaN error is never hidden); None if empty."""
    values = list(values)
    if not values:
        return None
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values)


def read_measurements(report_dir: str | Path) -> tuple[list[dict], int]:
    """All measurements of the run and the number of unreadable (truncated) lines.

    Each measurement gets a ``worker`` field (from its stream's file name) if it has none.
    """
    return read_stream(report_dir, "measurements")


def read_failures(report_dir: str | Path) -> list[dict]:
    out = []
    for path in sorted((Path(report_dir) / "failures").glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            data = {"test": path.name, "message": "unreadable failure file"}
        if isinstance(data, dict):
            data["file"] = str(Path("failures") / path.name)
            out.append(data)
    return out


# What a failure is, read from the words its message starts with (verify/asserts.py, verify/faults.py and verify/failures.py
# write them): the first that matches names it. The first is no verdict on the kernel (the suite's own code raised:
# first, as the exception it quotes may hold any words); the next two are the kernel's limits, not wrong answers.
FAILURE_KINDS = (
    ("the suite itself raised (a bug in flashverify, not a verdict on the kernel)", "suite raised"),
    ("resource limit (not a wrong answer)", "resource limit (not a wrong answer)"),
    ("compile failure (not a wrong answer)", "compile failure (not a wrong answer)"),
    ("Timeout:", "timeout"),
    ("ran out of device memory", "out of memory"),
    ("sticky CUDA error", "sticky CUDA error"),
    ("differs from the float64 reference", "wrong answer"),
    ("exceeds the tolerance", "results disagree"),
    ("the kernel raised (not a wrong answer)", "kernel raised"),
)


def failure_kind(failure: dict) -> str:
    """The kind of one failure file (:data:`FAILURE_KINDS`), ``other`` when none matches (a property's own
    check, a kernel that raises)."""
    message = str(failure.get("message", ""))
    return next((kind for words, kind in FAILURE_KINDS if words in message), "other")


def failure_counts(failures: list[dict]) -> str:
    """``3: 2 wrong answer, 1 resource limit (not a wrong answer)``, the heading of a report's failures."""
    kinds = collections.Counter(failure_kind(f) for f in failures)
    return f"{len(failures)}" + (": " + ", ".join(f"{n} {k}" for k, n in kinds.most_common()) if failures else "")


def brief(failure: dict) -> list[str]:
    """A failure in at most four lines for the end of a run's output: the test, the reason (its first line and
    the criteria that failed, or the exception), the case in one line and the command that replays it."""
    lines = [line.strip() for line in str(failure.get("message", "")).splitlines() if line.strip()]
    own = [line for line in lines if line.startswith(("property:", "case:", "replay:"))]
    body = [line for line in lines if line not in own]
    reason = body[:1] + [line for line in body[1:] if "FAILED]" in line]
    if failure_kind(failure) in ("kernel raised", "suite raised") and len(body) > 1:
        reason = [body[0].split(" on a case its declaration allows")[0], body[-1]]
    out = [f"{failure.get('test')}:", *(f"  {line}" for line in reason[:3])]
    if failure.get("case"):
        out.append(f"  case: {describe_case(failure['case'])}")
    out.append(f"  replay: {failure['replay']}" if failure.get("replay") else f"  no replay: {failure.get('note')}")
    return out


def describe_case(case: Any) -> str:
    """A case dict in the words of the failure messages (``B=1 Hq=2 ... seed=0``)."""
    if not isinstance(case, dict):
        return str(case)
    try:
        if "len_k" in case:
            from strategies.cases import AttentionCase

            return AttentionCase.from_dict(case).describe()
        if "rows" in case:
            from strategies.softmax import SoftmaxCase

            return SoftmaxCase.from_dict(case).describe()
    except (ValueError, TypeError):
        pass
    return " ".join(f"{k}={v}" for k, v in case.items())


def _run_info(runs: list[dict]) -> dict:
    """What every worker agrees on (device kind, profile, versions, implementations, command)."""
    main = next((r for r in runs if r.get("worker") == "main"), runs[0] if runs else {})
    devices = sorted({str(r.get("device")) for r in runs if r.get("device")})
    specs: dict[str, str] = {}
    for r in runs:
        for impl in r.get("implementations") or []:
            if isinstance(impl, dict) and impl.get("name"):
                specs[str(impl["name"])] = str(impl.get("spec") or impl["name"])
    return {"command": main.get("command"), "devices": devices, "device_name": main.get("device_name"),
            "profile": main.get("profile"), "versions": main.get("versions") or {},
            "triton_interpret": main.get("triton_interpret"), "started": main.get("started"),
            "finished": main.get("finished"), "implementations": main.get("implementations") or [],
            "specs": specs, "workers": [r.get("worker") for r in runs],
            "shard": main.get("shard"), "shards": main.get("shards")}


def _replay_for(row: dict, specs: dict[str, str], device_of: dict[str, str]) -> str | None:
    case, prop, impl = row.get("case"), row.get("property"), row.get("implementation")
    if not isinstance(case, dict) or not prop or not impl:
        return None
    device = device_of.get(str(row.get("worker")), next(iter(device_of.values()), "cpu"))
    return replay_command(impl=specs.get(str(impl), str(impl)), prop=str(prop), case=case, device=device)


def worst_cases(rows: list[dict], *, limit: int = WORST_CASES, specs: dict[str, str] | None = None,
                device_of: dict[str, str] | None = None) -> list[dict]:
    """The measurements with the largest error/bound (failed ones first), one per case and op and at
    most :data:`PER_CHECK` per (implementation, property, op)."""
    specs, device_of = specs or {}, device_of or {}

    def key(r):
        ratio = num(r.get("error_over_bound"))
        ratio = math.inf if math.isnan(ratio) else ratio
        err = num(r.get("max_abs"))
        # Ties (two infinite ratios) in an order of their own, not the workers' files': a run and the
        # merge of its shards list the same cases.
        return (r.get("pass") is False, ratio, math.inf if math.isnan(err) else err,
                json.dumps(r, sort_keys=True, default=str))

    seen, per_check, out = set(), defaultdict(int), []
    for r in sorted(rows, key=key, reverse=True):
        if r.get("pass") is not False and num(r.get("error_over_bound")) == 0 and num(r.get("max_abs")) == 0:
            break  # exact results are not worth listing (and everything after them is exact too)
        check = (r.get("implementation"), r.get("property"), r.get("op"))
        ident = (*check, json.dumps(r.get("case"), sort_keys=True))
        # A failure shrinks through many similar cases: show at most PER_CHECK of each check, so that
        # the list covers every check that came close to its bound.
        if ident in seen or per_check[check] >= PER_CHECK:
            continue
        seen.add(ident)
        per_check[check] += 1
        case = r.get("case") or {}
        out.append({"implementation": r.get("implementation"), "property": r.get("property"), "op": r.get("op"),
                    "dtype": case.get("dtype") if isinstance(case, dict) else None,
                    "case": case, "case_text": describe_case(case), "max_abs": num(r.get("max_abs")),
                    "max_rel": num(r.get("max_rel")), "max_ulp": num(r.get("max_ulp")),
                    "error_over_bound": num(r.get("error_over_bound")),
                    "error_over_baseline": num(r.get("error_over_baseline")), "pass": r.get("pass"),
                    "replay": _replay_for(r, specs, device_of)})
        if len(out) >= limit:
            break
    return out


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (implementation, op, dtype): counts and the largest errors."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        case = r.get("case") if isinstance(r.get("case"), dict) else {}
        groups[(str(r.get("implementation")), str(r.get("op")), str(case.get("dtype")))].append(r)
    table = []
    from reports.plots import DTYPE_ORDER, OP_ORDER

    def order(item):
        (impl, op, dtype), _ = item
        return (impl, OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER), op,
                DTYPE_ORDER.index(dtype) if dtype in DTYPE_ORDER else len(DTYPE_ORDER), dtype)

    for (impl, op, dtype), items in sorted(groups.items(), key=order):
        ratios = [num(i.get("error_over_bound")) for i in items if i.get("error_over_bound") is not None]
        finite = sorted(x for x in ratios if not math.isnan(x))
        table.append({
            "implementation": impl, "op": op, "dtype": dtype, "measurements": len(items),
            "failed": sum(1 for i in items if i.get("pass") is False),
            "max_abs": largest(num(i.get("max_abs")) for i in items if "max_abs" in i),
            "max_rel": largest(num(i.get("max_rel")) for i in items if "max_rel" in i),
            "max_rmse": largest(num(i.get("rmse")) for i in items if "rmse" in i),
            "max_ulp": largest(num(i.get("max_ulp")) for i in items if "max_ulp" in i),
            "median_error_over_bound": statistics.median(finite) if finite else None,
            "max_error_over_bound": largest(ratios),
            "max_error_over_baseline": largest(num(i.get("error_over_baseline")) for i in items
                                                if i.get("error_over_baseline") is not None),
        })
    return table


def summarise(report_dir: str | Path, *, outcomes: dict | None = None, rows: list[dict] | None = None,
              bad: int = 0) -> dict:
    """The summary of a report directory (finished or partial) as a JSON-ready dict."""
    if rows is None:
        rows, bad = read_measurements(report_dir)
    runs = read_runs(report_dir)
    info = _run_info(runs)
    unfinished = [str(r.get("worker")) for r in runs if not r.get("finished")]
    doing = {str(r.get("worker")): str(r["doing"]) for r in runs if not r.get("finished") and r.get("doing")}
    stopped = [r["stopped"] for r in runs if isinstance(r.get("stopped"), dict)]
    if outcomes is None:
        main = next((r for r in runs if r.get("worker") == "main"), {})
        outcomes = main.get("outcomes") or {}
    device_of = {str(r.get("worker")): str(r.get("device")) for r in runs if r.get("device")}
    # Forward properties first (the simplest verdict), as the run orders them; then by test.
    rank = {"test_forward.py": 0, "test_backward.py": 1, "test_longest.py": 2}
    failures = sorted(read_failures(report_dir), key=lambda f: (
        rank.get(str(f.get("test")).split("::")[0].rsplit("/", 1)[-1], 3), str(f.get("test"))))
    return {
        "status": "partial" if (unfinished or stopped or not runs) else "complete",
        "unfinished_workers": unfinished,
        "unfinished_doing": doing,
        "stopped": stopped,
        "run": info,
        "measurements": len(rows), "unreadable_lines": bad,
        "failed_measurements": sum(1 for r in rows if r.get("pass") is False),
        "by_implementation_op_dtype": aggregate(rows),
        "worst_cases": worst_cases(rows, specs=info["specs"], device_of=device_of),
        "failures": failures,
        "outcomes": outcomes,
        "coverage": coverage.summary(report_dir),
        "metamorphic": margins.summary(report_dir),
        "peak_memory": memory.summary(report_dir),
        "time": timing.summary(report_dir),
    }


def fmt(x: Any) -> str:
    """A table cell: 3 significant digits for floats, ``-`` for nothing."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def _md(text: Any) -> str:
    """Text for a Markdown table cell (pipes and newlines would break the table)."""
    return fmt(text).replace("|", "\\|").replace("\n", " ")


def tests_not_run(summary: dict) -> list[str]:
    """The tests a stopped run never ran (each stop's ``not_run``, in order, once each)."""
    return list(dict.fromkeys(t for s in summary.get("stopped") or [] for t in s.get("not_run") or []))


def status_line(summary: dict) -> str:
    """One line: complete, or PARTIAL with why and how many tests did not run (the tests themselves are
    listed apart, under "Tests not run": a run cut short can leave hundreds)."""
    if summary["status"] == "complete":
        return "Status: complete."
    if summary.get("stopped"):
        unfinished = summary.get("unfinished_workers") or []
        listed = " (listed under \"Tests not run\")" if tests_not_run(summary) else ""
        return " ".join("Status: PARTIAL: " + (f"the run stopped after {s['test']} ({s.get('reason')}); "
                                                 if s.get("test") else f"{s.get('reason')}; ")
                        + f"{len(s.get('not_run') or [])} test(s) not run{listed}." for s in summary["stopped"]) + (
            f" Workers that did not finish: {', '.join(unfinished)}." if unfinished else "")
    workers = ", ".join(summary.get("unfinished_workers") or []) or "no run header found"
    doing = "".join(f" {worker} was in {what}: if the process ended there, that is where it crashed."
                    for worker, what in (summary.get("unfinished_doing") or {}).items())
    return (f"Status: PARTIAL: the run did not finish (unfinished: {workers}); this summarises the "
            f"measurements written before it stopped.{doing}")


# The measured columns of one record (verify/measure.py) and their header in every table of every report.
RECORD_COLUMNS = {"rmse": "RMSE", "max_abs": "max abs err", "max_rel": "max rel err", "max_ulp": "max ULP",
                  "error_over_bound": "err/bound", "error_over_baseline": "err/eager"}
# The worst-cases table of report.md and report.html: (key of a worst_cases entry, header).
WORST_COLUMNS = (("implementation", "implementation"), ("property", "property"), ("op", "op"), ("case_text", "case"),
                 *((k, RECORD_COLUMNS[k]) for k in ("max_abs", "max_ulp", "error_over_bound", "error_over_baseline")),
                 ("pass", "pass"))
TABLE_COLUMNS = (("implementation", "implementation"), ("op", "op"), ("dtype", "dtype"), ("measurements", "n"),
                 ("failed", "failed"), ("max_abs", "max abs err"), ("max_rmse", "max RMSE"),
                 ("max_ulp", "max ULP"), ("median_error_over_bound", "median err/bound"),
                 ("max_error_over_bound", "max err/bound"), ("max_error_over_baseline", "max err/eager"))


# What each column of the report's tables means (report.md and report.html print it under the table).
LEGEND = (
    ("implementation, op, dtype", "the kernel under test, the result compared (out, lse, delta, dq, dk, dv) and "
                                  "the input dtype"),
    ("n, failed", "measurements (one per property example that compared this op with the float64 reference) "
                  "and how many of them failed a criterion"),
    ("max abs err", "largest |kernel - float64 reference|, in the stored dtype's values (NaN and disagreeing "
                    "infinities count as inf)"),
    ("max RMSE", "largest root-mean-square error over one measurement's elements"),
    ("max ULP", "largest error in units in the last place of the stored dtype at the row's scale (the largest "
                "reference magnitude of the element's row of D values; of the whole tensor for lse and delta), so "
                "an element near zero in a row of ones counts in the ones' units; rows that are all 0 or "
                "subnormal (fully masked) are left out (their error is in max abs err)"),
    ("median / max err/bound", "error divided by the componentwise rounding-error bound, "
                               "references/bounds.py (criterion 2: at most 1)"),
    ("max err/eager", "max abs error divided by that of the same-precision eager attention, or by criterion 1's "
                      "absolute floor where eager's error is below it (eager exact included), so it is never inf; "
                      "criterion 1 allows 2 for out, lse and delta and 3 for dq, dk, dv"),
    ("pass", "both criteria held"),
)


def markdown(summary: dict) -> str:
    run = summary.get("run") or {}
    lines = ["# flashverify report", "", status_line(summary), ""]
    if run.get("command"):
        lines += [f"Command: `{run['command']}`", ""]
    if run.get("devices"):
        lines += [f"Device: {', '.join(run['devices'])} ({run.get('device_name') or '?'}), profile "
                  f"{run.get('profile')}" + (", TRITON_INTERPRET=1" if run.get("triton_interpret") else ""), ""]
    narrow = [(i.get("name"), i.get("not_covered")) for i in run.get("implementations") or []
              if isinstance(i, dict) and i.get("not_covered")]
    if narrow:
        lines += ["## What the declarations leave out", ""]
        lines += [f"- {name}: {words}" for name, left_out in narrow for words in left_out] + [""]
    outcomes = summary.get("outcomes") or {}
    if outcomes:
        lines += ["Tests: " + ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items())), ""]
    lines += _failures_markdown(summary.get("failures") or [])
    lines += [f"Measurements: {summary['measurements']} ({summary.get('failed_measurements', 0)} failed)"
              + (f"; {summary['unreadable_lines']} unreadable lines skipped" if summary["unreadable_lines"] else ""),
              "", "| " + " | ".join(h for _, h in TABLE_COLUMNS) + " |",
              "|" + "---|" * len(TABLE_COLUMNS)]
    for row in summary["by_implementation_op_dtype"]:
        lines.append("| " + " | ".join(_md(row.get(k)) for k, _ in TABLE_COLUMNS) + " |")
    lines += ["", "Columns: " + "; ".join(f"**{name}**: {words}" for name, words in LEGEND) + "."]
    worst = summary.get("worst_cases") or []
    if worst:
        lines += ["", f"## Worst cases by error/bound ({len(worst)})", "",
                  "| " + " | ".join(h for _, h in WORST_COLUMNS) + " |", "|" + "---|" * len(WORST_COLUMNS)]
        for w in worst:
            lines.append("| " + " | ".join(_md(w.get(k)) for k, _ in WORST_COLUMNS) + " |")
    lines += margins.markdown(summary.get("metamorphic") or [])
    lines += coverage.markdown(summary.get("coverage") or {}, partial=summary.get("status") != "complete")
    lines += timing.markdown(summary.get("time") or {})
    lines += memory.markdown(summary.get("peak_memory") or {})
    not_run = tests_not_run(summary)
    if not_run:
        lines += ["", f"## Tests not run ({len(not_run)})", ""] + [f"- `{t}`" for t in not_run]
    return "\n".join(lines) + "\n"


def _failures_markdown(failures: list[dict]) -> list[str]:
    """The failures, first in the report (what a kernel author came for): each with its replay command."""
    lines = [f"## Failures ({failure_counts(failures)})", ""]
    for f in failures:
        lines += [f"### {f.get('test')} ({failure_kind(f)})", ""]
        if f.get("replay"):
            lines += ["Replay:", "", "```", f["replay"], "```", ""]
        elif f.get("note"):
            lines += [f"No replay command: {f['note']}", ""]
        lines += ["```", str(f.get("message", "")).strip().replace("```", "'''"), "```", ""]
    return lines
