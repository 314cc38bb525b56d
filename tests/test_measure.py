"""The accuracy sweep decides as ``pytest verify`` does: on the same cases, the records and verdicts the
sweep writes equal those of the properties (run as ``pytest verify`` and ``python -m verify.replay`` run
them), for kernels with and without a declared backward."""

from __future__ import annotations

import json
import math

import pytest

from references import bounds
from references.metrics import abs_error, max_ratio
from references.spec import AttentionSpec
from reports import accuracy
from reports.summary import num
from verify import accuracy as driver, calls, measure, properties
from verify.context import Context, NotForThisCase, PropertyFailure
from strategies import sweep as sweeps

# eager, sdpa_math and the plain callables declare no backward (their gradient bound is the wider of two
# models); fa2_blocked declares its own. The broken kernel gives failing verdicts to compare too.
IMPLS = ("eager", "sdpa_math", "fa2_blocked", "tests/fixtures/outside_kernels.py:attention_broken_drops_last_key")
SWEEPS = {
    "ordinary": sweeps.Sweep(lengths=(16,), head_dims=(8,), dtypes=("float16", "float32"),
                               magnitudes=("normal", "sparse_outliers"), causal=(False, True)),
    # sdpa_math's dQ here (autograd's eager backward) is near the default gradient bound alone (0.7x to 1.4x
    # over seeds, depending on the CPU's summation order) and far inside the autograd-eager one: a sweep that
    # used the default model alone would record a different err/bound (and at times fail it).
    "gradient_model": sweeps.Sweep(lengths=(128,), head_dims=(1,), dtypes=("float32",), magnitudes=("v_offset",),
                                     causal=(True,), seeds=(4,)),
}
METRICS = ("max_abs", "rmse", "max_ulp", "error_over_bound", "error_over_baseline")


def _key(impl: str, prop: str, case: dict) -> tuple[str, str, str]:
    return impl, prop, json.dumps(case, sort_keys=True)


def _differences(verified: dict, swept: dict) -> list[str]:
    """Where one op's record from the properties and from the sweep's stream (JSON: inf as "inf") differ."""
    out = [] if verified["pass"] == swept["pass"] else [f"pass {verified['pass']} vs {swept['pass']}"]
    for k in METRICS:
        a, b = num(verified[k]), num(swept[k])
        if a != b and not (math.isnan(a) and math.isnan(b)):
            out.append(f"{k} {a!r} vs {b!r}")
    return out


def _verify(impl, case) -> tuple[dict[str, bool], dict[str, dict]]:
    """The accuracy properties of ``pytest verify`` on ``case``: each one's verdict, and the records by op."""
    verdicts, records = {}, {}
    for prop in sorted(set(measure.PROPERTY_OF.values())):
        written: list[dict] = []
        ctx = Context(impl=impl, prop=prop, device="cpu", record=written.append, case=case)
        try:
            properties.PROPERTIES[prop](ctx, case)
            verdicts[prop] = True
        except properties.NotForThisKernel:
            continue
        except PropertyFailure:
            verdicts[prop] = False
        records.update({r["op"]: r for r in written})
    return verdicts, records


