"""Self-contained HTML pages for the run report and the accuracy report.

One file, no external resource: the style sheet is inline and the plots (:mod:`reports.plots`) are
embedded PNGs. Without matplotlib the page says so and still shows every table. Every string that
comes from the data (implementation names, cases, messages, commands) goes through :func:`esc`: the
suite runs kernels it has never seen, and their names end up here.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from reports import coverage, plots
from reports.summary import (LEGEND, TABLE_COLUMNS, WORST_COLUMNS, failure_counts, failure_kind, fmt, num,
                             status_line, tests_not_run)

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1400px;
       padding: 0 16px; color: #1d1d1f; }
h1 { margin-bottom: 4px; } h2 { margin-top: 32px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { border: 1px solid #d6d6d6; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f3f4f6; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.fail td { background: #fdecea; }
.banner { padding: 8px 12px; border-radius: 4px; margin: 12px 0; }
.ok { background: #e8f5e9; border: 1px solid #a5d6a7; }
.partial, .bad { background: #fff4e5; border: 1px solid #ffb74d; }
.bad { background: #fdecea; border-color: #ef9a9a; }
code, pre { font: 12px/1.4 ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; }
pre { background: #f6f8fa; padding: 8px; overflow-x: auto; white-space: pre-wrap; word-break: break-all; }
td code { overflow-wrap: anywhere; } td code.name { overflow-wrap: normal; } td.below { border-top: none; padding-left: 24px; }
figure { margin: 12px 0 24px; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; max-width: 1000px; }
.muted { color: #666; }
details > summary { cursor: pointer; }
table.fit { table-layout: fixed; width: 100%; } table.fit td { overflow-wrap: anywhere; }
table.fit ul { margin: 2px 0; padding-left: 16px; }
"""


def esc(value: Any) -> str:
    """``value`` as HTML text (quotes escaped too, so it is safe in attributes)."""
    return html.escape(str(value), quote=True)


class Raw(str):
    """Markup built here from escaped parts: :func:`table` inserts it as is."""


def code(text: Any, *, name: bool = False) -> Raw:
    """``text`` as code; ``name=True`` for an identifier (an --impl), which is not broken inside a word."""
    return Raw(f"<code class=\"name\">{esc(text)}</code>" if name else f"<code>{esc(text)}</code>")


