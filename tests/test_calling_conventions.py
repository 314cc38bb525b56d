"""The calling-convention adapters (flashverify_kernels/calling_conventions.py): a function written like flash_attn_func,
flash_attn_varlen_func, flash_attn_with_kvcache or xformers' memory_efficient_attention, adapted, gives the
float64 reference's out, LSE and gradients (the stand-ins in tests/fixtures/convention_standins.py);
`pytest verify --impl ... --convention ...` runs green on them; stand-ins with a convention's typical mistakes
(an LSE in base 2, top-left causal, heads read as positions, a misdeclared bias) fail with the suite's
messages; bad input (an unknown convention, a function without the convention's keywords, results of the
wrong shape, a field the API fixes) is refused with words naming what was wrong and what is allowed."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashverify_kernels import calling_conventions as cc, registry
from flashverify_kernels.conventions import ContractError
from flashverify_kernels.declaration import ImplementationError, declare
from references import attention as reference
from references.spec import AttentionSpec
from strategies.cases import AttentionCase
from tests.fixtures import convention_standins as standins
from verify import properties, replay
from verify.context import Context, PropertyFailure

ROOT = Path(__file__).resolve().parent.parent
STANDINS = "tests/fixtures/convention_standins.py"
SLOPES = (0.5, 0.25, 1.0, 0.125)  # float32-exact ALiBi slopes, one per query head
PACKED = dict(sequences="packed", seqlens_q=(3, 0, 5, 2), seqlens_k=(4, 2, 3, 0))
PAGED = dict(sequences="paged", seqlens_q=(2, 2, 2), seqlens_k=(5, 0, 9), page_size=3, page_seed=3)
DECODE = dict(sequences="paged", seqlens_q=(1, 1), seqlens_k=(7, 4), page_size=2)

ADAPTED = {
    "flash_attn": cc.flash_attn_convention(standins.flash_attn_func),
    "flash_attn_varlen": cc.flash_attn_varlen_convention(standins.flash_attn_varlen_func),
    "flash_attn_kvcache": cc.flash_attn_kvcache_convention(standins.flash_attn_with_kvcache),
    "xformers": cc.xformers_convention(standins.memory_efficient_attention),
    "xformers_causal": standins.XFORMERS_CAUSAL,
}
# (adapted, spec, (Nq, Nk) of a dense batch, scale): every variant a convention declares, both length orders
# (Nq > Nk: bottom-right causal leaves the first rows without keys), a given scale and the default.
CASES = [
    ("flash_attn", AttentionSpec(), (7, 11), 0.5),
    ("flash_attn", AttentionSpec(causal=True), (11, 7), None),
    ("flash_attn", AttentionSpec(causal=True), (7, 11), 0.5),
    ("flash_attn", AttentionSpec(window_left=2, window_right=1), (9, 6), None),
    ("flash_attn", AttentionSpec(causal=True, softcap=2.0, alibi_slopes=SLOPES), (7, 11), 0.5),
    ("flash_attn_varlen", AttentionSpec(**PACKED), None, 0.5),
    ("flash_attn_varlen", AttentionSpec(causal=True, window_left=1, alibi_slopes=SLOPES, **PACKED), None, None),
    ("flash_attn_varlen", AttentionSpec(causal=True, softcap=1.5, **PACKED), None, 0.5),
    ("flash_attn_kvcache", AttentionSpec(causal=True, softcap=3.0, **PAGED), None, 0.5),
    ("flash_attn_kvcache", AttentionSpec(window_left=2, alibi_slopes=SLOPES, num_splits=3, **DECODE), None, None),
    ("xformers", AttentionSpec(), (7, 11), 0.5),
    ("xformers_causal", AttentionSpec(causal=True), (11, 7), None),
    ("xformers_causal", AttentionSpec(causal=True), (7, 11), 0.5),
]
# (rtol, atol) of out, lse and the gradients against the float64 reference.
TOLERANCE = {torch.float64: (1e-12, 1e-13), torch.float32: (1e-5, 2e-5)}


def _inputs(spec, dtype, lengths, *, heads_kv):
    """``q, k, v, dout`` in the references' frame (float64 values rounded to ``dtype``), Hq = 4."""
    g = torch.Generator().manual_seed(0)
    batch, (len_q, len_k) = (1, (sum(spec.seqlens_q), sum(spec.seqlens_k))) if spec.varlen else (2, lengths)
    q, dout = (torch.randn(batch, 4, len_q, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    k, v = (torch.randn(batch, heads_kv, len_k, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, dout


def _close(label, got, want, dtype):
    rtol, atol = TOLERANCE[dtype]
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)}, reference {tuple(want.shape)}"
    assert torch.allclose(got.to(torch.float64), want, rtol=rtol, atol=atol, equal_nan=False), \
        f"{label}: max error {(got.to(torch.float64) - want).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name, spec, lengths, scale", CASES,
                         ids=[f"{c[0]}-{c[1].describe()}-{c[2]}-{c[3]}".replace(" ", "") for c in CASES])
def test_adapted_standin_matches_the_reference(name, spec, lengths, scale, dtype):
    impl = ADAPTED[name]
    q, k, v, dout = _inputs(spec, dtype, lengths, heads_kv=2 if impl.gqa else 4)
    ref = reference.attention(q, k, v, spec=spec, scale=scale, dout=dout)
    leaves = [t.clone().requires_grad_(impl.autograd) for t in (q, k, v)]
    out, lse = impl.call(*leaves, spec=spec, scale=scale)
    assert out.dtype == dtype
    _close("out", out, ref.out, dtype)
    if impl.returns_lse:
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref.lse)), "rows without keys: lse should be -inf"
        seen = torch.isfinite(ref.lse)
        _close("lse", lse[seen], ref.lse[seen], dtype)
    else:
        assert lse is None
    if impl.autograd:  # the gradients flow back through the adapter's layout conversions
        out.backward(dout)
        for label, leaf, want in zip(("dq", "dk", "dv"), leaves, (ref.dq, ref.dk, ref.dv)):
            _close(label, leaf.grad, want, dtype)


