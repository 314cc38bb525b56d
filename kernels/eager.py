"""Adapters to peers: the same-precision eager attention and PyTorch's scaled_dot_product_attention.

``eager`` is the baseline of pass criterion 1 run as a kernel (so the suite checks its own baseline).
``sdpa_math`` wraps ``torch.nn.functional.scaled_dot_product_attention`` pinned to its math backend:
it returns ``out`` alone (the LSE properties are skipped) and aligns causal masks top-left.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _validate
from kernels.registry import ALL_DTYPES, Implementation, register
from references import baseline


def eager_forward(q, k, v, *, causal: bool = False, scale: float | None = None):
    """Eager attention at the inputs' precision; gradients flow through autograd."""
    _validate.check_attention_inputs(q, k, v, kernel="eager", dtypes=ALL_DTYPES, scale=scale)
    return baseline.forward(q, k, v, causal=causal, scale=scale)


def sdpa_math_forward(q, k, v, *, causal: bool = False, scale: float | None = None):
    """``scaled_dot_product_attention`` with the math backend (top-left causal, no LSE)."""
    _validate.check_attention_inputs(q, k, v, kernel="sdpa_math", dtypes=ALL_DTYPES, scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


EAGER = register(Implementation(
    name="eager", forward=eager_forward, gqa=True,
    description="same-precision eager attention (the criterion-1 baseline)",
))
SDPA_MATH = register(Implementation(
    name="sdpa_math", forward=sdpa_math_forward, gqa=True, causal_alignment="top_left",
    returns_lse=False, description="torch scaled_dot_product_attention, math backend",
))
