"""Bad inputs to the shipped kernels raise clear exceptions naming what was wrong and what is allowed."""

import pytest
import torch

from flashverify_kernels.pytorch import adapters, blocked, online_softmax

F = torch.float32


def qkv(b=1, hq=2, hkv=1, nq=5, nk=6, d=8, dtype=F):
    return tuple(torch.randn(*shape).to(dtype) for shape in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)))


FORWARDS = [blocked.fa2_forward, blocked.fa1_forward, blocked.fa2_forward_raw, adapters.eager_forward,
            adapters.sdpa_math_forward]


@pytest.mark.parametrize("fn", FORWARDS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("make, error, words", [
    (lambda: (torch.randn(2, 5, 8), *qkv()[1:]), ValueError, r"q.shape=\(2, 5, 8\), but should be 4-D"),
    (lambda: (qkv()[0].numpy(), *qkv()[1:]), TypeError, "q is a ndarray, but should be a torch.Tensor"),
    (lambda: qkv(dtype=torch.int32), ValueError, "q.dtype=int32, but should be one of float16, bfloat16, float32, float64"),
    (lambda: (qkv()[0].half(), *qkv()[1:]), ValueError, "q, k, v dtypes are float16, float32, float32, but should be equal"),
    (lambda: (qkv()[0], qkv()[1], qkv(nk=7)[2]), ValueError, r"k.shape=\(1, 1, 6, 8\) and v.shape=\(1, 1, 7, 8\) should agree in \[batch, heads, seq_len\]"),
    (lambda: (qkv()[0], *qkv(d=4)[1:]), ValueError, "q has head_dim 8 but k has head_dim 4"),
    (lambda: (qkv(hq=3)[0], *qkv(hkv=2)[1:]), ValueError, "q has 3 heads and k, v have 2"),
    (lambda: (qkv(b=2)[0], *qkv()[1:]), ValueError, "q has batch 2 but k and v have batch 1"),
], ids=["rank", "type", "int-dtype", "mixed-dtype", "kv-shape", "head-dim", "heads", "batch"])
def test_bad_tensors(fn, make, error, words):
    with pytest.raises(error, match=words):
        fn(*make(), causal=False, scale=None)


def test_a_value_head_dim_of_its_own_is_refused_where_not_taken_and_bounded_where_it_is():
    """v [B, Hkv, Nk, Dv] with Dv != D: the kernels that take it return out [..., Dv]; one that does not says so."""
    q, k, _ = qkv()
    v = torch.randn(1, 1, 6, 3)
    out, lse = blocked.fa2_forward(q, k, v, causal=False, scale=None)
    assert out.shape == (1, 2, 5, 3) and lse.shape == (1, 2, 5)
    with pytest.raises(ValueError, match=r"sdpa_math: k.shape=\(1, 1, 6, 8\) and v.shape=\(1, 1, 6, 3\) should be "
                                         r"equal: this kernel takes no value head dim of its own"):
        adapters.sdpa_math_forward(q, k, v, causal=False, scale=None)
    with pytest.raises(ValueError, match=r"out.shape=\(1, 2, 5, 8\) and dout.shape=\(1, 2, 5, 8\) should be "
                                         r"\(1, 2, 5, 3\) \(q's \[batch, heads_q, len_q\] and v's head_dim\)"):
        blocked.fa2_backward(q, k, v, torch.zeros(1, 2, 5, 8), lse, torch.zeros(1, 2, 5, 8))


@pytest.mark.parametrize("fn", [blocked.fa2_forward, blocked.fa1_forward])
@pytest.mark.parametrize("kwargs, words", [
    ({"block_m": 0}, "block_m=0, but should be a positive int"),
    ({"block_n": 2.5}, "block_n=2.5, but should be a positive int"),
    ({"block_m": True}, "block_m=True, but should be a positive int"),
    ({"scale": float("nan")}, "scale=nan, but should be a finite float or None"),
    ({"scale": "0.5"}, "scale='0.5', but should be a finite float or None"),
])
def test_bad_settings(fn, kwargs, words):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=words):
        fn(q, k, v, **{"causal": False, "scale": None, **kwargs})


def test_backward_checks_its_extra_tensors():
    q, k, v = qkv()
    out, lse = blocked.fa2_forward_raw(q, k, v)
    with pytest.raises(ValueError, match=r"lse.shape=\(1, 2\), but should be \(1, 2, 5\)"):
        blocked.fa2_backward(q, k, v, out, lse[..., 0], out)
    with pytest.raises(ValueError, match=r"out.shape=\(1, 2, 2, 8\) and dout.shape=\(1, 2, 5, 8\) should be \(1, 2, 5, 8\)"):
        blocked.fa2_backward(q, k, v, out[:, :, :2], lse, out)
    with pytest.raises(TypeError, match="dout is a NoneType"):
        blocked.fa2_backward(q, k, v, out, lse, None)


@pytest.mark.parametrize("fn", [online_softmax.streaming_softmax, online_softmax.batched_softmax,
                                online_softmax.blocked_softmax])
def test_softmax_bad_inputs(fn):
    with pytest.raises(ValueError, match=r"x.shape=\(3,\), but should be 2-D"):
        fn(torch.randn(3))
    with pytest.raises(ValueError, match="x.dtype=torch.int64"):
        fn(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="x is a list"):
        fn([[1.0]])


def test_blocked_softmax_bad_block():
    with pytest.raises(ValueError, match="block_n=0, but should be a positive int"):
        online_softmax.blocked_softmax(torch.randn(2, 3), block_n=0)


def test_gqa_and_strided_inputs_are_accepted():
    q, k, v = qkv(hq=4, hkv=2)
    out, lse = blocked.fa2_forward(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, causal=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