def test_declarations_say_what_each_convention_supports():
    dense, varlen, kvcache = ADAPTED["flash_attn"], ADAPTED["flash_attn_varlen"], ADAPTED["flash_attn_kvcache"]
    for impl in (dense, varlen, kvcache):
        assert impl.gqa and impl.windows and impl.softcap and impl.alibi and impl.returns_lse
        assert impl.causal and impl.causal_alignment == "bottom_right"
        assert not (impl.sinks or impl.chunks or impl.out_buffers) and impl.backward is None
    assert dense.sequences == ("dense",) and dense.autograd and not dense.splits and not dense.deterministic
    assert varlen.sequences == ("packed",) and varlen.autograd and not varlen.splits
    assert kvcache.sequences == ("paged",) and not kvcache.autograd and kvcache.splits
    xformers = ADAPTED["xformers"]
    assert xformers.sequences == ("dense",) and xformers.returns_lse is False and xformers.autograd
    assert not (xformers.gqa or xformers.windows or xformers.softcap or xformers.alibi)
    assert xformers.causal is False and "non-causal only" in xformers.description
    assert "causal masks: not covered, declared unsupported" in xformers.not_covered()
    assert standins.XFORMERS_CAUSAL.causal and standins.XFORMERS_CAUSAL.causal_alignment == "bottom_right"
    # The contract's plain-callable defaults for what the suite cannot know, and overrides as keywords.
    assert set(dense.dtypes) == {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    assert dense.head_dims is None and kvcache.page_sizes is None
    narrow = cc.flash_attn_kvcache_convention(standins.flash_attn_with_kvcache, name="narrow", page_sizes=(256,),
                                              dtypes=(torch.float16,), max_len_q=16)
    assert narrow.name == "narrow" and narrow.page_sizes == (256,) and narrow.dtypes == (torch.float16,)


def test_fields_from_declare_on_the_function_are_kept_and_keywords_win():
    fn = declare(dtypes=(torch.float64,), max_head_dim=64)(lambda *a, **kw: standins.flash_attn_func(*a, **kw))
    impl = cc.adapt(fn, "flash_attn", name="declared", max_head_dim=128)
    assert impl.dtypes == (torch.float64,) and impl.max_head_dim == 128


def _recording(results):
    """A function of any convention that records the positional arguments' shapes and the keywords it gets,
    and returns ``results(*args)``."""
    calls = []

    def fn(*args, **kwargs):
        calls.append(([tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args], kwargs))
        return results(*args)

    return fn, calls


def test_the_suites_keywords_reach_the_function_under_the_apis_names():
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    spec = AttentionSpec(causal=True, window_left=2, window_right=0, softcap=4.0, alibi_slopes=SLOPES)
    dense, calls = _recording(lambda q, k, v: (q.clone(), torch.zeros(1, 4, 3, dtype=torch.float32), None))
    out, lse = cc.flash_attn_convention(dense, deterministic=True).call(q, k, k, spec=spec, scale=0.25)
    (shapes, kw), = calls
    assert shapes == [(1, 3, 4, 8), (1, 5, 2, 8), (1, 5, 2, 8)]
    assert kw.pop("alibi_slopes").tolist() == list(SLOPES)
    assert kw == dict(softmax_scale=0.25, causal=True, window_size=(2, 0), softcap=4.0, deterministic=True,
                      return_attn_probs=True)
    assert lse.dtype == torch.float64  # flash_attn's float32 LSE as the contract's float64 for float64 inputs

    spec = AttentionSpec(causal=True, num_splits=3, **DECODE)
    q, k = torch.randn(1, 4, 2, 8, dtype=torch.float64), torch.randn(1, 2, 11, 8, dtype=torch.float64)
    paged, calls = _recording(lambda q, k, v: (q.clone(), torch.zeros(2, 4, 1, dtype=torch.float32)))
    cc.flash_attn_kvcache_convention(paged).call(q, k, k, spec=spec)
    (shapes, kw), = calls
    assert shapes == [(2, 1, 4, 8), (7, 2, 2, 8), (7, 2, 2, 8)]  # q [B, Nq, Hq, D]; the cache's pages
    table, lengths = kw.pop("block_table"), kw.pop("cache_seqlens")
    assert lengths.tolist() == [7, 4] and table.dtype == lengths.dtype == torch.int32 and table.shape[0] == 2
    assert kw == dict(softmax_scale=None, causal=True, num_splits=3, return_softmax_lse=True)

    bias = object()
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    xformers, calls = _recording(lambda q, k, v: q.clone())
    impl = cc.xformers_convention(xformers, causal_bias=lambda query, key: bias, causal_alignment="top_left")
    impl.call(q, q, q, spec=AttentionSpec(causal=True, alignment="top_left"), scale=0.5)
    impl.call(q, q, q, spec=AttentionSpec(), scale=0.5)
    assert [kw for _, kw in calls] == [dict(scale=0.5, attn_bias=bias), dict(scale=0.5)]


def test_contiguous_only_passes_contiguous_tensors_in_the_api_layout():
    seen = []

    def fn(q, k, v, softmax_scale=None, causal=False, return_attn_probs=False):
        seen.append(all(t.is_contiguous() for t in (q, k, v)))
        return standins.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                        return_attn_probs=return_attn_probs)

    fields = dict(windows=False, softcap=False, alibi=False)
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)  # [B, H, N, D] contiguous: its transpose is not
    for contiguous in (False, True):
        impl = cc.flash_attn_convention(fn, contiguous_only=contiguous, **fields)
        impl.call(q, q, q, spec=AttentionSpec())
    assert seen == [False, True]