def cell(value: Any) -> str:
    if isinstance(value, Raw):
        return f"<td>{value}</td>"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f'<td class="num">{esc(fmt(value))}</td>'
    return f"<td>{esc(fmt(value))}</td>"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, failed: Iterable[bool] | None = None,
          below: Iterable[Any] | None = None, widths: Sequence[str] | None = None) -> str:
    """An HTML table; every cell is escaped unless it is :class:`Raw`. ``failed`` marks rows red;
    ``below`` gives each row a full-width second line (a replay command), or None for none. Headers that
    are all empty (a key-value table) leave the header row out. ``widths`` (CSS widths, one per column)
    fit the table to the page, wrapping long cells."""
    marks = list(failed) if failed is not None else None
    extra = list(below) if below is not None else None
    head = ("<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in headers) + "</tr></thead>") if any(headers) else ""
    cols = ("<colgroup>" + "".join(f'<col style="width:{esc(w)}">' for w in widths) + "</colgroup>") if widths else ""
    out = [('<table class="fit">' if widths else "<table>") + cols + head + "<tbody>"]
    for i, row in enumerate(rows):
        cls = ' class="fail"' if marks is not None and i < len(marks) and marks[i] else ""
        out.append(f"<tr{cls}>" + "".join(cell(v) for v in row) + "</tr>")
        if extra is not None and i < len(extra) and extra[i] is not None:
            content = extra[i] if isinstance(extra[i], Raw) else esc(extra[i])
            out.append(f'<tr{cls}><td class="below" colspan="{len(headers)}">{content}</td></tr>')
    out.append("</tbody></table>")
    return "\n".join(out)


def figure(png: str | None, *, alt: str, caption: str) -> str:
    """An embedded plot with its caption (or the caption alone when there was nothing to plot)."""
    if png is None:
        return f'<p class="muted">{esc(alt)}: nothing to plot.</p>'
    return (f'<figure><img alt="{esc(alt)}" src="data:image/png;base64,{png}">'
            f"<figcaption>{esc(caption)}</figcaption></figure>")


def plot_or_reason(draw, *, alt: str, caption: str) -> str:
    """Draw one plot with ``draw()``; without matplotlib, or if drawing fails, say why instead."""
    reason = plots.unavailable()
    if reason:
        return f'<p class="muted">{esc(alt)}: not drawn, {esc(reason)}. The tables below hold the same data.</p>'
    try:
        return figure(draw(), alt=alt, caption=caption)
    except Exception as exc:  # noqa: BLE001 - a plot that fails must not cost the report
        return f'<p class="muted">{esc(alt)}: drawing failed ({esc(type(exc).__name__)}: {esc(exc)}).</p>'


def page(title: str, body: Iterable[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def key_values(pairs: Iterable[tuple[str, Any]]) -> str:
    return table(("", ""), ((k, v) for k, v in pairs if v not in (None, "", [], {})))


# ------------------------------------------------------------------------------------ run report
def _points_error_vs_len(rows: list[dict]):
    points: dict[tuple[str, str], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        case = r.get("case")
        if not isinstance(case, dict) or "len_k" not in case or "max_abs" not in r:
            continue
        points[(str(case.get("dtype")), str(r.get("op")))][str(r.get("implementation"))].append(
            (num(case.get("len_k")), num(r.get("max_abs")), r.get("pass") is False))
    return points


def _ratios_by_dtype(rows: list[dict]):
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("error_over_bound") is None:
            continue
        case = r.get("case") if isinstance(r.get("case"), dict) else {}
        values[str(case.get("dtype"))][str(r.get("implementation"))].append(num(r.get("error_over_bound")))
    return values


def run_plots(rows: list[dict], names: Sequence[str] = ()) -> list[str]:
    points = _points_error_vs_len(rows)
    dtypes = plots.ordered({d for d, _ in points}, plots.DTYPE_ORDER)
    ops = plots.ordered({op for _, op in points}, plots.OP_ORDER)
    ratios = _ratios_by_dtype(rows)
    panels = plots.ordered(ratios, plots.DTYPE_ORDER)
    return [
        "<h2>Error against Nk</h2>",
        plot_or_reason(lambda: plots.scatter_panels(points, rows=dtypes, cols=ops, xlabel="Nk (keys)",
                                                    ylabel="max abs error", names=names,
                                                    title="Max abs error vs float64, by op (columns) and dtype (rows), "
                                                          "one colour per implementation"),
                       alt="Error against Nk",
                       caption="Each point is one measurement (one drawn case, one op). Each row of panels has its "
                               "own scale; open circles on the bottom edge are errors below it (exact results, "
                               "near-subnormal inputs); crosses on the top edge are NaN or infinite errors; a red "
                               "ring marks a measurement that failed a criterion."),
        "<h2>Error / bound</h2>",
        plot_or_reason(lambda: plots.ratio_histograms(ratios, panels=panels, names=names,
                                                      title="Distribution of error / rounding-error bound"),
                       alt="Distribution of error/bound ratios",
                       caption="Criterion 2: every measurement's largest error divided by its componentwise "
                               "bound (log scale). Right of the dashed line the bound is exceeded. A correct "
                               "kernel far left of 1 means the bound is loose for it."),
    ]


def _run_section(summary: dict) -> list[str]:
    run = summary.get("run") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (run.get("versions") or {}).items() if v)
    out = ["<h2>Run</h2>", key_values([
        ("command", code(run["command"]) if run.get("command") else None),
        ("device", ", ".join(map(str, run.get("devices") or [])) + (f" ({run.get('device_name')})"
                                                                   if run.get("device_name") else "")),
        ("profile", run.get("profile")), ("versions", versions),
        ("TRITON_INTERPRET", "1" if run.get("triton_interpret") else None),
        ("started", run.get("started")), ("finished", run.get("finished")),
        ("workers", ", ".join(map(str, run.get("workers") or []))),
    ])]
    impls = [i for i in run.get("implementations") or [] if isinstance(i, dict)]
    if impls:
        out += ["<h3>Implementations under test</h3>", table(
            ("implementation (--impl)", "kind", "dtypes", "causal alignment", "gqa", "gradients", "description",
             "not covered"),
            ([_impl_name(i), i.get("kind"), ", ".join(map(str, i.get("dtypes") or [])), i.get("causal_alignment"),
              i.get("gqa"), _gradients(i), i.get("description"), _left_out(i)] for i in impls),
            widths=("20%", "6%", "8%", "8%", "4%", "12%", "20%", "22%"))]
    return out


def _impl_name(impl: dict) -> Raw:
    """The name, and the --impl that selects it when that differs."""
    name, spec = str(impl.get("name")), str(impl.get("spec") or impl.get("name"))
    return Raw(esc(name) + ("" if spec == name else f"<br>{code(spec)}"))


_WHY = (": not covered, declared unsupported",
        ": not covered, a plain callable is assumed not to support it (declare it to have it drawn)")


def _left_out(impl: dict) -> Raw | str:
    """What the declaration leaves out, folded under a count (the words say whether it was declared or is
    the plain callable's default)."""
    words = [str(w) for w in impl.get("not_covered") or []]
    if not words:
        return "-"
    how = "assumed (plain callable)" if any(w.endswith(_WHY[1]) for w in words) else "declared"
    items = "".join(f"<li>{esc(w.removesuffix(_WHY[0]).removesuffix(_WHY[1]))}</li>" for w in words)
    return Raw(f"<details><summary>{len(words)} left out ({how})</summary><ul>{items}</ul></details>")


def _gradients(impl: dict) -> str:
    """How an implementation gives gradients: through autograd, and its own backward (with Delta) or not."""
    backward = "its backward function (dQ, dK, dV, Delta)"
    if "autograd" not in impl:  # a run recorded before the field: only whether it exposes its backward
        return backward if impl.get("backward") else "no backward function"
    ways = (["autograd"] if impl["autograd"] else []) + ([backward] if impl.get("backward") else [])
    return " and ".join(ways) or "none"


def report_html(summary: dict, rows: list[dict]) -> str:
    """The run report as one self-contained HTML page."""
    partial = summary.get("status") != "complete"
    failures = summary.get("failures") or []
    banner_cls = "partial" if partial else ("bad" if failures or summary.get("failed_measurements") else "ok")
    outcomes = summary.get("outcomes") or {}
    counts = (f"{summary['measurements']} measurements ({summary.get('failed_measurements', 0)} failed), "
              f"{len(failures)} failing tests"
              + (f"; {summary['unreadable_lines']} unreadable lines skipped"
                 if summary.get("unreadable_lines") else ""))
    body = ["<h1>flashverify report</h1>",
            f'<div class="banner {banner_cls}">{esc(status_line(summary))}<br>{esc(counts)}'
            + (f"<br>Tests: {esc(', '.join(f'{v} {k}' for k, v in sorted(outcomes.items())))}" if outcomes else "")
            + "</div>"]
    body += _failures_section(summary)
    body += _run_section(summary)
    names = [str(i.get("name")) for i in (summary.get("run") or {}).get("implementations") or []
             if isinstance(i, dict)]
    body += run_plots(rows, names)
    table_rows = summary.get("by_implementation_op_dtype") or []
    body += ["<h2>By implementation, op and dtype</h2>",
             table([h for _, h in TABLE_COLUMNS], ([r.get(k) for k, _ in TABLE_COLUMNS] for r in table_rows),
                   failed=[bool(r.get("failed")) for r in table_rows]),
             '<dl class="muted">' + "".join(f"<dt>{esc(name)}</dt><dd>{esc(words)}</dd>" for name, words in LEGEND)
             + "</dl>"]
    worst = summary.get("worst_cases") or []
    body += [f"<h2>Worst cases ({len(worst)})</h2>",
             '<p class="muted">The measurements with the largest error/bound, failed ones first; each replays on '
             "its own with the command shown (run it from the repository root).</p>",
             table([h for _, h in WORST_COLUMNS], ([w.get(k) for k, _ in WORST_COLUMNS] for w in worst),
                   failed=[w.get("pass") is False for w in worst],
                   below=[Raw("replay: " + code(w["replay"])) if w.get("replay") else None for w in worst])]
    body += _metamorphic_section(summary.get("metamorphic") or [])
    not_run = tests_not_run(summary)
    if not_run:
        body += [f"<h2>Tests not run ({len(not_run)})</h2>",
                 f"<details{' open' if len(not_run) <= 20 else ''}><summary>the tests the run never got to</summary>"
                 "<ul>" + "".join(f"<li><code>{esc(t)}</code></li>" for t in not_run) + "</ul></details>"]
    body += _coverage_section(summary.get("coverage") or {}, partial=partial)
    return page("flashverify report", body)


# Failures shown open at the top of the page; the rest are folded (each still one click away).
OPEN_FAILURES = 5


def _failures_section(summary: dict) -> list[str]:
    """The failures first, each with its replay command: what a kernel author came for."""
    failures = summary.get("failures") or []
    out = [f"<h2>Failures ({esc(failure_counts(failures))})</h2>"]
    if not failures:
        return out + ['<p class="muted">No test failed.</p>']
    out.append('<p class="muted">Each replays on its own with the command shown (run it from the directory the '
               "run was started in); report.md holds the same.</p>")
    for n, f in enumerate(failures):
        out.append(f"<details{' open' if n < OPEN_FAILURES else ''}><summary><code>{esc(f.get('test'))}</code> "
                   f"({esc(failure_kind(f))})</summary>"
                   + (f"<p>Replay:</p><pre>{esc(f['replay'])}</pre>" if f.get("replay") else
                      f"<p class=\"muted\">No replay command{': ' + esc(f['note']) if f.get('note') else ''}</p>")
                   + f"<pre>{esc(str(f.get('message', '')).strip())}</pre>"
                   + f"<p class=\"muted\">File: <code>{esc(f.get('file', ''))}</code></p></details>")
    return out


def _metamorphic_section(rows: list[dict]) -> list[str]:
    """The metamorphic checks' margins (``reports/margins.py``)."""
    if not rows:
        return []
    return ["<h2>Metamorphic checks</h2>",
            '<p class="muted">Two results of the kernel that should agree (another tiling, permuted keys, shifted '
            "scores, ...), compared within a tolerance made of both results' rounding bounds: the median and "
            "largest difference/tolerance (at most 1 to pass).</p>",
            table(("implementation", "property", "dtype", "n", "failed", "median diff/tol", "max diff/tol"),
                  ([r["implementation"], r["property"], r["dtype"], r["comparisons"], r["failed"],
                    r["median_difference_over_tolerance"], r["max_difference_over_tolerance"]] for r in rows),
                  failed=[bool(r["failed"]) for r in rows])]


def _coverage_section(cov: dict, *, partial: bool) -> list[str]:
    """The boundary classes each property's examples reached (``reports/coverage.py``)."""
    rows = cov.get("by_property") or []
    if not rows:
        return []
    out = ["<h2>Coverage: boundary classes reached</h2>",
           '<p class="muted">Examples each property ran, and how many of them reached each boundary class '
           "(a fact of the case: <code>strategies/attention.py</code>, <code>boundary_classes</code>); the "
           "longest sequence drawn (by its keys), the largest group and the most KV splits.</p>",
           table(("property", "tests", "examples", "longest, group, splits", "classes reached (examples)"),
                 ([r["property"], r["tests"], r["examples"], coverage.shapes_cell(r),
                   ", ".join(f"{k} {v}" for k, v in r["classes"].items()) or "none"] for r in rows))]
    if cov.get("required_missing"):
        out.append(f"<p class=\"fail\">{esc(coverage.missing_line(cov, partial=partial))}</p>")
    return out



# ------------------------------------------------------------------------------------ accuracy report
