"""The Gluon forward of Hopper (flashverify_kernels/hopper/forward.py): when it runs, that it compiles without
serialized products, and (on an H100/H200) that it computes attention.

* Dispatch rules, without a GPU: :func:`gluon_forward.unsupported` names what rules a call out.
* Compilation, without a GPU: the kernel compiled for sm_90 in a fresh process (Triton's interpreter off),
  in each head dim, dtype and causal flag, and its PTX assembled by Triton's own ptxas, whose report must
  not carry note C7514 ("wgmma.mma_async instructions are serialized"): a kernel that carries a product in
  flight across its loop's back edge gets that note and loses the overlap it exists for.
* On a GPU of compute capability 9.0: ``fa2_forward_raw`` (which dispatches here) against a float64
  reference, over tails, Nq != Nk with the causal diagonal (rows that see no key), GQA, strided inputs and
  output buffers; and that the Gluon kernel, not the Triton one, ran.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from flashverify_kernels.hopper import forward as gf  # noqa: E402
from flashverify_kernels.triton import attention as ta  # noqa: E402
from tests import gluon_compile  # noqa: E402

needs_gluon = pytest.mark.skipif(not gf.AVAILABLE, reason=f"Gluon not importable: {gf.UNAVAILABLE_REASON}")


def _plain(**overrides):
    t = torch.zeros(2, 4, 64, 128, dtype=torch.float16)
    kwargs = dict(device=torch.device("cuda"), dtype=torch.float16, head_dim=128, scale=0.1, variant=False,
                  inner_scaled=False, fixed_blocks=False, tensors=(t, t, t, t))
    kwargs.update(overrides)
    return kwargs


@needs_gluon
def test_unsupported_names_each_rule(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv(gf.ENV_OFF, raising=False)
    assert gf.unsupported(**_plain()) == ""
    t = torch.zeros(2, 4, 64, 128, dtype=torch.float16)
    cases = {
        "variant": _plain(variant=True), "inner-scaled": _plain(inner_scaled=True),
        "fixed": _plain(fixed_blocks=True), "dtype": _plain(dtype=torch.float32), "head dim": _plain(head_dim=96),
        "scale": _plain(scale=-0.1), "device": _plain(device=torch.device("cpu")),
        "descriptor": _plain(tensors=(t, t.transpose(2, 3), t, t)),
    }
    for word, kwargs in cases.items():
        assert word in gf.unsupported(**kwargs), word
    assert "head dim" in gf.unsupported(**_plain(head_dim=32))
    broadcast = torch.zeros(1, 1, 64, 128, dtype=torch.float16).expand(2, 4, 64, 128)
    assert "descriptor" in gf.unsupported(**_plain(tensors=(t, broadcast, t, t)))
    # a dimension of size 1 is never stepped over: any stride; a storage offset off 16 bytes is not readable
    odd = torch.zeros(2 * 64 * 128 * 4 + 8, dtype=torch.float16)
    assert gf.readable(odd[:4 * 64 * 128].as_strided((1, 4, 64, 128), (7, 64 * 128, 128, 1)))
    assert not gf.readable(odd[1:1 + 2 * 4 * 64 * 128].view(2, 4, 64, 128))
    assert not gf.readable(odd[:4 * 64 * 128].as_strided((2, 2, 64, 128), (7, 64 * 128, 128, 1)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "capability" in gf.unsupported(**_plain())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv(gf.ENV_OFF, "0")
    assert gf.ENV_OFF in gf.unsupported(**_plain())


def _readable_by_strides(t):
    """readable's rule, stride by stride (what its contiguous fast path must agree with)."""
    size = t.element_size()
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and all(t.shape[i] == 1 or (t.stride(i) > 0 and t.stride(i) * size % 16 == 0) for i in range(3)))


