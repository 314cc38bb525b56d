"""The adapters to PyTorch's SDPA backends: what they declare (top-left causal, out alone, CUDA only) and
their clear refusal of CPU tensors. FlexAttention's adapter, which takes every variant Flex expresses
bottom-right with its LSE, has its own tests (tests/test_flex_adapter.py)."""

import pytest
import torch

from flashverify_kernels.registry import registry

SDPA_PEERS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn")


@pytest.mark.parametrize("name", SDPA_PEERS)
def test_gpu_backends_declare_top_left_no_lse_cuda_only(name):
    impl = registry()[name]
    assert impl.causal_alignment == "top_left" and impl.returns_lse is False
    assert impl.devices == ("cuda",) and impl.in_default is False and impl.deterministic is False
    assert torch.float64 not in impl.dtypes and {torch.float16, torch.bfloat16} <= set(impl.dtypes)
    assert impl.supports_head_dim(64) and impl.supports_head_dim(128)


@pytest.mark.parametrize("name", (*SDPA_PEERS, "flex_attention"))
def test_gpu_backends_refuse_cpu_tensors_with_a_clear_error(name):
    q = torch.zeros(1, 1, 4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=f"{name}: q is on cpu, but this kernel runs on cuda"):
        registry()[name].forward(q, q, q, causal=True)
