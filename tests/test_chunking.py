"""Row chunking of the suite's own work (references/attention.py, "Memory model").

The float64 reference, the eager baseline, the rounding bounds and the criteria's magnitudes run in
chunks of query rows. Row-wise results do not depend on the chunking beyond float64 rounding (a
matrix product over a different number of rows may take another kernel); the dK and dV sums change
their summation order only. These tests force tiny chunks (1 to 3 rows) and compare with one chunk
for the whole problem, on causal, grouped-query, Nq != Nk (both ways), fully masked rows and Nk = 0;
they check the per-row counts that replace the Nq x Nk mask, that a Reference holds no Nq x Nk
tensor, and the peak-memory estimate (references.attention.peak_bytes) against the measured peak.

Tolerances: two float64 computations of the same value, each within ``(n + D + 4) u M`` of the exact
one (tests/test_references.py's first-order analysis, ``M`` the value's magnitude computed on
absolute values); SLACK covers the dropped second-order terms.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from references import attention as ra
from references import baseline, bounds, criteria
from references import mp as ref_mp
from references.spec import ALIGNMENTS, AttentionSpec
from tests.test_references import kappa, magnitudes

F64 = torch.float64
U64 = 2.0 ** -53
SLACK = 4.0
WHOLE = 10 ** 9  # rows per chunk: the whole problem in one chunk
SETTINGS = dict(max_examples=40, deadline=None)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@st.composite
def chunk_cases(draw, *, max_len: int = 9, max_dim: int = 6):
    """Return a strategy for small cases (dict) with a forced chunk size of 1 to 3 rows. Nk = 0 and
    Nq > Nk with a causal mask (fully masked rows) are drawn often."""
    heads_kv = draw(st.integers(1, 2), label="heads_kv")
    return dict(
        batch=draw(st.integers(1, 2), label="batch"),
        heads_kv=heads_kv,
        heads_q=heads_kv * draw(st.integers(1, 3), label="group"),
        len_q=draw(st.integers(1, max_len), label="len_q"),
        len_k=draw(st.integers(0, max_len), label="len_k"),
        head_dim=draw(st.integers(1, max_dim), label="head_dim"),
        causal=draw(st.booleans(), label="causal"),
        alignment=draw(st.sampled_from(ALIGNMENTS), label="alignment"),
        window=tuple(draw(st.one_of(st.just(-1), st.integers(0, 4)), label=f"window_{side}") for side in "lr"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        rows=draw(st.integers(1, 3), label="rows"),
        seed=draw(st.integers(0, 2 ** 31 - 1), label="seed"),
    )


def _spec(case) -> AttentionSpec:
    return AttentionSpec(case["causal"], case["alignment"], *case["window"])


def _inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, hq, hkv, nq, nk, d = (case[x] for x in ("batch", "heads_q", "heads_kv", "len_q", "len_k", "head_dim"))
    q, dout = (torch.randn(b, hq, nq, d, generator=g, dtype=F64) for _ in range(2))
    k = torch.randn(b, hkv, nk, d, generator=g, dtype=F64)
    v = torch.randn(b, hkv, nk, d, generator=g, dtype=F64) + 2.0  # an offset: centred terms matter
    return tuple(t.to(case["dtype"]) for t in (q, k, v, dout))


def _assert_close(name, a, b, tol, case):
    __tracebackhide__ = True
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)} [{case}]"
    a, b = a.to(F64), b.to(F64)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    err = torch.where(same, 0.0, (a - b).abs())
    err = torch.where(torch.isnan(err), math.inf, err)
    bad = err > tol
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{name}: chunked {float(b[idx])!r} vs whole {float(a[idx])!r} at {idx}: "
                             f"|diff| {float(err[idx]):.3e} > {float(torch.as_tensor(tol).expand_as(err)[idx]):.3e} "
                             f"[{case}]")


def _both(case, fn):
    """``fn()`` with the whole problem in one chunk and with ``case['rows']`` rows per chunk."""
    with ra.forced_chunk_rows(WHOLE):
        whole = fn()
    with ra.forced_chunk_rows(case["rows"]):
        chunked = fn()
    return whole, chunked


# --- the float64 reference -----------------------------------------------------------------------------

@settings(**SETTINGS)
@given(case=chunk_cases())
def test_chunked_reference_equals_one_chunk(case):
    q, k, v, dout = _inputs(case)
    kw = dict(spec=_spec(case))
    whole, chunked = _both(case, lambda: ra.attention(q, k, v, dout=dout, **kw))
    scale = whole.scale
    kap = kappa(q, k, scale=scale, len_k=k.shape[2])
    mags = magnitudes(whole, q, k, v, dout, scale=scale)
    n = k.shape[2] + q.shape[2] + q.shape[-1] + 4
    for name in ("out", "lse", "delta", "dq", "dk", "dv"):
        tol = 2 * SLACK * (kap + n) * U64 * mags[name]
        _assert_close(name, getattr(whole, name), getattr(chunked, name), tol, case)
    _assert_close("row_max", whole.row_max, chunked.row_max, 2 * SLACK * kap * U64, case)
    # Score-level quantities: the chunks put together equal the dense matrices.
    dense = whole.dense()
    # dP = dO V^T is a product at every (row, key some row sees), visible to that row or not: its magnitude
    # is |dO| |V|^T, not P's (a one-row chunk's matrix product may add in another order, 1 ulp apart).
    dp_mag = dout.to(F64).abs() @ torch.where(whole.keys_seen[:, None], whole.v_expanded.abs(), 0.0).transpose(-1, -2)
    for name in ("scores", "p", "dp", "ds"):
        with ra.forced_chunk_rows(case["rows"]):
            parts = chunked.rowwise(lambda c, name=name: getattr(c, name))
        mag = {"scores": 1 + dense.scores.abs().nan_to_num(posinf=0, neginf=0), "dp": dp_mag}.get(
            name, mags["p"] * (1 + mags["delta"][..., None]))
        tol = 2 * SLACK * (kap + n) * U64 * mag
        _assert_close(name, getattr(dense, name), parts, tol * (1 + dout.abs().amax().to(F64)), case)


def test_reference_holds_no_score_matrix():
    b, hq, hkv, nq, nk, d = 1, 4, 2, 40, 50, 3  # Nq * Nk is far above (Nq + Nk) * D
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(b, hq, nq, d, generator=g), torch.randn(b, hq, nq, d, generator=g)
    k, v = torch.randn(b, hkv, nk, d, generator=g), torch.randn(b, hkv, nk, d, generator=g)
    with ra.forced_chunk_rows(7):
        ref = ra.attention(q, k, v, spec=AttentionSpec(causal=True), dout=dout)
    held = {name: value for name, value in vars(ref).items() if isinstance(value, torch.Tensor)}
    assert set(held) >= {"out", "lse", "row_max", "q64", "k_expanded", "v_expanded", "dout", "delta", "dq", "dk", "dv"}
    for name, t in held.items():
        assert t.numel() <= b * hq * max(nq, nk) * d, f"Reference.{name} has shape {tuple(t.shape)}"
    assert ref._single is None  # several chunks: none is kept


# --- baseline, bounds, criteria -------------------------------------------------------------------------

@settings(**SETTINGS)
@given(case=chunk_cases())
def test_chunked_bounds_equal_one_chunk(case):
    q, k, v, dout = _inputs(case)
    kw = dict(spec=_spec(case))
    dtype = q.dtype
    out = ra.attention(q, k, v, **kw).out.to(dtype)  # a kernel output within its rounding

    def run():
        ref = ra.attention(q, k, v, dout=dout, **kw)
        fwd = bounds.forward_bounds(ref, q, k, v, dtype=dtype)
        bwd = bounds.backward_bounds(ref, q, k, v, dtype=dtype, out=out)
        eager = bounds.backward_bounds(ref, q, k, v, dtype=dtype, out=out,
                                       model=bounds.kernel_model(dtype, autograd_eager=True))
        return ref, fwd + bwd + eager
    (ref, whole), (_, chunked) = _both(case, run)
    # The bounds are float64 sums of the same non-negative terms; the Delta bound holds the measured
    # |sum dO (O - ref.out)|, which moves with ref.out's float64 rounding: u D |dO| |O| per row.
    top = max(1.0, float(dout.abs().amax()) if dout.numel() else 0.0) * (
        1.0 + (float(ref.out.abs().amax()) if ref.out.numel() else 0.0))
    names = ("out", "lse", "dq", "dk", "dv", "delta", "eager dq", "eager dk", "eager dv", "eager delta")
    for name, a, b in zip(names, whole, chunked):
        tol = 1e-9 * a.abs() + 64 * U64 * (q.shape[-1] + k.shape[2] + 4) * top
        _assert_close(f"{name} bound", a, b, tol, case)


@settings(**SETTINGS)
@given(case=chunk_cases())
def test_chunked_criteria_magnitudes_equal_one_chunk(case):
    q, k, v, dout = _inputs(case)
    kw = dict(spec=_spec(case))
    ref = ra.attention(q, k, v, dout=dout, **kw)

    def run():
        mags = [criteria.magnitudes(op, ref) for op in criteria.FACTOR]
        return [(m.summands, m.scores, m.lse) for m in mags], criteria.ds_magnitude_rowsum(ref)
    (whole, rows_whole), (chunked, rows_chunked) = _both(case, run)
    for op, a, b in zip(criteria.FACTOR, whole, chunked):
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-12 * abs(x), (op, x, y, case)
    _assert_close("rowsum of dS magnitude", rows_whole, rows_chunked, 1e-12 * rows_whole.abs(), case)


@settings(**SETTINGS)
@given(case=chunk_cases())
def test_chunked_baseline_equals_one_chunk(case):
    """Row-wise results at the baseline's precision; dK and dV in another float32 summation order."""
    q, k, v, dout = _inputs(case)
    kw = dict(spec=_spec(case))
    whole, chunked = _both(case, lambda: baseline.forward(q, k, v, **kw) + baseline.backward(q, k, v, dout, **kw))
    ref = ra.attention(q, k, v, dout=dout, **kw)
    mags = magnitudes(ref, q, k, v, dout, scale=ref.scale)
    u_acc = 2.0 ** -53 if q.dtype == F64 else 2.0 ** -24
    u_in = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24, F64: U64}[q.dtype]
    kap = kappa(q, k, scale=ref.scale, len_k=k.shape[2])
    n = k.shape[2] + q.shape[2] + q.shape[-1] + 4
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "delta"), whole, chunked):
        # Each within its own eager error of the exact value: casts of P and dS to the input dtype
        # (u_in), a rounding of the result (u_in), and the accumulator's sums (n + kappa roundings).
        mag = mags[name]
        tol = 2 * SLACK * ((kap + n) * u_acc + (0 if name in ("lse", "delta") else 3 * u_in)) * mag
        _assert_close(f"baseline {name}", a, b, tol + 2 * torch.finfo(a.dtype).tiny, case)
    # Not bitwise: the float32 scores come from a matrix product whose CPU kernel (and so its summation
    # order) depends on the chunk's row count (rows=1 is a matrix-vector product), so a row's LSE may
    # differ in its last bit between chunkings (len_q=8, len_k=9, D=6, float16, one-row chunks).