@needs_gluon
def test_readable_fast_path_agrees_with_the_stride_rule():
    seen = {True: 0, False: 0}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        storage = torch.zeros(4096 + 64, dtype=dtype)
        for shape in ((1, 1, 1, 1), (2, 1, 5, 8), (1, 2, 3, 16), (2, 2, 0, 64), (3, 2, 5, 64), (1, 1, 4, 3)):
            for offset in (0, 1, 8):
                t = storage[offset:offset + torch.Size(shape).numel()].view(shape)
                for view in (t, t.transpose(1, 2), t.transpose(0, 2), t[:, :, ::2]):
                    assert gf.readable(view) == _readable_by_strides(view), (shape, dtype, offset, view.stride())
                    seen[gf.readable(view)] += 1
    assert seen[True] and seen[False]


@needs_gluon
def test_descriptors_equal_checked_ones():
    """The descriptors built from a tile shape's first, checked one (``_descriptor``) hold what Gluon's own
    constructor, with its checks, gives the same tensor."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def checked(t, rows, cols, strides):
        block = [1, 1, rows, cols]
        gdt = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[t.dtype]
        return TensorDescriptor(t, list(t.shape), strides, block, gl.NVMMASharedLayout.get_default_for(block, gdt))

    # whole rows of float16/bfloat16 (Q, K, V, O tiles); half rows as well (the atomic-dQ backward's K in
    # column halves, and its float32 dQ tiles)
    for dtype, half in ((torch.float16, False), (torch.bfloat16, False), (torch.float16, True),
                        (torch.float32, True)):
        for d in gf.HEAD_DIMS:
            cols = d // 2 if half else None
            first = torch.zeros(2, 3, 64, d, dtype=dtype)
            gf._descriptor(first, 64, cols)  # the tile shape's checked descriptor, if no other test made it
            same = torch.zeros(2, 3, 40, d, dtype=dtype)
            one_head = torch.zeros(2, 64, 1, d, dtype=dtype).transpose(1, 2)  # size-1 dim: a contiguous stride
            strided = torch.zeros(2, 40, 3, d, dtype=dtype).transpose(1, 2)
            for t, strides in ((same, list(same.stride())), (one_head, [64 * d, 64 * d, d, 1]),
                               (strided, list(strided.stride()))):
                got, want = gf._descriptor(t, 64, cols), checked(t, 64, cols or d, strides)
                assert type(got) is TensorDescriptor and got.base is t and want.base is t
                fields = [name for name in vars(want) if name != "base"]
                assert sorted(vars(got)) == sorted(vars(want))
                assert all(getattr(got, name) == getattr(want, name) for name in fields), (vars(got), vars(want))
            assert gf._descriptor(same, 64, cols).layout is gf._descriptor(strided, 64, cols).layout  # computed once


# (head dim, consumer warpgroups) pairs that gf.warpgroups chooses
WARPGROUP_CONFIGS = [(64, 2), (64, 3), (128, 2)]
_COMPILE = f"WARPGROUP_CONFIGS = {WARPGROUP_CONFIGS!r}\n" + r"""
from flashverify_kernels.hopper import forward as gf

def build_forward(key, d, groups, dt, gdt, causal):
    signature = {"q_desc": desc(dt, gdt, gf.BLOCK_M, d), "k_desc": desc(dt, gdt, gf.BLOCK_N, d),
                 "v_desc": desc(dt, gdt, gf.BLOCK_N, d), "o_desc": desc(dt, gdt, gf.BLOCK_M, d),
                 "Lse": "*fp32", **{name: "i32" for name in ("stride_lb", "stride_lh", "stride_ln")},
                 "c": "fp32", **{name: "i32" for name in ("heads_q", "group", "len_q", "len_k")},
                 **{name: "constexpr" for name in ("CAUSAL", "BLOCK_M", "BLOCK_N", "D", "WARPGROUPS",
                                                   "CONSUMER_REGS")}}
    constexprs = {"CAUSAL": causal, "BLOCK_M": gf.BLOCK_M, "BLOCK_N": gf.BLOCK_N, "D": d, "WARPGROUPS": groups,
                  "CONSUMER_REGS": gf.CONSUMER_REGS}
    build(key, gf._attn_fwd_ws, signature, constexprs)


