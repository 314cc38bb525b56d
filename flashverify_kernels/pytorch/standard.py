"""Standard attention with its intermediates in the input dtype: the FlashAttention-3 paper's FP16 baseline.

The FlashAttention-3 paper (arXiv 2407.08608, section 4.3, Table 3) compares FlashAttention-2 and -3 with
a "standard implementation" of attention whose intermediate results (the softmax) stay in FP16, where
FlashAttention keeps them in FP32. This is that implementation, written as PyTorch runs attention eagerly
when every tensor is half precision (the same order of operations as the no-upcast reference of
flash_attn's own tests, ``attention_ref(..., upcast=False, reorder_ops=True)``)::

    k_scaled = k * scale                      rounded to the input dtype
    s        = q @ k_scaled^T                 one matmul, its result rounded to the input dtype
    s        = s masked to -inf where a key is hidden
    p        = softmax(s)                     computed by torch.softmax on the input dtype, stored in it
    out      = p @ v                          one matmul, its result rounded to the input dtype

How a matmul accumulates inside (float32 on CUDA tensor cores and in PyTorch's CPU half-precision
kernels) is the framework's business; what this implementation fixes is that the scores and the
probabilities are materialised in the input dtype. In float32 and float64 it is ordinary eager attention.

Unlike :mod:`references.baseline` (criterion 1's eager attention: scores and softmax in float32, only
``P`` rounded), nothing here is up-cast: the extra error is the rounding of the scores, which the
softmax's exponential turns into a relative error of ``|s| u`` in each probability (``u`` the unit
roundoff of the dtype), large where the scores are large (outliers).

It is a point of comparison, not a kernel that meets the suite's criteria: ``pytest verify --impl
flashverify_kernels/pytorch/standard.py:STANDARD`` finds its error above criterion 1 and 2 in float16 and bfloat16, and
scores beyond the dtype's range (the ``large_logits`` class) overflow to inf and turn their rows to NaN,
as they do in any framework that runs attention this way.

It follows the contract of README.md ("The contract"): bottom-right causal masks, grouped-query
attention (query head ``h`` reads key/value head ``h // (Hq // Hkv)``), any strides, ``scale=None`` for
``1/sqrt(D)``; a row with no visible key gives 0. It returns ``out`` alone (a framework's standard
attention keeps no LSE): the suite skips the LSE properties. Gradients flow through autograd, with the
backward's intermediates in the input dtype too.
"""

from __future__ import annotations

import torch

from flashverify_kernels import _validate
from flashverify_kernels.declaration import ALL_DTYPES, Implementation

NAME = "standard"


def standard_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                     scale: float | None = None) -> torch.Tensor:
    """``softmax(q (scale k)^T, masked) v`` with the scores and the softmax in the input dtype."""
    scale = _validate.check_attention_inputs(q, k, v, kernel=NAME, dtypes=ALL_DTYPES, scale=scale)
    if not isinstance(causal, bool):
        raise TypeError(f"{NAME}: causal={causal!r}, but should be a bool")
    b, hq, len_q, d = q.shape
    group = hq // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ (k * scale).transpose(-1, -2)  # [B, Hq, Nq, Nk] in the input dtype
    hidden = None
    if causal:
        len_k = k.shape[2]
        hidden = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).triu(len_k - len_q + 1)
        # Selected, never multiplied: a NaN or inf in a hidden key cannot reach the row.
        s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s, dim=-1)  # in the input dtype
    if hidden is not None:
        # A row that sees no key has softmax(-inf, ..., -inf) = NaN: the contract asks for out = 0.
        p = p.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)
    return p @ v


STANDARD = Implementation(
    name=NAME, forward=standard_forward, gqa=True, returns_lse=False, selector="flashverify_kernels.pytorch.standard:STANDARD",
    description="standard attention, scores and softmax stored in the input dtype (the FlashAttention-3 "
                "paper's FP16 baseline)",
)