# ------------------------------------------------------------------------------------ wrong stand-ins
CASE = AttentionCase(batch=2, heads_q=2, heads_kv=2, len_q=5, len_k=9, head_dim=8, dtype="float32",
                     spec=AttentionSpec(True))


@pytest.mark.parametrize("wrong, prop, case, words", [
    (cc.flash_attn_convention(standins.flash_attn_func_lse_base2), "lse_matches_reference", CASE,
     "it looks like a base-2 logarithm (log2 of the row sum, as kernels that use exp2 store it)"),
    (cc.flash_attn_convention(standins.flash_attn_func_top_left), "out_matches_reference", CASE,
     "out differs from the float64 reference"),
    (cc.flash_attn_convention(standins.flash_attn_func_heads_as_positions), "out_matches_reference",
     CASE.replace(spec=AttentionSpec(), len_k=5), "out differs from the float64 reference"),
    (standins.XFORMERS_MISALIGNED, "out_matches_reference", CASE, "out differs from the float64 reference"),
], ids=["lse_base2", "top_left", "heads_as_positions", "xformers_misaligned"])
def test_a_wrong_standin_fails_with_the_suites_message(wrong, prop, case, words):
    with pytest.raises(PropertyFailure) as info:
        properties.PROPERTIES[prop](Context(impl=wrong, prop=prop, case=case), case)
    assert words in str(info.value), str(info.value)


def test_a_failure_replays_through_its_convention(capsys):
    impl = registry.load(f"{STANDINS}:flash_attn_func_top_left", device="cpu", convention="flash_attn")
    assert impl.cli_name == f"{STANDINS}:flash_attn_func_top_left@flash_attn"
    context = Context(impl=impl, prop="out_matches_reference", case=CASE)
    with pytest.raises(PropertyFailure) as info:
        properties.out_matches_reference(context, CASE)
    argv = shlex.split(info.value.replay)[3:]  # python -m verify.replay <arguments>
    assert argv[:2] == ["--impl", impl.cli_name]
    assert replay.main(argv) == 1
    assert "out differs from the float64 reference" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ bad input
