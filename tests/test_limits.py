"""Real kernels have limits: a declaration states them, the strategies draw only conforming cases (no
filtering, no health-check failures, shrinking to the smallest conforming case), the report lists what
the declaration leaves out, and a nonsensical declaration is refused with a clear error.

The stand-ins are in tests/fixtures/constrained_kernels.py: each refuses any call outside its limits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings

from flashverify_kernels.declaration import Implementation, ImplementationError, declare
from flashverify_kernels.registry import load
from strategies.attention import Limits, attention_cases
from verify.runner import declared_draws, longest_case

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/constrained_kernels.py"
CORRECT = ("equal_lengths_only", "multiple_of_64_only", "causal_only", "fixed_scale", "tutorial_like",
           "varlen_tiles_of_16", "wide_tiles_in_float32")
LIMITS = Limits(max_len=200, max_head_dim=80, max_tiles=64, max_scores=2 ** 18)


def _impl(name: str) -> Implementation:
    return load(f"{FIXTURE}:{name}", device="cpu")


# --- the declaration --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, words", [
    ({"causal": False, "non_causal": False}, "causal=False and non_causal=False leave no mask to run"),
    ({"len_q_multiple": 0}, "len_q_multiple=0, but should be an int >= 1"),
    ({"min_len": -1}, "min_len=-1, but should be an int >= 0"),
    ({"scales": ()}, r"scales=\(\), but should be None \(any scale\), 'power_of_two', or a non-empty tuple"),
    ({"scales": (math.inf,)}, r"scales=\(inf,\)"),
    ({"max_head_dim": {torch.float32: 0}}, r"max_head_dim\[float32\]=0, but should be an int >= 1"),
    ({"max_head_dim": {"float32": 64}}, "max_head_dim has key 'float32'"),
    ({"head_dims": (64, 128), "max_head_dim": 32}, r"head_dims \[64, 128\] are all above max_head_dim=32"),
    ({"max_batch_heads": 0}, "max_batch_heads=0, but should be an int >= 1"),
    ({"max_splits": 0}, "max_splits=0, but should be an int >= 1"),
    ({"equal_lengths": 1}, "equal_lengths=1, but should be a bool"),
    ({"min_block": 32}, "min_block=32, but the kernel declares no block_m and block_n to draw from"),
    ({"min_block": {torch.float16: 0}, "block_m": (16,), "block_n": (16,)}, r"min_block\[float16\]=0"),
    ({"min_block": {"float8_e4m3fn": 32}, "block_m": (16,), "block_n": (16,)}, "min_block has key 'float8_e4m3fn'"),
    ({"min_block": {torch.float16: 32}, "block_m": (16, 32), "block_n": (16,)},
     r"every block_n \[16\] is below min_block=32 in float16: declare a larger size or drop float16"),
])
def test_a_nonsensical_declaration_is_refused_with_its_field(fields, words):
    with pytest.raises(ImplementationError, match=words):
        Implementation(name="k", forward=lambda *a, **k: None, **fields)


def test_declare_takes_implementation_fields_only():
    with pytest.raises(ImplementationError, match=r"declare\(\) got \['equal_length'\]"):
        declare(equal_length=True)
    with pytest.raises(ImplementationError, match=r"declare\(\) got \['name'\]"):
        declare(name="x")


def test_a_decorated_callable_carries_its_limits_and_the_report_words_them():
    impl = _impl("tutorial_like")
    assert impl.equal_lengths and impl.length_multiples == (16, 16) and impl.contiguous_only
    assert impl.head_dim_limit(torch.float32) == 32 and impl.head_dim_limit(torch.float16) == 64
    left_out = impl.not_covered()
    for words in ("Nq != Nk", "lengths that are not a multiple of 16", "lengths below 16",
                  "head dims above 32 in float32", "non-contiguous inputs", "B x Hq above 2",
                  "grouped-query attention"):
        assert any(w.startswith(words) and w.endswith("not covered, declared unsupported") for w in left_out), \
            (words, left_out)
    assert _impl("causal_only").not_covered()[0] == "non-causal attention: not covered, declared unsupported"
    assert _impl("fixed_scale").not_covered()[0] == "scales other than 1/sqrt(D): not covered, declared unsupported"
    wide = _impl("wide_tiles_in_float32")
    assert [w for w in wide.not_covered() if w.startswith("tiles")] == [
        "tiles below 16 in float32: not covered, declared unsupported"]
    assert wide.blocks_for("float32") == ((16, 32), (16, 32)) and wide.blocks_for(torch.float16) == ((8, 16, 32),) * 2


def test_a_split_cap_narrows_the_draws_and_the_report_words_it():
    from verify.runner import limits_of

    impl = Implementation(name="k", forward=lambda *a, **k: None, splits=True, max_splits=16)
    assert "more than 16 KV splits: not covered, declared unsupported" in impl.not_covered()
    limits = limits_of(impl, LIMITS)
    assert limits.max_splits == 16

    @settings(max_examples=200, database=None, derandomize=True)
    @given(attention_cases(dtype="float32", limits=limits, splits=True))
    def check(case):
        seen.add(case.spec.num_splits)
        assert case.spec.num_splits <= 16, case.describe()

    seen = set()
    check()
    assert {1, 8, 16} <= seen, seen  # the cap bounds the draws; it does not stop them


# --- the strategies ---------------------------------------------------------------------------------

def _conforms(impl: Implementation, case) -> list[str]:
    """What in ``case`` breaks ``impl``'s declared limits (empty: it conforms)."""
    mq, mk = impl.length_multiples
    bad = []
    if impl.equal_lengths and case.len_q != case.len_k:
        bad.append("Nq != Nk")
    if case.len_q % mq or case.len_k % mk:
        bad.append("multiple")
    if min(case.len_q, case.len_k) < impl.min_len:
        bad.append("min_len")
    if not case.causal and not impl.non_causal:
        bad.append("non-causal")
    if impl.scale_choices is not None and case.scale not in impl.scale_choices:
        bad.append("scale")
    top = impl.head_dim_limit(case.torch_dtype)
    if top is not None and case.head_dim > top:
        bad.append("head dim")
    if impl.contiguous_only and case.layout != "contiguous":
        bad.append("layout")
    floor = impl.block_floor(case.torch_dtype) if impl.tunable else None
    if floor is not None and any(b is not None and b < floor for b in (case.block_m, case.block_n)):
        bad.append("tiles")
    if impl.max_batch_heads is not None and case.batch * case.heads_q > impl.max_batch_heads:
        bad.append("B x Hq")
    spec = case.spec
    for nq, nk in zip(spec.seqlens_q or (), spec.seqlens_k or ()):  # every sequence keeps the limits
        if (impl.equal_lengths and nq != nk) or nq % mq or nk % mk or min(nq, nk) < impl.min_len:
            bad.append(f"sequence of {nq} queries and {nk} keys")
    return bad


