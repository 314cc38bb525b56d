"""Plots for the HTML reports, drawn with matplotlib when it is installed (it is optional).

Every function returns a PNG as base64 text, ready for a ``data:`` URI, or ``None`` when there is
nothing to plot. Only matplotlib's object-oriented API is used (``Figure`` + the Agg canvas, never
``pyplot``), so drawing a report changes no global state of the process it runs in (a pytest
session). Text that comes from the data (implementation names) is drawn literally: ``$`` would
otherwise start matplotlib's math mode.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Iterable, Sequence

OP_ORDER = ("out", "lse", "delta", "dq", "dk", "dv", "softmax")
DTYPE_ORDER = ("float16", "bfloat16", "float32", "float64")


def unavailable() -> str | None:
    """Why plots cannot be drawn here (``None`` when matplotlib is importable)."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no plots, not no report
        return f"matplotlib is not available ({type(exc).__name__}: {exc})"
    return None


def label(text: object, *, limit: int = 48) -> str:
    """``text`` safe as a matplotlib label: no math mode, not hidden from legends, not too long."""
    s = str(text).replace("\n", " ")
    if len(s) > limit:  # keep both ends: "path/to/file.py:attr" stays recognisable
        head = (limit - 1) // 3
        s = s[:head] + "\u2026" + s[len(s) - (limit - 1 - head):]
    s = s.replace("\\", "\\\\").replace("$", r"\$")
    return " " + s if s.startswith("_") else s


def ordered(values: Iterable[str], order: Sequence[str]) -> list[str]:
    """``values`` in the order of ``order``, then the others sorted."""
    values = set(values)
    return [v for v in order if v in values] + sorted(v for v in values if v not in order)


def colours(names: Sequence[str]) -> dict[str, tuple]:
    """One stable colour per name (tab10, then tab20 for more than ten)."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def _palette(present: set[str], order: Sequence[str]) -> tuple[list[str], dict[str, tuple]]:
    """The names present, in order, and their colours; colours follow the full ``order`` so that every
    plot of a page gives an implementation the same colour, whichever implementations it shows."""
    everyone = ordered(set(present) | set(order), order)
    colour = colours(everyone)
    return [n for n in everyone if n in present], colour


# The fixed layout, in inches: matplotlib's constrained layout measures every tick label of every panel and
# took most of a report's drawing time (5 s of a 28-panel grid on a 2-core machine).
LEFT, RIGHT, WGAP = 0.8, 0.25, 0.6  # the y label and tick labels; the next panel's tick labels
LINE = 0.19  # one line of small text
XLABEL = 0.5  # the x tick labels and label under a panel


def _figure(nrows: int, ncols: int, *, width: float = 3.4, height: float = 2.5):
    """A grid of ``nrows x ncols`` panels of ``width x height`` inches; :func:`_finish` sizes the margins."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.0, width * ncols), height * nrows + 0.9))
    fig.panel_grid = (nrows, ncols, width, height)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _arrange(fig, *, title_lines: int, legend_rows: int) -> None:
    """Place the panels by hand: the title's lines above, the legend's rows below, room for each panel's
    title (as many lines as the longest) and tick labels between them."""
    nrows, ncols, width, height = fig.panel_grid
    panel_title = max((len(ax.get_title().splitlines()) for ax in fig.axes), default=1) * LINE + 0.1
    hgap = panel_title + XLABEL
    top = title_lines * 1.3 * LINE + 0.2 + panel_title
    bottom = XLABEL + (legend_rows + 1) * 1.3 * LINE + (0.25 if legend_rows else 0.0)
    fig_w = max(4.0, LEFT + RIGHT + ncols * width + (ncols - 1) * WGAP)
    fig_h = top + bottom + nrows * height + (nrows - 1) * hgap
    fig.set_size_inches(fig_w, fig_h)
    fig.subplots_adjust(left=LEFT / fig_w, right=1 - RIGHT / fig_w, bottom=bottom / fig_h, top=1 - top / fig_h,
                        wspace=WGAP / width, hspace=hgap / height)


