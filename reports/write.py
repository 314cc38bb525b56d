"""Writing a run's report files: ``summary.json``, ``report.md`` and ``report.html``, each replaced atomically.

The one place that puts the folds of :mod:`reports.summary` and the pages of :mod:`reports.html` on disk: the
plugin calls it at the end of a run (and the watchdog when a run is cut short), ``python -m reports summarise``
for a report directory a killed run left.
"""

from __future__ import annotations

from pathlib import Path

from reports import summary as summary_module
from reports.html import report_html
from reports.session import dumps, write_atomic


def write_summary(report_dir: str | Path, *, outcomes: dict | None = None, html: bool = True) -> dict:
    """Write ``summary.json``, ``report.md`` and (unless ``html=False``) ``report.html``; return the summary.

    The HTML comes last and its failure is reported in the summary's ``html_error``, never raised: the
    JSON and Markdown must come out whatever the plotting library does.
    """
    report_dir = Path(report_dir)
    rows, bad = summary_module.read_measurements(report_dir)
    summary = summary_module.summarise(report_dir, outcomes=outcomes, rows=rows, bad=bad)
    write_atomic(report_dir / "summary.json", dumps(summary, indent=2))
    write_atomic(report_dir / "report.md", summary_module.markdown(summary))
    if html:
        try:
            write_atomic(report_dir / "report.html", report_html(summary, rows))
        except Exception as exc:  # noqa: BLE001 - the report must not take the run down with it
            summary["html_error"] = f"{type(exc).__name__}: {exc}"
            write_atomic(report_dir / "summary.json", dumps(summary, indent=2))
    return summary