for d, groups in WARPGROUP_CONFIGS:
    for dt, gdt in (("fp16", gl.float16), ("bf16", gl.bfloat16)):
        for causal in (False, True):
            build_forward(f"d{d}-wg{groups}-{dt}-{'causal' if causal else 'full'}", d, groups, dt, gdt, causal)
# the persistent kernel (forward() runs it where not causal, and causal over up to 16384 keys, there with the
# dynamic walk)
def build_persistent(key, d, groups, dt, gdt, causal):
    signature = {"q_desc": desc(dt, gdt, gf.BLOCK_M, d), "k_desc": desc(dt, gdt, gf.BLOCK_N, d),
                 "v_desc": desc(dt, gdt, gf.BLOCK_N, d), "o_desc": desc(dt, gdt, gf.BLOCK_M, d),
                 "Lse": "*fp32", **{name: "i32" for name in ("stride_lb", "stride_lh", "stride_ln")},
                 "c": "fp32", **{name: "i32" for name in ("heads_q", "group", "len_q", "len_k", "tiles_m",
                                                          "n_tiles")},
                 "Counter": "*i32", "tail_heads": "i32",
                 **{name: "constexpr" for name in ("CAUSAL", "BLOCK_M", "BLOCK_N", "D", "WARPGROUPS",
                                                   "CONSUMER_REGS")}}
    constexprs = {"CAUSAL": causal, "BLOCK_M": gf.BLOCK_M, "BLOCK_N": gf.BLOCK_N, "D": d, "WARPGROUPS": groups,
                  "CONSUMER_REGS": gf.CONSUMER_REGS}
    build(key, gf._attn_fwd_persistent, signature, constexprs)


for d, groups in WARPGROUP_CONFIGS:
    for dt, gdt in (("fp16", gl.float16), ("bf16", gl.bfloat16)):
        build_persistent(f"d{d}-wg{groups}-{dt}-persistent", d, groups, dt, gdt, False)
    build_persistent(f"d{d}-wg{groups}-fp16-persistent-causal", d, groups, "fp16", gl.float16, True)
"""


@pytest.fixture(scope="module")
def compiled():
    return gluon_compile.results(_COMPILE)


@needs_gluon
@pytest.mark.parametrize("d,groups", WARPGROUP_CONFIGS)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_compiles_for_sm90_without_serialized_products(compiled, d, groups, dt, causal):
    result = compiled[f"d{d}-wg{groups}-{dt}-{'causal' if causal else 'full'}"]
    gluon_compile.assert_not_serialized(result)


@needs_gluon
@pytest.mark.parametrize("d,groups", WARPGROUP_CONFIGS)
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_the_persistent_kernel_compiles_without_serialized_products(compiled, d, groups, dt):
    gluon_compile.assert_not_serialized(compiled[f"d{d}-wg{groups}-{dt}-persistent"])


@needs_gluon
@pytest.mark.parametrize("d,groups", WARPGROUP_CONFIGS)
def test_the_causal_persistent_kernel_compiles_without_serialized_products(compiled, d, groups):
    gluon_compile.assert_not_serialized(compiled[f"d{d}-wg{groups}-fp16-persistent-causal"])


@needs_gluon
@pytest.mark.parametrize("d,groups", WARPGROUP_CONFIGS)
@pytest.mark.parametrize("kind", ["causal", "persistent", "persistent-causal"])
def test_every_partition_waits_for_the_kernels_before_it(compiled, d, groups, kind):
    """Launched programmatically (gf.PROGRAMMATIC_LAUNCH), a kernel may start before the one ahead of it on the
    stream has ended: each partition (the consumer warpgroups, the producer warp) waits for that one
    (griddepcontrol.wait) before it touches global memory. One wait fewer would let a partition read inputs,
    or the walk's counter, not yet written."""
    result = compiled[f"d{d}-wg{groups}-fp16-{kind}"]
    assert "error" not in result, result.get("error")
    assert result["grid_waits"] == groups + 1