def _png(fig) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _legend(fig, handles_by_name: dict, *, title: str, names: Sequence[str] = ()) -> int:
    """The legend under the panels; the number of its rows."""
    handles_by_name = {n: handles_by_name[n] for n in ordered(handles_by_name, names)}
    if not handles_by_name:
        return 0
    ncols = min(4, len(handles_by_name))
    fig.legend(list(handles_by_name.values()), [label(n) for n in handles_by_name], loc="lower center",
               bbox_to_anchor=(0.5, 0.005), ncols=ncols, fontsize="small", title=title, title_fontsize="small")
    return math.ceil(len(handles_by_name) / ncols)


def _finite_positive(values: Iterable[float]) -> list[float]:
    return [v for v in values if v > 0 and math.isfinite(v)]


def _robust_range(values: list[float]) -> tuple[float, float]:
    """A log-axis range that shows the bulk of ``values``: six decades under the median up to above the
    largest (errors of 1e-300 from near-subnormal inputs must not flatten everything else)."""
    if not values:
        return 1e-12, 1.0
    values = sorted(values)
    return max(values[0] / 2, values[len(values) // 2] * 1e-6), values[-1] * 3


FAILED = "failed a criterion"  # the legend's words for the ring drawn round a failing point


def scatter_panels(points: dict[tuple[str, str], dict[str, list[tuple]]], *, rows: Sequence[str],
                   cols: Sequence[str], xlabel: str, ylabel: str, title: str, names: Sequence[str] = ()) -> str | None:
    """Small multiples: panel ``(row, col)`` holds one series ``(x, y)`` or ``(x, y, failed)`` per name, log y;
    each row of panels has its own y range (:func:`_robust_range`).

    Values below the range (exact zeros included) are drawn on the bottom edge with an open marker;
    infinite or NaN values on the top edge with an ``x``; a point whose measurement failed gets a thick red
    ring, drawn over everything, so that failures stand out among thousands of passing points.
    """
    if not points:
        return None
    names, colour = _palette({n for series in points.values() for n in series}, names)
    xs = [p[0] for series in points.values() for pts in series.values() for p in pts]
    log_x = bool(xs) and min(xs) > 0 and max(xs) / min(xs) > 32
    fig, axes = _figure(len(rows), len(cols), width=3.0, height=2.4)
    handles = {}
    for i, r in enumerate(rows):
        lo, hi = _robust_range(_finite_positive(y for c in cols for pts in (points.get((r, c)) or {}).values()
                                                for *_, y in (p[:2] for p in pts)))
        for j, c in enumerate(cols):
            ax = axes[i][j]
            ax.set_title(label(f"{r} / {c}"), fontsize="small", y=1.0)
            ax.set_yscale("log")
            if log_x:
                ax.set_xscale("log", base=2)
            ax.set_ylim(lo / 1.5, hi * 1.5)  # six decades or more: the major ticks label it
            ax.minorticks_off()
            for name, pts in (points.get((r, c)) or {}).items():
                normal = [(p[0], p[1]) for p in pts if lo <= p[1] < math.inf]
                below = [(p[0], lo) for p in pts if p[1] < lo]
                bad = [(p[0], hi) for p in pts if not (p[1] < math.inf)]
                failed = [(p[0], min(max(p[1], lo), hi) if p[1] == p[1] else hi) for p in pts if len(p) > 2 and p[2]]
                if failed:
                    h = ax.scatter([p[0] for p in failed], [p[1] for p in failed], s=70, facecolors="none",
                                   edgecolors="crimson", linewidths=1.6, zorder=5)
                    handles.setdefault(FAILED, h)
                if normal:
                    h = ax.scatter([p[0] for p in normal], [p[1] for p in normal], s=14, alpha=0.65,
                                   color=colour[name], linewidths=0)
                    handles.setdefault(name, h)
                if below:
                    ax.scatter([p[0] for p in below], [p[1] for p in below], s=14, facecolors="none",
                               edgecolors=[colour[name]], linewidths=0.8)
                if bad:
                    ax.scatter([p[0] for p in bad], [p[1] for p in bad], s=22, marker="x", color=colour[name])
            _label_panel(ax, bottom=i == len(rows) - 1, left=j == 0, xlabel=xlabel, ylabel=ylabel)
    return _finish(fig, title, handles, names)


def _label_panel(ax, *, bottom: bool, left: bool, xlabel: str, ylabel: str) -> None:
    """Axis labels on the bottom row and the left column of a grid of panels, small ticks, a grid."""
    if bottom:
        ax.set_xlabel(xlabel, fontsize="small")
    if left:
        ax.set_ylabel(label(ylabel), fontsize="small")
    ax.tick_params(labelsize="x-small")
    ax.grid(True, which="major", alpha=0.3)


def _suptitle(fig, title: str) -> int:
    """The figure's title, wrapped to the figure's width (about 11 characters an inch at this size), so that a
    narrow figure (one panel) does not clip it; the number of its lines."""
    import textwrap

    nrows, ncols, width, _ = fig.panel_grid
    fig_w = max(4.0, LEFT + RIGHT + ncols * width + (ncols - 1) * WGAP)
    text = textwrap.fill(label(title, limit=160), max(24, int(fig_w * 11)))
    fig.suptitle(text, fontsize="medium", y=0.995, va="top")
    return len(text.splitlines())


def _finish(fig, title: str, handles: dict, names) -> str:
    title_lines = _suptitle(fig, title)
    legend_rows = _legend(fig, handles, title="implementation", names=names)
    _arrange(fig, title_lines=title_lines, legend_rows=legend_rows)
    return _png(fig)


HIST_RANGE = (1e-8, 1e6)  # ratios outside are counted in the panel title, not drawn


def ratio_histograms(values: dict[str, dict[str, list[float]]], *, panels: Sequence[str], title: str,
                     xlabel: str = "error / bound", names: Sequence[str] = ()) -> str | None:
    """One panel per ``panels`` entry, a step histogram per name of the ratios, log-spaced bins, with
    the bound (ratio 1) marked; zero, non-finite and off-scale ratios are counted in the panel title."""
    if not any(values.values()):
        return None
    lo_cut, hi_cut = HIST_RANGE
    positive = [v for v in _finite_positive(v for per in values.values() for vs in per.values() for v in vs)
                if lo_cut <= v <= hi_cut]
    if positive:
        lo_e = math.floor(math.log10(min(positive)))
        hi_e = max(1, math.ceil(math.log10(max(positive))))
    else:
        lo_e, hi_e = -3, 1
    lo_e = min(lo_e, -1)
    nbins = max(10, min(60, 6 * (hi_e - lo_e)))
    edges = [10 ** (lo_e + (hi_e - lo_e) * k / nbins) for k in range(nbins + 1)]
    names, colour = _palette({n for per in values.values() for n in per}, names)
    ncols = min(len(panels), 4)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = _figure(nrows, ncols, width=4.2, height=2.8)
    handles = {}
    for idx, panel in enumerate(panels):
        ax = axes[idx // ncols][idx % ncols]
        per = values.get(panel) or {}
        counts = {"exact (0)": sum(1 for vs in per.values() for v in vs if v == 0),
                  "not finite": sum(1 for vs in per.values() for v in vs if not math.isfinite(v)),
                  f"above {hi_cut:.0e}": sum(1 for vs in per.values() for v in vs if hi_cut < v < math.inf),
                  f"below {lo_cut:.0e}": sum(1 for vs in per.values() for v in vs if 0 < v < lo_cut)}
        for name, vs in per.items():
            pos = [v for v in _finite_positive(vs) if lo_cut <= v <= hi_cut]
            if pos:
                _, _, patches = ax.hist(pos, bins=edges, histtype="step", color=colour[name], linewidth=1.3)
                handles.setdefault(name, patches[0])
        ax.set_xscale("log")
        ax.axvline(1.0, color="crimson", linestyle="--", linewidth=1)
        ax.text(1.0, 0.97, " bound", color="crimson", fontsize="x-small", transform=ax.get_xaxis_transform(),
                va="top")
        extra = [f"{k}: {n}" for k, n in counts.items() if n]
        # Two counts a line: one line of all four is wider than a panel and was clipped at the figure's edge.
        lines = [", ".join(extra[i:i + 2]) for i in range(0, len(extra), 2)]
        ax.set_title("\n".join([label(panel), *lines]), fontsize="small", y=1.0)
        ax.set_xlabel(xlabel, fontsize="small")
        ax.set_ylabel("measurements", fontsize="small")
        ax.tick_params(labelsize="x-small")
    for idx in range(len(panels), nrows * ncols):
        axes[idx // ncols][idx % ncols].set_visible(False)
    return _finish(fig, title, handles, names)


def grouped_bars(values: dict[tuple[str, str], dict[str, dict[str, float]]], *, rows: Sequence[str],
                 cols: Sequence[str], groups: Sequence[str], ylabel: str, title: str,
                 names: Sequence[str] = ()) -> str | None:
    """Panel ``(row, col)``: for each group on the x axis, one bar per name (``values[(r, c)][name][group]``),
    log y. Missing bars are left out; zero bars are drawn as a small tick at the floor."""
    if not values:
        return None
    names, colour = _palette({n for per in values.values() for n in per}, names)
    ys = _finite_positive(v for per in values.values() for g in per.values() for v in g.values())
    lo = min(ys) / 3 if ys else 1e-12
    hi = max(ys) * 3 if ys else 1.0
    width = 0.8 / max(1, len(names))
    fig, axes = _figure(len(rows), len(cols), width=max(3.4, 0.22 * len(names) * len(groups) + 1.2), height=2.7)
    handles = {}
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            ax = axes[i][j]
            per = values.get((r, c)) or {}
            for k, name in enumerate(names):
                xs, hs = [], []
                for g_idx, g in enumerate(groups):
                    v = (per.get(name) or {}).get(g)
                    if v is None or math.isnan(v):
                        continue
                    xs.append(g_idx - 0.4 + width * (k + 0.5))
                    hs.append(min(max(v, lo), hi))
                if xs:
                    h = ax.bar(xs, [y - lo / 1.5 for y in hs], width=width * 0.95, bottom=lo / 1.5,
                               color=colour[name])
                    handles.setdefault(name, h)
            ax.set_yscale("log")
            ax.set_ylim(lo / 1.5, hi)
            ax.set_xticks(range(len(groups)), [label(g, limit=14) for g in groups], fontsize="x-small")
            ax.set_title(label(f"{r} / {c}"), fontsize="small", y=1.0)
            if j == 0:
                ax.set_ylabel(label(ylabel), fontsize="small")
            ax.tick_params(axis="y", labelsize="x-small")
            ax.grid(True, axis="y", alpha=0.3)
    return _finish(fig, title, handles, names)


def line_panels(series: dict[tuple[str, str], dict[str, list[tuple[float, float]]]], *, rows: Sequence[str],
                cols: Sequence[str], xlabel: str, ylabel: str, title: str, names: Sequence[str] = ()) -> str | None:
    """Panel ``(row, col)``: one line per name through its ``(x, y)`` points (sorted by x), log-log."""
    if not series:
        return None
    names, colour = _palette({n for per in series.values() for n in per}, names)
    fig, axes = _figure(len(rows), len(cols))
    handles = {}
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            ax = axes[i][j]
            for name, pts in (series.get((r, c)) or {}).items():
                pts = sorted((x, y) for x, y in pts if y > 0 and math.isfinite(y))
                if pts:
                    (h,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                                   linewidth=1.2, color=colour[name])
                    handles.setdefault(name, h)
            ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ax.set_title(label(f"{r} / {c}"), fontsize="small", y=1.0)
            _label_panel(ax, bottom=i == len(rows) - 1, left=j == 0, xlabel=xlabel, ylabel=ylabel)
    return _finish(fig, title, handles, names)