@pytest.mark.parametrize("name", CORRECT + ("tile_multiple_wrong", "varlen_tiles_of_16_wrong"))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_drawn_case_conforms_without_filtering(name, dtype):
    impl = _impl(name)
    limits = LIMITS if impl.head_dim_limit(torch.float32) is None else Limits(
        max_len=200, max_head_dim=min(80, impl.head_dim_limit(getattr(torch, dtype))), max_tiles=64,
        max_scores=2 ** 18)

    @settings(max_examples=150, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])  # filter_too_much is NOT suppressed
    @given(attention_cases(dtype=dtype, limits=limits, **declared_draws(impl, None, {}, dtype=dtype)))
    def check(case):
        assert _conforms(impl, case) == [], (case.describe(), _conforms(impl, case))
        tiles.add(case.block_m)

    tiles = set()
    check()
    if impl.tunable:  # a floor narrows the declared tiles, and only in the dtypes it names
        assert tiles == set(impl.blocks_for(dtype)[0]), tiles


def test_failures_shrink_to_the_smallest_conforming_case():
    impl = _impl("tutorial_like")
    smallest = find(attention_cases(dtype="float32", limits=LIMITS, **declared_draws(impl, None, {})),
                    lambda c: True)
    assert (smallest.len_q, smallest.len_k, smallest.batch * smallest.heads_q) == (16, 16, 1), smallest
    longer = find(attention_cases(dtype="float32", limits=LIMITS, **declared_draws(impl, None, {})),
                  lambda c: c.len_q >= 40)
    assert longer.len_q == longer.len_k == 48, longer  # the first multiple of 16 from 40
    m64 = _impl("multiple_of_64_only")
    smallest = find(attention_cases(dtype="float32", limits=LIMITS, **declared_draws(m64, None, {})),
                    lambda c: c.len_k > 0)
    assert (smallest.len_q, smallest.len_k) == (64, 64), smallest


