"""The mutation self-check: every deliberately broken FA2 variant fails ``pytest verify`` under the
ci profile, with a replayable minimal case, while the unchanged kernel (loaded the same way) passes. The
mutants of the attention variants (varlen, paged KV, split-KV, sinks, windows, chunks, softcap, ALiBi) are
also held to the shape of their shrunk case (``MINIMAL``)."""

import json
import re

import torch

import pytest

from tests import mutants


# What the shrunk case of each variant mutant must look like: the variant's field present (the bug lives only
# there) and the fewest, shortest sequences, the smallest page, the fewest splits, the narrowest window. Every
# failure file the run wrote is held to it.
def _small(case: dict, most: int = 3, *, heads: bool = True) -> bool:
    """Every length, the batch, the head dims and (``heads``) the query head count at most ``most``."""
    return max(case["len_q"], case["len_k"], case["batch"], case["head_dim"], case.get("head_dim_v") or 1,
               case["heads_q"] if heads else 1) <= most


def _narrow_window(spec: dict) -> bool:
    """A window side of 0 or 1 (-1, or no side, is unbounded)."""
    return any(spec.get(side, -1) in (0, 1) for side in ("window_left", "window_right"))


MINIMAL = {
    "varlen_keys_from_cu_seqlens_q": ("packed, 2 or 3 sequences of at most 2 queries and 2 keys",
                                      lambda c, s: s.get("sequences") == "packed" and 2 <= len(s["seqlens_q"]) <= 3
                                      and max(s["seqlens_q"] + s["seqlens_k"]) <= 2),
    "paged_logical_pages": ("paged, one or two sequences of at most 2 keys, in pages of 1 key",
                            lambda c, s: s.get("sequences") == "paged" and len(s["seqlens_k"]) <= 2
                            and max(s["seqlens_k"]) <= 2 and s["page_size"] == 1),
    "split_merge_log2": ("2 splits of at most 3 keys", lambda c, s: s.get("num_splits") == 2 and c["len_k"] <= 3),
    "gqa_large_group_packed_by_4": ("a group of 5 on 2 KV heads (10 query heads)",
                                    lambda c, s: c["heads_q"] == 10 and c["heads_kv"] == 2),
    "split_partials_in_64_slots": ("128 splits of at most 2 keys", lambda c, s: s.get("num_splits") == 128
                                   and c["len_k"] <= 2),
    "sink_missing_from_denominator": ("one sink, one query, at most 2 keys",
                                      lambda c, s: len(s.get("sinks") or ()) == 1 and c["len_q"] == 1
                                      and c["len_k"] <= 2),
    "chunks_top_left": ("chunks of 1 or 2 positions", lambda c, s: s.get("attention_chunk") in (1, 2)),
    "window_off_by_one": ("a window side of 0 or 1", lambda c, s: _narrow_window(s)),
    "window_top_left": ("a window side of 0 or 1", lambda c, s: _narrow_window(s)),
    "alibi_top_left": ("ALiBi on one head", lambda c, s: len(s.get("alibi_slopes") or ()) == 1),
    "alibi_slope_of_wrong_head": ("ALiBi on 2 heads", lambda c, s: len(s.get("alibi_slopes") or ()) == 2),
    "softcap_wrong_sign": ("a softcap", lambda c, s: s.get("softcap", 0) > 0),
    "softcap_backward_no_chain_rule": ("a softcap", lambda c, s: s.get("softcap", 0) > 0),
    "softcap_after_masking": ("a softcap and a mask that hides a key",
                              lambda c, s: s.get("softcap", 0) > 0 and (s["causal"] or "window_left" in s
                                                                        or "window_right" in s
                                                                        or "attention_chunk" in s)),
    "scale_from_value_head_dim": ("a value head dim of its own and the default scale",
                                  lambda c, s: c.get("head_dim_v") is not None and c["scale"] is None),
    "delta_over_query_head_dim": ("v wider than q and k", lambda c, s: (c.get("head_dim_v") or 0) > c["head_dim"]),
    "k_descale_from_q": ("float8 with descales", lambda c, s: c.get("descale") is True),
    "v_descale_dropped": ("float8 with descales", lambda c, s: c.get("descale") is True),
}


# Mutants whose bug needs a group of more than 3 query heads: their head count is MINIMAL's alone to judge.
LARGE_GROUPS = {"gqa_large_group_packed_by_4"}


def test_minimal_shapes_name_mutants():
    unknown = set(MINIMAL) - {m.name for m in mutants.MUTATIONS}
    assert not unknown, f"MINIMAL names no mutant called {sorted(unknown)} (tests/mutants.py MUTATIONS)"


