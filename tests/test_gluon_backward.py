"""The Gluon dK/dV kernel of Hopper (kernels/gluon_backward.py): when it runs, that it compiles without
serialized products, and (on an H100/H200) that its gradients are right.

* Dispatch rules, without a GPU: :func:`gluon_backward.unsupported` are the forward's, for the deterministic
  backward and the one that adds dQ alike; off Hopper ``gluon=True`` names what rules a call out.
* Compilation, without a GPU: the kernel compiled for sm_90 in a fresh process, in each head dim, dtype,
  causal flag and form (with dQ added or not), and its PTX assembled by Triton's own ptxas, whose report
  must not carry note C7514 ("wgmma.mma_async instructions are serialized": see tests/test_gluon_forward.py).
* On a GPU of compute capability 9.0: the gradients of ``fa2_forward`` (whose backward dispatches here),
  deterministic or not, within the suite's bound of the float64 ones (references/bounds.py) over tails,
  Nq != Nk with the causal diagonal (rows that see no key, keys no row sees), GQA and strided inputs; that
  the Gluon kernel ran; and that adding dQ leaves dK and dV bitwise the deterministic ones.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import gluon_backward as gb  # noqa: E402
from kernels import gluon_forward as gf  # noqa: E402
from kernels import triton_attention as ta  # noqa: E402
from references import attention as ref_attention  # noqa: E402
from references import bounds  # noqa: E402
from references.spec import AttentionSpec  # noqa: E402
from tests import gluon_compile  # noqa: E402

needs_gluon = pytest.mark.skipif(not gf.AVAILABLE, reason=f"Gluon not importable: {gf.UNAVAILABLE_REASON}")


def _on_hopper() -> bool:
    return (torch.cuda.is_available() and not ta.INTERPRET and gf.AVAILABLE
            and torch.cuda.get_device_capability() == (9, 0))


on_hopper = pytest.mark.skipif(not _on_hopper(), reason="the Gluon kernels run on a GPU of compute capability 9.0 only")


@needs_gluon
def test_unsupported_takes_the_forwards_rules(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv(gf.ENV_OFF, raising=False)
    t = torch.zeros(2, 4, 64, 128, dtype=torch.float16)
    plain = dict(device=torch.device("cuda"), dtype=torch.float16, head_dim=128, scale=0.1, variant=False,
                 inner_scaled=False, fixed_blocks=False, tensors=(t, t, t, t))
    assert gb.unsupported(**plain) == ""
    # the forward's rules, each named
    assert "head dim" in gb.unsupported(**{**plain, "head_dim": 96})
    assert "fixed" in gb.unsupported(**{**plain, "fixed_blocks": True})
    monkeypatch.setenv(gf.ENV_OFF, "0")
    assert gf.ENV_OFF in gb.unsupported(**plain)


def test_gluon_true_names_what_rules_the_atomic_backward_out():
    """gluon=True with deterministic=False asks for the Gluon kernel that adds dQ: off Hopper the error names
    what rules the call out, as for the deterministic backward."""
    if _on_hopper():
        pytest.skip("on Hopper the call runs (test_gradients_within_the_bound_on_hopper)")
    q = torch.zeros(1, 2, 16, 64, dtype=torch.float16)
    out, lse = ta.fa2_forward_raw(q.float(), q.float(), q.float(), gluon=False)
    with pytest.raises(ValueError, match="gluon=True, but the Gluon dK/dV kernel does not take this call"):
        ta.fa2_backward(q, q, q, out.half(), lse, q, gluon=True, deterministic=False)


def test_backward_gluon_keyword_is_checked():
    """fa2_backward's ``gluon``: a bool or None; True names what rules the call out (off Hopper at least the
    device or the dtype); False and None run the Triton kernels there."""
    device = "cpu" if ta.INTERPRET or not torch.cuda.is_available() else "cuda"
    q = torch.randn(1, 2, 16, 64, dtype=torch.float32 if device == "cpu" else torch.float16, device=device)
    out, lse = ta.fa2_forward_raw(q, q, q, gluon=False)
    with pytest.raises(TypeError, match="gluon='yes'"):
        ta.fa2_backward(q, q, q, out, lse, q, gluon="yes")
    if not _on_hopper():
        with pytest.raises(ValueError, match="gluon=True, but the Gluon dK/dV kernel does not take this call"):
            ta.fa2_backward(q, q, q, out, lse, q, gluon=True)
    for gluon in (None, False):
        dq, dk, dv, _ = ta.fa2_backward(q, q, q, out, lse, q, gluon=gluon)
        assert dk.shape == q.shape and torch.isfinite(dk).all()
    # checked with no work to run as well: no key, or no query
    none = q[:, :, :0]
    out0, lse0 = ta.fa2_forward_raw(q, none, none, gluon=False)
    with pytest.raises(TypeError, match="gluon='yes'"):
        ta.fa2_backward(q, none, none, out0, lse0, q, gluon="yes")
    with pytest.raises(TypeError, match="gluon=1"):
        ta.fa2_forward(none, q, q, gluon=1)
    with pytest.raises(TypeError, match="gluon=1"):
        ta.fa2_forward_raw(none, q, q, gluon=1)


def test_fill_rows_lays_out_what_the_kernel_reads():
    """The rows buffer of a Q tile: LSE * log2(e) (+inf for a row that sees no key, lse = -inf, and for the
    padding to whole tiles, so that p = 0 there) and Delta (0 on the padding)."""
    lse = torch.tensor([[[1.0, float("-inf"), -2.0]]])
    delta = torch.tensor([[[0.5, 0.25, -1.0]]])
    rows = gb.fill_rows(gb.rows_buffer(lse).fill_(float("nan")), lse, delta)
    assert rows.shape == (1, 1, 2, gb.BLOCK_M)
    assert torch.equal(rows[0, 0, 0, :3], torch.tensor([1.0 * gb.LOG2E, float("inf"), -2.0 * gb.LOG2E]))
    assert (rows[0, 0, 0, 3:] == float("inf")).all() and (rows[0, 0, 1, 3:] == 0).all()
    assert rows[0, 0, 1, :3].tolist() == [0.5, 0.25, -1.0]


@pytest.mark.parametrize("nq, nk, causal, lse_layout", [(70, 50, True, "bhn"), (5, 5, False, "nhb"),
                                                      (128, 300, True, "bhn")])
def test_delta_kernel_fills_the_rows_buffer(nq, nk, causal, lse_layout, monkeypatch):
    """Where the Gluon dK/dV kernel runs, fa2_backward's Delta kernel fills its rows buffer in the same pass:
    equal to :func:`gluon_backward.fill_rows` over the whole padded buffer (filled with NaN first), with
    rows that see no key (causal, Nq > Nk), a tail short of a whole tile and an LSE of any strides. Runs
    the launch of any machine (the interpreter's here), the Gluon kernel stubbed out."""
    device = "cpu" if ta.INTERPRET or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.float16
    gen = torch.Generator(device=device).manual_seed(nq + nk)
    q, dout = (torch.randn((2, 3, nq, 64), generator=gen, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn((2, 3, nk, 64), generator=gen, device=device, dtype=dtype) for _ in range(2))
    out, lse = ta.fa2_forward_raw(q, k, v, causal=causal, gluon=False)
    if lse_layout == "nhb":
        lse = lse.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    if causal and nq > nk:
        assert (lse == float("-inf")).any()
    got = {}
    real_buffer = gb.rows_buffer
    monkeypatch.setattr(gb, "rows_buffer", lambda lse: real_buffer(lse).fill_(float("nan")))
    monkeypatch.setattr(ta, "_gluon_plan", lambda *a, **kw: True)
    monkeypatch.setattr(gb, "dkdv", lambda *a, **kw: got.update(kw))
    _, _, _, delta = ta.fa2_backward(q, k, v, out, lse, dout, causal=causal)
    want = gb.fill_rows(real_buffer(lse), lse, delta)
    assert got["rows"].shape == want.shape
    assert torch.equal(got["rows"], want)


_COMPILE = r"""
from kernels import gluon_backward as gb

for d in gb.HEAD_DIMS:
    for dt, gdt in (("fp16", gl.float16), ("bf16", gl.bfloat16)):
        for causal in (False, True):
            for atomic in (False, True):
                q_rows, keys = desc(dt, gdt, gb.BLOCK_M, d), desc(dt, gdt, gb.BLOCK_N, d)
                # the atomic-dQ form's K in column halves and float32 dQ tiles; otherwise stand-ins
                kh = desc(dt, gdt, gb.BLOCK_N, d // 2) if atomic else keys
                dq = desc("fp32", gl.float32, gb.BLOCK_M, d // 2) if atomic else keys
                rows_desc = "tensordesc<fp32[1,1,2,%d],%r>" % (gb.BLOCK_M, gl.NVMMASharedLayout(
                    swizzle_byte_width=0, element_bitwidth=32, rank=4))
                signature = {"q_desc": q_rows, "k_desc": keys, "v_desc": keys, "do_desc": q_rows,
                             "rows_desc": rows_desc, "dk_desc": keys,
                             "dv_desc": keys, "kh_desc": kh, "dq_desc": dq, "c": "fp32", "scale": "fp32",
                             **{name: "i32" for name in ("heads_kv", "group", "len_q", "len_k")},
                             **{name: "constexpr" for name in ("CAUSAL", "BLOCK_M", "BLOCK_N", "D", "STAGES",
                                                               "ATOMIC_DQ", "DS_BUFS", "DS_LAYOUT", "DQ_FIRST",
                                                               "WARPGROUPS")}}
                ds_layout = gl.NVMMASharedLayout.get_default_for([gb.BLOCK_N, gb.BLOCK_M], gdt)
                build(f"d{d}-{dt}-{'causal' if causal else 'full'}-{'atomic' if atomic else 'det'}",
                      gb._attn_bwd_dkdv_ws, signature,
                      {"CAUSAL": causal, "BLOCK_M": gb.BLOCK_M, "BLOCK_N": gb.BLOCK_N, "D": d, "STAGES": gb.STAGES,
                       "ATOMIC_DQ": atomic, "DS_BUFS": gb.DS_BUFS, "DS_LAYOUT": ds_layout,
                       "DQ_FIRST": gb.DQ_FIRST[d], "WARPGROUPS": gb.warpgroups(d, atomic)})
"""


@pytest.fixture(scope="module")
def compiled():
    return gluon_compile.results(_COMPILE)


@needs_gluon
@pytest.mark.parametrize("d", gb.HEAD_DIMS)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("form", ["det", "atomic"])
def test_compiles_for_sm90_without_serialized_products(compiled, d, dt, causal, form):
    result = compiled[f"d{d}-{dt}-{'causal' if causal else 'full'}-{form}"]
    gluon_compile.assert_not_serialized(result)


# (B, Hq, Hkv, Nq, Nk, D, causal, layout): one query over three KV programs' worth of keys; Nq > Nk causal
# (the first rows see no key); Nq < Nk causal (the last keys' tiles see every row, the first few rows see
# many keys); GQA groups of 2 and 4 (dK, dV summed over the group's heads); key tails inside a
# warpgroup's 64 keys and past a program's 128 (192 at head dim 64 without dQ: its last warpgroups past the
# end); [B, N, H, D] storage.
SHAPES = [
    (1, 1, 1, 1, 257, 64, False, "bhnd"), (1, 2, 2, 63, 65, 128, True, "bhnd"), (2, 3, 3, 129, 127, 64, True, "bhnd"),
    (1, 4, 2, 200, 333, 128, False, "bhnd"), (1, 4, 1, 300, 100, 128, True, "bhnd"),
    (2, 2, 2, 256, 256, 64, True, "bnhd"), (1, 8, 2, 520, 520, 128, True, "bnhd"),
    (1, 2, 2, 100, 1024, 64, True, "bhnd"), (1, 2, 2, 517, 40, 64, False, "bnhd"),
    (1, 4, 2, 333, 700, 64, True, "bhnd"),
]


@on_hopper
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_gradients_within_the_bound_on_hopper(shape, dtype, deterministic, monkeypatch):
    b, hq, hkv, nq, nk, d, causal, layout = shape
    gen = torch.Generator(device="cuda").manual_seed(nq * 7 + nk)

    def make(h, n):
        if layout == "bnhd":
            return torch.randn((b, n, h, d), generator=gen, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=dtype)

    q, k, v, dout = make(hq, nq), make(hkv, nk), make(hkv, nk), make(hq, nq)
    calls = []
    real = gb.dkdv
    monkeypatch.setattr(gb, "dkdv", lambda *a, **kw: (calls.append(kw.get("dq_sum") is not None), real(*a, **kw))[1])
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = ta.fa2_forward(*leaves, causal=causal, deterministic=deterministic)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    assert calls, "the Triton dK/dV kernel ran, not the Gluon one"
    assert calls == [not deterministic], "the Gluon kernel should add dQ exactly when deterministic=False"
    ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=causal), dout=dout)
    bq, bk, bv, _ = bounds.backward_bounds(ref, q, k, v, dtype=dtype, out=out.detach())
    for name, got, exact, bound in (("dq", dq, ref.dq, bq), ("dk", dk, ref.dk, bk), ("dv", dv, ref.dv, bv)):
        assert torch.isfinite(got).all(), name
        assert ((got.double() - exact).abs() <= bound).all(), (name, (got.double() - exact).abs().max().item())


