"""Declarations of the shipped Triton kernels: ``triton_softmax``, ``triton_fa1``, ``triton_fa2``.

Importing this module registers them; :func:`kernels.registry.registry` imports it and skips it when
Triton is not installed. On a machine without a GPU the kernels run in Triton's interpreter when
``TRITON_INTERPRET=1`` is set before Triton is imported: they then also declare the CPU, only small
tiles (the interpreter runs every program in Python), and the interpreter's bfloat16 ``tl.dot`` as an
environment limit.
"""

from __future__ import annotations

import torch

from kernels import triton_attention, triton_softmax
from kernels.registry import Implementation, register

INTERPRET = triton_attention.INTERPRET

_BF16_DOT_LIMIT = ((torch.bfloat16, "Triton interpreter: tl.dot on bfloat16 operands is unsupported "
                                    "(bf16 held as int16); bf16 is verified on GPU only"),)
_ENVIRONMENT_LIMITS = _BF16_DOT_LIMIT if INTERPRET else ()
# The interpreter runs every program instance in Python: cap the examples per property there.
_MAX_EXAMPLES = 10 if INTERPRET else None
# Tile sizes the suite draws. The launchers accept powers of two from 16 to 256, but float32 tiles of
# 128 rows do not fit a GPU's shared memory for large head dims, and every dtype must run every tile.
_ATTENTION_BLOCKS = (16, 32) if INTERPRET else (16, 32, 64)
_SOFTMAX_BLOCKS = (16, 32, 64) if INTERPRET else (16, 32, 64, 256, 1024)

TRITON_SOFTMAX = register(Implementation(
    name="triton_softmax", kind="softmax", forward=triton_softmax.softmax,
    dtypes=triton_softmax.DTYPES, devices=triton_softmax.DEVICES,
    block_m=(1,), block_n=_SOFTMAX_BLOCKS, autograd=False,
    description="Triton online softmax: one pass for (m, l), one pass to normalise",
))

TRITON_FA2 = register(Implementation(
    name="triton_fa2", forward=triton_attention.fa2_forward, backward=triton_attention.fa2_backward,
    dtypes=triton_attention.DTYPES, devices=triton_attention.DEVICES,
    head_dims=triton_attention.HEAD_DIMS, gqa=True,
    block_m=_ATTENTION_BLOCKS, block_n=_ATTENTION_BLOCKS, deterministic=True, out_buffers=True,
    sibling="triton_fa1",
    environment_limits=_ENVIRONMENT_LIMITS, max_examples=_MAX_EXAMPLES,
    description="Triton FlashAttention-2: outer-scaled forward, Delta/dK-dV/dQ backward without atomics",
))

TRITON_FA1 = register(Implementation(
    name="triton_fa1", forward=triton_attention.fa1_forward, backward=triton_attention.fa2_backward,
    dtypes=triton_attention.DTYPES, devices=triton_attention.DEVICES,
    head_dims=triton_attention.HEAD_DIMS, gqa=True,
    block_m=_ATTENTION_BLOCKS, block_n=_ATTENTION_BLOCKS, deterministic=True, out_buffers=True,
    environment_limits=_ENVIRONMENT_LIMITS, max_examples=_MAX_EXAMPLES,
    description="Triton FlashAttention-1: inner-scaled forward (renormalised every KV step); FA2 backward",
))