def test_an_unknown_convention_is_refused_with_the_known_ones():
    known = "known: flash_attn (flash_attn_func), flash_attn_varlen (flash_attn_varlen_func), flash_attn_kvcache"
    words = f"convention 'flash' is not a calling convention; {known}"
    with pytest.raises(ImplementationError, match=re.escape(words)):
        cc.adapt(standins.flash_attn_func, "flash")
    for spec, convention in ((f"{STANDINS}:flash_attn_func@flashattn", None), (f"{STANDINS}:flash_attn_func", "fa")):
        with pytest.raises(ImplementationError, match="is not a calling convention; known: flash_attn, "):
            registry.load(spec, device="cpu", convention=convention)


@pytest.mark.parametrize("spec, words", [
    ("fa2_blocked", "'fa2_blocked' is a shipped implementation; it speaks the suite's contract already"),
    (f"{STANDINS}:FLASH_ATTN", "names an Implementation; it speaks the suite's contract already"),
    (f"{STANDINS}:STANDINS_NOTHING", "has no attribute 'STANDINS_NOTHING'"),
])
def test_a_convention_applies_to_plain_functions_only(spec, words):
    with pytest.raises(ImplementationError, match=re.escape(words)):
        registry.load(spec, device="cpu", convention="flash_attn")


def test_the_convention_syntax_and_the_option_load_the_same_declaration():
    by_option = registry.load(f"{STANDINS}:flash_attn_varlen_func", device="cpu", convention="flash_attn_varlen")
    by_suffix = registry.load(f"{STANDINS}:flash_attn_varlen_func@flash_attn_varlen", device="cpu")
    assert by_option.name == by_suffix.name == f"{STANDINS}:flash_attn_varlen_func@flash_attn_varlen"
    assert by_option.sequences == ("packed",) and by_option.devices == ("cpu",)
    # an @ that names no convention is part of the spec (a path); a one-line declaration loads as any other
    assert registry.split_convention("dir@v2/file.py:fn") == ("dir@v2/file.py:fn", None)
    assert registry.load(f"{STANDINS}:FLASH_ATTN", device="cpu").name == "flash_attn_standin"


def test_a_function_without_the_conventions_keywords_is_refused_with_the_way_out():
    words = ("cannot be called in the flash_attn convention, as flash_attn_func: it takes no keyword 'window_size', "
             "'softcap', 'alibi_slopes'; the adapter calls fn(q, k, v, softmax_scale=..., causal=..., window_size=..., "
             "softcap=..., alibi_slopes=..., return_attn_probs=...); to leave a keyword out, declare window_size: "
             "windows=False, softcap: softcap=False, alibi_slopes: alibi=False")
    with pytest.raises(ImplementationError, match=re.escape(words)):
        cc.flash_attn_convention(standins.flash_attn_func_no_variants)
    impl = cc.flash_attn_convention(standins.flash_attn_func_no_variants, windows=False, softcap=False, alibi=False)
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    out, lse = impl.call(q, q, q, spec=AttentionSpec(causal=True))
    assert torch.allclose(out, reference.forward(q, q, q, spec=AttentionSpec(causal=True))[0])
    with pytest.raises(ImplementationError, match=r"it takes 2 positional arguments, but the adapter calls fn\(q, k, "
                                                  r"v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "):
        cc.flash_attn_varlen_convention(lambda q, k, **kw: q)
    with pytest.raises(ImplementationError, match="it requires 'mask', which the adapter does not pass"):
        cc.xformers_convention(lambda query, key, value, mask, scale=None: query)


