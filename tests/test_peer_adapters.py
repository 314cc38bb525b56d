"""The adapters to PyTorch's SDPA backends and FlexAttention: what they declare, and (on CPU, where
the fused backends cannot run) that the FlexAttention mask they use is the top-left causal mask they
declare, so the reference compares them with the right mask."""

import warnings

import pytest
import torch

from kernels import adapters
from kernels.registry import registry
from references import attention as reference
from references.spec import AttentionSpec

GPU_PEERS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex_attention")


@pytest.mark.parametrize("name", GPU_PEERS)
def test_gpu_backends_declare_top_left_no_lse_cuda_only(name):
    impl = registry()[name]
    assert impl.causal_alignment == "top_left" and impl.returns_lse is False
    assert impl.devices == ("cuda",) and impl.in_default is False and impl.deterministic is False
    assert torch.float64 not in impl.dtypes and {torch.float16, torch.bfloat16} <= set(impl.dtypes)
    assert impl.supports_head_dim(64) and impl.supports_head_dim(128)


@pytest.mark.parametrize("name", GPU_PEERS)
def test_gpu_backends_refuse_cpu_tensors_with_a_clear_error(name):
    q = torch.zeros(1, 1, 4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=f"{name}: q is on cpu, but this kernel runs on cuda"):
        registry()[name].forward(q, q, q, causal=True)


@pytest.mark.parametrize("len_q, len_k", [(5, 9), (9, 5)])
def test_flex_attention_mask_is_the_declared_top_left_alignment(len_q, len_k):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, len_q, 16, generator=gen, dtype=torch.float64).float()
    k, v = (torch.randn(1, 2, len_k, 16, generator=gen, dtype=torch.float64).float() for _ in range(2))
    mask = flex.create_block_mask(adapters._top_left_causal, B=None, H=None, Q_LEN=len_q, KV_LEN=len_k, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": the unfused path is fine for a mask check
        out = flex.flex_attention(q, k, v, block_mask=mask)
    expected = reference.forward(q, k, v, spec=AttentionSpec(causal=True, alignment="top_left"))[0]
    assert torch.allclose(out.double(), expected, atol=1e-5), (out.double() - expected).abs().max()
    other = reference.forward(q, k, v, spec=AttentionSpec(causal=True, alignment="bottom_right"))[0]
    assert not torch.allclose(out.double(), other, atol=1e-3)