@pytest.mark.parametrize("name", SWEEPS)
def test_accuracy_report_decides_as_pytest_verify(name, tmp_path):
    sweep = SWEEPS[name]
    impls = driver.select_implementations(list(IMPLS), device="cpu")
    result = driver.run(sweep, impls, device="cpu", out_dir=tmp_path, command="test", progress=False)
    assert not result["not_measured"], result["not_measured"]
    swept: dict[tuple, dict[str, dict]] = {}
    for line in accuracy.read_stream(tmp_path)[0]:
        if line.get("kind") == "measurement":
            swept.setdefault(_key(line["implementation"], line["property"], line["case"]), {})[line["op"]] = line
    report = {(r["implementation"], r["dtype"], r["magnitude"], r["causal"], r["len"], r["head_dim"], r["seed"]):
              r["pass"] for r in result["results"]}
    wrong_verdicts, wrong_records, verdicts_seen = [], [], set()
    for impl in impls:
        for case in sweep.cases():
            # the case as this kernel computes it: its own causal alignment (pytest verify draws it so)
            case = case.replace(spec=AttentionSpec(causal=case.causal, alignment=impl.causal_alignment))
            verdicts, records = _verify(impl, case)
            where = f"{impl.name} on {case.describe()}"
            for prop, verdict in verdicts.items():
                mine = swept.get(_key(impl.name, prop, case.to_dict()), {})
                said = all(r["pass"] for r in mine.values()) if mine else None
                if said != verdict:
                    ops = ", ".join(f"{op} {'pass' if r['pass'] else 'FAIL'} "
                                    f"(err/bound {num(r['error_over_bound']):.3g})" for op, r in mine.items())
                    wrong_verdicts.append(f"{where}: {prop} {'passes' if verdict else 'fails'} in pytest verify, "
                                          f"the sweep says {ops or 'nothing'}")
                verdicts_seen.add(verdict)
            row = (impl.name, case.dtype, case.magnitude, case.causal, case.len_k, case.head_dim, case.seed)
            if report[row] != all(verdicts.values()):
                wrong_verdicts.append(f"{where}: the report's verdict is {report[row]}, pytest verify's {verdicts}")
            for op, r in records.items():
                differ = _differences(r, swept[_key(impl.name, r["property"], case.to_dict())][op])
                if differ:
                    wrong_records.append(f"{where}: {op} " + "; ".join(differ))
    assert not wrong_verdicts, "\n".join(wrong_verdicts)
    assert not wrong_records, "\n".join(wrong_records)
    assert verdicts_seen == {True, False}


def test_the_gradient_model_case_needs_the_wider_bound():
    """The ``gradient_model`` sweep's case keeps the records comparison sharp: sdpa_math's dQ there has an
    err/bound under the default model many times that under the bound ``pytest verify`` holds it to, so a
    sweep that used the default model alone would write records that differ from pytest verify's. (Whether
    it is also beyond the default bound depends on the CPU's summation order: 0.7x to 1.4x over seeds.)"""
    (case,) = SWEEPS["gradient_model"].cases()
    impl = driver.select_implementations(["sdpa_math"], device="cpu")[0]
    case = case.replace(spec=AttentionSpec(causal=case.causal, alignment=impl.causal_alignment))
    ctx = Context(impl=impl, prop="gradients_match_reference", case=case)
    t = case.build("cpu")
    got = calls.run_backward(ctx, case, t.q, t.k, t.v, t.dout)
    truth = measure.Truth(case, t.q, t.k, t.v, dout=t.dout)
    default_dq, *_ = bounds.backward_bounds(truth.ref, t.q, t.k, t.v, dtype=t.q.dtype, out=got["out"])
    err = abs_error(got["dq"], truth.ref.dq)
    within_default = max_ratio(err, default_dq)[0]
    within_verify = max_ratio(err, truth.gradient_bounds(impl, got["out"])["dq"])[0]
    assert within_verify < 0.1
    assert within_default > 0.3 and within_default > 10 * within_verify


def test_check_names_the_ops_it_measures():
    (case,) = SWEEPS["gradient_model"].cases()
    t = case.build("cpu")
    truth = measure.Truth(case, t.q, t.k, t.v)
    with pytest.raises(ValueError, match=r"op='delta', but should be one of .*check_delta"):
        measure.check(Context(impl=None, prop="p", case=case), truth, "delta", t.q, truth.forward_bounds)


def test_a_case_whose_ds_overflows_float16_is_not_for_the_backward_properties():
    """dS = P (dP - Delta) past float16's range (wide-range V, D = 188) while the exact gradients are in it:
    a correct kernel that casts dS to float16 for dQ and dK (FlashAttention-2 and 3 do) gets NaN, so the
    gradient properties reject the case instead of failing the kernel (found on an H200 by
    gqa_gradients_sum_over_group)."""
    from strategies.cases import AttentionCase

    case = AttentionCase(batch=2, heads_q=6, heads_kv=2, len_q=33, len_k=3, head_dim=188, dtype="float16",
                         magnitude="v_wide_range", seed=696, block_m=2, block_n=1)
    t = case.build()
    truth = measure.Truth(case, t.q, t.k, t.v, dout=t.dout)
    with pytest.raises(NotForThisCase, match=r"dS = P \(dP - Delta\) reaches 9.463e\+04"):
        truth.ref
    assert measure.Truth(case, t.q, t.k, t.v).ref.ds_max is None  # the forward alone is not concerned
