"""The Triton decoding kernel with a value head dim of its own (``v [num_pages, page_size, Hkv, Dv]``,
``Dv != D``, as multi-head latent attention decodes): ``out [S, Hq, Nq, Dv]`` and the LSE against a float64
softmax computed here, in Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``).

The cache is built by :class:`flashverify_kernels.conventions.Layout` (pages in a permuted order, NaN in the
slots and pages no sequence uses). The tolerances are tight enough that V read with q/k's tile width, or
the default scale taken as ``1/sqrt(Dv)``, fails; float16 only beside float32 (the interpreter's bfloat16
``tl.dot`` is not trustworthy)."""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from flashverify_kernels.conventions import Layout  # noqa: E402
from flashverify_kernels.triton.decode import DEVICES, HEAD_DIMS, INTERPRET, decode_forward  # noqa: E402
from references.spec import AttentionSpec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
pytestmark = pytest.mark.skipif(DEVICE not in DEVICES, reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")

# (D, Dv, dtype, Hq, Hkv, Nq, seqlens_k, page_size, num_splits, causal, sinks): both orders of D and Dv
# (v's tile wider and narrower than q/k's; 24 and 40 fill no power-of-two tile, so columns are masked),
# GQA, an empty cache, pages that do not divide the lengths, split-KV, several causal queries with fewer
# keys than queries (rows that see nothing), sinks (split 0's running state), and Dv == D as before.
CASES = [
    (16, 24, torch.float32, 4, 2, 3, (37, 0, 11), 5, 3, True, None),
    (24, 16, torch.float32, 4, 1, 1, (20, 45), 7, 2, False, None),
    (24, 40, torch.float32, 2, 2, 4, (2, 29), 6, 4, True, (0.5, -1.0)),
    (24, 16, torch.float16, 4, 2, 2, (26, 9), 5, 2, True, None),
    (24, 24, torch.float32, 2, 1, 2, (19, 30), 4, 2, True, None),
]
IDS = [f"D{c[0]}-Dv{c[1]}-{str(c[2]).removeprefix('torch.')}-Hq{c[3]}-Hkv{c[4]}-Nq{c[5]}-splits{c[8]}"
       f"{'-causal' if c[9] else ''}{'-sinks' if c[10] else ''}" for c in CASES]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}  # relative to the reference's largest |value|


def _reference(q, k, v, lens, *, causal, sinks):
    """Float64 ``(out [S, Hq, Nq, Dv], lse [S, Hq, Nq])``: softmax attention of sequence ``s``'s queries over
    its ``lens[s]`` keys of the packed ``k``, ``v [1, Hkv, total, D or Dv]``, bottom-right causal, scale
    ``1/sqrt(D)``; a sink adds ``exp(sink)`` to the denominator; a row with nothing to see has out 0, lse -inf."""
    q, k, v = q.double(), k[0].double(), v[0].double()
    group = q.shape[1] // k.shape[0]
    n_q = q.shape[2]
    outs, lses, start = [], [], 0
    for s, n in enumerate(lens):
        keys = k[:, start:start + n].repeat_interleave(group, 0)
        values = v[:, start:start + n].repeat_interleave(group, 0)
        start += n
        scores = q[s] @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [Hq, Nq, n]
        if causal:  # query i is key position n - Nq + i
            hidden = torch.arange(n)[None, :] > torch.arange(n_q)[:, None] + n - n_q
            scores = scores.masked_fill(hidden, -math.inf)
        if sinks is not None:
            scores = torch.cat([scores, torch.tensor(sinks, dtype=torch.float64)[:, None, None].expand(-1, n_q, 1)], -1)
        lse = torch.logsumexp(scores, -1)
        p = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])  # rows with nothing visible: p = 0
        outs.append(p[..., :n] @ values)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("d, dv, dtype, hq, hkv, n_q, lens, page_size, num_splits, causal, sinks", CASES, ids=IDS)
def test_value_head_dim_of_its_own_equals_the_float64_reference(d, dv, dtype, hq, hkv, n_q, lens, page_size,
                                                                num_splits, causal, sinks):
    assert d in HEAD_DIMS and dv in HEAD_DIMS
    layout = Layout(AttentionSpec(causal=causal, sequences="paged", seqlens_q=(n_q,) * len(lens), seqlens_k=lens,
                                  page_size=page_size, page_seed=5))
    g = torch.Generator().manual_seed(d * 1000 + dv)
    q = torch.randn(len(lens), hq, n_q, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, sum(lens), d, generator=g).to(dtype)
    v = torch.randn(1, hkv, sum(lens), dv, generator=g).to(dtype)
    block_table, _, _ = layout.pages(DEVICE)
    out, lse = decode_forward(
        q.to(DEVICE), layout.keys_in(k.to(DEVICE)), layout.keys_in(v.to(DEVICE)), block_table=block_table,
        seqlens_k=torch.tensor(lens, dtype=torch.int32, device=DEVICE), causal=causal, num_splits=num_splits,
        sinks=None if sinks is None else torch.tensor(sinks, dtype=torch.float32, device=DEVICE))
    ref_out, ref_lse = _reference(q, k, v, lens, causal=causal, sinks=sinks)
    assert out.shape == (len(lens), hq, n_q, dv) and out.dtype == dtype and lse.shape == ref_lse.shape
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert finite.any()
    tol = TOLERANCE[dtype]
    assert (out - ref_out).abs().max().item() <= tol * ref_out.abs().max().item()
    assert (lse[finite] - ref_lse[finite]).abs().max().item() <= tol * ref_lse[finite].abs().max().item()


def test_value_pages_that_do_not_match_the_keys_or_the_head_dims_are_refused():
    if DEVICE != "cpu":
        pytest.skip("the messages name the CPU device")
    q, k = torch.randn(2, 2, 1, 16), torch.randn(4, 4, 1, 16)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 8], dtype=torch.int32)
    bad_v = {
        r"v's head_dim=20 is not supported; supported head dims are 16..256": torch.randn(4, 4, 1, 20),
        r"v's head_dim=8 is not supported": torch.randn(4, 4, 1, 8),
        r"k.shape=\(4, 4, 1, 16\) and v.shape=\(4, 4, 2, 24\) should agree in \[num_pages, page_size, Hkv\]":
            torch.randn(4, 4, 2, 24),
        # as many slots as k's pages hold, cut into other pages
        r"k.shape=\(4, 4, 1, 16\) and v.shape=\(2, 8, 1, 24\) should agree": torch.randn(2, 8, 1, 24),
        r"q, k, v dtypes are float32, float32, float16, but should be equal": torch.randn(4, 4, 1, 24).half(),
    }
    for words, v in bad_v.items():
        with pytest.raises(ValueError, match=words):
            decode_forward(q, k, v, block_table=table, seqlens_k=lens)
