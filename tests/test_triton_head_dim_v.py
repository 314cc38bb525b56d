"""The Triton FA2/FA1 kernels with a value head dim of its own: ``q``, ``k`` ``[B, H, N, D]`` and ``v [B, Hkv,
Nk, Dv]`` with ``Dv != D`` (multi-head latent attention's 192/128; FlashAttention-3's ``headdim_v``).

``out`` and ``dO`` are ``Dv`` wide, ``dq`` and ``dk`` ``D``, ``dv`` ``Dv``; Delta sums over ``Dv``; the default
scale stays ``1/sqrt(D)``. Checked against a float64 reference written out here (plain softmax attention,
causal bottom-right: key ``j`` visible to query ``i`` iff ``j <= i + Nk - Nq``, and its gradients in closed
form), in Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``) or on a GPU. The head-dim
pairs pad to different tiles ((16, 24): 16 and 32 wide; (24, 16), (40, 16)) or to the same one ((56, 40) and
(40, 56): both 64 wide, so that a column mask taken from the wrong head dim shows); lengths are not multiples
of the tiles, and the inputs are views whose rows and columns past the end hold NaN (a read past Dv, or past
D, poisons the sums over them). The tolerances (float32: 1e-5 of the reference's largest magnitude; float16:
2e-3) fail a kernel that tiles v with q's width or scales by ``1/sqrt(Dv)``.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from flashverify_kernels.triton import attention as ta  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not ta.INTERPRET else "cpu"
pytestmark = pytest.mark.skipif(DEVICE not in ta.DEVICES, reason="the Triton kernels need a GPU or "
                                                                 "TRITON_INTERPRET=1 set before triton is imported")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}  # relative to the reference's largest magnitude
FORWARDS = {"fa2": ta.fa2_forward, "fa1": ta.fa1_forward}


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def _poisoned(b, h, n, d, *, dtype, seed):
    """Standard normal ``[B, H, N, D]`` values in a view of a ``[B, N + 3, H, D + 5]`` buffer whose other rows
    and columns hold NaN."""
    buf = torch.full((b, n + 3, h, d + 5), math.nan, dtype=dtype, device=DEVICE)
    buf[:, :n, :, :d] = _randn(b, n, h, d, dtype=dtype, seed=seed)
    return buf[:, :n, :, :d].transpose(1, 2)


def _reference(q, k, v, dout, *, causal: bool) -> dict:
    """Attention of one dense batch in float64 and its gradients in closed form: ``P = exp(S - lse)`` (0
    where a key is hidden, and in a row that sees none: ``out = 0``, ``lse = -inf``), ``out = P V``, ``Delta =
    rowsum(dO * out)``, ``dS = P (dO V^T - Delta)``, ``dq = scale dS K``, ``dk = scale dS^T Q``, ``dv = P^T dO``,
    dk and dv summed over each group's query heads."""
    q, k, v, dout = (t.detach().cpu().double() for t in (q, k, v, dout))
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1])  # q's and k's head dim, never v's
    nq, nk = q.shape[2], k.shape[2]
    visible = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        visible = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq
    s = torch.where(visible, scale * q @ ke.transpose(-1, -2), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(visible, torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None]), 0.0)
    out = p @ ve
    delta = (dout * out).sum(-1)
    ds = p * (dout @ ve.transpose(-1, -2) - delta[..., None])
    grouped = (lambda t: t.unflatten(1, (k.shape[1], group)).sum(2))
    return dict(out=out, lse=lse, dq=scale * ds @ ke, dk=grouped(scale * ds.transpose(-1, -2) @ q),
                dv=grouped(p.transpose(-1, -2) @ dout), delta=delta)


def _assert_close(name, got, want, dtype):
    __tracebackhide__ = True
    got = got.detach().cpu().double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, but the reference's is {tuple(want.shape)}"
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{name}: the -inf entries differ"
    finite = torch.isfinite(want)
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    mag = max(want[finite].abs().max().item() if finite.any() else 0.0, 1.0)
    assert err <= TOLERANCE[dtype] * mag, f"{name}: max error {err:.3g} > {TOLERANCE[dtype]:g} x {mag:.3g}"


