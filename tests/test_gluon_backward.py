"""The Gluon dK/dV kernel of Hopper (flashverify_kernels/hopper/backward.py): when it runs, that it compiles without
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

from flashverify_kernels.hopper import backward as gb  # noqa: E402
from flashverify_kernels.hopper import forward as gf  # noqa: E402
from flashverify_kernels.triton import replay  # noqa: E402
from flashverify_kernels.triton import attention as ta  # noqa: E402
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


def _dq_programs(len_k: int) -> int:
    return -(-len_k // (2 * gb.BLOCK_N))


@pytest.mark.parametrize("causal, rotate", [(False, True), (True, False), (False, False)],
                         ids=["rotated", "causal", "in-order"])
def test_dq_order_is_a_total_order_that_runs_to_the_end(causal, rotate):
    """The ordered form's walk (:func:`gluon_backward.dq_order`, the kernel's ``_tile`` in Python): on every Q
    tile the programs that add to it hold the ranks 0..n-1 once each (the causal ones: exactly those that
    see the tile); in any interleaving of the programs, each adding to a tile only when its counter equals
    its rank, every program reaches its end (no wait on a program that waits, in turn, on it); rotated and
    causal, a program's predecessor on a tile reaches the tile at the same step or earlier, so that
    programs running in step seldom wait."""
    import random
    rng = random.Random(0)
    for len_q in (1, 63, 64, 65, 200, 333, 777, 1024, 4100):
        for len_k in (1, 100, 129, 256, 457, 1000, 4100):
            programs = _dq_programs(len_k)
            walks = [gb.dq_order(p, programs, len_q, len_k, causal, rotate) for p in range(programs)]
            tiles: dict[int, list] = {}
            for p, walk in enumerate(walks):
                for step, (tile, rank) in enumerate(walk):
                    tiles.setdefault(tile, []).append((rank, step, p))
            for tile, adders in tiles.items():
                assert sorted(r for r, _, _ in adders) == list(range(len(adders))), (len_q, len_k, tile, adders)
                if causal:  # the programs whose keys some row of the tile sees, causal (bottom-right)
                    last_row = min(tile * gb.BLOCK_M + gb.BLOCK_M, len_q) - 1
                    sees = [p for p in range(programs) if p * 2 * gb.BLOCK_N <= last_row + len_k - len_q]
                    assert sorted(p for _, _, p in adders) == sees, (len_q, len_k, tile)
                if causal or rotate:
                    by_rank = sorted(adders)
                    assert all(a[1] <= b[1] for a, b in zip(by_rank, by_rank[1:])), (len_q, len_k, tile, by_rank)
            if not causal:
                assert all(sorted(t for t, _ in walk) == list(range(-(-len_q // gb.BLOCK_M))) for walk in walks)
            counters = {tile: 0 for tile in tiles}
            at = [0] * programs
            for _ in range(len(walks) * max(map(len, walks), default=0) * 4 + 10):
                waiting = [p for p in range(programs) if at[p] < len(walks[p])]
                if not waiting:
                    break
                ready = [p for p in waiting if counters[walks[p][at[p]][0]] == walks[p][at[p]][1]]
                assert ready, f"every unfinished program waits: Nq={len_q} Nk={len_k}"
                p = rng.choice(ready)
                counters[walks[p][at[p]][0]] += 1
                at[p] += 1
            assert all(at[p] == len(walks[p]) for p in range(programs))
            assert all(counters[t] == len(a) for t, a in tiles.items())


def test_ordered_dq_needs_head_dim_128_and_a_head_that_fits_the_sms(monkeypatch):
    class Props:
        multi_processor_count = 132
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    fits = 132 * 2 * gb.BLOCK_N
    monkeypatch.delenv(gb.ORDERED_ENV, raising=False)
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    assert gb.ordered_dq(128, fits, "cuda")
    assert not gb.ordered_dq(128, fits + 1, "cuda")
    assert not gb.ordered_dq(64, 1024, "cuda")
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")  # an MPS client's share of the SMs
    assert gb.ordered_dq(128, 66 * 2 * gb.BLOCK_N, "cuda") and not gb.ordered_dq(128, 67 * 2 * gb.BLOCK_N, "cuda")
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    monkeypatch.setenv(gb.ORDERED_ENV, "0")
    assert not gb.ordered_dq(128, 1024, "cuda")
    with pytest.raises(ValueError, match="dq_sum"):
        t = torch.zeros(1, 1, 4, 128, dtype=torch.float16)
        rows = torch.zeros(1, 1, 4)
        gb.dkdv(t, t, t, t, rows, rows, t, t, causal=False, scale=1.0, ordered=True)


@pytest.mark.parametrize("d, ordered, deterministic, runs_dq_kernel, adds_dq",
                         [(128, True, True, False, True), (128, False, True, True, False),
                          (64, False, True, True, False), (128, False, False, False, True)])
def test_deterministic_backward_adds_dq_in_order_where_allowed(d, ordered, deterministic, runs_dq_kernel, adds_dq,
                                                               monkeypatch):
    """Where the Gluon dK/dV kernel runs, the deterministic backward asks it to add dQ in order exactly where
    :func:`gluon_backward.ordered_dq` allows (then no dQ kernel runs, and dQ is the sum buffer's copy);
    otherwise the dQ kernel runs; deterministic=False adds dQ in any order. The Gluon kernel stubbed out
    (it writes a recognisable dQ sum), the rest of the launch runs on any machine."""
    device = "cpu" if ta.INTERPRET or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.float16
    gen = torch.Generator(device=device).manual_seed(d)
    q, k, v, dout = (torch.randn((1, 2, 70, d), generator=gen, device=device, dtype=dtype) for _ in range(4))
    out, lse = ta.fa2_forward_raw(q, k, v, gluon=False)
    got = {}

    def fake_dkdv(*args, **kw):
        got.update(kw)
        if kw["dq_sum"] is not None:
            kw["dq_sum"].fill_(7.0)

    dq_kernel = []
    real_run = ta._run
    monkeypatch.setattr(ta, "_run", lambda kernel, *a, **kw: (dq_kernel.append(kernel is ta._attn_bwd_dq),
                                                              real_run(kernel, *a, **kw))[1])
    monkeypatch.setattr(ta, "_gluon_plan", lambda *a, **kw: True)
    monkeypatch.setattr(gb, "ordered_dq", lambda head_dim, len_k, device: ordered and head_dim == 128)
    monkeypatch.setattr(gb, "dkdv", fake_dkdv)
    dq, _, _, _ = ta.fa2_backward(q, k, v, out, lse, dout, deterministic=deterministic)
    assert got["ordered"] == (ordered and deterministic)
    assert (got["dq_sum"] is not None) == adds_dq
    assert any(dq_kernel) == runs_dq_kernel
    if adds_dq:
        assert (dq == 7.0).all()


_COMPILE = r"""
from flashverify_kernels.hopper import backward as gb

for d in gb.HEAD_DIMS:
    for dt, gdt in (("fp16", gl.float16), ("bf16", gl.bfloat16)):
        for causal in (False, True):
            for form in ("det", "atomic", "ordered"):
                atomic = form != "det"
                q_rows, keys = desc(dt, gdt, gb.BLOCK_M, d), desc(dt, gdt, gb.BLOCK_N, d)
                # the atomic-dQ form's K in column halves and float32 dQ tiles; otherwise stand-ins
                kh = desc(dt, gdt, gb.BLOCK_N, d // 2) if atomic else keys
                dq = desc("fp32", gl.float32, gb.BLOCK_M, d // 2) if atomic else keys
                rows_desc = "tensordesc<fp32[1,1,2,%d],%r>" % (gb.BLOCK_M, gl.NVMMASharedLayout(
                    swizzle_byte_width=0, element_bitwidth=32, rank=4))
                signature = {"q_desc": q_rows, "k_desc": keys, "v_desc": keys, "do_desc": q_rows,
                             "rows_desc": rows_desc, "dk_desc": keys,
                             "dv_desc": keys, "kh_desc": kh, "dq_desc": dq, "lock_ptr": "*i32", "c": "fp32",
                             "scale": "fp32", **{name: "i32" for name in ("heads_kv", "group", "len_q", "len_k")},
                             **{name: "constexpr" for name in ("CAUSAL", "BLOCK_M", "BLOCK_N", "D", "STAGES",
                                                               "ATOMIC_DQ", "DS_BUFS", "DS_LAYOUT", "DK_FIRST",
                                                               "WARPGROUPS", "ROTATE", "ORDERED")}}
                ds_layout = gl.NVMMASharedLayout.get_default_for([gb.BLOCK_N, gb.BLOCK_M], gdt)
                build(f"d{d}-{dt}-{'causal' if causal else 'full'}-{form}",
                      gb._attn_bwd_dkdv_ws, signature,
                      {"CAUSAL": causal, "BLOCK_M": gb.BLOCK_M, "BLOCK_N": gb.BLOCK_N, "D": d, "STAGES": gb.STAGES,
                       "ATOMIC_DQ": atomic, "DS_BUFS": gb.DS_BUFS, "DS_LAYOUT": ds_layout,
                       "DK_FIRST": gb.DK_FIRST[d], "WARPGROUPS": gb.warpgroups(d, atomic),
                       "ROTATE": atomic and not causal, "ORDERED": form == "ordered"})
"""


@pytest.fixture(scope="module")
def compiled():
    return gluon_compile.results(_COMPILE)


@needs_gluon
@pytest.mark.parametrize("d", gb.HEAD_DIMS)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("form", ["det", "atomic", "ordered"])
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
    monkeypatch.setattr(gb, "dkdv", lambda *a, **kw: (calls.append((kw.get("dq_sum") is not None, kw.get("ordered"))),
                                                      real(*a, **kw))[1])
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = ta.fa2_forward(*leaves, causal=causal, deterministic=deterministic)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    assert calls, "the Triton dK/dV kernel ran, not the Gluon one"
    # dQ added where deterministic=False, and in order in the deterministic backward at head dim 128
    assert calls == [(not deterministic or d == 128, deterministic and d == 128)]
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
@pytest.mark.parametrize("shape", [(2, 4, 2, 2048, 2048, True), (1, 2, 2, 1500, 3000, False),
                                   (1, 3, 3, 3000, 700, False), (1, 2, 2, 777, 777, True)],
                         ids=lambda s: "-".join(map(str, s)))
def test_ordered_dq_is_reproducible_and_the_dq_kernels_sum_on_hopper(shape, monkeypatch):
    """The deterministic backward at head dim 128 adds dQ in the dK/dV kernel in a fixed order: bitwise the
    same dQ, dK and dV in five runs (many programs per head: each waits on others' turns), and dQ within a
    few roundings of the dQ kernel's (:func:`gluon_backward.ordered_dq` switched off), dK and dV bitwise
    the same where causal (same walk; the rotated walk sums them in another order)."""
    b, hq, hkv, nq, nk, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(nq + nk)
    q, dout = (torch.randn((b, hq, nq, 128), generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn((b, hkv, nk, 128), generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
    assert gb.ordered_dq(128, nk, q.device)
    runs = [ta.fa2_backward(q, k, v, out, lse, dout, causal=causal) for _ in range(5)]
    assert all(torch.equal(a, c) for run in runs[1:] for a, c in zip(runs[0][:3], run[:3]))
    monkeypatch.setattr(gb, "ordered_dq", lambda *a: False)
    replay.clear()
    kernel = ta.fa2_backward(q, k, v, out, lse, dout, causal=causal)
    torch.testing.assert_close(runs[0][0], kernel[0], rtol=1e-2, atol=1e-2 * kernel[0].abs().max().item())
    if causal:
        assert torch.equal(runs[0][1], kernel[1]) and torch.equal(runs[0][2], kernel[2])
    replay.clear()


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