def test_mp_reference_holds_probabilities_only_when_asked():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 3, 2, generator=g, dtype=F64) for _ in range(3))
    lean = ref_mp.attention(q, k, v, spec=AttentionSpec(causal=True))
    full = ref_mp.attention(q, k, v, spec=AttentionSpec(causal=True), probabilities=True)
    assert lean.p is None and full.p.shape == (1, 1, 3, 3)
    assert torch.equal(lean.out, full.out) and torch.equal(lean.lse, full.lse)


# --- chunk size and the memory estimate ----------------------------------------------------------------

def test_rows_per_chunk_fits_the_budget():
    for len_k, d, heads in ((1, 1, 1), (100, 64, 8), (4096, 128, 32), (0, 8, 2)):
        for budget in (1, 2 ** 16, 2 ** 24, ra.DEFAULT_BUDGET_BYTES):
            rows = ra.rows_per_chunk(len_k, d, heads, budget=budget)
            per_row = 8 * heads * (ra.SCORE_MATRICES * max(1, len_k) + max(1, d))
            assert rows >= 1
            assert rows == 1 or rows * per_row <= budget < (rows + 1) * per_row, (len_k, d, heads, budget, rows)
    with ra.forced_chunk_rows(3):
        assert ra.rows_per_chunk(4096, 128, 32) == 3
        assert ra.row_chunks(8, 5, 2, 1) == [(0, 3), (3, 6), (6, 8)]
    assert ra.row_chunks(0, 5, 2, 1) == []
    with pytest.raises(ValueError, match="budget="):
        ra.rows_per_chunk(10, 4, 1, budget=0)
    with pytest.raises(ValueError, match="len_k="):
        ra.rows_per_chunk(-1, 4, 1)
    with pytest.raises(ValueError, match="rows="):
        with ra.forced_chunk_rows(0):
            pass