def test_the_longest_case_keeps_the_limits():
    for name in CORRECT:
        impl = _impl(name)
        for causal in ([True] if not impl.non_causal else [False, True]):
            case = longest_case(impl, "float32", LIMITS, causal=causal)
            assert _conforms(impl, case) == [], (name, case.describe())


# --- end to end ---------------------------------------------------------------------------------------

def _verify(tmp_path, *args):
    report = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "verify", "--hypothesis-profile=ci", "-q", "-rs",
                           "-p", "no:cacheprovider", "--report-dir", str(report), *args],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    return proc, report


@pytest.mark.slow
def test_constrained_correct_kernels_pass_with_real_coverage(tmp_path):
    impls = [a for name in CORRECT for a in ("--impl", f"{FIXTURE}:{name}")]
    proc, report = _verify(tmp_path, *impls, "-k", "float32 and not longest")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "FailedHealthCheck" not in out and "filter" not in out.lower(), out[-4000:]
    examples: dict[str, int] = {}
    for path in report.glob("coverage-*.jsonl"):
        for line in path.open():
            r = json.loads(line)
            examples[r["implementation"]] = examples.get(r["implementation"], 0) + r["examples"]
    for name in CORRECT:
        assert examples.get(f"{FIXTURE}:{name}", 0) >= 100, examples  # every one measured, not skipped
    # What the declarations leave out is in the report and the terminal header.
    text = (report / "report.md").read_text()
    assert "## What the declarations leave out" in text
    assert f"- {FIXTURE}:equal_lengths_only: Nq != Nk: not covered, declared unsupported" in text
    assert f"- {FIXTURE}:causal_only: non-causal attention: not covered, declared unsupported" in text
    assert "left out (declared)</summary>" in (report / "report.html").read_text()
    # A property that needs what a kernel declared unsupported is skipped with the declaration's words.
    assert "equal_lengths_only declares Nq == Nk only; the property needs len_q longer than the other" in out, \
        out[-3000:]


@pytest.mark.slow
def test_a_constrained_wrong_kernel_fails_with_the_smallest_conforming_case(tmp_path):
    proc, report = _verify(tmp_path, "--impl", f"{FIXTURE}:tile_multiple_wrong", "-k",
                           "test_out_matches_reference and float32")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    (failure,) = [json.loads(p.read_text()) for p in (report / "failures").glob("*.json")]
    case = failure["case"]
    assert (case["len_q"], case["len_k"]) == (32, 32), case
    assert "FailedHealthCheck" not in failure["message"] and failure["replay"]


@pytest.mark.slow
def test_a_varlen_kernel_wrong_past_its_first_sequence_fails_with_whole_tiles(tmp_path):
    # Every sequence within the per-sequence limits (multiples of 16, at least 16): the failure is a wrong
    # value, never the kernel refusing a sequence, and it shrinks to a second sequence of 32 keys.
    proc, report = _verify(tmp_path, "--impl", f"{FIXTURE}:varlen_tiles_of_16_wrong", "-k",
                           "test_out_matches_reference and float32")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    (failure,) = [json.loads(p.read_text()) for p in (report / "failures").glob("*.json")]
    spec = failure["case"]["spec"]
    assert "refuse" not in failure["message"] and "supports" not in failure["message"], failure["message"]
    assert spec["sequences"] == "packed" and len(spec["seqlens_k"]) == 2 and spec["seqlens_k"][1] == 32, spec
    assert all(n % 16 == 0 and n >= 16 for n in spec["seqlens_q"] + spec["seqlens_k"]), spec