@needs_gluon
@pytest.mark.parametrize("d,groups", WARPGROUP_CONFIGS)
@pytest.mark.parametrize("kind", ["persistent", "persistent-causal"])
def test_the_dynamic_walk_leaves_its_counter_at_zero(compiled, d, groups, kind):
    """A call launches no zero fill of the dynamic walk's counter (gf.walk_counter): the kernel's last claim
    sets it back to 0 (one exchange in the causal persistent kernel, none where no counter is read)."""
    result = compiled[f"d{d}-wg{groups}-fp16-{kind}"]
    assert "error" not in result, result.get("error")
    assert result["clears"] == (kind == "persistent-causal")


def test_warpgroup_configs_are_the_chosen_ones():
    chosen = {(d, gf.warpgroups(d, causal, n, n)) for d in gf.HEAD_DIMS for causal in (False, True)
              for n in (1, 1024, 4095, 4096, 16384)}
    assert chosen == set(WARPGROUP_CONFIGS)


@pytest.mark.parametrize("len_q,causal,len_k,groups", [(16384, False, 16384, 3), (4096, False, 4096, 3),
                                                       (2048, False, 2048, 3), (1024, False, 1024, 2),
                                                       (1024, False, 16384, 2), (2048, False, 1, 3),
                                                       (1, False, 4096, 2), (2048, True, 2048, 3),
                                                       (2048, True, 2047, 2), (1024, True, 1024, 2),
                                                       (2048, True, 4096, 3), (1024, True, 4096, 2)])
def test_three_warpgroups_at_head_dim_64_where_their_tiles_pad_little(len_q, causal, len_k, groups):
    """192-row tiles at Nq = 1024 pad it to 1152 rows (1.125x 128-row tiles'): two warpgroups; at 2048 and
    4096 (1.03x) three; causal over fewer than 2048 keys, two; head dim 128, always two."""
    assert gf.warpgroups(64, causal, len_q, len_k) == groups
    assert gf.warpgroups(128, causal, len_q, len_k) == 2


