"""The variants in the accuracy report: the cases of ``--preset variants`` (packed sequences, a sliding
window, a softcap, decoding from a paged KV cache), measured by the sweep as ``pytest verify`` measures
them, and the per-variant table, which names what was not measured on a variant and why."""

from __future__ import annotations

import json

import pytest

from flashverify_kernels.registry import registry
from references.spec import AttentionSpec
from reports import accuracy
from strategies.cases import AttentionCase
from tests.test_measure import _differences, _key, _verify
from strategies import sweep as sweeps
from verify import accuracy as driver

# The variants preset at a shape a test can afford: float16, N(0, 1) inputs, N = 16; fa2_blocked, eager
# (always added) and sdpa_math, which declares none of the variants.
VARIANTS = ("packed", "window", "softcap", "paged_decode")
SMALL = ["--variant", *VARIANTS, "--len", "16", "--head-dim", "8", "--dtype", "float16", "--magnitude", "normal"]
IMPLS = ["--impl", "fa2_blocked", "--impl", "sdpa_math"]


@pytest.fixture(scope="module")
def variants_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("variants")
    status = driver.main(["--device", "cpu", "--preset", "variants", *SMALL, *IMPLS, "--out", str(out)])
    header = json.loads((out / accuracy.RUN_FILE).read_text())
    return status, out, header, json.loads((out / "accuracy.json").read_text())


def _sweep(header: dict) -> sweeps.Sweep:
    return accuracy._sweep_of(header)


# ------------------------------------------------------------------------------------ the cases
@pytest.mark.parametrize("variant", sweeps.VARIANTS)
def test_each_variant_case_is_that_variant(variant):
    case = sweeps.variant_case(variant, length=32, head_dim=8, dtype="bfloat16", heads=8, page_size=4)
    spec = case.spec
    assert sweeps.variant_of(spec) == variant
    if spec.varlen:  # one packed batch, the sums of the sequences' lengths (strategies/cases.py's frame)
        assert case.batch == 1 and (case.len_q, case.len_k) == (sum(spec.seqlens_q), sum(spec.seqlens_k))
        assert len(set(spec.seqlens_k)) == len(spec.seqlens_k) == 4  # sequences of different lengths
    if variant == "paged_decode":
        assert spec.sequences == "paged" and spec.seqlens_q == (1, 1, 1, 1) and spec.page_size == 4
        assert case.heads_kv == 2 and case.heads_q == 8  # grouped-query attention
        assert any(n % 4 for n in spec.seqlens_k)  # a cache that ends inside a page
    if variant == "packed":
        assert spec.sequences == "packed" and spec.seqlens_q == spec.seqlens_k
    if variant == "window":
        assert (spec.window_left, spec.window_right) == (8, 0) and spec.causal
    if variant == "softcap":
        assert spec.softcap == sweeps.VARIANT_SOFTCAP


def test_the_preset_is_small_on_a_cpu_and_gpu_sized_on_cuda():
    cpu, gpu = sweeps.preset("variants", device="cpu"), sweeps.preset("variants", device="cuda")
    for p in (cpu, gpu):
        sweep = sweeps.Sweep(**{k: v for k, v in p.items() if k in sweeps.Sweep.__dataclass_fields__})
        assert sweep.dtypes == ("float16", "bfloat16") and sweep.backward
        assert {sweeps.variant_of(c.spec) for c in sweep.cases()} == set(sweeps.VARIANTS)
    assert (cpu["lengths"], cpu["head_dims"], cpu["page_size"]) == ((96,), (32,), 16)
    assert (gpu["lengths"], gpu["head_dims"], gpu["heads"], gpu["page_size"]) == ((4096,), (128,), 16, 256)
    names = [i.name for i in driver.select_implementations([], device="cpu", defaults=cpu["implementations"],
                                                             list_all=cpu["list_all"])]
    assert names == ["fa2_blocked", "fa1_blocked", "eager", "triton_fa2", "triton_fa1", "triton_decode"]


@pytest.mark.parametrize("spec, len_q, len_k, matters", [
    (AttentionSpec(causal=True), 8, 8, False),
    (AttentionSpec(causal=True), 4, 8, True),
    (AttentionSpec(causal=False), 4, 8, False),
    (AttentionSpec(window_left=2, window_right=2), 4, 8, True),  # non-causal, but the window has a diagonal
    (AttentionSpec(causal=True, sequences="packed", seqlens_q=(3, 5), seqlens_k=(5, 3)), 8, 8, True),
    (AttentionSpec(causal=True, sequences="packed", seqlens_q=(3, 5), seqlens_k=(3, 5)), 8, 8, False),
])
def test_whether_the_alignment_changes_the_attention(spec, len_q, len_k, matters):
    """Kernels of both alignments share one reference only where the alignment changes nothing: equal
    totals Nq = Nk do not say so for sequences of unequal lengths, nor for a non-causal window."""
    case = AttentionCase(batch=1, heads_q=1, heads_kv=1, len_q=len_q, len_k=len_k, head_dim=4, dtype="float16",
                         spec=spec)
    assert sweeps.alignment_matters(case) is matters


