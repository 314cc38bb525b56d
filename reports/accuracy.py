"""The accuracy report: what a sweep of :mod:`verify.accuracy` recorded, rendered as ``accuracy.json``,
``accuracy.md`` and ``accuracy.html``.

The sweep streams its measurements to ``accuracy-measurements.jsonl`` (one line each, a ``done`` line after
each implementation and case) beside its run header ``accuracy-run.json``; :func:`write_report` folds them
(:func:`aggregate`): the RMSE of O, LSE, dQ, dK and dV against float64 per implementation, dtype and
magnitude class (geometric means over the cases), the largest error/bound and error/eager per op, the worst
measurements with their replay commands, what was not measured and why, and, for the sweeps that have them,
the FlashAttention-3 paper's protocol table (:func:`fa3_protocol`) and the variants table
(:func:`variant_rows`). An interrupted sweep renders as PARTIAL; ``python -m reports summarise DIR``
re-renders it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from reports.html import Raw, code, esc, key_values, page, plot_or_reason, table
from reports import plots
from reports.session import dumps, read_jsonl, replay_command, write_atomic
from reports.summary import RECORD_COLUMNS, describe_case, fmt, largest, num
from strategies.cases import FP8_NAMES
from strategies.sweep import (FA3_MAGNITUDE, VARIANT_WORDS, Sweep, as_computed_by, case_key, preset, variant_of)

OPS = ("out", "lse", "dq", "dk", "dv")


METRICS = tuple(RECORD_COLUMNS)


# ------------------------------------------------------------------ the FlashAttention-3 paper's protocol
FA3_TITLE = "FlashAttention-3 accuracy protocol"


FA3_SOURCE = ("the FlashAttention-3 paper (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao; arXiv 2407.08608), "
              "section 4.3 \"Numerical error validation\", Table 3")


# Table 3's FP16 RMSE of O, by the method the paper names.
FA3_PAPER_FP16 = {"standard attention": 3.2e-4, "FlashAttention-2": 1.9e-4, "FlashAttention-3": 1.9e-4}


# Its FP8 (e4m3) RMSE of O: the baseline with one scale per tensor, and FlashAttention-3 with block quantization
# and incoherent processing.
FA3_PAPER_FP8 = {"FP8 per-tensor scaling": 2.4e-2, "FlashAttention-3 FP8": 9.1e-3}


# A float8 row's figure beside it: the suite's float8 kernels scale per batch entry and head (the contract's
# descales), with no incoherent processing: nearer the per-tensor baseline than FlashAttention-3's FP8.
FA3_FP8_METHOD = "FP8 per-tensor scaling"


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


# ------------------------------------------------------------------ variants
VARIANTS_TITLE = "Variants"


STREAM = "accuracy-measurements.jsonl"


RUN_FILE = "accuracy-run.json"


OUTPUTS = ("accuracy.json", "accuracy.md", "accuracy.html")


def read_stream(out_dir: Path) -> tuple[list[dict], int]:
    """The lines of the sweep's stream (a truncated last line is skipped and counted)."""
    return read_jsonl(Path(out_dir) / STREAM)


# ------------------------------------------------------------------------------------ unrounded inputs
# The stream's lines of the FlashAttention-3 table's second column (:class:`UnroundedInputs`).
UNROUNDED_KIND = "against_unrounded_inputs"


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
        key = case_key(str(item.get("spec")), case)
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
                                             "started", "cases", "planned", "baselines")},
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
        if dtype in FP8_NAMES:
            method, paper = (FA3_FP8_METHOD, FA3_PAPER_FP8[FA3_FP8_METHOD]) if method else (None, None)
        else:
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
        "paper_fp16_rmse": FA3_PAPER_FP16, "paper_fp8_rmse": FA3_PAPER_FP8, "paper_setup": FA3_PAPER_SETUP,
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
    return {case_key(str(spec), as_computed_by(cases[index], alignment.get(str(spec)) or "bottom_right").to_dict())
            for spec, index, *_ in pairs if 0 <= index < len(cases)}


