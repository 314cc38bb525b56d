"""Smoke tests of the Triton kernels: a few small cases against the float64 reference.

The property suite (``pytest verify``) checks these kernels in depth; this file only makes sure they
build, run and are roughly right, fast (well under a minute in Triton's interpreter). It needs a GPU,
or ``TRITON_INTERPRET=1`` set before Triton is imported (bfloat16 is left to the GPU: the
interpreter's ``tl.dot`` does not support it).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from flashverify_kernels.triton import attention as ta  # noqa: E402
from flashverify_kernels.triton import softmax as tsm  # noqa: E402
from references import attention as ref  # noqa: E402
from references import baseline  # noqa: E402
from references.spec import AttentionSpec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not ta.INTERPRET else "cpu"
pytestmark = pytest.mark.skipif(DEVICE not in ta.DEVICES,
                                reason="the Triton kernels need a GPU or TRITON_INTERPRET=1 set before "
                                       "triton is imported")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
FORWARDS = {"fa2": ta.fa2_forward, "fa1": ta.fa1_forward}


def _randn(*shape, dtype, seed, poison_pad=0):
    """Standard normal values in a [B, H, N, D] view of a larger buffer whose padding (rows and head-dim
    columns past the view) holds NaN, so reading past the end of the view poisons the result."""
    g = torch.Generator().manual_seed(seed)
    b, h, n, d = shape
    buf = torch.full((b, n + poison_pad, h, d + poison_pad), math.nan)
    buf[:, :n, :, :d] = torch.randn(b, n, h, d, generator=g)
    return buf.to(dtype=dtype, device=DEVICE)[:, :n, :, :d].transpose(1, 2)


def _max_err(got, want):
    got, want = got.double(), want.double()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf pattern differs"
    finite = torch.isfinite(want)
    return (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0


def _check_close(name, got, want, base, dtype, c):
    """Kernel error within c times the eager baseline's, plus a small floor of a few roundings."""
    __tracebackhide__ = True
    err, base_err = _max_err(got, want), _max_err(base, want)
    finite = want[torch.isfinite(want)]
    mag = finite.abs().max().item() if finite.numel() else 0.0
    floor = 8 * torch.finfo(dtype).eps * max(mag, 1.0)
    assert not torch.isnan(got).any(), f"{name}: NaN in the output"
    assert err <= c * base_err + floor, f"{name}: max error {err:.3g} > {c} x baseline {base_err:.3g} + {floor:.3g}"


CASES = [
    # (B, Hq, Hkv, Nq, Nk, D, causal, block_m, block_n)
    (1, 2, 1, 17, 33, 16, True, 16, 16),
    (1, 2, 2, 33, 17, 24, True, 16, 32),  # Nq > Nk: the first rows see no key
    (2, 1, 1, 32, 32, 40, False, 32, 16),
    (1, 4, 2, 5, 70, 64, True, 16, 32),
    (1, 1, 1, 1, 1, 16, False, 16, 16),
    (1, 3, 1, 40, 40, 16, True, 32, 32),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("variant", sorted(FORWARDS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_H{}x{}_N{}x{}_D{}_{}_bm{}_bn{}".format(
    *c[:6], "causal" if c[6] else "full", *c[7:]))
def test_forward_backward_match_reference(case, variant, dtype):
    b, hq, hkv, nq, nk, d, causal, bm, bn = case
    q = _randn(b, hq, nq, d, dtype=dtype, seed=1, poison_pad=3).requires_grad_()
    k = _randn(b, hkv, nk, d, dtype=dtype, seed=2, poison_pad=3).requires_grad_()
    v = _randn(b, hkv, nk, d, dtype=dtype, seed=3, poison_pad=3).requires_grad_()
    dout = _randn(b, hq, nq, d, dtype=dtype, seed=4)
    out, lse = FORWARDS[variant](q, k, v, causal=causal, block_m=bm, block_n=bn)
    out.backward(dout)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32

    r = ref.attention(q.detach(), k.detach(), v.detach(), spec=AttentionSpec(causal=causal), dout=dout)
    base_out, base_lse = baseline.forward(q.detach(), k.detach(), v.detach(), spec=AttentionSpec(causal=causal))
    base_grads = baseline.backward(q.detach(), k.detach(), v.detach(), dout, spec=AttentionSpec(causal=causal))
    _check_close("out", out, r.out, base_out, dtype, 2)
    _check_close("lse", lse, r.lse, base_lse, dtype, 2)
    for name, got, want, base in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad),
                                     (r.dq, r.dk, r.dv), base_grads):
        _check_close(name, got, want, base, dtype, 3)

    # Rows with no visible key: out = 0, lse = -inf.
    empty = ~r.rows_with_keys
    assert torch.all(out.detach()[:, :, empty] == 0) and torch.all(torch.isneginf(lse[:, :, empty]))

    # The direct backward returns the same gradients, bit for bit (deterministic), and Delta.
    dq, dk, dv, delta = ta.fa2_backward(q.detach(), k.detach(), v.detach(), out.detach(), lse, dout,
                                        causal=causal, block_m=bm, block_n=bn)
    assert torch.equal(dq, q.grad) and torch.equal(dk, k.grad) and torch.equal(dv, v.grad)
    assert _max_err(delta, r.delta) <= 16 * torch.finfo(dtype).eps * max(1.0, r.delta.abs().max().item())