CASES = [
    # (D, Dv, B, Hq, Hkv, Nq, Nk, causal, dtype, forward)
    (16, 24, 1, 4, 2, 19, 37, True, torch.float32, "fa2"),  # GQA
    (16, 24, 2, 2, 2, 33, 21, True, torch.float32, "fa1"),  # Nq > Nk: the first rows see no key
    (24, 16, 1, 4, 2, 40, 27, False, torch.float32, "fa2"),
    (40, 16, 1, 2, 1, 23, 45, True, torch.float32, "fa2"),
    (56, 40, 1, 2, 2, 17, 30, False, torch.float32, "fa1"),  # both padded to 64 (EVEN_D, EVEN_DV false) ...
    (40, 56, 1, 2, 1, 25, 18, True, torch.float32, "fa2"),  # ... either way round
    (32, 64, 1, 4, 2, 21, 35, True, torch.float16, "fa2"),  # powers of two: no column masks (EVEN_D, EVEN_DV)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "D{}_Dv{}_B{}_H{}x{}_N{}x{}_{}_{}_{}".format(
    *c[:7], "causal" if c[7] else "full", str(c[8]).removeprefix("torch."), c[9]))
def test_forward_and_backward_equal_the_float64_reference(case):
    d, dv, b, hq, hkv, nq, nk, causal, dtype, forward = case
    q = _poisoned(b, hq, nq, d, dtype=dtype, seed=1)
    k = _poisoned(b, hkv, nk, d, dtype=dtype, seed=2)
    v = _poisoned(b, hkv, nk, dv, dtype=dtype, seed=3)
    dout = _poisoned(b, hq, nq, dv, dtype=dtype, seed=4)
    want = _reference(q, k, v, dout, causal=causal)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # the same views: their NaN padding stays beside
    out, lse = FORWARDS[forward](*leaves, causal=causal, block_m=16, block_n=16)
    out.backward(dout)
    assert out.dtype == dtype and lse.dtype == torch.float32
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *(t.grad for t in leaves))):
        _assert_close(name, got, want[name], dtype)
    # The direct backward: the same gradients, and Delta over v's head dim.
    grads = ta.fa2_backward(q, k, v, out.detach(), lse, dout, causal=causal, block_m=16, block_n=16)
    for name, got, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        assert torch.equal(got, leaf.grad), f"{name}: the direct backward differs from autograd's"
    _assert_close("delta", grads[3], want["delta"], dtype)


def test_atomic_dq_backward():
    """deterministic=False: the dK/dV kernel adds dQ (D columns) from dS and K, with dO and V Dv wide."""
    q, k = _randn(1, 2, 29, 24, dtype=torch.float32, seed=5), _randn(1, 1, 38, 24, dtype=torch.float32, seed=6)
    v, dout = _randn(1, 1, 38, 40, dtype=torch.float32, seed=7), _randn(1, 2, 29, 40, dtype=torch.float32, seed=8)
    want = _reference(q, k, v, dout, causal=True)
    out, lse = ta.fa2_forward_raw(q, k, v, causal=True, block_m=16, block_n=16)
    grads = ta.fa2_backward(q, k, v, out, lse, dout, causal=True, block_m=16, block_n=16, deterministic=False)
    for name, got in zip(("dq", "dk", "dv", "delta"), grads):
        _assert_close(name, got, want[name], torch.float32)