def test_chunk_rows_from_the_environment(monkeypatch):
    monkeypatch.setenv(ra.CHUNK_ROWS_ENV, "2")
    assert ra.rows_per_chunk(100, 4, 1) == 2
    monkeypatch.setenv(ra.CHUNK_ROWS_ENV, "zero")
    with pytest.raises(ValueError, match=ra.CHUNK_ROWS_ENV):
        ra.rows_per_chunk(100, 4, 1)


def test_peak_bytes_never_decreases_when_a_size_grows():
    sizes = dict(batch=1, heads_q=2, heads_kv=1, len_q=64, len_k=64, head_dim=16)
    for budget in (2 ** 16, 2 ** 20, None):
        base = ra.peak_bytes(**sizes, budget=budget)
        assert base > 0
        for name in sizes:
            for factor in (2, 3, 8, 64):
                grown = dict(sizes, **{name: sizes[name] * factor})
                if name == "heads_kv" and grown["heads_q"] % grown["heads_kv"]:
                    continue
                if name == "heads_q":
                    grown["heads_kv"] = 1
                assert ra.peak_bytes(**grown, budget=budget) >= base, (name, factor, budget)
        for len_k in range(1, 300, 7):  # rows per chunk step down as Nk grows: no dip
            assert ra.peak_bytes(**dict(sizes, len_k=len_k + 1), budget=budget) >= ra.peak_bytes(
                **dict(sizes, len_k=len_k), budget=budget)
    with pytest.raises(ValueError, match="heads_q=3"):
        ra.peak_bytes(1, 3, 2, 8, 8, 4)
    with pytest.raises(ValueError, match="len_q=-1"):
        ra.peak_bytes(1, 2, 1, -1, 8, 4)


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages the ops inside the block allocate, alive at once (CPU: torch keeps
    no allocator statistics there). A storage counts until the last tensor that an op returned on it
    is gone."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors alive]

    def _release(self, key):
        entry = self.storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.storages[key]
            self.live -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.storages:
                self.storages[key][1] += 1
            else:
                self.storages[key] = [storage.nbytes(), 1]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key)
        return out