@on_hopper
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[6]], ids=lambda s: "-".join(map(str, s)))
def test_atomic_dq_changes_only_dq_on_hopper(shape):
    """deterministic=False runs the same kernel with dQ added in it: dK and dV bitwise the deterministic
    backward's (same products, same order), dQ within a few roundings of the dQ kernel's."""
    b, hq, hkv, nq, nk, d, causal, _ = shape
    gen = torch.Generator(device="cuda").manual_seed(nq + nk)
    q, dout = (torch.randn((b, hq, nq, d), generator=gen, device="cuda", dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn((b, hkv, nk, d), generator=gen, device="cuda", dtype=torch.float16) for _ in range(2))
    out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
    det = ta.fa2_backward(q, k, v, out, lse, dout, causal=causal, gluon=True)
    atomic = ta.fa2_backward(q, k, v, out, lse, dout, causal=causal, gluon=True, deterministic=False)
    assert torch.equal(det[1], atomic[1]) and torch.equal(det[2], atomic[2])
    torch.testing.assert_close(atomic[0], det[0], rtol=2e-3, atol=2e-3 * det[0].abs().max().item())


@on_hopper
def test_routing_on_hopper(monkeypatch):
    """gluon=None: Gluon unless the tiles are fixed or a tensor is one no descriptor reads (``out.sum()``'s dO
    broadcasts one element), deterministic or not; gluon=False: never; gluon=True: always
    (the tiles then the dQ kernel's), through contiguous copies where no descriptor reads a tensor (dO
    broadcast, or at a storage offset of one element); no query row: dK = dV = 0."""
    calls = []
    real = gb.dkdv
    monkeypatch.setattr(gb, "dkdv", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn((1, 2, 300, 64), generator=gen, device="cuda", dtype=torch.float16) for _ in range(3))
    dout = torch.randn(q.shape, generator=gen, device="cuda", dtype=torch.float16)
    expected = {(None, None, True, False): 1, (None, 64, True, False): 0, (False, None, True, False): 0,
                (True, 64, True, False): 1, (None, None, False, False): 1, (False, None, False, False): 0,
                (True, None, False, False): 1, (None, None, True, True): 0, (True, None, True, True): 1}
    for (gluon, block, deterministic, broadcast), runs in expected.items():
        calls.clear()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = ta.fa2_forward(*leaves, causal=True, gluon=gluon, block_m=block, block_n=block,
                                deterministic=deterministic)
        out.sum().backward() if broadcast else out.backward(dout)
        assert len(calls) == runs, (gluon, block, deterministic, broadcast)
    out, lse = ta.fa2_forward_raw(q, k, v, causal=True)
    flat = torch.randn(1 * 2 * 300 * 64 + 1, generator=gen, device="cuda", dtype=torch.float16)
    shifted = flat[1:].view(1, 2, 300, 64)  # 2 bytes off a 16-byte boundary
    assert not gf.readable(shifted)
    calls.clear()
    got = ta.fa2_backward(q, k, v, out, lse, shifted, causal=True, gluon=True)
    want = ta.fa2_backward(q, k, v, out, lse, shifted.clone(), causal=True, gluon=True)
    assert calls and all(torch.equal(a, b) for a, b in zip(got, want))
    _, dk, dv, _ = ta.fa2_backward(q[:, :, :0], k, v, out[:, :, :0], lse[:, :, :0], shifted[:, :, :0], gluon=True)
    assert (dk == 0).all() and (dv == 0).all()