@pytest.mark.parametrize("len_q", [1, 63, 64, 65, 100, 127, 128, 129, 191, 192, 193, 333, 1000, 1024, 2100, 4033])
@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_tiles_cover_every_row_from_row_0_and_causal_ones_end_at_the_last(len_q, groups, causal):
    """gf.first_row and gf.wg_row (the kernels' _first_row and _wg_row): the warpgroups' rows of a head's tiles
    cover every row, no warpgroup starts before row 0; not causal the tiles start at row 0 (the last one's
    warpgroups may start past the end), causal the last ends at the last row, no warpgroup starts past it, and
    only the first tile has rows before row 0 (the shortest tile carries the padding)."""
    rows = groups * gf.BLOCK_M
    tiles = -(-len_q // rows)
    covered = set()
    for m in range(tiles):
        start = gf.first_row(m, len_q, causal, groups)
        assert start >= 0 or (causal and m == 0), (m, start)
        for w in range(groups):
            first = gf.wg_row(start, w)
            assert first >= 0 and (first < len_q or not causal), (m, w, first)  # causal: none past the end
            covered |= set(range(first, min(first + gf.BLOCK_M, len_q)))
    assert covered == set(range(len_q))
    last = gf.first_row(tiles - 1, len_q, causal, groups) + rows
    assert last == len_q if causal else last == tiles * rows


def _on_hopper() -> bool:
    return (torch.cuda.is_available() and not ta.INTERPRET and gf.AVAILABLE
            and torch.cuda.get_device_capability() == (9, 0))


def _reference(q, k, v, causal, scale):
    """float64 attention with bottom-right causal alignment; rows that see no key give 0 and -inf."""
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = scale * q64 @ k64.transpose(-1, -2)
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        keep = torch.arange(nk, device=q.device)[None, :] <= torch.arange(nq, device=q.device)[:, None] + nk - nq
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v64, lse


# (B, Hq, Hkv, Nq, Nk, D, causal, layout): tails of every size class, Nq != Nk both ways (Nq > Nk, causal:
# the first rows see no key), GQA, [B, N, H, D] storage; at head dim 64 programs of three warpgroups (not causal,
# or causal over 2048 keys or more, where 192-row tiles pad little: warpgroups()), not causal the last with its
# third or its last two warpgroups past the end (Nq = 700, 4033), causal the first with warpgroups that would start
# before row 0 and run rows from row 0 on, some of them twice (Nq = 333, 4500, 2100; and 129, 63 with two).
SHAPES = [
    (2, 4, 4, 1, 1, 64, False, "bhnd"), (1, 2, 2, 63, 65, 128, True, "bhnd"), (2, 3, 3, 129, 127, 64, True, "bhnd"),
    (1, 4, 2, 200, 333, 128, False, "bhnd"), (1, 4, 1, 300, 100, 128, True, "bhnd"), (2, 2, 2, 256, 256, 64, True, "bnhd"),
    (1, 8, 2, 1000, 1000, 128, True, "bnhd"), (1, 2, 2, 100, 1024, 64, True, "bhnd"), (1, 2, 2, 517, 517, 128, False, "bnhd"),
    (2, 4, 2, 700, 300, 64, False, "bhnd"), (1, 2, 2, 333, 4100, 64, True, "bnhd"),
    (1, 4, 2, 4500, 4500, 64, True, "bhnd"), (1, 2, 2, 4033, 200, 64, False, "bhnd"),
    (1, 4, 2, 2100, 2100, 64, True, "bnhd"),
]


@pytest.mark.skipif(not _on_hopper(), reason="the Gluon forward runs on a GPU of compute capability 9.0 only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_matches_float64_on_hopper(shape, dtype, monkeypatch):
    b, hq, hkv, nq, nk, d, causal, layout = shape
    gen = torch.Generator(device="cuda").manual_seed(nq * 7 + nk)

    def make(h, n):
        if layout == "bnhd":
            return torch.randn((b, n, h, d), generator=gen, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=dtype)

    q, k, v = make(hq, nq), make(hkv, nk), make(hkv, nk)
    calls = []
    real = gf.forward
    monkeypatch.setattr(gf, "forward", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    out_buf = torch.full((b, nq, hq, d), float("nan"), device="cuda", dtype=dtype).transpose(1, 2)
    lse_buf = torch.full((b, nq, hq), float("nan"), device="cuda", dtype=torch.float32).transpose(1, 2)
    out, lse = ta.fa2_forward_raw(q, k, v, causal=causal, out=out_buf, lse=lse_buf)
    assert calls, "the Triton forward ran, not the Gluon one"
    ref_out, ref_lse = _reference(q, k, v, causal, d ** -0.5)
    unit = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    # out: inputs rounded once, p rounded to the input dtype, output rounded once: a few units of the dtype
    assert torch.isfinite(out).all()
    assert (out.double() - ref_out).abs().max().item() <= 4 * unit * max(1.0, ref_out.abs().max().item())
    blind = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), blind) and (out[blind.expand_as(out[..., 0])] == 0).all()
    if (~blind).any():  # the LSE: float32 sums of exactly rounded products, no rounding to the dtype
        assert (lse[~blind].double() - ref_lse[~blind]).abs().max().item() <= 1e-4


@pytest.mark.skipif(not _on_hopper(), reason="the Gluon forward runs on a GPU of compute capability 9.0 only")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lse_exact_to_float32_rounding_when_the_max_comes_first(d, dtype):
    """A row's max in its first KV block (a dominant key: m c ~ 50-70 in log2 units) and 24 blocks after it:
    the running sum is rescaled 24 times by ``2^(mc_old - mc_new)``, which must be exactly 1 where the max
    held. Formed as ``2^(m_old c - fl(m_new c))`` (a contracted multiply), each rescale is off by up to half
    an ulp of ``m c`` and the LSE drifts by up to 24 of them (on an H200: 5.9e-5 where 3 ulps of the LSE
    are 1.1e-5)."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn((1, 8, 64, d), generator=gen, device="cuda", dtype=torch.float64).abs()
    k = torch.randn((1, 8, 3183, d), generator=gen, device="cuda", dtype=torch.float64)
    k[:, :, 3] = 8.0
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn((1, 8, 3183, d), generator=gen, device="cuda", dtype=dtype)
    _, lse = ta.fa2_forward_raw(q, k, v, causal=False, scale=0.1, gluon=True)
    _, ref_lse = _reference(q, k, v, False, 0.1)
    ulp = torch.exp2(torch.floor(torch.log2(ref_lse.abs())) - 23)  # of float32 at each LSE (40-90 here)
    err = (lse.double() - ref_lse).abs() / ulp
    assert err.max().item() <= 3, f"LSE off by up to {err.max().item():.1f} float32 ulps (3 allowed)"


# (B, Hq, Hkv, Nq, Nk, D): more tiles than a card has SMs, so that the persistent kernel's programs walk several
# tiles each (its K/V ring and Q buffers run on from tile to tile); tails, Nq != Nk both ways, GQA
PERSISTENT_SHAPES = [(4, 16, 16, 1000, 1000, 128), (8, 8, 2, 777, 1500, 128), (3, 16, 4, 2000, 333, 64),
                     (16, 12, 12, 600, 600, 64), (2, 40, 8, 1100, 2100, 64)]


@pytest.mark.skipif(not _on_hopper(), reason="the Gluon forward runs on a GPU of compute capability 9.0 only")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", PERSISTENT_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_persistent_kernel_equals_the_per_tile_one(shape, causal, monkeypatch):
    """Both kernels run the same steps on each tile: outputs and LSE bitwise equal, whichever walks the tiles."""
    b, hq, hkv, nq, nk, d = shape
    assert -(-nq // (gf.warpgroups(d, causal, nq, nk) * gf.BLOCK_M)) * b * hq > 2 * gf._sm_count(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(nq + nk)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16, generator=g) * 2 for _ in range(2))
    results = []
    for walk in (False, True):
        monkeypatch.setattr(gf, "persistent", lambda causal, len_k, walk=walk: walk)
        out, lse = torch.full_like(q, float("nan")), torch.full((b, hq, nq), float("nan"), device="cuda")
        gf.forward(q, k, v, out, lse, causal=causal, scale=d ** -0.5)
        results.append((out, lse))
    (out0, lse0), (out1, lse1) = results
    assert torch.isfinite(out0).all() and not torch.isnan(lse0).any()
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)


@pytest.mark.skipif(not _on_hopper(), reason="the Gluon forward runs on a GPU of compute capability 9.0 only")
def test_the_walk_counter_is_left_at_zero_across_calls_streams_and_graphs():
    """No call zeroes the dynamic walk's counter (gf.walk_counter): each causal call's kernel leaves it at 0 for
    the next. Calls of other shapes one after another (other counts of units and programs), on two streams
    and replayed from a CUDA graph must each give what the per-tile kernel (no counter) gives, and leave
    every counter at 0; a counter left at its last claim would have the next call's programs take no tile."""
    device = torch.device("cuda")

    def inputs(b, h, n, d, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3)]

    def call(q, k, v, walk=True):
        out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")
        real = gf.persistent
        try:
            gf.persistent = (lambda causal, len_k: real(causal, len_k)) if walk else (lambda causal, len_k: False)
            gf.forward(q, k, v, out, lse, causal=True, scale=q.shape[-1] ** -0.5)
        finally:
            gf.persistent = real
        return out, lse

    # the last: as many programs as units, each program's first unit its own, its first claim past the end
    cases = [inputs(8, 16, 1000, 64, 1), inputs(3, 40, 2100, 64, 2), inputs(4, 16, 777, 128, 3),
             inputs(8, 16, 1000, 64, 4), inputs(1, 2, 1000, 64, 5)]
    expected = [call(*c, walk=False) for c in cases]
    for c, want in zip(cases, expected):
        got = call(*c)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert gf.walk_counter(device).item() == 0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = [call(*c) for c in cases]
        side_counter = gf.walk_counter(device)
    torch.cuda.current_stream().wait_stream(side)
    assert side_counter is not gf.walk_counter(device) and side_counter.item() == 0
    assert all(torch.equal(g, w) for pair, want in zip(got, expected) for g, w in zip(pair, want))
    q, k, v = cases[1]
    graph = torch.cuda.CUDAGraph()
    call(q, k, v)  # compiled before the capture
    with torch.cuda.graph(graph):
        captured = call(q, k, v)
    for _ in range(3):
        captured[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], expected[1][0]) and torch.equal(captured[1], expected[1][1])
    assert gf.walk_counter(device).item() == 0


