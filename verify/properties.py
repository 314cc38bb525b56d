"""The property catalogue (README.md, "What is checked") as plain functions of ``(ctx, case)``.

Every property is deterministic in its case: whatever else it needs (a second tiling, a key
permutation, a shift vector, a poison value) is derived from ``case.seed``, so the one-line replay
command reproduces it exactly. The pytest modules in this folder draw cases with Hypothesis and call
these functions; ``python -m verify.replay`` calls them directly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
# The module, not the function that torch.autograd.gradcheck names (the package re-exports it).
from torch.autograd.gradcheck import GradcheckError

from flashverify_kernels.registry import registry
from references import attention as reference, mp
from references.criteria import ds_magnitude_rowsum
from references.metrics import abs_error, max_ratio, unit_roundoff
from references.softmax_bounds import softmax_bounds
from strategies.attention import tiles_per_axis
from strategies.cases import DTYPES, LAYOUTS, AttentionCase
from strategies.softmax import SoftmaxCase
from verify import measure
from verify.asserts import assert_close, assert_no_nan
from verify.calls import check_tensor, lse_dtype, run_backward, run_direct_backward, run_forward
from verify.context import Context, NotForThisCase, NotForThisKernel
from verify.stages import stage

PROPERTIES: dict[str, Callable[[Context, AttentionCase], None]] = {}


def prop(fn):
    PROPERTIES[fn.__name__] = fn
    return fn


def _rng(case: AttentionCase, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(case.seed * 1_000_003 + salt)


def _truth(ctx: Context, case: AttentionCase, q, k, v, dout=None, *, descales=None) -> measure.Truth:
    """What the kernel's results on ``q, k, v`` are compared with: the attention the case's spec describes
    (of the dequantised values, for float8 inputs with ``descales``)."""
    return measure.Truth(case, q, k, v, dout=dout, descales=descales)


def _needs_lse(ctx: Context, lse) -> None:
    if lse is None:
        raise NotForThisKernel(f"{ctx.impl.name} returns out alone (no LSE): LSE properties are skipped")


def _same(ctx: Context, *, what: str, a, b, tol) -> None:
    """Two results of the kernel that should agree within ``tol`` (the sum of both results' error
    bounds): their arithmetic differs (tiling, strides, order), so bitwise equality is not owed."""
    __tracebackhide__ = True
    assert_close(ctx, what=what, actual=a, expected=b, tolerance=tol)


# ------------------------------------------------------------------------------------ forward
@prop
def out_matches_reference(ctx: Context, case: AttentionCase) -> None:
    """``out`` vs the float64 reference: criterion 1 (baseline-relative) and 2 (rounding bound)."""
    t = case.build(ctx.device)
    out, _ = run_forward(ctx, case, t.q, t.k, t.v, descales=t.descales)
    truth = _truth(ctx, case, t.q, t.k, t.v, descales=t.descales)
    measure.check(ctx, truth, "out", out, truth.forward_bounds)


@prop
def lse_matches_reference(ctx: Context, case: AttentionCase) -> None:
    """``lse`` (natural log, over the visible keys) vs the float64 reference, both criteria."""
    t = case.build(ctx.device)
    _, lse = run_forward(ctx, case, t.q, t.k, t.v, descales=t.descales)
    _needs_lse(ctx, lse)
    truth = _truth(ctx, case, t.q, t.k, t.v, descales=t.descales)
    measure.check(ctx, truth, "lse", lse, truth.forward_bounds)


@prop
def lse_between_max_and_max_plus_log_n(ctx: Context, case: AttentionCase) -> None:
    """``max_j s_ij <= lse_i <= max_j s_ij + log(visible keys of row i)``, up to the LSE bound (with sinks
    the sink is one more of the row's terms: every row has it)."""
    t = case.build(ctx.device)
    _, lse = run_forward(ctx, case, t.q, t.k, t.v, descales=t.descales)
    _needs_lse(ctx, lse)
    truth = _truth(ctx, case, t.q, t.k, t.v, descales=t.descales)
    ref, lse_bound = truth.ref, truth.forward_bounds["lse"]
    n_visible = ref.n_visible.to(torch.float64)  # [Nq]
    if ref.sink is not None:
        ref = dataclasses.replace(ref, row_max=torch.maximum(ref.row_max, ref.sink[:, None]))
        n_visible = n_visible + 1
    has_keys = n_visible > 0
    got = lse.to(torch.float64)
    lo = torch.where(has_keys, ref.row_max - lse_bound, -math.inf)
    hi = torch.where(has_keys, ref.row_max + torch.log(n_visible.clamp(min=1)) + lse_bound, math.inf)
    bad = has_keys & ((got < lo) | (got > hi) | torch.isnan(got))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        ctx.fail(f"lse[{', '.join(map(str, idx))}]={float(got[idx]):.9g} is outside "
                 f"[max score, max score + log(n)] = [{float(ref.row_max[idx]):.9g}, "
                 f"{float(ref.row_max[idx] + math.log(float(n_visible[idx[-1]]))):.9g}] "
                 f"(widened by the bound {float(lse_bound[idx]):.3e})")


@prop
def out_within_visible_values(ctx: Context, case: AttentionCase) -> None:
    """Each ``out`` row lies in the box spanned by the visible ``v`` rows (up to the bound); with sinks, by
    those rows and 0 (the sink's value)."""
    t = case.build(ctx.device)
    out, _ = run_forward(ctx, case, t.q, t.k, t.v, descales=t.descales)
    truth = _truth(ctx, case, t.q, t.k, t.v, descales=t.descales)
    ref, out_bound = truth.ref, truth.forward_bounds["out"]
    lo, hi = _visible_value_box(ref)
    if ref.sink is not None:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    has = ref.rows_with_keys[None, None, :, None]
    lo, hi = torch.where(has, lo, 0.0) - out_bound, torch.where(has, hi, 0.0) + out_bound
    got = out.to(torch.float64)
    bad = (got < lo) | (got > hi) | torch.isnan(got)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        ctx.fail(f"out[{', '.join(map(str, idx))}]={float(got[idx]):.6g} is outside the range of the "
                 f"visible v values [{float(lo[idx] + out_bound[idx]):.6g}, {float(hi[idx] - out_bound[idx]):.6g}]"
                 f" (widened by the bound {float(out_bound[idx]):.3e})")


def _visible_value_box(ref) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max ``[B, Hq, Nq, D]`` of the ``v`` rows each query row sees (0 for rows
    that see none). The visible keys of a row are one range (``AttentionSpec.key_range``): a prefix
    without a left window, where a running min and max over the keys (``O(Nk D)``) answer every row;
    with one, a sparse table of minima and maxima over power-of-two spans (``O(Nk D log Nk)``). Neither
    forms an ``Nq x Nk`` mask."""
    first, end = ref.spec.key_range(ref.len_q, ref.len_k, device=ref.out.device)
    has = (end > first)[None, None, :, None]
    if ref.len_k == 0:
        return torch.zeros_like(ref.out), torch.zeros_like(ref.out)
    last = (end - 1).clamp(min=0)  # the last visible key of each row
    values = ref.v_expanded
    if not bool((first > 0).any()):
        lo, hi = torch.cummin(values, dim=2).values[:, :, last], torch.cummax(values, dim=2).values[:, :, last]
    else:
        seen = end > first  # rows that see no key get the dummy range [0, 1), masked below
        lo, hi = _range_extremes(values, torch.where(seen, first, 0), torch.where(seen, end, 1))
    return torch.where(has, lo, 0.0), torch.where(has, hi, 0.0)


def _range_extremes(values: torch.Tensor, first: torch.Tensor, end: torch.Tensor):
    """Min and max of ``values[:, :, first[i]:end[i]]`` for every ``i`` (``end > first``), by a sparse
    table: level ``l`` holds the extremes of the spans of ``2^l`` keys; a range is two spans that overlap."""
    lows, highs = [values], [values]
    width = 1
    while 2 * width <= values.shape[2]:
        lo, hi = lows[-1], highs[-1]
        lows.append(torch.minimum(lo[:, :, :-width], lo[:, :, width:]))
        highs.append(torch.maximum(hi[:, :, :-width], hi[:, :, width:]))
        width *= 2
    length = end - first
    level = torch.floor(torch.log2(length.to(torch.float64))).to(torch.int64)  # 2^level <= length
    lo = torch.empty(values.shape[:2] + (first.numel(), values.shape[3]), dtype=values.dtype, device=values.device)
    hi = torch.empty_like(lo)
    for l in level.unique().tolist():
        rows = (level == l).nonzero().flatten()
        a, b = first[rows], end[rows] - 2 ** l  # [a, a + 2^l) and [b, b + 2^l) cover [a, end)
        lo[:, :, rows] = torch.minimum(lows[l][:, :, a], lows[l][:, :, b])
        hi[:, :, rows] = torch.maximum(highs[l][:, :, a], highs[l][:, :, b])
    return lo, hi


@prop
def block_size_invariance(ctx: Context, case: AttentionCase) -> None:
    """Another tiling (drawn from the declared block sizes) gives the same out and lse, up to bounds.

    For a kernel that declares ``max_tiles`` the other tiling is drawn among the block sizes that keep
    each axis within its share of it, as the case's own tiling was."""
    if not ctx.impl.tunable:
        raise NotForThisKernel(f"{ctx.impl.name} declares no tunable block sizes")
    t = case.build(ctx.device)
    g = _rng(case, 1)
    sizes_m, sizes_n = (list(sizes) for sizes in ctx.impl.blocks_for(case.dtype))
    if ctx.impl.max_tiles is not None:
        per_axis = tiles_per_axis(ctx.impl.max_tiles)
        sizes_m = [b for b in sizes_m if -(-case.len_q // b) <= per_axis] or [case.block_m]
        sizes_n = [b for b in sizes_n if -(-case.len_k // b) <= per_axis] or [case.block_n]
    other = case.replace(block_m=sizes_m[int(torch.randint(len(sizes_m), (1,), generator=g))],
                         block_n=sizes_n[int(torch.randint(len(sizes_n), (1,), generator=g))])
    out_a, lse_a = run_forward(ctx, case, t.q, t.k, t.v)
    out_b, lse_b = run_forward(ctx, other, t.q, t.k, t.v)
    bound = _truth(ctx, case, t.q, t.k, t.v).forward_bounds
    what = f"blocks {case.block_m}x{case.block_n} vs {other.block_m}x{other.block_n}"
    _same(ctx, what=f"out with {what}", a=out_a, b=out_b, tol=2 * bound["out"])
    if lse_a is not None:
        _same(ctx, what=f"lse with {what}", a=lse_a, b=lse_b, tol=2 * bound["lse"])


@prop
def siblings_agree(ctx: Context, case: AttentionCase) -> None:
    """Two implementations of the same function (the declared sibling: FA1 for FA2) agree, up to
    both results' bounds."""
    if ctx.impl.sibling is None:
        raise NotForThisKernel(f"{ctx.impl.name} declares no sibling implementation")
    other = registry()[ctx.impl.sibling]
    why = other.unsupported(dtype=DTYPES[case.dtype], device=ctx.device)
    if why:
        raise NotForThisKernel(why)
    other_ctx = dataclasses.replace(ctx, impl=other)
    t = case.build(ctx.device)
    out_a, lse_a = run_forward(ctx, case, t.q, t.k, t.v)
    out_b, lse_b = run_forward(other_ctx, case, t.q, t.k, t.v)
    bound = _truth(ctx, case, t.q, t.k, t.v).forward_bounds
    _same(ctx, what=f"out of {ctx.impl.name} vs {other.name}", a=out_a, b=out_b, tol=2 * bound["out"])
    if lse_a is not None and lse_b is not None:
        _same(ctx, what=f"lse of {ctx.impl.name} vs {other.name}", a=lse_a, b=lse_b, tol=2 * bound["lse"])


@prop
def key_permutation_invariance(ctx: Context, case: AttentionCase) -> None:
    """Permuting keys and values together (within each sequence) leaves out and lse unchanged (non-causal)."""
    if case.causal:
        raise NotForThisCase("key order matters under a causal mask")
    t = case.build(ctx.device)
    g = _rng(case, 2)
    spans = [(0, t.k.shape[2])] if not case.spec.varlen else [(k0, k1) for _, _, k0, k1 in case.spec.sequence_spans()]
    perm = torch.cat([k0 + torch.randperm(k1 - k0, generator=g) for k0, k1 in spans]).to(t.k.device)
    out_a, lse_a = run_forward(ctx, case, t.q, t.k, t.v)
    out_b, lse_b = run_forward(ctx, case, t.q, t.k[:, :, perm], t.v[:, :, perm])
    bound = _truth(ctx, case, t.q, t.k, t.v).forward_bounds
    _same(ctx, what="out after permuting keys and values", a=out_b, b=out_a, tol=2 * bound["out"])
    if lse_a is not None:
        _same(ctx, what="lse after permuting keys and values", a=lse_b, b=lse_a, tol=2 * bound["lse"])


def _grid(t: torch.Tensor, headroom: float) -> tuple[torch.Tensor, float]:
    """Round ``t`` onto a grid ``delta`` such that every multiple of ``delta`` up to ``headroom``
    times ``max|t|`` is exactly representable in ``t``'s dtype; returns ``(t on the grid, delta)``."""
    x = t.to(torch.float64)
    finite = x[torch.isfinite(x)]
    top = float(finite.abs().max()) if finite.numel() else 1.0
    top = max(top, 1e-30)
    # Keep |t A + b| (up to headroom * top) inside the dtype's range: halving is exact.
    while top * headroom > torch.finfo(t.dtype).max / 2:
        x, top = x / 2, top / 2
    bits = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}[t.dtype]
    span = 2.0 ** math.ceil(math.log2(top * headroom))
    smallest_subnormal = torch.finfo(t.dtype).tiny * 2.0 ** (1 - bits)
    delta = max(span / 2.0 ** bits, smallest_subnormal)
    return (torch.round(x / delta) * delta).to(t.dtype), delta


@prop
def score_shift_invariance(ctx: Context, case: AttentionCase) -> None:
    """``k -> k + w`` (one w for all keys) leaves out unchanged and shifts lse by ``scale * q_i . w``.

    ``k`` is first put on a grid on which ``k + w`` is exact in the input dtype, so the shifted
    inputs are exactly the shifted function and the reference needs no rounding model.
    """
    t = case.build(ctx.device)
    k0, delta = _grid(t.k, headroom=4.0)
    k0_top = float(k0.to(torch.float64).abs().max()) if k0.numel() else 0.0
    g = _rng(case, 3)
    w = torch.randn(t.k.shape[0], t.k.shape[1], 1, t.k.shape[3], generator=g, dtype=torch.float64)
    w = torch.round(w / w.abs().max().clamp(min=1e-30) * 2.0 * (k0_top or delta) / delta) * delta
    w = w.to(t.k.device)
    k1 = (k0.to(torch.float64) + w).to(t.k.dtype)
    if not torch.equal(k1.to(torch.float64), k0.to(torch.float64) + w):
        raise AssertionError("internal: the shifted keys are not exact on the chosen grid")
    out0, lse0 = run_forward(ctx, case, t.q, k0, t.v)
    out1, lse1 = run_forward(ctx, case, t.q, k1, t.v)
    b0 = _truth(ctx, case, t.q, k0, t.v).forward_bounds
    b1 = _truth(ctx, case, t.q, k1, t.v).forward_bounds
    _same(ctx, what="out after shifting every key by the same w", a=out1, b=out0, tol=b0["out"] + b1["out"])
    if lse0 is None:
        return
    scale = case.scale if case.scale is not None else 1.0 / math.sqrt(t.q.shape[-1])
    shift = scale * (t.q.to(torch.float64) @ reference.expand_kv(w, t.q.shape[1]).transpose(-1, -2))[..., 0]
    expected = lse0.to(torch.float64) + shift
    _same(ctx, what="lse after shifting every key by w (expected lse + scale * q.w)",
          a=lse1.to(torch.float64), b=expected,
          tol=b0["lse"] + b1["lse"] + 4 * unit_roundoff(torch.float64) * expected.abs())


@prop
def value_linearity(ctx: Context, case: AttentionCase) -> None:
    """``out(v A + 1 b^T) = out(v) A + 1 b^T`` for A a permutation with entries +-1 or +-2 and an offset
    b, with v put on a grid where ``v A + b`` is exact in the input dtype."""
    t = case.build(ctx.device)
    v0, delta = _grid(t.v, headroom=4.0)
    d = t.v.shape[-1]
    g = _rng(case, 4)
    perm = torch.randperm(d, generator=g)
    signs = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    powers = torch.pow(2.0, torch.randint(0, 2, (d,), generator=g)).to(torch.float64)
    a = torch.zeros(d, d, dtype=torch.float64)
    a[torch.arange(d), perm] = signs * powers
    a = a.to(t.v.device)
    v0_top = float(v0.to(torch.float64).abs().max()) if v0.numel() else 0.0
    v0_top = v0_top or delta
    b = torch.round(torch.randn(d, generator=g, dtype=torch.float64) * v0_top / delta) * delta
    b = (torch.round(b.clamp(-2 * v0_top, 2 * v0_top) / delta) * delta).to(t.v.device)
    v1_exact = v0.to(torch.float64) @ a + b
    v1 = v1_exact.to(t.v.dtype)
    if not torch.equal(v1.to(torch.float64), v1_exact):
        raise AssertionError("internal: the transformed values are not exact on the chosen grid")
    out0, _ = run_forward(ctx, case, t.q, t.k, v0)
    out1, _ = run_forward(ctx, case, t.q, t.k, v1)
    truth0 = _truth(ctx, case, t.q, t.k, v0)
    ob0, ob1 = truth0.forward_bounds["out"], _truth(ctx, case, t.q, t.k, v1).forward_bounds["out"]
    has = truth0.ref.rows_with_keys[None, None, :, None]
    expected = torch.where(has, out0.to(torch.float64) @ a + b, 0.0)
    _same(ctx, what="out(v A + b) vs out(v) A + b", a=out1.to(torch.float64), b=expected,
          tol=ob1 + ob0 @ a.abs() + 2 * unit_roundoff(torch.float64) * expected.abs())


@prop
def hidden_keys_never_reach_output(ctx: Context, case: AttentionCase) -> None:
    """Under a causal mask (or a sliding window), keys hidden from rows 0..r may hold NaN, inf or huge
    values (v: huge finite values) without changing rows 0..r of out and lse.

    A dot product multiplies each hidden value by p = 0, and 0 * inf = NaN, so a tensor-core kernel
    cannot hide inf/NaN in V at in-bounds positions that share a tile with visible ones; V is poisoned
    with the largest finite values instead. K may hold anything: masking selects, it never multiplies.
    """
    if not case.spec.masked:
        raise NotForThisCase("needs a mask (causal, a window, chunks, other sequences)")
    t = case.build(ctx.device)
    nq, nk = t.q.shape[2], t.k.shape[2]
    g = _rng(case, 5)
    cut = int(torch.randint(0, max(1, nq - 1), (1,), generator=g))  # rows 0..cut are checked
    # Each row sees one range of keys and the ranges' ends never move back: rows 0..cut see keys
    # first[0] .. end[cut] - 1 at most (the keys between are seen unless a range is empty).
    hidden = ~case.spec.rows(nq, nk, rows=(0, min(cut + 1, nq))).any(dim=0)
    if not bool(hidden.any()):
        raise NotForThisCase("every key is visible to the checked rows")
    poison = [float("nan"), float("inf"), float("-inf"), 0.5 * torch.finfo(t.k.dtype).max][
        int(torch.randint(0, 4, (1,), generator=g))]
    # The poisoned inputs in the case's own layout (a fresh build, written in place): a clone would be
    # contiguous where the case's tensors are strided views, and a kernel may round differently then.
    t1 = case.build(ctx.device)
    t1.k[:, :, hidden.to(t1.k.device)] = poison
    t1.v[:, :, hidden.to(t1.v.device)] = 0.5 * torch.finfo(t.v.dtype).max
    out0, lse0 = run_forward(ctx, case, t.q, t.k, t.v)
    out1, lse1 = run_forward(ctx, case, t1.q, t1.k, t1.v)
    rows = slice(0, cut + 1)
    bound = _truth(ctx, case, t.q, t.k, t.v).forward_bounds
    what = f"rows 0..{cut} with {int(hidden.sum())} hidden keys set to k={poison}, v=max/2"
    assert_no_nan(ctx, what=f"out {what}", actual=out1[:, :, rows])
    # A deterministic kernel does the same arithmetic on the rows it checks: identical bits.
    exact = ctx.impl.deterministic
    assert_close(ctx, what=f"out {what}", actual=out1[:, :, rows], expected=out0[:, :, rows],
                 tolerance=bound["out"][:, :, rows], exact=exact)
    if lse0 is not None:
        assert_close(ctx, what=f"lse {what}", actual=lse1[:, :, rows], expected=lse0[:, :, rows],
                     tolerance=bound["lse"][:, :, rows], exact=exact)


@prop
def layouts_agree(ctx: Context, case: AttentionCase) -> None:
    """Contiguous, transposed (``[B, N, H, D]`` storage), padded and packed views (non-zero storage
    offsets into one shared buffer) give the same result; padded and packed views sit in buffers full
    of NaN, so reading past a tensor's end, or ignoring its storage offset, shows up as NaN."""
    results = {}
    for layout in LAYOUTS:
        c = case.replace(layout=layout)
        t = c.build(ctx.device)
        results[layout] = run_forward(ctx, c, t.q, t.k, t.v)
    t = case.replace(layout="contiguous").build(ctx.device)
    bound = _truth(ctx, case, t.q, t.k, t.v).forward_bounds
    out0, lse0 = results["contiguous"]
    for layout in LAYOUTS[1:]:
        out1, lse1 = results[layout]
        assert_no_nan(ctx, what=f"out with {layout} inputs", actual=out1)
        _same(ctx, what=f"out with {layout} vs contiguous inputs", a=out1, b=out0, tol=2 * bound["out"])
        if lse0 is not None:
            _same(ctx, what=f"lse with {layout} vs contiguous inputs", a=lse1, b=lse0, tol=2 * bound["lse"])


@prop
def fully_masked_rows(ctx: Context, case: AttentionCase) -> None:
    """Rows that see no key (causal with Nq > Nk, bottom-right) give out = 0 and lse = -inf exactly (with
    sinks lse = the sink's logit, within the LSE bound)."""
    t = case.build(ctx.device)
    per_row, _ = case.spec.counts(t.q.shape[2], t.k.shape[2])
    empty = per_row == 0
    if not bool(empty.any()):
        raise NotForThisCase("no row is fully masked")
    out, lse = run_forward(ctx, case, t.q, t.k, t.v)
    rows = empty.to(out.device)
    masked_out = out[:, :, rows]
    if bool((masked_out != 0).any()) or bool(torch.isnan(masked_out).any()):
        bad = ((masked_out != 0) | torch.isnan(masked_out)).nonzero()[0].tolist()
        ctx.fail(f"fully masked rows {empty.nonzero().flatten().tolist()} should give out = 0, "
                 f"got {float(masked_out[tuple(bad)]):.6g} at masked-row index {bad}")
    if lse is not None and case.spec.sinks is not None:
        sink = torch.tensor(case.spec.sinks, dtype=torch.float64, device=lse.device)[None, :, None]
        bound = _truth(ctx, case, t.q, t.k, t.v).forward_bounds["lse"][:, :, rows]
        assert_close(ctx, what="lse of rows that see no key (should be the sink's logit)",
                     actual=lse[:, :, rows].to(torch.float64), expected=sink.expand_as(bound), tolerance=bound)
    elif lse is not None:
        masked_lse = lse[:, :, rows]
        if not bool(torch.isneginf(masked_lse).all()):
            bad = (~torch.isneginf(masked_lse)).nonzero()[0].tolist()
            ctx.fail(f"fully masked rows should give lse = -inf, got {float(masked_lse[tuple(bad)])!r} "
                     f"at masked-row index {bad}")
    assert_no_nan(ctx, what="out (rows with keys)", actual=out)


@prop
def gqa_equals_repeated_heads(ctx: Context, case: AttentionCase) -> None:
    """Grouped-query attention equals full attention with each K/V head repeated for its group."""
    if case.heads_q == case.heads_kv:
        raise NotForThisCase("not a grouped-query case")
    t = case.build(ctx.device)
    out_g, lse_g = run_forward(ctx, case, t.q, t.k, t.v)
    k_full, v_full = reference.expand_kv(t.k, case.heads_q), reference.expand_kv(t.v, case.heads_q)
    out_f, lse_f = run_forward(ctx, case, t.q, k_full, v_full)
    bound = _truth(ctx, case, t.q, t.k, t.v).forward_bounds
    _same(ctx, what="out with GQA vs repeated K/V heads", a=out_g, b=out_f, tol=2 * bound["out"])
    if lse_g is not None:
        _same(ctx, what="lse with GQA vs repeated K/V heads", a=lse_g, b=lse_f, tol=2 * bound["lse"])


def _variant_equals_plain(ctx: Context, t, *, plain: AttentionCase, variant: AttentionCase, words: str) -> None:
    """The kernel's ``variant`` path against its ``plain`` one on the same tensors ``t``: each is within its
    own bound of its own reference, and the references differ by what they compute differently (0 where
    they compute the same attention), so out and lse agree within the sum."""
    out0, lse0 = run_forward(ctx, plain, t.q, t.k, t.v)
    out1, lse1 = run_forward(ctx, variant, t.q, t.k, t.v)
    truth0, truth1 = _truth(ctx, plain, t.q, t.k, t.v), _truth(ctx, variant, t.q, t.k, t.v)
    b0, b1 = truth0.forward_bounds, truth1.forward_bounds
    gap_out = (truth1.ref.out - truth0.ref.out).abs()
    _same(ctx, what=f"out with {words} vs without", a=out1, b=out0, tol=b0["out"] + b1["out"] + gap_out)
    if lse0 is not None:
        gap_lse = torch.where(torch.isinf(truth0.ref.lse), 0.0, (truth1.ref.lse - truth0.ref.lse).abs())
        _same(ctx, what=f"lse with {words} vs without", a=lse1, b=lse0, tol=b0["lse"] + b1["lse"] + gap_lse)


@prop
def wide_window_equals_no_window(ctx: Context, case: AttentionCase) -> None:
    """A sliding window at least ``Nq + Nk`` wide on both sides sees every key the unwindowed mask sees:
    out and lse equal those without a window (the kernel's windowed and plain paths agree)."""
    if not ctx.impl.windows:
        raise NotForThisKernel(f"{ctx.impl.name} declares no sliding window")
    wide = case.len_q + case.len_k
    _variant_equals_plain(ctx, case.build(ctx.device), words=f"window ({wide}, {wide})",
                          plain=case.replace(spec=dataclasses.replace(case.spec, window_left=-1, window_right=-1)),
                          variant=case.replace(spec=dataclasses.replace(case.spec, window_left=wide,
                                                                        window_right=wide)))


def _without_modifications(case: AttentionCase) -> AttentionCase:
    return case.replace(spec=dataclasses.replace(case.spec, softcap=None, alibi_slopes=None))


def _largest_row_norm(x: torch.Tensor) -> float:
    return float(x.to(torch.float64).norm(dim=-1).max()) if x.numel() else 0.0


@prop
def huge_softcap_equals_no_softcap(ctx: Context, case: AttentionCase) -> None:
    """A softcap ``c`` far above every score (a power of two at least ``2^20 max |s|``) changes each score
    by ``|s|^3 / (3 c^2)`` at most: the kernel's softcapped path gives the out and lse of its plain path
    (within both bounds and the references' own difference)."""
    if not ctx.impl.softcap:
        raise NotForThisKernel(f"{ctx.impl.name} declares no logit softcap")
    t = case.build(ctx.device)
    scale = case.scale if case.scale is not None else 1.0 / math.sqrt(case.head_dim)
    top = abs(scale) * _largest_row_norm(t.q) * _largest_row_norm(t.k)  # >= every |s| (Cauchy-Schwarz)
    cap = 2.0 ** math.ceil(math.log2(max(top, 1.0) * 2 ** 20))
    _variant_equals_plain(ctx, t, plain=_without_modifications(case), words=f"softcap {cap:g}",
                          variant=case.replace(spec=dataclasses.replace(case.spec, softcap=cap)))


@prop
def zero_alibi_equals_no_alibi(ctx: Context, case: AttentionCase) -> None:
    """ALiBi with every slope 0 adds ``-0 |i - j|``: the kernel's ALiBi path gives the out and lse of its
    plain path (within both bounds)."""
    if not ctx.impl.alibi:
        raise NotForThisKernel(f"{ctx.impl.name} declares no ALiBi")
    zero = dataclasses.replace(case.spec, alibi_slopes=(0.0,) * case.heads_q)
    _variant_equals_plain(ctx, case.build(ctx.device), plain=_without_modifications(case),
                          variant=case.replace(spec=zero), words="ALiBi slopes 0")


@prop
def wide_chunks_equal_no_chunks(ctx: Context, case: AttentionCase) -> None:
    """Chunks at least as long as both lengths put every key in the query's chunk: out and lse equal those
    without chunks (the kernel's chunked and plain paths agree). Not where a query sits before the first
    key (bottom-right with Nq > Nk, non-causal): its chunk holds no key, however long."""
    if not ctx.impl.chunks:
        raise NotForThisKernel(f"{ctx.impl.name} declares no chunked local attention")
    wide = case.len_q + case.len_k + 1
    chunked = case.replace(spec=dataclasses.replace(case.spec, attention_chunk=wide))
    if not torch.equal(case.spec.counts(case.len_q, case.len_k)[0], chunked.spec.counts(case.len_q, case.len_k)[0]):
        raise NotForThisCase("a query positioned before the first key is in a chunk of its own")
    _variant_equals_plain(ctx, case.build(ctx.device), words=f"chunks of {wide}", plain=case, variant=chunked)


@prop
def sinks_rescale_the_output(ctx: Context, case: AttentionCase) -> None:
    """A sink only adds ``exp(t_h)`` to each row's denominator: against the kernel's own results without it,
    ``out_sink = out (1 - P_sink)`` and ``lse_sink = log(exp(lse) + exp(t_h))``, with ``P_sink =
    exp(t_h - lse_sink)`` of the float64 reference (rows that see no key: ``out = 0``, ``lse = t_h``).
    The logits come from the case's seed: all 0, one far above every score, or any in [-8, 8]."""
    if not ctx.impl.sinks:
        raise NotForThisKernel(f"{ctx.impl.name} declares no attention sinks")
    t = case.build(ctx.device)
    g = _rng(case, 7)
    kind = int(torch.randint(0, 3, (1,), generator=g))
    logits = [0.0] * case.heads_q if kind == 0 else [30.0] * case.heads_q if kind == 1 else [
        float(x) for x in (16 * torch.rand(case.heads_q, generator=g) - 8).to(torch.float32)]
    sunk = case.replace(spec=dataclasses.replace(case.spec, sinks=tuple(logits)))
    out0, lse0 = run_forward(ctx, case, t.q, t.k, t.v)
    out1, lse1 = run_forward(ctx, sunk, t.q, t.k, t.v)
    truth0, truth1 = _truth(ctx, case, t.q, t.k, t.v), _truth(ctx, sunk, t.q, t.k, t.v)
    b0, b1 = truth0.forward_bounds, truth1.forward_bounds
    # the weight left to the keys, summed over them (1 - P_sink cancels when the sink dominates)
    keep = truth1.ref.rowwise(lambda c: c.p.sum(dim=-1))[..., None]
    f64 = torch.float64
    expected = out0.to(f64) * keep
    _same(ctx, what=f"out with sinks {tuple(logits)} vs out without times 1 - P_sink", a=out1.to(f64), b=expected,
          tol=b1["out"] + keep * b0["out"] + 4 * unit_roundoff(f64) * expected.abs())
    if lse0 is None or lse1 is None:
        return
    sink = torch.tensor(logits, dtype=f64, device=lse0.device)[None, :, None].expand(lse0.shape)
    expected_lse = torch.logaddexp(lse0.to(f64), sink)
    _same(ctx, what=f"lse with sinks {tuple(logits)} vs logaddexp(lse without, sink)", a=lse1.to(f64),
          b=expected_lse, tol=b1["lse"] + torch.where(torch.isinf(lse0), 0.0, b0["lse"])
          + 4 * unit_roundoff(f64) * expected_lse.abs())


@prop
def split_count_invariance(ctx: Context, case: AttentionCase) -> None:
    """Split-KV's result does not depend on the number of splits: ``num_splits`` S (2 .. 5 from the seed)
    and 1 give the same out and lse, within both bounds (S splits' bound holds the merge's roundings)."""
    if not ctx.impl.splits:
        raise NotForThisKernel(f"{ctx.impl.name} declares no split-KV")
    t = case.build(ctx.device)
    splits = int(torch.randint(2, 6, (1,), generator=_rng(case, 8)))
    split = case.replace(spec=dataclasses.replace(case.spec, num_splits=splits))
    out1, lse1 = run_forward(ctx, case, t.q, t.k, t.v)
    out_s, lse_s = run_forward(ctx, split, t.q, t.k, t.v)
    b1, bs = _truth(ctx, case, t.q, t.k, t.v).forward_bounds, _truth(ctx, split, t.q, t.k, t.v).forward_bounds
    _same(ctx, what=f"out with num_splits={splits} vs 1", a=out_s, b=out1, tol=b1["out"] + bs["out"])
    if lse1 is not None:
        _same(ctx, what=f"lse with num_splits={splits} vs 1", a=lse_s, b=lse1, tol=b1["lse"] + bs["lse"])


@prop
def sequences_equal_each_alone(ctx: Context, case: AttentionCase) -> None:
    """Variable-length sequences are independent: each sequence's rows of out and lse equal the kernel's
    results on that sequence alone (the same convention, one sequence), within both bounds."""
    if not case.spec.varlen:
        raise NotForThisCase("a dense batch")
    t = case.build(ctx.device)
    out, lse = run_forward(ctx, case, t.q, t.k, t.v)
    bound = _truth(ctx, case, t.q, t.k, t.v).forward_bounds
    for s, (q0, q1, k0, k1) in enumerate(case.spec.sequence_spans()):
        if q1 == q0:  # no rows to compare
            continue
        one = case.replace(len_q=q1 - q0, len_k=k1 - k0, spec=case.spec.one_sequence(s))
        qs, ks, vs = t.q[:, :, q0:q1], t.k[:, :, k0:k1], t.v[:, :, k0:k1]
        out_s, lse_s = run_forward(ctx, one, qs, ks, vs)
        alone = _truth(ctx, one, qs, ks, vs).forward_bounds
        what = f"sequence {s} of {case.spec.num_sequences} ({q1 - q0} x {k1 - k0})"
        _same(ctx, what=f"out of {what} in the batch vs alone", a=out[:, :, q0:q1], b=out_s,
              tol=bound["out"][:, :, q0:q1] + alone["out"])
        if lse is not None:
            _same(ctx, what=f"lse of {what} in the batch vs alone", a=lse[:, :, q0:q1], b=lse_s,
                  tol=bound["lse"][:, :, q0:q1] + alone["lse"])


@prop
def paged_equals_contiguous(ctx: Context, case: AttentionCase) -> None:
    """A paged KV cache gives the attention of its keys whatever the block table: another page order (and
    another page size, when the kernel takes any) gives the same out and lse (identical bits for a
    deterministic kernel with the same page size), and so do the same sequences packed or padded when the
    kernel takes them."""
    if case.spec.sequences != "paged":
        raise NotForThisCase("not a paged KV cache")
    t = case.build(ctx.device)
    g = _rng(case, 9)
    spec = case.spec
    sizes = ctx.impl.page_sizes or (1, 2, 3, 16, 256)
    size = sizes[int(torch.randint(len(sizes), (1,), generator=g))]
    others = [dataclasses.replace(spec, page_seed=spec.page_seed + 1 + int(torch.randint(64, (1,), generator=g))),
              dataclasses.replace(spec, page_size=size, page_seed=int(torch.randint(64, (1,), generator=g)))]
    others += [dataclasses.replace(spec, sequences=kind, page_size=None, page_seed=0)
               for kind in ("padded", "packed") if kind in ctx.impl.sequences]
    out0, lse0 = run_forward(ctx, case, t.q, t.k, t.v)
    bound = _truth(ctx, case, t.q, t.k, t.v).forward_bounds
    for other in others:
        out1, lse1 = run_forward(ctx, case.replace(spec=other), t.q, t.k, t.v)
        words = (f"{other.sequences} sequences" if other.sequences != "paged"
                 else f"pages of {other.page_size} in order {other.page_seed}")
        exact = ctx.impl.deterministic and other.page_size == spec.page_size
        what = f"with {words} vs pages of {spec.page_size} in order {spec.page_seed}"
        assert_close(ctx, what=f"out {what}", actual=out1, expected=out0, tolerance=2 * bound["out"], exact=exact)
        if lse0 is not None:
            assert_close(ctx, what=f"lse {what}", actual=lse1, expected=lse0, tolerance=2 * bound["lse"],
                         exact=exact)


# ------------------------------------------------------------------------------------ backward
@prop
def gradients_match_reference(ctx: Context, case: AttentionCase) -> None:
    """dQ, dK, dV (and the sinks' gradient) through autograd vs the float64 reference, both criteria
    (factor 3)."""
    t = case.build(ctx.device)
    got = run_backward(ctx, case, t.q, t.k, t.v, t.dout)
    truth = _truth(ctx, case, t.q, t.k, t.v, dout=t.dout)
    bound = truth.gradient_bounds(ctx.impl, got["out"])
    lse_error = truth.lse_error(got.get("lse"))  # once: every gradient inherits the same stored LSE
    for op in measure.gradients_of(case):
        measure.check(ctx, truth, op, got[op], bound, lse_error=lse_error)


@prop
def delta_matches_reference(ctx: Context, case: AttentionCase) -> None:
    """The kernel's own ``Delta = rowsum(dO * O)`` vs float64, and the identity
    ``rowsum(dO * O) = rowsum(P * dP)`` in the reference."""
    if ctx.impl.backward is None:
        raise NotForThisKernel(f"{ctx.impl.name} does not expose its backward (and Delta)")
    t = case.build(ctx.device)
    out, lse = run_forward(ctx, case, t.q, t.k, t.v)
    _needs_lse(ctx, lse)
    grads = run_direct_backward(ctx, case, t.q, t.k, t.v, out, lse, t.dout)
    delta = grads[3]
    truth = _truth(ctx, case, t.q, t.k, t.v, dout=t.dout)
    ref = truth.ref
    identity = ref.rowwise(lambda c: (c.p * c.dp).sum(dim=-1))
    _same(ctx, what="reference identity rowsum(dO*O) vs rowsum(P*dP)", a=ref.delta, b=identity,
          tol=_delta_identity_tolerance(ref))
    bounds = truth.gradient_bounds(ctx.impl, out)
    measure.check_delta(ctx, truth, out, delta, bounds)
    if case.spec.sinks is not None:  # the declared backward's own dsinks
        measure.check(ctx, truth, "dsinks", grads[4], bounds)


def _delta_identity_tolerance(ref):
    """Float64 roundings of the terms of rowsum(P * dP) and rowsum(dO * O). P itself is only as exact
    as exp(s - lse) lets it be: an absolute error of u * |s| in the exponent, which large logits make
    the leading term. A result below float64's normal range has an absolute error instead (the bounds'
    eta, ``references/bounds.py``: float64's smallest normal, which covers flush-to-zero too), once for
    each of the products and sums behind the terms: 2 D for a dot, and the row's 2 Nk + 2."""
    u = unit_roundoff(torch.float64)
    finite = lambda t: torch.where(torch.isfinite(t), t.abs(), 0.0)  # noqa: E731
    exponent = 1.0 + finite(ref.row_max) + finite(ref.lse)
    return 64 * u * exponent * ds_magnitude_rowsum(ref) + _underflow_allowance(ref)


def _underflow_allowance(ref) -> float:
    """The absolute error of a row's float64 products and sums that fall below the normal range."""
    return torch.finfo(torch.float64).tiny * (2 * ref.out.shape[-1] + 2 * ref.len_k + 2)  # dots over v's head dim


@prop
def gradient_sums(ctx: Context, case: AttentionCase) -> None:
    """``sum_j dK_j = 0``, ``sum_j dV_j = sum_i dO_i`` over rows with a visible key, and in the reference
    ``sum_j dS_ij = 0``; tolerances are the summed elementwise bounds."""
    t = case.build(ctx.device)
    got = run_backward(ctx, case, t.q, t.k, t.v, t.dout)
    truth = _truth(ctx, case, t.q, t.k, t.v, dout=t.dout)
    ref, bound = truth.ref, truth.gradient_bounds(ctx.impl, got["out"])
    f64 = torch.float64
    sum_dk = got["dk"].to(f64).sum(dim=2)
    _same(ctx, what="sum over keys of dK (should be 0)", a=sum_dk, b=torch.zeros_like(sum_dk),
          tol=bound["dk"].sum(dim=2) + ref.dk.abs().sum(dim=2) * 8 * unit_roundoff(f64))
    rows = ref.rows_with_keys[None, None, :, None]
    do_sum = reference.reduce_group(torch.where(rows, t.dout.to(f64), 0.0), case.heads_kv).sum(dim=2)
    _same(ctx, what="sum over keys of dV vs sum over rows with a key of dO", a=got["dv"].to(f64).sum(dim=2), b=do_sum,
          tol=bound["dv"].sum(dim=2) + do_sum.abs() * 8 * unit_roundoff(f64))
    ds_sum = ref.rowwise(lambda c: c.ds.sum(dim=-1))
    _same(ctx, what="reference: sum over keys of dS (should be 0)", a=ds_sum, b=torch.zeros_like(ds_sum),
          tol=_delta_identity_tolerance(ref))


@prop
def hidden_positions_get_zero_gradient(ctx: Context, case: AttentionCase) -> None:
    """Keys no query can see get exactly zero dK and dV; rows that see no key get exactly zero dQ."""
    t = case.build(ctx.device)
    per_row, per_key = case.spec.counts(t.q.shape[2], t.k.shape[2])
    unseen_keys, empty_rows = per_key == 0, per_row == 0
    if not bool(unseen_keys.any()) and not bool(empty_rows.any()):
        raise NotForThisCase("every key is seen and every row sees a key")
    got = run_backward(ctx, case, t.q, t.k, t.v, t.dout)
    for label, grad, mask in (("dK", got["dk"], unseen_keys), ("dV", got["dv"], unseen_keys),
                              ("dQ", got["dq"], empty_rows)):
        sel = grad[:, :, mask.to(grad.device)]
        if sel.numel() and not bool((sel == 0).all()):
            bad = (sel != 0).nonzero()[0].tolist()
            ctx.fail(f"{label} at hidden positions {mask.nonzero().flatten().tolist()} should be exactly 0, "
                     f"got {float(sel[tuple(bad)]):.6g} (index {bad} among them)")


@prop
def gqa_gradients_sum_over_group(ctx: Context, case: AttentionCase) -> None:
    """With GQA, dK and dV equal the group sums of the gradients with repeated K/V heads."""
    if case.heads_q == case.heads_kv:
        raise NotForThisCase("not a grouped-query case")
    t = case.build(ctx.device)
    gqa = run_backward(ctx, case, t.q, t.k, t.v, t.dout)
    k_full, v_full = reference.expand_kv(t.k, case.heads_q), reference.expand_kv(t.v, case.heads_q)
    full = run_backward(ctx, case, t.q, k_full, v_full, t.dout)
    bound = _truth(ctx, case, t.q, t.k, t.v, dout=t.dout).gradient_bounds(ctx.impl, gqa["out"])
    # Each per-head gradient of the repeated-heads run is within its own bound of its own reference,
    # and those references sum over the group to the GQA reference: the tolerance adds both bounds.
    truth_full = _truth(ctx, case, t.q, k_full, v_full, dout=t.dout)
    bound_full = truth_full.gradient_bounds(ctx.impl, gqa["out"])
    f64 = torch.float64
    group_sum = lambda g: reference.reduce_group(g.to(f64), case.heads_kv)  # noqa: E731
    big = torch.finfo(t.q.dtype).max
    for label, op in (("dK", "dk"), ("dV", "dv")):
        got, per_head, per_head_ref = gqa[op], full[op], getattr(truth_full.ref, op)
        tol = bound[op] + group_sum(bound_full[op])
        # A per-head gradient beyond the dtype's range is inf in the repeated-heads run, while the GQA
        # kernel sums the group before rounding and may land back in range (seen on an H200: -42656 vs
        # -inf): no agreement is owed where a group member's true per-head value is that large. An inf
        # whose reference is far inside the range is still compared (and fails).
        beyond = torch.isinf(per_head) & (per_head_ref.abs() > big / 2)
        skip = group_sum(beyond) > 0
        # Compared in the kernel's dtype: a group sum beyond its range is the infinity it rounds to.
        _same(ctx, what=f"{label} with GQA vs group sum of {label} with repeated heads",
              a=torch.where(skip, 0.0, got.to(f64)).to(got.dtype),
              b=torch.where(skip, 0.0, group_sum(per_head)), tol=tol)
    _same(ctx, what="dQ with GQA vs repeated heads", a=gqa["dq"], b=full["dq"], tol=2 * bound["dq"])


GRADCHECK_ATOL = 1e-7


@prop
def gradcheck_float64(ctx: Context, case: AttentionCase) -> None:
    """Finite-difference gradcheck of the float64 kernel on a small case."""
    if case.dtype != "float64":
        raise NotForThisKernel("gradcheck runs on float64 cases")
    if not ctx.impl.autograd:
        raise NotForThisKernel(f"{ctx.impl.name} declares no autograd backward")
    t = case.build(ctx.device)

    def fn(q, k, v):
        with stage("kernel"):
            out, _ = ctx.impl.call(q, k, v, spec=case.spec, scale=case.scale, block_m=case.block_m,
                                   block_n=case.block_n)
        return out

    inputs = tuple(x.detach().requires_grad_(True) for x in (t.q, t.k, t.v))
    # A backward declared not deterministic (atomics) sums in another order each run: its float64 Jacobians
    # differ between runs by reordered roundings, far below the atol at which the analytical Jacobian is
    # compared with the numerical one; the run-to-run difference itself is run_to_run_identical's to measure.
    nondet_tol = 0.0 if ctx.impl.deterministic else GRADCHECK_ATOL
    try:
        torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=GRADCHECK_ATOL, rtol=1e-5, nondet_tol=nondet_tol,
                                 raise_exception=True)
    except GradcheckError as exc:
        ctx.fail(f"finite-difference gradcheck failed: {str(exc).splitlines()[0]}")


# ------------------------------------------------------------------------------------ trust in the suite
RUNS = 3  # calls of run_to_run_identical on the same inputs

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` (contiguous, as integers of the same width)."""
    return t.detach().contiguous().view(_INT_OF_SIZE[t.element_size()])


def _show(t: torch.Tensor, idx: tuple[int, ...]) -> str:
    """One element as a float with its bit pattern (NaN payloads and the sign of zero show)."""
    width = 2 * t.element_size()
    bits = int(_bits(t[idx].reshape(1))[0]) & ((1 << (8 * t.element_size())) - 1)
    return f"{float(t[idx])!r} (0x{bits:0{width}x})"


def _run_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise |a - b| in float64, 0 where the bits are identical (NaN == NaN), inf where only one
    is NaN or they disagree about an infinity."""
    same = (_bits(a) == _bits(b)).view(a.shape)
    return torch.where(same.to(a.device), 0.0, abs_error(a, b))


def _forward_backward(ctx: Context, case: AttentionCase, q, k, v, dout) -> dict[str, torch.Tensor]:
    """One call on fresh leaves: out, lse (when returned) and, with autograd, dq, dk, dv."""
    __tracebackhide__ = True
    if not ctx.impl.autograd:
        out, lse = run_forward(ctx, case, q, k, v)
        return {"out": out, **({"lse": lse} if lse is not None else {})}
    return run_backward(ctx, case, q, k, v, dout)


@prop
def run_to_run_identical(ctx: Context, case: AttentionCase) -> None:
    """The same call repeated (forward, and backward through autograd) gives bitwise identical out, lse,
    dq, dk, dv (NaN equals NaN of the same bits).

    A kernel declared ``deterministic`` fails on any difference. For one declared ``deterministic=False``
    (atomics) the run-to-run max |difference| of each op is recorded in the report (op ``<op> run-to-run``,
    ``error_over_bound`` = the difference over twice the rounding bound, as two results within their
    bounds may differ by that much) and the property is skipped with the measured values in the reason;
    a difference beyond twice the bound still fails: one of the runs is then outside its bound.
    """
    t = case.build(ctx.device)
    runs = [_forward_backward(ctx, case, t.q, t.k, t.v, t.dout) for _ in range(RUNS)]
    first = runs[0]
    # Per op: the elementwise largest |difference| from run 1 over the other runs, and the first run
    # whose bits differ from run 1's (-0.0 vs 0.0 and NaN payloads count: the comparison is bitwise).
    spread: dict[str, torch.Tensor] = {}
    differs_in: dict[str, int] = {}
    for op, a in first.items():
        spread[op] = torch.zeros(a.shape, dtype=torch.float64, device=a.device)
        for i, other in enumerate(runs[1:], start=2):
            if op not in differs_in and not torch.equal(_bits(a), _bits(other[op])):
                differs_in[op] = i
            spread[op] = torch.maximum(spread[op], _run_difference(a, other[op]))
    if not differs_in and ctx.impl.deterministic:
        return
    tolerance = _run_to_run_tolerance(ctx, case, t, first)
    measured = []
    for op, d in spread.items():
        top = float(d.max()) if d.numel() else 0.0
        ratio, _ = max_ratio(d, tolerance[op])
        passed = ratio <= 1.0 and not (ctx.impl.deterministic and op in differs_in)
        ctx.record({"implementation": ctx.impl.name, "property": ctx.prop, "op": f"{op} run-to-run",
                    "case": case.to_dict(), "max_abs": top, "error_over_bound": ratio, "runs": RUNS,
                    "declared_deterministic": ctx.impl.deterministic, "pass": passed})
        measured.append(f"{op} {top:.3g}")
    for op, i in differs_in.items():
        a, b = first[op], runs[i - 1][op]
        bad = (_bits(a) != _bits(b)).view(a.shape)
        idx = tuple(int(j) for j in bad.nonzero()[0])
        where = (f"{int(bad.sum())} of {a.numel()} values differ, first at {list(idx)}: "
                 f"{_show(a, idx)} in run 1 vs {_show(b, idx)} in run {i}; max |difference| over {RUNS} runs "
                 f"{float(spread[op].max()):.3e}")
        if ctx.impl.deterministic:
            ctx.fail(f"{op} differs between run 1 and run {i} of {RUNS} on the same inputs although "
                     f"{ctx.impl.name} declares deterministic=True: {where}")
        ratio, at = max_ratio(spread[op], tolerance[op])
        if ratio > 1.0:
            ctx.fail(f"{op} differs between runs by more than two results within their rounding bounds can: "
                     f"|difference| {float(spread[op][at]):.3e} at {list(at)} is {ratio:.3g}x twice the bound "
                     f"{float(tolerance[op][at]) / 2:.3e} ({where}); not declared deterministic, but one of "
                     "the runs is outside its bound")
    raise NotForThisKernel(f"{ctx.impl.name} is not declared deterministic; measured run-to-run max |difference| "
                        f"over {RUNS} runs: {', '.join(measured)}")


def _run_to_run_tolerance(ctx: Context, case: AttentionCase, t, first) -> dict[str, torch.Tensor]:
    """Twice each op's rounding bound: two results each within its bound differ by at most that."""
    truth = _truth(ctx, case, t.q, t.k, t.v, dout=t.dout if "dq" in first else None)
    bound = dict(truth.forward_bounds)
    if "dq" in first:
        bound.update(truth.gradient_bounds(ctx.impl, first["out"]))
    return {op: (2 * bound[op]).to(first[op].device) for op in first}


# Canaries: quiet NaNs with a payload no arithmetic produces, compared bit for bit (a kernel that writes
# its own NaN, or -0.0 over 0.0, into the padding is caught too).
_CANARY_BITS = {torch.float16: 0x7E5A, torch.bfloat16: 0x7FDA, torch.float32: 0x7FDEAD5A,
                torch.float64: 0x7FFDEAD5A5A5A5A5}


@dataclasses.dataclass
class _Canaried:
    """A view handed to a kernel as an output, inside a larger buffer filled with canaries."""

    label: str
    buffer: torch.Tensor
    view: torch.Tensor
    padding: torch.Tensor       # bool, the buffer's shape: True outside the view
    before: torch.Tensor        # the buffer's bits before the call
    order: tuple[int, ...]      # buffer dim i holds view dim order[i]
    start: tuple[int, ...]      # per view dim: where the view starts in the buffer
    names: tuple[str, ...]      # per view dim, for messages

    def position(self, buffer_index: tuple[int, ...]) -> str:
        """A buffer position in the view's coordinates: ``row 37 of 32 (past the end)``."""
        coords = [0] * len(self.order)
        for i, j in enumerate(self.order):
            coords[j] = buffer_index[i] - self.start[j]
        words = []
        for c, n, name in zip(coords, self.view.shape, self.names):
            if c < 0:
                words.append(f"{name} {c} of {n} (before the start)")
            elif c >= n:
                words.append(f"{name} {c} of {n} (past the end)")
            else:
                words.append(f"{name} {c}")
        return ", ".join(words)


def _canaried(label: str, shape: tuple[int, ...], dtype: torch.dtype, device, g: torch.Generator, *,
              names: tuple[str, ...], order: tuple[int, ...], pads: list[tuple[int, int]]) -> _Canaried:
    """A buffer of canaries with the view of ``shape`` inside it: view dim ``j`` has ``pads[j]``
    elements before and after it, and the buffer stores the view's dims in ``order``."""
    start = tuple(p[0] for p in pads)
    buf_shape = [pads[j][0] + shape[j] + pads[j][1] for j in order]
    ints = _INT_OF_SIZE[torch.empty((), dtype=dtype).element_size()]
    buffer = torch.full(buf_shape, _CANARY_BITS[dtype], dtype=ints, device=device).view(dtype)
    inside = tuple(slice(pads[j][0], pads[j][0] + shape[j]) for j in order)
    inverse = tuple(order.index(j) for j in range(len(order)))
    view = buffer[inside].permute(inverse)
    padding = torch.ones(buf_shape, dtype=torch.bool, device=device)
    padding[inside] = False
    return _Canaried(label, buffer, view, padding, _bits(buffer).clone(), order, start, names)


def _check_padding(ctx: Context, c: _Canaried) -> None:
    __tracebackhide__ = True
    changed = (_bits(c.buffer) != c.before) & c.padding
    if bool(changed.any()):
        idx = tuple(int(i) for i in changed.nonzero()[0])
        ctx.fail(f"{c.label}: the kernel wrote outside the given {c.label}= view: {int(changed.sum())} padding "
                 f"elements of the buffer changed, first at {c.position(idx)}: the canary "
                 f"{_show(c.before.view(c.buffer.dtype), idx)} became {_show(c.buffer, idx)} "
                 f"(view {tuple(c.view.shape)} with strides {c.view.stride()} in a buffer {tuple(c.buffer.shape)})")


def _check_written(ctx: Context, c: _Canaried, *, returned, normal, tolerance) -> None:
    """(b) the returned tensor is the view, or holds its values; (c) the view holds a normal call's
    result: bitwise for a deterministic kernel, else within ``tolerance``."""
    __tracebackhide__ = True
    check_tensor(ctx, label=c.label, actual=returned, shape=tuple(c.view.shape), dtype=c.view.dtype,
                 device=c.view.device)
    view = c.view.detach()
    same_memory = returned.data_ptr() == view.data_ptr() and returned.stride() == view.stride()
    canary = _CANARY_BITS[view.dtype]
    unwritten = (_bits(view) == canary) & (_bits(normal) != canary)
    if bool(unwritten.any()):
        idx = tuple(int(i) for i in unwritten.view(view.shape).nonzero()[0])
        ctx.fail(f"{c.label}: {int(unwritten.sum())} of {view.numel()} elements of the given {c.label}= view were "
                 f"never written (they still hold the canary), first at {list(idx)}; a normal call gives "
                 f"{_show(normal, idx)} there" + ("" if same_memory else f" (and the forward returned another "
                                                  f"tensor than the {c.label}= view)"))
    if not same_memory:
        differ = (_bits(returned) != _bits(view)).view(view.shape)
        if bool(differ.any()):
            idx = tuple(int(i) for i in differ.nonzero()[0])
            ctx.fail(f"{c.label}: the returned {c.label} is not the given {c.label}= view and holds other values: "
                     f"at {list(idx)} it returned {_show(returned.detach(), idx)}, the view holds {_show(view, idx)}")
    if ctx.impl.deterministic:
        differ = (_bits(view) != _bits(normal)).view(view.shape)
        if bool(differ.any()):
            idx = tuple(int(i) for i in differ.nonzero()[0])
            ctx.fail(f"{c.label} written into the given buffer differs from a normal call: {int(differ.sum())} of "
                     f"{view.numel()} values, first at {list(idx)}: {_show(view, idx)} vs {_show(normal, idx)} "
                     f"(should be identical: {ctx.impl.name} declares deterministic=True)")
    else:
        _same(ctx, what=f"{c.label} written into the given buffer vs a normal call", a=view, b=normal,
              tol=tolerance())


@prop
def outputs_stay_in_bounds(ctx: Context, case: AttentionCase) -> None:
    """A forward given ``out=``/``lse=`` views into larger buffers of NaN canaries writes its results
    there and nowhere else: every padding element (rows before and after, head-dim columns, other heads,
    in ``[B, H, N, D]`` or transposed ``[B, N, H, D]`` storage) is bitwise unchanged afterwards, the
    returned tensors are the views (or hold the same values), and the values equal a normal call's."""
    if not ctx.impl.out_buffers:
        raise NotForThisKernel(f"{ctx.impl.name} declares no out_buffers")
    t = case.build(ctx.device)
    out0, lse0 = run_forward(ctx, case, t.q, t.k, t.v)
    g = _rng(case, 6)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    transposed = bool(draw(0, 1))  # storage [B, N, H, D]: rows are strided by the heads
    rows, heads = (draw(1, 3), draw(1, 3)), (draw(0, 1), draw(0, 1))
    bufs = [_canaried("out", (*t.q.shape[:3], t.v.shape[-1]), t.q.dtype, ctx.device, g,
                      names=("batch", "head", "row", "head-dim column"),
                      order=(0, 2, 1, 3) if transposed else (0, 1, 2, 3),
                      pads=[(0, draw(0, 1)), heads, rows, (draw(0, 2), draw(1, 5))])]
    if lse0 is not None:
        bufs.append(_canaried("lse", tuple(t.q.shape[:3]), lse0.dtype, ctx.device, g,
                              names=("batch", "head", "row"), order=(0, 2, 1) if transposed else (0, 1, 2),
                              pads=[(0, draw(0, 1)), heads, (draw(1, 3), draw(1, 3))]))
    given = {c.label: c.view for c in bufs}
    try:
        with stage("kernel"):
            result = ctx.impl.call(t.q, t.k, t.v, spec=case.spec, scale=case.scale, block_m=case.block_m,
                                   block_n=case.block_n, **given)
    except Exception as exc:  # noqa: BLE001 - any refusal of a valid strided view is the finding
        views = "; ".join(f"{c.label} {tuple(c.view.shape)} strides {c.view.stride()}" for c in bufs)
        ctx.fail(f"the forward raised {type(exc).__name__} when given out=/lse= views ({views}): {exc}")
    for c in bufs:
        _check_padding(ctx, c)
    truth = _truth(ctx, case, t.q, t.k, t.v)  # computes its bounds only when asked: when not bitwise
    _check_written(ctx, bufs[0], returned=result[0], normal=out0, tolerance=lambda: 2 * truth.forward_bounds["out"])
    if lse0 is not None:
        if result[1] is None:
            ctx.fail("the forward returned no lse when given an lse= buffer")
        _check_written(ctx, bufs[1], returned=result[1], normal=lse0, tolerance=lambda: 2 * truth.forward_bounds["lse"])


_INPUTS = ("q", "k", "v", "dout")


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """Every byte of ``storage`` (not only what one view of it shows), as a flat uint8 tensor on that memory."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclasses.dataclass
class _Held:
    """One storage behind the caller's inputs and its bytes before the kernel ran."""

    storage: torch.UntypedStorage
    views: list[tuple[str, torch.Tensor]]  # the inputs viewing it, in q, k, v, dout order
    before: torch.Tensor                   # uint8, a copy of every byte


def _layout(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.untyped_storage().data_ptr()


def _hold(named: dict[str, torch.Tensor]) -> list[_Held]:
    """A bitwise copy of each distinct storage behind the ``named`` tensors (one for a packed buffer)."""
    held: dict[int, _Held] = {}
    for name, x in named.items():
        storage = x.untyped_storage()
        if storage.nbytes() == 0:
            continue
        if storage.data_ptr() not in held:
            held[storage.data_ptr()] = _Held(storage, [], _storage_bytes(storage).clone())
        held[storage.data_ptr()].views.append((name, x))
    return list(held.values())


def _through(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``flat`` (one entry per element of ``x``'s dtype over its whole storage) seen through ``x``'s view."""
    return flat.as_strided(x.shape, x.stride(), x.storage_offset())


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _around(element: int, views: list[tuple[str, torch.Tensor]]) -> tuple[str, str]:
    """The input whose view is nearest to storage ``element`` (which none of them holds), and where it is."""
    spans = [(name, x.storage_offset(), x.storage_offset() + sum((n - 1) * s for n, s in zip(x.shape, x.stride())))
             for name, x in views if x.numel()]
    for name, lo, hi in spans:
        if lo <= element <= hi:
            return name, (f"within the span of the {name} view (storage elements {lo}..{hi}) but not one of its "
                          "elements: padding between its rows or head-dim columns")
    past = [(element - hi, name, hi) for name, lo, hi in spans if hi < element]
    if past:
        d, name, hi = min(past)
        return name, f"{_count(d, 'element')} past the last element of the {name} view (storage element {hi})"
    ahead = [(lo - element, name, lo) for name, lo, hi in spans if lo > element]
    if ahead:
        d, name, lo = min(ahead)
        return name, f"{_count(d, 'element')} before the first element of the {name} view (storage element {lo})"
    name = views[0][0]
    return name, f"in a storage where every view ({', '.join(n for n, _ in views)}) is empty"


def _changes(held: list[_Held]) -> list[str]:
    """What changed in the held storages since they were copied: per input, inside its view, and outside
    every view (padding, a packed buffer's gaps), each with how much and where first."""
    lines = []
    for h in held:
        now = _storage_bytes(h.storage)
        if now.numel() != h.before.numel():
            lines.append(f"the storage of {', '.join(n for n, _ in h.views)} was resized from "
                         f"{_count(h.before.numel(), 'byte')} to {now.numel()}")
            continue
        changed = now != h.before
        if not bool(changed.any()):
            continue
        covered = torch.zeros_like(changed)  # the bytes some input's view holds
        for name, x in h.views:
            size = x.element_size()
            whole = changed.numel() // size * size  # the bytes of the storage's whole elements
            mine = torch.zeros(whole // size, dtype=torch.bool, device=changed.device)
            _through(mine, x).fill_(True)
            mine = torch.cat([mine.repeat_interleave(size), mine.new_zeros(changed.numel() - whole)])
            covered |= mine
            inside = _through(changed[:whole].view(-1, size).any(dim=1), x)
            count = int(inside.sum())
            if count:
                idx = tuple(int(i) for i in inside.nonzero()[0])
                old, new = (_through(b[:whole].view(x.dtype), x) for b in (h.before, now))
                lines.append(f"{name} changed inside its view: {_count(count, 'element')} of {x.numel()} "
                             f"({_count(int((changed & mine).sum()), 'byte')} changed), first at {list(idx)}: "
                             f"{_show(old, idx)} became {_show(new, idx)}")
        outside = changed & ~covered
        if bool(outside.any()):
            x = h.views[0][1]  # the inputs sharing one storage share its dtype too
            size = x.element_size()
            whole = changed.numel() // size * size
            element = int(outside.nonzero()[0, 0]) // size
            name, where = _around(element, h.views)
            shared = f" (the buffer {', '.join(n for n, _ in h.views)} share)" if len(h.views) > 1 else ""
            old, new = (b[:whole].view(x.dtype) for b in (h.before, now))
            value = f": {_show(old, (element,))} became {_show(new, (element,))}" if element < old.numel() else ""
            lines.append(f"{name} changed outside its view: "
                         f"{_count(int(outside[:whole].view(-1, size).any(dim=1).sum()), 'element')} "
                         f"({_count(int(outside.sum()), 'byte')} changed) of the memory around the {name} view"
                         f"{shared} that no input's view holds (padding or neighbouring memory the caller owns), "
                         f"first at storage element {element}, {where}{value}")
    return lines


class _Watch:
    """What the kernel is given, held bitwise before it runs: the case's ``q, k, v, dout`` and, in a
    variable-length convention, the tensors laid out for the kernel (with their NaN padding, unused page
    slots and pages) and the convention's index tensors (``cu_seqlens_q``, ``seqlens_k``, ``block_table``)."""

    def __init__(self, t):
        self.named = {name: getattr(t, name) for name in _INPUTS}
        self.held = _hold(self.named)
        self.layouts = {name: _layout(x) for name, x in self.named.items()}
        self.handed: dict[str, torch.Tensor] = {}
        self.handed_held: list[_Held] = []

    def hand(self, given: dict) -> None:
        """``Implementation.call``'s ``handed``: hold the tensors of a variable-length convention (a dense
        call is handed the case's own tensors, held already)."""
        held = {h.storage.data_ptr() for h in self.held}
        self.handed = {f"{name} as the kernel takes it" if name in "qkv" else name: x for name, x in given.items()
                       if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in held}
        self.handed_held = _hold(self.handed)

    def check(self, ctx: Context, when: str) -> None:
        __tracebackhide__ = True
        lines = _changes(self.held) + _changes(self.handed_held)
        for name, x in self.named.items():
            if _layout(x) != self.layouts[name]:
                lines.append(f"{name} itself was changed: shape, strides, storage offset, dtype and storage were "
                             f"{self.layouts[name]}, are {_layout(x)}")
        if lines:
            given = ", ".join(self.handed) or "q, k, v and dout"
            ctx.fail(f"the kernel modified what it was given {when}; it may read {given} but never write them or "
                     "the memory around their views:\n  " + "\n  ".join(lines))


@prop
def inputs_untouched(ctx: Context, case: AttentionCase) -> None:
    """The forward on the caller's ``q, k, v``, and with autograd the forward and ``out.backward(dout)``
    on leaves that share their memory, leave every byte of what the kernel is given as it was: the views
    (q, k, v, dout), the NaN padding around them and the gaps of a packed buffer, and in a variable-length
    convention the tensors laid out for it (a paged cache's unused slots and pages included) and its
    ``cu_seqlens``, ``seqlens`` and ``block_table``, compared bitwise (NaN equals itself), and the inputs'
    shapes, strides and offsets."""
    t = case.build(ctx.device)
    watch = _Watch(t)
    run_forward(ctx, case, t.q, t.k, t.v, handed=watch.hand)
    watch.check(ctx, "in its forward")
    if ctx.impl.autograd:
        # Fresh leaves: x.detach() shares x's storage.
        run_backward(ctx, case, t.q, t.k, t.v, t.dout, handed=watch.hand)
        watch.check(ctx, "in its forward and backward through autograd (out.backward(dout) on leaves sharing "
                         "the inputs' memory)")


# ------------------------------------------------------------------------------------ softmax
SOFTMAX_PROPERTIES: dict[str, Callable[[Context, SoftmaxCase], None]] = {}

MPMATH_MAX_ELEMENTS = 64  # rows x n at or below this are checked against 50-digit mpmath


@prop
def softmax_matches_reference(ctx: Context, case: SoftmaxCase) -> None:
    """Softmax and LSE of an online-softmax kernel vs float64 (vs 50-digit mpmath for small rows)."""
    x = case.build(ctx.device)
    kwargs = {"block_n": case.block_n} if case.block_n is not None else {}
    with stage("kernel"):
        y, lse = ctx.impl.forward(x, **kwargs)
    check_tensor(ctx, label="softmax", actual=y, shape=tuple(x.shape), dtype=x.dtype, device=x.device,
                 inputs=(x,))
    check_tensor(ctx, label="lse", actual=lse, shape=tuple(x.shape[:1]), dtype=lse_dtype(x.dtype),
                 device=x.device, inputs=(x,))
    with stage("reference"):
        if x.numel() <= MPMATH_MAX_ELEMENTS:
            rows = [mp.softmax(r) for r in x.tolist()]
            expected_y = torch.tensor(rows, dtype=torch.float64, device=x.device)
            expected_lse = torch.tensor([mp.logsumexp(r) for r in x.tolist()], dtype=torch.float64,
                                        device=x.device)
        else:
            expected_y, expected_lse = reference.softmax(x), reference.logsumexp(x)
    with stage("bounds"):
        y_bound, lse_bound = softmax_bounds(x, dtype=x.dtype)
    for label, got, exp, bnd in (("softmax", y, expected_y, y_bound), ("lse", lse, expected_lse, lse_bound)):
        err = abs_error(got, exp)
        ratio, at = max_ratio(err, bnd)
        ctx.record({"implementation": ctx.impl.name, "property": ctx.prop, "op": label,
                    "case": dataclasses.asdict(case), "max_abs": float(err.max()),
                    "error_over_bound": ratio, "pass": ratio <= 1.0})
        if ratio > 1.0:
            ctx.fail(f"{label} error {float(err[at]):.3e} at {list(at)} (got {float(got[at]):.9g}, expected "
                     f"{float(exp[at]):.9g}) exceeds the rounding bound {float(bnd[at]):.3e} by {ratio:.3g}x")


SOFTMAX_PROPERTIES["softmax_matches_reference"] = PROPERTIES.pop("softmax_matches_reference")