def _problems(name: str, failures: list[dict]) -> list[str]:
    """What is wrong with the failure files of mutant ``name``: none, none that replays, one not minimal."""
    if not failures:
        return [f"mutant {name} ({mutants.VARIANTS[name].description}) passed pytest verify: no test failed"]
    problems = []
    for failure in failures:
        replay = failure.get("replay") or ""
        if not replay.startswith(f"python -m verify.replay --impl tests/mutants.py:{name} "):
            problems.append(f"mutant {name}: {failure['test']} has no replay command of its own: {replay!r}")
        case = failure["case"]
        if name in MINIMAL:
            what, holds = MINIMAL[name]
            if not (_small(case, heads=name not in LARGE_GROUPS) and holds(case, case.get("spec") or {})):
                problems.append(f"mutant {name}: {failure['test']} holds a case that is not minimal (expected {what}, "
                                f"and every length, the batch, the head count and the head dim at most 3): "
                                f"{json.dumps(case)}")
    return problems


@pytest.mark.slow(seconds=540)
def test_every_mutant_fails_the_suite_and_the_unmutated_kernel_passes(tmp_path):
    """One ``pytest verify`` session over the unchanged kernel and every mutant, each stopped at its first failing
    test: the unchanged kernel passes every test, each mutant fails one, with a replay command and (MINIMAL) a
    shrunk case of the shape its bug needs."""
    names = [m.name for m in mutants.MUTATIONS]
    session = mutants.run_all(["unmutated", *names], report_dir=tmp_path)
    tail = session.output[-6000:]
    assert session.returncode == 1, f"pytest verify should exit 1 (mutants failed), got {session.returncode}:\n{tail}"
    assert not session.failures["unmutated"], (
        "the unchanged kernel, loaded as the mutants are, failed pytest verify:\n"
        + "\n\n".join(f["message"] for f in session.failures["unmutated"]))
    verdict = session.verdicts.get("unmutated", "")
    assert re.fullmatch(r"\d+ passed(, \d+ skipped)?", verdict), f"the unchanged kernel's tests: {verdict!r}\n{tail}"
    problems = [p for name in names for p in _problems(name, session.failures[name])]
    assert not problems, "\n".join(problems)
    assert all(len(session.failures[name]) == 1 for name in names), "a mutant went on past its first failure"
    assert "replay: python -m verify.replay --impl tests/mutants.py:" in session.output, tail


# The impl's name holds "float16": select the dtype by excluding the others.
_ONLY = {"float16": "not bfloat16 and not float32 and not float64", "bfloat16": "bfloat16"}


@pytest.mark.slow(seconds=15)
@pytest.mark.parametrize("dtype", sorted(_ONLY))
def test_scale_rounded_to_float16_fails_in_half_precision(dtype, tmp_path):
    """A kernel that rounds the scale to float16 first is wrong by up to 2^-11 of every score: the bounds
    stay tight enough to fail it in the half-precision dtypes too, where the inputs' own rounding is as large."""
    out = mutants.run_variant("scale_rounded_to_float16", report_dir=tmp_path, extra=("-k", _ONLY[dtype]))
    assert out.returncode == 1, f"expected a failure in {dtype}, got exit {out.returncode}:\n{out.output[-4000:]}"
    assert f"-{dtype}]" in out.output


@pytest.mark.parametrize(("name", "before"), [("gqa_large_group_packed_by_4", {"max_group": 3}),
                                              ("split_partials_in_64_slots", {"max_splits": 5}),
                                              ("scale_from_value_head_dim", {}),
                                              ("delta_over_query_head_dim", {}),
                                              ("k_descale_from_q", {}), ("v_descale_dropped", {})])
def test_only_the_real_shape_draws_catch_these_mutants(name, before):
    """Drawn as before groups above 3, splits above 5, a value head dim of its own and float8 inputs were
    (``before``; the draws below never ask for ``head_dim_v`` and are float32), every case gives the mutant's out and LSE, and with a declared
    backward its dq, dk, dv and Delta, bit for bit the unchanged kernel's: only the new draws can catch it
    (and the suite does, ``test_mutant_fails_the_suite``)."""
    import dataclasses

    from hypothesis import given, settings

    from strategies.attention import attention_cases
    from verify import calls
    from verify.context import Context
    from verify.profiles import limits_for

    impl, good = mutants.VARIANTS[name], mutants.unmutated
    limits = dataclasses.replace(limits_for("cpu", "ci"), **before)

    @settings(max_examples=150, database=None, derandomize=True, deadline=None)
    @given(attention_cases(dtype="float32", limits=limits, gqa=True, splits=True, block_m=(1, 2, 4, 8, 16),
                           block_n=(1, 2, 4, 8, 16), min_len_k=1))
    def same(case):
        t = case.build()
        got = calls.run_forward(Context(impl=impl, prop="mutant", case=case), case, t.q, t.k, t.v)
        want = calls.run_forward(Context(impl=good, prop="mutant", case=case), case, t.q, t.k, t.v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), case
        backward = [i.call_backward(t.q, t.k, t.v, want[0], want[1], t.dout, spec=case.spec, scale=case.scale,
                                    block_m=case.block_m, block_n=case.block_n) for i in (impl, good)]
        assert all(torch.equal(a, b) for a, b in zip(*backward)), case

    same()