def test_persistent_where_not_causal_and_causal_over_short_rows():
    limit = gf.PERSISTENT_CAUSAL_MAX_KEYS
    assert all(gf.persistent(False, n) for n in (1, 1024, limit, limit + 1, 16384))
    assert gf.persistent(True, 1) and gf.persistent(True, limit) and not gf.persistent(True, limit + 1)


def test_gluon_keyword_is_checked():
    q = torch.randn(1, 2, 16, 64, dtype=torch.float32 if ta.INTERPRET else torch.float16,
                    device="cpu" if ta.INTERPRET or not torch.cuda.is_available() else "cuda")
    with pytest.raises(TypeError, match="gluon=1"):
        ta.fa2_forward_raw(q, q, q, gluon=1)
    if not _on_hopper():
        # gluon=True names what rules the call out (here at least the device or the dtype)
        with pytest.raises(ValueError, match="gluon=True, but the Gluon forward does not take this call"):
            ta.fa2_forward_raw(q, q, q, gluon=True)
    out, lse = ta.fa2_forward_raw(q, q, q, gluon=False)
    assert out.shape == q.shape and lse.shape == q.shape[:3]


@pytest.mark.skipif(not _on_hopper(), reason="the Gluon forward runs on a GPU of compute capability 9.0 only")
def test_routing_on_hopper(monkeypatch):
    """gluon=None: Gluon unless the tiles are fixed; gluon=False: never; gluon=True: always, through
    contiguous copies where no descriptor reads a tensor (here a storage offset of one element)."""
    calls = []
    real = gf.forward
    monkeypatch.setattr(gf, "forward", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn((1, 2, 300, 64), generator=gen, device="cuda", dtype=torch.float16) for _ in range(3))
    expected = {(None, None): 1, (None, 64): 0, (False, None): 0, (True, 64): 1}
    for (gluon, block), runs in expected.items():
        calls.clear()
        ta.fa2_forward_raw(q, k, v, causal=True, gluon=gluon, block_m=block, block_n=block)
        assert len(calls) == runs, (gluon, block)
    flat = torch.randn(1 * 2 * 300 * 64 + 1, generator=gen, device="cuda", dtype=torch.float16)
    shifted = flat[1:].view(1, 2, 300, 64)  # 2 bytes off a 16-byte boundary
    out_buf = torch.empty(1 * 2 * 300 * 64 + 1, device="cuda", dtype=torch.float16)[1:].view(1, 2, 300, 64)
    assert gf.unsupported(device=q.device, dtype=q.dtype, head_dim=64, scale=0.125, variant=False,
                          inner_scaled=False, fixed_blocks=False, tensors=(shifted,))
    calls.clear()
    out, lse = ta.fa2_forward_raw(shifted, k, v, causal=True, gluon=True, out=out_buf)
    assert calls and out.data_ptr() == out_buf.data_ptr()
    ref_out, ref_lse = _reference(shifted, k, v, True, 64 ** -0.5)
    assert (out.double() - ref_out).abs().max().item() <= 4 * 2.0 ** -10
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-4
    # no key at all: out = 0, lse = -inf (no descriptor of an empty tensor is built)
    out, lse = ta.fa2_forward_raw(q, k[:, :, :0], v[:, :, :0], gluon=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    # a batch of one whose batch stride is no multiple of 16 bytes: read in place
    odd = torch.randn(2 * 300 * 64 + 8, generator=gen, device="cuda", dtype=torch.float16)
    q1 = odd[:2 * 300 * 64].as_strided((1, 2, 300, 64), (3, 300 * 64, 64, 1))
    assert gf.readable(q1)
    out, lse = ta.fa2_forward_raw(q1, k, v, gluon=True)
    ref_out, _ = _reference(q1, k, v, False, 64 ** -0.5)
    assert (out.double() - ref_out).abs().max().item() <= 4 * 2.0 ** -10
    with pytest.raises(ValueError, match="head dim 32"):
        ta.fa2_forward_raw(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(), gluon=True)


@pytest.mark.parametrize("tiles_m,heads,programs", [(8, 256, 132), (8, 512, 132), (32, 64, 132), (64, 32, 132),
                                                    (128, 16, 132), (3, 7, 5), (5, 1, 8), (1, 300, 132),
                                                    (11, 33, 114), (16, 10, 132), (2, 2, 132)])
def test_dynamic_walk_takes_every_tile_once_and_ends_on_the_shortest(tiles_m, heads, programs):
    """gf.unit (the kernel's causal _unit in Python): over its units (gf.units), every (head, Q tile) once; a
    pair's tiles of one head, the longer first, adding up to the same work; the tail's tiles (gf.tail_heads)
    one a unit and never longer than the one before, so that the walk ends on its shortest tiles."""
    n_tiles = tiles_m * heads
    programs = min(programs, n_tiles)
    tail = gf.tail_heads(programs, tiles_m, heads)
    assert 1 <= tail <= heads and tail * tiles_m >= min(n_tiles, gf.TAIL_UNITS_PER_PROGRAM * programs)
    seen, lengths = [], []
    for u in range(gf.units(tiles_m, n_tiles, tail)):
        tiles = gf.unit(u, tiles_m, n_tiles, tail)
        assert all(0 <= bh < heads and 0 <= m < tiles_m for bh, m in tiles)
        if len(tiles) == 2:
            (bh0, m0), (bh1, m1) = tiles
            assert bh0 == bh1 < heads - tail and m0 > m1 and m0 + m1 == tiles_m - 1
        else:
            lengths.append(tiles[0][1] if tiles[0][0] >= heads - tail else None)
        seen += tiles
    assert sorted(seen) == [(bh, m) for bh in range(heads) for m in range(tiles_m)]
    tail_lengths = [m for m in lengths if m is not None]
    assert len(tail_lengths) == tail * tiles_m and tail_lengths == sorted(tail_lengths, reverse=True)
    assert tail_lengths[-1] == 0


@pytest.mark.parametrize("tiles_m,heads,programs", [(8, 256, 132), (32, 64, 132), (128, 16, 132), (3, 7, 5),
                                                    (5, 1, 8), (1, 300, 132), (11, 33, 114), (16, 10, 132)])
def test_persistent_walk_takes_every_tile_once(tiles_m, heads, programs):
    """gf.walk (the kernel's _walk in Python, not causal): over the rounds of the kernel's loop, every (head, Q
    tile) once, no program more than one tile over another."""
    n_tiles = tiles_m * heads
    programs = min(programs, n_tiles)
    seen, work = [], [0] * programs
    for p in range(programs):
        for it in range(gf.rounds(programs, tiles_m, n_tiles)):
            tile = gf.walk(it, p, programs, tiles_m, n_tiles)
            if tile is not None:
                bh, m = tile
                assert 0 <= bh < heads and 0 <= m < tiles_m
                seen.append((bh, m))
                work[p] += 1
    assert sorted(seen) == [(bh, m) for bh in range(heads) for m in range(tiles_m)]
    assert max(work) - min(work) <= 1