def write_report(out_dir: str | Path) -> dict:
    """(Re)write ``accuracy.json``, ``accuracy.md`` and ``accuracy.html`` from the sweep's files."""
    out_dir = Path(out_dir)
    header = json.loads((out_dir / RUN_FILE).read_text(encoding="utf-8"))
    lines, bad = read_stream(out_dir)
    result = aggregate(header, lines, bad)
    write_atomic(out_dir / "accuracy.json", dumps(result, indent=1))
    write_atomic(out_dir / "accuracy.md", markdown(result))
    try:
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
                  "RMSE of O against the unrounded inputs", "paper's method", "paper's RMSE",
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
    fp8 = protocol.get("paper_fp8_rmse") or FA3_PAPER_FP8
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
        "Hopper CUDA code). Its FP8 (e4m3) RMSE: "
        f"{paper_figure(fp8[FA3_FP8_METHOD])} with one scale per tensor, "
        f"{paper_figure(fp8['FlashAttention-3 FP8'])} for FlashAttention-3 (block quantization and incoherent "
        "processing). A float8_e4m3fn row here quantises q, k and v with one scale per batch entry and head (the "
        "contract's q_descale, k_descale, v_descale: references/fp8.py), with no incoherent processing; its "
        "\"paper's RMSE\" is the per-tensor baseline's, the nearer of the two. Against the rounded inputs (the "
        "dequantised values) its error is the kernel's own (P cast to float8 before P V); against the unrounded "
        "inputs the quantisation of q, k and v dominates it.",
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


def failed_cases(result: dict) -> tuple[int, int]:
    """``(judged, baselines)``: the (implementation, case) results with a failed criterion, those of judged
    implementations and those of the preset's baselines (compared with, not judged)."""
    baselines = set((result.get("meta") or {}).get("baselines") or ())
    counts = [(c.get("failed_cases", 0), c["implementation"] in baselines) for c in result.get("criteria") or []]
    return sum(n for n, baseline in counts if not baseline), sum(n for n, baseline in counts if baseline)


def results_words(result: dict) -> str:
    """How many results there are and how many failed a criterion, a baseline's failures counted apart."""
    judged, of_baselines = failed_cases(result)
    names = ", ".join((result.get("meta") or {}).get("baselines") or ())
    also = (f" (and {of_baselines} of {names}, a baseline the sweep compares with: not judged)"
            if of_baselines else "")
    return (f"{len(result.get('results') or [])} (implementation, case) results, {judged} with a failed criterion"
            f"{also}")


def status_words(result: dict) -> str:
    if result["status"] == "complete":
        return "Status: complete."
    return (f"Status: PARTIAL: {result['missing']} of {result['meta'].get('planned')} (implementation, case) pairs "
            "were not measured (interrupted or stopped by --time-limit; rerun with --resume).")


def markdown(result: dict) -> str:
    meta = result["meta"]
    stack = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items() if v)
    lines = [f"# {title(result)}", "",
             status_words(result), "", f"{results_words(result)}.", "",
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


# ------------------------------------------------------------------------------------ the HTML page
# ------------------------------------------------------------------------------------ accuracy report
def _accuracy_plots(result: dict) -> list[str]:
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
    meta = result.get("meta") or {}
    sweep = meta.get("sweep") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items() if v)
    partial = result.get("status") != "complete"
    failed, _ = failed_cases(result)
    body = [f"<h1>{esc(title(result))}</h1>",
            f'<div class="banner {"partial" if partial else ("bad" if failed else "ok")}">'
            f"{esc(status_words(result))}<br>{esc(results_words(result))}.</div>",
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
            table(("magnitude class", "inputs"), ((m, MAGNITUDE_WORDS.get(m, "see strategies/cases.py"))
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
        *before, after = fa3_words(protocol)
        body += [f"<h2>{esc(FA3_TITLE)}</h2>", *(f"<p>{esc(w)}</p>" for w in before),
                 _shown(fa3_table(result)), f'<p class="muted">{esc(after)}</p>']
    variants = result.get("variants")
    if variants:
        *before, after = variant_words(variants)
        body += [f"<h2>{esc(VARIANTS_TITLE)}</h2>", "<ul>",
                 *(f"<li>{esc(w.replace('`', ''))}</li>" for w in before), "</ul>",
                 f'<p class="muted">{esc(after)}</p>', _shown(variant_table(result))]
    body += _accuracy_plots(result)
    for op, rmse in rmse_tables(result).items():
        body += [f"<h2>RMSE of {esc(OP_WORDS.get(op, op))}</h2>",
                 f'<p class="muted">Geometric mean over {esc(pooled_words(result))}.</p>', _shown(rmse)]
    crit = criteria_table(result)
    if crit.rows:
        body += ["<h2>Pass criteria: largest err/bound and err/eager</h2>", _shown(crit)]
    worst = worst_table(result)
    if worst.rows:
        body += ["<h2>Worst measurements by err/bound</h2>",
                 _shown(worst, below=[Raw("replay: " + code(w["replay"])) for w in result["worst_cases"]])]
    skipped = not_measured_table(result)
    if skipped.rows:
        body += ["<h2>Not measured</h2>", _shown(skipped)]
    cases = case_table(result)
    if cases.rows:
        body += [f"<h2>Every case ({len(cases.rows)})</h2>", "<details><summary>show the table</summary>",
                 _shown(cases), "</details>"]
    return page(title(result), body)