def test_gqa_equals_repeated_heads():
    q = _randn(1, 4, 19, 24, dtype=torch.float32, seed=5)
    k = _randn(1, 2, 23, 24, dtype=torch.float32, seed=6)
    v = _randn(1, 2, 23, 24, dtype=torch.float32, seed=7)
    out, lse = ta.fa2_forward(q, k, v, causal=True, block_m=16, block_n=16)
    out_full, lse_full = ta.fa2_forward(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=True,
                                        block_m=16, block_n=16)
    assert torch.equal(out, out_full) and torch.equal(lse, lse_full)


def test_softmax_rows():
    # A strided [9, 37] view of a buffer with NaN past the end of each row and in every other row.
    buf = torch.full((18, 40), math.nan)
    buf[::2, :37] = 4 * torch.randn(9, 37, generator=torch.Generator().manual_seed(8))
    buf[2 * 2, :37] = -math.inf
    buf[2 * 3, :37:3] = -math.inf
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xd = buf.to(dtype=dtype, device=DEVICE)[::2, :37]
        for block_n in (None, 16, 32):
            y, lse = tsm.softmax(xd, block_n=block_n)
            assert y.dtype == dtype and lse.dtype == torch.float32
            # exp(x - lse) carries the rounding of lse (about eps * |lse|) besides its own.
            tol = torch.finfo(dtype).eps * (2 + lse[torch.isfinite(lse)].abs().max().item())
            assert (y.double() - ref.softmax(xd)).abs().max().item() <= tol
            assert _max_err(lse, ref.logsumexp(xd)) <= 1e-6


@pytest.mark.parametrize("kwargs, error, match", [
    ({"dtype": torch.float64}, ValueError, "float64"),
    ({"d": 20}, ValueError, "head_dim=20"),
    ({"d": 264}, ValueError, "head_dim=264"),
    ({"hq": 3}, ValueError, "multiple"),
    ({"block_m": 24}, ValueError, "block_m=24"),
    ({"block_n": 8}, ValueError, "block_n=8"),
])
def test_bad_input_raises_before_launch(kwargs, error, match):
    d, hq = kwargs.pop("d", 16), kwargs.pop("hq", 2)
    dtype = kwargs.pop("dtype", torch.float32)
    q = torch.zeros(1, hq, 4, d, dtype=dtype, device=DEVICE)
    k = torch.zeros(1, 2, 4, d, dtype=dtype, device=DEVICE)
    with pytest.raises(error, match=match):
        ta.fa2_forward(q, k, k, **kwargs)
    with pytest.raises(error, match=match):
        ta.fa2_backward(q, k, k, q, q[..., 0].float(), q, **kwargs)


def test_declarations():
    from flashverify_kernels.registry import registry

    impls = registry()
    for name in ("triton_softmax", "triton_fa1", "triton_fa2"):
        assert DEVICE in impls[name].devices
    fa2 = impls["triton_fa2"]
    assert fa2.gqa and fa2.deterministic and fa2.backward is ta.fa2_backward
    assert list(fa2.head_dims) == list(range(16, 257, 8))
    assert (fa2.environment_limit(torch.bfloat16) is not None) == ta.INTERPRET
    assert os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda"