# ------------------------------------------------------------------------------------ the sweep
def test_the_table_names_each_unsupported_implementation_with_its_declarations_reason(variants_run):
    status, out, header, result = variants_run
    assert status == 2  # sdpa_math, named with --impl, measured nothing (the others passed)
    assert not [c for c in result["criteria"] if c["failed_cases"]]
    sdpa = registry()["sdpa_math"]
    rows = {(r["variant"], r["implementation"]): r for r in result["variants"]["rows"]}
    for case in _sweep(header).cases():
        variant = sweeps.variant_of(case.spec)
        row = rows[(variant, "sdpa_math")]
        assert row["cases"] == 0 and row["dtype"] == "float16"
        assert row["not_measured"] == sdpa.unsupported_spec(case.spec) is not None, row
        for name in ("fa2_blocked", "eager"):
            assert rows[(variant, name)]["cases"] == 1 and rows[(variant, name)]["not_measured"] is None
    for name in accuracy.OUTPUTS:
        text = (out / name).read_text()
        assert "Variants" in text and "sdpa_math declares no sliding window" in text, name
        assert "sdpa_math declares sequences (&#x27;dense&#x27;,); the case&#x27;s are paged" in text \
            if name.endswith(".html") else "sdpa_math declares sequences ('dense',); the case's are paged" in text


def test_every_op_of_every_variant_is_measured(variants_run):
    _, _, _, result = variants_run
    for r in result["variants"]["rows"]:
        if r["cases"]:
            assert all(r[f"{op}_error_over_bound"] is not None for op in accuracy.OPS), r
            assert 0 < r["rmse_out"] < 1e-3 and r["failed_cases"] == 0, r


def test_variant_records_equal_pytest_verify_s(variants_run):
    """On each variant's case, the records the sweep streamed (err/bound, err/eager, RMSE, ...) and its
    verdicts are those of pytest verify's accuracy properties (tests/test_measure.py, on dense cases)."""
    _, out, header, _ = variants_run
    swept: dict[tuple, dict[str, dict]] = {}
    for line in accuracy.read_stream(out)[0]:
        if line.get("kind") == "measurement":
            swept.setdefault(_key(line["implementation"], line["property"], line["case"]), {})[line["op"]] = line
    wrong, compared = [], 0
    for impl in driver.select_implementations(["fa2_blocked"], device="cpu"):
        for case in _sweep(header).cases():
            verdicts, records = _verify(impl, case)
            assert set(records) == {"out", "lse", "dq", "dk", "dv"}, (impl.name, case.describe())
            for op, r in records.items():
                mine = swept[_key(impl.name, r["property"], case.to_dict())][op]
                wrong += [f"{impl.name} {case.describe()} {op}: {d}" for d in _differences(r, mine)]
                compared += 1
            assert all(verdicts.values())
    assert not wrong, "\n".join(wrong)
    assert compared == 2 * 5 * len(VARIANTS)


def test_a_forward_only_kernel_is_measured_on_its_forward_in_a_sweep_with_gradients():
    """A kernel that declares no backward (triton_decode) is measured on O and its LSE; the sweep's
    gradients are not a problem of that kernel's, and a kernel with a backward still gets them."""
    import dataclasses

    from verify import measure

    case = sweeps.variant_case("paged_decode", length=16, head_dim=8, dtype="float32", heads=4, page_size=4)
    t = case.build("cpu")
    truth = measure.Truth(case, t.q, t.k, t.v, dout=t.dout)
    blocked = registry()["fa2_blocked"]
    forward_only = dataclasses.replace(blocked, name="fa2_forward_only", autograd=False)
    records, problems = measure.sweep_case(forward_only, case, t, truth, device="cpu", backward=True)
    assert problems == [] and sorted(r["op"] for r in records) == ["lse", "out"]
    assert all(r["pass"] for r in records)
    records, problems = measure.sweep_case(blocked, case, t, truth, device="cpu", backward=True)
    assert problems == [] and sorted(r["op"] for r in records) == ["dk", "dq", "dv", "lse", "out"]
