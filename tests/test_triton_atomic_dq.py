"""The Triton FA2 backward with ``deterministic=False``: dQ added with atomics by the dK/dV kernel.

dK and dV come from the same dK/dV kernel, so they are bitwise those of the deterministic backward. dQ is
summed in another order, from a ``dS`` recomputed in the other orientation (``k q^T`` there, ``q k^T`` in
the dQ kernel), so its last bits differ (in float16 a ``dS`` may round to its neighbour): both dQs must
lie within the suite's error bound of the float64 dQ (references/bounds.py), which in float32 is below a
0.1% error. Runs in
Triton's interpreter (tests/conftest.py sets it) or on a GPU; the property suite checks the implementation
``triton_fa2_atomic_dq`` in depth (``pytest verify --impl triton_fa2_atomic_dq``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from flashverify_kernels.triton import attention as ta  # noqa: E402
from references import attention as ref_attention  # noqa: E402
from references import bounds  # noqa: E402
from references.spec import AttentionSpec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not ta.INTERPRET else "cpu"
pytestmark = pytest.mark.skipif(DEVICE not in ta.DEVICES, reason="the Triton kernels need a GPU or "
                                                                 "TRITON_INTERPRET=1 set before triton is imported")

CASES = {
    "causal GQA": dict(shape=(2, 4, 2, 40, 70, 32), kw=dict(causal=True)),
    "non-causal Nq > Nk": dict(shape=(1, 2, 2, 50, 20, 24), kw=dict(causal=False)),
    "window softcap ALiBi": dict(shape=(1, 2, 1, 33, 33, 16),
                                 kw=dict(causal=True, window_size=(5, 0), softcap=3.0,
                                         alibi_slopes=torch.tensor([0.5, 0.25]))),
    "packed sequences": dict(shape=None, kw=dict(causal=True)),
}
# The same attention as the references state it (the packed case: lengths (q, k) = (5, 9), (0, 3), (20, 20)).
SPECS = {
    "causal GQA": AttentionSpec(causal=True), "non-causal Nq > Nk": AttentionSpec(causal=False),
    "window softcap ALiBi": AttentionSpec(causal=True, window_left=5, window_right=0, softcap=3.0,
                                          alibi_slopes=(0.5, 0.25)),
    "packed sequences": AttentionSpec(causal=True, sequences="packed", seqlens_q=(5, 0, 20), seqlens_k=(9, 3, 20)),
}


def _inputs(name, dtype):
    g = torch.Generator().manual_seed(7)
    case = CASES[name]
    kw = dict(case["kw"])
    if case["shape"] is None:  # packed: lengths (q, k) = (5, 9), (0, 3), (20, 20)
        cu_q, cu_k = torch.tensor([0, 5, 5, 25], dtype=torch.int32), torch.tensor([0, 9, 12, 32], dtype=torch.int32)
        q, k, v = (torch.randn(n, 2, 16, generator=g) for n in (25, 32, 32))
        kw.update(cu_seqlens_q=cu_q.to(DEVICE), cu_seqlens_k=cu_k.to(DEVICE), max_seqlen_q=20, max_seqlen_k=20)
    else:
        b, hq, hkv, nq, nk, d = case["shape"]
        q, k, v = torch.randn(b, hq, nq, d, generator=g), torch.randn(b, hkv, nk, d, generator=g), \
            torch.randn(b, hkv, nk, d, generator=g)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"].to(DEVICE)
    return [t.to(dtype=dtype, device=DEVICE) for t in (q, k, v)], kw


def _grads(q, k, v, kw, deterministic):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = ta.fa2_forward(*leaves, block_m=16, block_n=16, deterministic=deterministic, **kw)
    return torch.autograd.grad(out, leaves, _dout(out))


def _dout(out):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)


def _four(t):
    """Packed ``[total, H, D]`` as ``[1, H, total, D]``; ``[B, H, N, D]`` as it is."""
    return t.permute(1, 0, 2).unsqueeze(0) if t.dim() == 3 else t


def _dq_bound(name, q, k, v, kw):
    """The suite's elementwise bound on a contract-following kernel's dQ error (references/bounds.py) and the
    float64 dQ, ``[B, Hq, Nq, D]`` (packed rows as one sequence of a batch of one, as the references
    take them)."""
    out = ta.fa2_forward(q, k, v, block_m=16, block_n=16, **kw)[0]
    tensors = [_four(t) for t in (q, k, v, out, _dout(out))]
    ref = ref_attention.attention(*tensors[:3], spec=SPECS[name], dout=tensors[4])
    return bounds.backward_bounds(ref, *tensors[:3], dtype=q.dtype, out=tensors[3])[0], ref.dq


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_atomic_dq_equals_the_deterministic_backward(name, dtype):
    # On a GPU the dense float16 cases add dQ by TMA reduce-adds, which the interpreter cannot run: there
    # they take the per-element atomics.
    (q, k, v), kw = _inputs(name, dtype)
    dq, dk, dv = _grads(q, k, v, kw, deterministic=True)
    adq, adk, adv = _grads(q, k, v, kw, deterministic=False)
    assert torch.equal(adk, dk) and torch.equal(adv, dv), "dK, dV come from the same kernel: they must not change"
    # dQ: the same products summed in another order (the dK/dV kernel recomputes dS from k q^T, the dQ
    # kernel from q k^T): each within the suite's bound of the float64 dQ (so apart by at most twice it)
    bound, exact = _dq_bound(name, q, k, v, kw)
    for got in (dq, adq):
        assert ((_four(got).double() - exact).abs() <= bound).all(), name
    if dtype == torch.float32:  # the bound is below a 0.1% error of dQ: one that large (dQ scaled by 1.001) fails
        assert 2 * bound.max() < 1e-3 * exact.abs().max(), name
    assert dq.abs().max() > 0


def test_deterministic_must_be_a_bool():
    (q, k, v), kw = _inputs("causal GQA", torch.float32)
    with pytest.raises(TypeError, match="triton_fa2: deterministic='no', but should be a bool"):
        ta.fa2_forward(q, k, v, deterministic="no", **kw)
    with pytest.raises(TypeError, match="backward: deterministic=1, but should be a bool"):
        ta.fa2_backward(q, k, v, q, torch.zeros(q.shape[:3]), q, deterministic=1, **kw)
