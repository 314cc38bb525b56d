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
           "(a fact of the case: <code>strategies/attention.py</code>, <code>boundary_classes</code>).</p>",
           table(("property", "tests", "examples", "classes reached (examples)"),
                 ([r["property"], r["tests"], r["examples"],
                   ", ".join(f"{k} {v}" for k, v in r["classes"].items()) or "none"] for r in rows))]
    if cov.get("required_missing"):
        out.append(f"<p class=\"fail\">{esc(coverage.missing_line(cov, partial=partial))}</p>")
    return out



# ------------------------------------------------------------------------------------ accuracy report
def _accuracy_plots(result: dict) -> list[str]:
    from reports.accuracy import OP_WORDS, OPS, geomean

    res = result.get("results") or []
    sweep = (result.get("meta") or {}).get("sweep") or {}
    dtypes = list(sweep.get("dtypes") or plots.ordered({r["dtype"] for r in res}, plots.DTYPE_ORDER))
    mags = list(sweep.get("magnitudes") or sorted({r["magnitude"] for r in res}))
    ops = [op for op in OPS if any(op in r["ops"] for r in res)]
    bars: dict[tuple[str, str], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for op, per_impl in (result.get("rmse") or {}).items():
        for name, cells in per_impl.items():
            for d in dtypes:
                for m in mags:
                    v = cells.get(f"{d} {m}")
                    if v is not None:
                        bars[(OP_WORDS.get(op, op), d)][name][m] = v
    lines: dict[tuple[str, str], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    by_point: dict[tuple, list[float]] = defaultdict(list)
    for r in res:
        if "out" in r["ops"]:
            by_point[(r["magnitude"], r["dtype"], r["implementation"], r["len"])].append(r["ops"]["out"]["rmse"])
    for (m, d, name, n), vals in by_point.items():
        gm = geomean(vals)
        if gm is not None:
            lines[(m, d)][name].append((float(n), gm))
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in res:
        for o in r["ops"].values():
            ratios[r["dtype"]][r["implementation"]].append(o["error_over_bound"])
    op_rows = [OP_WORDS.get(op, op) for op in ops]
    names = [str(i.get("name")) for i in result.get("implementations") or []]
    against_n = [
        "<h2>RMSE of O against N</h2>",
        plot_or_reason(lambda: plots.line_panels(lines, rows=mags, cols=dtypes, xlabel="N (= Nq = Nk)",
                                                 ylabel="RMSE of O", names=names,
                                                 title="RMSE of the output against sequence length"),
                       alt="RMSE of O against N",
                       caption="Geometric mean over head dims, causal flags and seeds; one panel per magnitude class "
                               "(rows) and dtype (columns)."),
    ] if not sweep.get("variants") else []  # a variant's lengths are its own (sequences, a cache): no one N axis
    return [
        "<h2>RMSE by implementation, magnitude class and dtype</h2>",
        plot_or_reason(lambda: plots.grouped_bars(bars, rows=op_rows, cols=dtypes, groups=mags,
                                                  ylabel="RMSE vs float64", names=names,
                                                  title="RMSE against float64 (geometric mean over N, D, causal)"),
                       alt="RMSE by implementation, magnitude class and dtype",
                       caption="One panel per output (rows) and dtype (columns); bars grouped by magnitude class, "
                               "one colour per implementation. Lower is better; log scale."),
        *against_n,
        "<h2>Error / bound</h2>",
        plot_or_reason(lambda: plots.ratio_histograms(ratios, panels=dtypes, names=names,
                                                      title="Distribution of error / rounding-error bound, all ops"),
                       alt="Distribution of error/bound ratios",
                       caption="Criterion 2 for every measurement of the sweep (O, LSE, dQ, dK, dV). Right of the "
                               "dashed line the bound is exceeded."),
    ]


def _shown(t, *, below: list | None = None) -> str:
    """One of :mod:`reports.accuracy`'s tables (the ones accuracy.md shows too)."""
    return table(t.headers, t.rows, failed=t.failed, below=below)


def accuracy_html(result: dict) -> str:
    """The accuracy report as one self-contained HTML page."""
    from reports import accuracy

    meta = result.get("meta") or {}
    sweep = meta.get("sweep") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items() if v)
    partial = result.get("status") != "complete"
    failed = sum(c.get("failed_cases", 0) for c in result.get("criteria") or [])
    body = [f"<h1>{esc(accuracy.title(result))}</h1>",
            f'<div class="banner {"partial" if partial else ("bad" if failed else "ok")}">'
            f"{esc(accuracy.status_words(result))}<br>{esc(len(result.get('results') or []))} "
            "(implementation, case) results, "
            f"{esc(failed)} with a failed criterion.</div>",
            "<h2>Run</h2>",
            key_values([("command", code(meta.get("command"))),
                        ("device", f"{meta.get('device')} ({meta.get('device_name')})"), ("versions", versions),
                        ("started", meta.get("started")), ("written", result.get("finished")),
                        ("shapes", f"variants {', '.join(sweep['variants'])} (below), H={sweep.get('heads')}, N in "
                                   f"{sweep.get('lengths')}, D in {sweep.get('head_dims')}, pages of "
                                   f"{sweep.get('page_size')} keys" if sweep.get("variants") else
                                   f"B={sweep.get('batch')}, H={sweep.get('heads')}, N = Nq = Nk in "
                                   f"{sweep.get('lengths')}, D in {sweep.get('head_dims')}"),
                        ("dtypes", ", ".join(map(str, sweep.get("dtypes") or []))),
                        ("causal", ", ".join(map(str, sweep.get("causal") or []))),
                        ("seeds", ", ".join(map(str, sweep.get("seeds") or [])))]),
            table(("magnitude class", "inputs"), ((m, accuracy.MAGNITUDE_WORDS.get(m, "see strategies/cases.py"))
                                                  for m in sweep.get("magnitudes") or [])),
            '<p class="muted">Inputs are rounded to the dtype first and the float64 reference is computed from the '
            "rounded inputs. RMSE = sqrt(mean((x - ref)^2)), the FlashAttention-3 paper's measure. err/bound: largest "
            "error over the componentwise rounding-error bound (criterion 2, at most 1). err/eager: max error over "
            "that of the same-precision eager attention (criterion 1: at most 2 for O and LSE, 3 for gradients, "
            "plus a tiny floor).</p>",
            "<h3>Implementations</h3>",
            table(("name", "--impl", "causal alignment", "returns LSE", "dtypes", "description"),
                  ([i.get("name"), code(i.get("spec"), name=True), i.get("causal_alignment"), i.get("returns_lse"),
                    ", ".join(map(str, i.get("dtypes") or [])), i.get("description")]
                   for i in result.get("implementations") or []))]
    protocol = result.get("fa3_protocol")
    if protocol:
        *before, after = accuracy.fa3_words(protocol)
        body += [f"<h2>{esc(accuracy.FA3_TITLE)}</h2>", *(f"<p>{esc(w)}</p>" for w in before),
                 _shown(accuracy.fa3_table(result)), f'<p class="muted">{esc(after)}</p>']
    variants = result.get("variants")
    if variants:
        *before, after = accuracy.variant_words(variants)
        body += [f"<h2>{esc(accuracy.VARIANTS_TITLE)}</h2>", "<ul>",
                 *(f"<li>{esc(w.replace('`', ''))}</li>" for w in before), "</ul>",
                 f'<p class="muted">{esc(after)}</p>', _shown(accuracy.variant_table(result))]
    body += _accuracy_plots(result)
    for op, rmse in accuracy.rmse_tables(result).items():
        body += [f"<h2>RMSE of {esc(accuracy.OP_WORDS.get(op, op))}</h2>",
                 f'<p class="muted">Geometric mean over {esc(accuracy.pooled_words(result))}.</p>', _shown(rmse)]
    crit = accuracy.criteria_table(result)
    if crit.rows:
        body += ["<h2>Pass criteria: largest err/bound and err/eager</h2>", _shown(crit)]
    worst = accuracy.worst_table(result)
    if worst.rows:
        body += ["<h2>Worst measurements by err/bound</h2>",
                 _shown(worst, below=[Raw("replay: " + code(w["replay"])) for w in result["worst_cases"]])]
    skipped = accuracy.not_measured_table(result)
    if skipped.rows:
        body += ["<h2>Not measured</h2>", _shown(skipped)]
    cases = accuracy.case_table(result)
    if cases.rows:
        body += [f"<h2>Every case ({len(cases.rows)})</h2>", "<details><summary>show the table</summary>",
                 _shown(cases), "</details>"]
    return page(accuracy.title(result), body)