@pytest.mark.parametrize("fn, convention, spec, words", [
    (standins.flash_attn_func_out_heads_first, "flash_attn", AttentionSpec(),
     "returned out.shape=(1, 2, 3, 8), but should return (1, 3, 2, 8) (flash_attn_func's out is [B, Nq, Hq, D])"),
    (lambda q, k, v, softmax_scale=None, causal=False, window_size=None, softcap=0.0, alibi_slopes=None,
     return_attn_probs=False: q.clone(), "flash_attn", AttentionSpec(),
     "returned Tensor, but with return_attn_probs=True flash_attn_func returns (out, softmax_lse, S_dmask); declare "
     "returns_lse=False"),
    (lambda *a, **kw: (lambda out, lse, _: (out, lse.transpose(0, 1), None))(
        *standins.flash_attn_varlen_func(*a, **kw)), "flash_attn_varlen", AttentionSpec(**PACKED),
     "returned softmax_lse.shape=(10, 2), but should return (2, 10) (flash_attn_varlen_func's softmax_lse is "
     "[Hq, total_q])"),
    (lambda query, key, value, attn_bias=None, scale=None: (query.clone(), None), "xformers", AttentionSpec(),
     "returned a tuple, but memory_efficient_attention returns out alone, a tensor [B, M, H, K]"),
], ids=["out_heads_first", "out_alone_with_lse_declared", "varlen_lse_transposed", "xformers_tuple"])
def test_results_of_the_wrong_shape_are_refused_naming_the_conventions_layout(fn, convention, spec, words):
    impl = cc.adapt(fn, convention, name="wrong")
    batch, len_q = (1, sum(spec.seqlens_q)) if spec.varlen else (1, 3)
    q = torch.randn(batch, 2, len_q, 8, dtype=torch.float64)
    k = torch.randn(batch, 2, sum(spec.seqlens_k) if spec.varlen else 3, 8, dtype=torch.float64)
    with pytest.raises(ContractError, match=re.escape(f"wrong {words}")):
        impl.call(q, k, k, spec=spec)


@pytest.mark.parametrize("make, words", [
    (lambda: cc.flash_attn_convention(standins.flash_attn_func, sinks=True),
     "sinks=True, but the flash_attn convention fixes sinks=False (the API has no keyword for attention sinks)"),
    (lambda: cc.flash_attn_convention(standins.flash_attn_func, sequences=("packed",)),
     "the flash_attn convention fixes sequences=('dense',)"),
    (lambda: cc.flash_attn_kvcache_convention(standins.flash_attn_with_kvcache, autograd=True),
     "autograd=True, but the flash_attn_kvcache convention fixes autograd=False (flash_attn_with_kvcache has no "
     "backward)"),
    (lambda: cc.flash_attn_convention(standins.flash_attn_func, head_dim=64), "['head_dim'] are not fields"),
    (lambda: cc.flash_attn_convention(standins.flash_attn_func, dtypes=(torch.int8,)), "dtypes=(torch.int8,)"),
    (lambda: cc.flash_attn_convention("flash_attn_func"), "'flash_attn_func' is not callable"),
    (lambda: cc.xformers_convention(standins.memory_efficient_attention, causal=True),
     "causal=True, but the xformers convention expresses a causal mask only through causal_bias="),
    (lambda: cc.xformers_convention(standins.memory_efficient_attention, causal_bias=lambda q, k: None),
     "causal_bias is given without causal_alignment: say which mask it makes, causal_alignment='top_left' "
     "(xformers' LowerTriangularMask: j <= i) or 'bottom_right'"),
], ids=["sinks", "sequences", "kvcache_autograd", "unknown_field", "bad_dtype", "not_callable", "xformers_causal",
        "xformers_alignment"])
def test_a_declaration_the_convention_cannot_keep_is_refused(make, words):
    with pytest.raises(ImplementationError, match=re.escape(words)):
        make()


# ------------------------------------------------------------------------------------ the command line
def _pytest_verify(tmp_path, *args):
    cmd = [sys.executable, "-m", "pytest", "verify", *args, "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider",
           "--report-dir", str(tmp_path / "report")]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_pytest_verify_with_conventions_runs_green(tmp_path):
    """One run for the four conventions: --convention names the first's, the others their own (@convention)."""
    named = {"flash_attn_func": "flash_attn", "flash_attn_varlen_func": "flash_attn_varlen",
             "flash_attn_with_kvcache": "flash_attn_kvcache", "memory_efficient_attention": "xformers"}
    impls = [f"{STANDINS}:{fn}" + ("" if convention == "flash_attn" else f"@{convention}")
             for fn, convention in named.items()]
    proc = _pytest_verify(tmp_path, *(a for spec in impls for a in ("--impl", spec)), "--convention", "flash_attn",
                          "-k", "test_forward and (out_matches_reference or lse_matches_reference)")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for fn, convention in named.items():  # out and lse in four dtypes; xformers' out alone (no LSE)
        tally = "4 passed, 4 skipped" if convention == "xformers" else "8 passed"
        assert f"{STANDINS}:{fn}@{convention}: {tally}\n" in proc.stdout, proc.stdout[-2000:]


def test_convention_without_impl_is_a_usage_error(tmp_path):
    proc = _pytest_verify(tmp_path, "--convention", "flash_attn")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "--convention flash_attn applies to the kernels named with --impl, and none was given" in proc.stderr