def _suite_work(q, k, v, dout):
    """What one example of the suite computes besides the kernel (verify/properties.py)."""
    ref = ra.attention(q, k, v, spec=AttentionSpec(causal=True), dout=dout)
    out, _ = baseline.forward(q, k, v, spec=AttentionSpec(causal=True))
    baseline.backward(q, k, v, dout, spec=AttentionSpec(causal=True), out=out)
    bounds.forward_bounds(ref, q, k, v, dtype=q.dtype)
    for eager in (False, True):
        bounds.backward_bounds(ref, q, k, v, dtype=q.dtype, out=out,
                               model=bounds.kernel_model(q.dtype, autograd_eager=eager))
    for op in criteria.FACTOR:
        criteria.magnitudes(op, ref)
    criteria.ds_magnitude_rowsum(ref)


def _measured_peak(shape, *, budget: int, device: str = "cpu") -> int:
    b, hq, hkv, nq, nk, d = shape
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, hq, nq, d, generator=g).half().to(device) for _ in range(2))
    k, v = (torch.randn(b, hkv, nk, d, generator=g).half().to(device) for _ in range(2))
    saved, ra.DEFAULT_BUDGET_BYTES = ra.DEFAULT_BUDGET_BYTES, budget
    try:
        if device == "cuda":
            _suite_work(q, k, v, dout)  # once first: cuBLAS workspaces and the like stay allocated
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            _suite_work(q, k, v, dout)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - start
        with _LiveBytes() as live:
            _suite_work(q, k, v, dout)
        return live.peak
    finally:
        ra.DEFAULT_BUDGET_BYTES = saved


# (B, Hq, Hkv, Nq, Nk, D) and a budget: one chunk; many chunks; Nq >> Nk; Nk >> Nq; GQA.
PEAK_CASES = [
    ((1, 2, 1, 48, 48, 8), ra.DEFAULT_BUDGET_BYTES),
    ((1, 2, 1, 160, 160, 8), 2 ** 18),
    ((1, 1, 1, 400, 24, 32), 2 ** 16),
    ((1, 1, 1, 16, 600, 32), 2 ** 18),
    ((2, 4, 2, 40, 90, 4), 2 ** 17),
]


@pytest.mark.parametrize("shape,budget", PEAK_CASES)
def test_peak_bytes_bounds_measured_peak(shape, budget):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    measured = _measured_peak(shape, budget=budget, device=device)
    estimate = ra.peak_bytes(*shape, budget=budget)
    assert measured <= estimate, f"{shape}, budget {budget}: measured {measured} B > estimate {estimate} B"
    # An estimate far above the truth would turn away cases that fit.
    assert estimate <= 6 * measured, f"{shape}, budget {budget}: estimate {estimate} B >> measured {measured} B"


def test_chunking_bounds_the_measured_peak():
    """A score-heavy case in one chunk against the same case with a small budget: the chunked peak is
    far below the whole problem's Nq x Nk matrices."""
    shape = (1, 2, 1, 192, 192, 4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    whole = _measured_peak(shape, budget=ra.DEFAULT_BUDGET_BYTES, device=device)
    chunked = _measured_peak(shape, budget=2 ** 17, device=device)
    one_matrix = 8 * 2 * 192 * 192
    assert whole >= 10 * one_matrix  # the unchunked work holds many Nq x Nk matrices
    assert chunked <= 4 * one_matrix, (whole, chunked)