def test_packed_sequences():
    """Packed variable-length sequences: ``q [total_q, Hq, D]``, ``k [total_k, Hkv, D]``, ``v [total_k, Hkv,
    Dv]`` give ``out [total_q, Hq, Dv]`` and ``lse [Hq, total_q]``; each sequence is its own dense case."""
    d, dv, hq, hkv = 24, 16, 2, 1
    lens_q, lens_k = (5, 0, 18, 12), (9, 3, 18, 7)  # an empty sequence, and Nq > Nk (causal: rows without keys)
    cu_q, cu_k = ([0, *torch.tensor(lens).cumsum(0).tolist()] for lens in (lens_q, lens_k))
    q = _randn(cu_q[-1], hq, d, dtype=torch.float32, seed=9)
    k = _randn(cu_k[-1], hkv, d, dtype=torch.float32, seed=10)
    v = _randn(cu_k[-1], hkv, dv, dtype=torch.float32, seed=11)
    dout = _randn(cu_q[-1], hq, dv, dtype=torch.float32, seed=12)
    packed = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=DEVICE),
                  cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=DEVICE),
                  max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ta.fa2_forward(*leaves, causal=True, block_m=16, block_n=16, **packed)
    assert out.shape == (cu_q[-1], hq, dv) and lse.shape == (hq, cu_q[-1])
    out.backward(dout)
    delta = ta.fa2_backward(q, k, v, out.detach(), lse, dout, causal=True, block_m=16, block_n=16, **packed)[3]
    dense = (lambda t, lo, hi: t[lo:hi].transpose(0, 1)[None])  # rows lo..hi of a packed tensor, [1, H, N, D]
    for s in range(len(lens_q)):
        rows, keys = (cu_q[s], cu_q[s + 1]), (cu_k[s], cu_k[s + 1])
        want = _reference(dense(q, *rows), dense(k, *keys), dense(v, *keys), dense(dout, *rows), causal=True)
        _assert_close(f"out[{s}]", dense(out, *rows), want["out"], torch.float32)
        _assert_close(f"lse[{s}]", lse[None, :, rows[0]:rows[1]], want["lse"], torch.float32)
        _assert_close(f"delta[{s}]", delta[None, :, rows[0]:rows[1]], want["delta"], torch.float32)
        for name, leaf, span in (("dq", leaves[0], rows), ("dk", leaves[1], keys), ("dv", leaves[2], keys)):
            _assert_close(f"{name}[{s}]", dense(leaf.grad, *span), want[name], torch.float32)


def test_out_buffers_take_v_s_head_dim():
    """``out=`` is ``[B, Hq, Nq, Dv]`` (a strided view here) and receives what a call without buffers returns,
    and nothing past its Dv columns; a buffer with q's head dim is refused."""
    q, k = _randn(1, 2, 20, 16, dtype=torch.float32, seed=13), _randn(1, 2, 26, 16, dtype=torch.float32, seed=14)
    v = _randn(1, 2, 26, 32, dtype=torch.float32, seed=15)
    want_out, want_lse = ta.fa2_forward_raw(q, k, v, causal=True, block_m=16, block_n=16)
    buf = torch.full((1, 20, 2, 40), math.nan, device=DEVICE)
    out = buf[..., :32].transpose(1, 2)  # [B, Hq, Nq, Dv], strided
    lse = torch.empty(1, 2, 20, device=DEVICE)
    got_out, got_lse = ta.fa2_forward(q, k, v, causal=True, block_m=16, block_n=16, out=out, lse=lse)
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.isnan(buf[..., 32:]).all(), "the forward wrote past out's Dv columns"
    with pytest.raises(ValueError, match=r"out.shape=\(1, 2, 20, 16\), but should be \(1, 2, 20, 32\)"):
        ta.fa2_forward(q, k, v, causal=True, out=torch.empty(1, 2, 20, 16, device=DEVICE))


def test_unsupported_value_head_dims_are_refused_by_name():
    q, k = _randn(1, 2, 8, 16, dtype=torch.float16, seed=16), _randn(1, 2, 8, 16, dtype=torch.float16, seed=17)
    v = _randn(1, 2, 8, 24, dtype=torch.float16, seed=18)
    zeros = (lambda *shape: torch.zeros(*shape, dtype=torch.float16, device=DEVICE))
    lse = torch.zeros(1, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="v's head_dim=20 is not supported; supported head dims are 16..256"):
        ta.fa2_forward(q, k, _randn(1, 2, 8, 20, dtype=torch.float16, seed=19))
    # The Gluon kernels take one head dim: gluon=True names that before any other reason (on the CPU, the device).
    for call in (lambda: ta.fa2_forward(q, k, v, gluon=True),
                 lambda: ta.fa2_backward(q, k, v, zeros(1, 2, 8, 24), lse, zeros(1, 2, 8, 24), gluon=True)):
        with pytest.raises(ValueError, match="gluon=True, but v's head dim 24 differs from q's and k's 16: the Gluon "
                                             "kernels take one head dim; only the Triton kernels"):
            call()
    # out and dout are v's head dim wide in the backward
    with pytest.raises(ValueError, match=r"should be \(1, 2, 8, 24\) \(q's \[batch, heads_q, len_q\] and v's "
                                         r"head_dim\)"):
        ta.fa2_backward(q, k, v, zeros(1, 2, 8, 24), lse, zeros(1, 2, 8, 16))
