"""The Triton FA2 kernels' tensor-descriptor (TMA) path: which calls take it, and that it computes exactly
what the pointer path computes.

On Hopper the unmasked tiles (forward and dQ: K and V; dK/dV: Q and dO) are read through ``[B, H, N, D]``
descriptors built on the host; Triton's interpreter emulates them, so these tests run the descriptor code
on the CPU. The same tiles reach the same arithmetic either way, so
the outputs and gradients must be bitwise equal; a descriptor read one row off fails them.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from flashverify_kernels.triton import attention as ta  # noqa: E402

pytestmark = pytest.mark.skipif(not ta.INTERPRET, reason="checks the descriptor path under Triton's interpreter "
                                                         "(TRITON_INTERPRET=1, set by tests/conftest.py)")


def _qkv(b=2, hq=4, hkv=2, nq=72, nk=96, d=64, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, nq, d, generator=g).to(dtype), torch.randn(b, hkv, nk, d, generator=g).to(dtype),
            torch.randn(b, hkv, nk, d, generator=g).to(dtype))


def _call(q, k, v, **kw):
    return ta._Call(q, k, v, kernel="test", causal=False, scale=None, block_m=None, block_n=None, **kw)


def test_dense_half_precision_rows_with_a_power_of_two_head_dim_take_descriptors():
    q, k, v = _qkv()
    assert ta._use_tma(_call(q, k, v), 64, 64, k, v)


@pytest.mark.parametrize("why", ["float32", "head dim 40", "column stride 2", "misaligned base", "packed",
                                 "broadcast heads", "no keys"])
def test_other_calls_keep_pointer_loads(why):
    q, k, v = _qkv(dtype=torch.float32 if why == "float32" else torch.float16, d=40 if why == "head dim 40" else 64)
    d = q.shape[-1]
    kw = {}
    if why == "column stride 2":
        k = torch.cat([k, k], dim=-1)[..., ::2]
    if why == "broadcast heads":  # one KV head expanded to two (stride 0): no descriptor over it
        k, v = (t[:, :1].expand(-1, 2, -1, -1) for t in (k, v))
    if why == "no keys":
        k, v = k[:, :, :0], v[:, :, :0]
    if why == "misaligned base":  # one element into a buffer: 2 bytes off every 16-byte boundary
        k = torch.cat([k.flatten(), k.flatten()[:1]])[1:].view(k.shape)
    if why == "packed":
        q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (q, k, v))
        cu_q = torch.tensor([0, 72, 144], dtype=torch.int32)
        cu_k = torch.tensor([0, 96, 192], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=72, max_seqlen_k=96)
    call = _call(q, k, v, **kw)
    block_d = ta._padded_head_dim(d)
    assert not ta._use_tma(call, d, block_d, call.k, call.v)


@pytest.mark.parametrize("causal", [False, True])
# head dim 128: the backward reads its masked tiles through descriptors too (MASKED_TMA)
@pytest.mark.parametrize("shape", [(72, 96, 64), (96, 40, 32), (64, 64, 16), (40, 56, 128), "bshd"])
def test_descriptor_path_equals_pointer_path_bitwise(monkeypatch, causal, shape):
    nq, nk, d = (80, 112, 32) if shape == "bshd" else shape
    q, k, v = _qkv(nq=nq, nk=nk, d=d)
    if shape == "bshd":  # [B, N, H, D] storage seen as [B, H, N, D]: the descriptors take the strides as they are
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ta.fa2_forward(qq, kk, vv, causal=causal, block_m=16, block_n=16)
        grads = torch.autograd.grad(out, (qq, kk, vv), dout)
        return (out, lse, *grads)

    used = []
    real = ta._use_tma
    monkeypatch.setattr(ta, "_use_tma", lambda *a: used.append(real(*a)) or used[-1])
    with_descriptors = run()
    assert used and all(used), "the descriptor path was not taken"
    monkeypatch.setattr(ta, "_use_tma", lambda *a: False)
    with_pointers = run()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), with_descriptors, with_pointers):
        assert torch.equal(a, b), f"{name} differs between the descriptor and the pointer path"
