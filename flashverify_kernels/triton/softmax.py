"""Triton online softmax over the rows of a 2-D tensor: one pass for the statistics, one to normalise.

One program owns one row ``x`` of length ``n`` and reads it ``BLOCK_N`` elements at a time. The first
pass keeps the running state of :mod:`flashverify_kernels.pytorch.online_softmax`, a scalar pair per row, in float32::

    m_new = max(m, max_j x_j);  l = l * exp(m - m_new) + sum_j exp(x_j - m_new);  m = m_new

(with ``exp(-inf - 0) = 0`` guarding a row that has seen only ``-inf`` so far), then
``lse = m + log(l)``. The second pass reads the row again and writes ``y_j = exp(x_j - lse)``, rounded
once to the input dtype. An all ``-inf`` row keeps the identity state ``(-inf, 0)`` and gives ``y = 0``
and ``lse = -inf``, never NaN. Exponentials are ``exp2`` of ``log2(e)``-scaled arguments (what a GPU
computes for ``exp`` anyway); the state and the LSE stay in natural-log units.

Elements past the end of the row are loaded as ``-inf`` and never stored. Rows and columns are addressed
through their strides, so non-contiguous inputs are read in place.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from flashverify_kernels import _validate

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEVICES = ("cpu", "cuda") if INTERPRET else ("cuda",)
# Block sizes accepted (powers of two; tl.arange needs one).
BLOCK_SIZES = tuple(2 ** i for i in range(4, 15))
_MAX_DEFAULT_BLOCK = 1024

_LOG2E = tl.constexpr(1.4426950408889634)


# --------------------------------------------------------------------------------------------------
# Capability helpers
# --------------------------------------------------------------------------------------------------

def _default_block_n(n: int) -> int:
    """The whole row in one block up to 1024 elements, at least 16."""
    return max(16, min(triton.next_power_of_2(max(n, 1)), _MAX_DEFAULT_BLOCK))


def _num_warps(block_n: int) -> int:
    return 1 if block_n <= 256 else 4 if block_n <= 2048 else 8


def _check(x, block_n, *, kernel: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{kernel}: x is a {type(x).__name__}, but should be a torch.Tensor")
    if x.dim() != 2:
        raise ValueError(f"{kernel}: x.shape={tuple(x.shape)}, but should be 2-D [rows, n]")
    if x.dtype not in DTYPES:
        raise ValueError(f"{kernel}: x.dtype={_validate.dtype_name(x.dtype)}, "
                         f"but should be one of {_validate.dtype_names(DTYPES)}")
    if x.device.type not in DEVICES:
        raise ValueError(f"{kernel}: x is on {x.device}, but this kernel runs on {', '.join(DEVICES)}"
                         + ("" if INTERPRET else " (set TRITON_INTERPRET=1 before importing triton for CPU)"))
    if block_n is not None:
        _validate.check_block("block_n", block_n, kernel=kernel, allowed=BLOCK_SIZES)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------

@triton.jit
def _softmax_rows(X, Y, Lse, n_cols, stride_xm, stride_xn, stride_ym, stride_yn,
                  BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    y_row = Y + row * stride_ym
    offs = tl.arange(0, BLOCK_N)

    # Pass 1: the running (m, l) state of the row, one block at a time.
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + offs
        x = tl.load(x_row + cols * stride_xn, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(x, axis=0))
        # Nothing but -inf seen so far: subtract 0, so exp(-inf - 0) = 0 instead of exp(NaN).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2((m_i - m_ref) * _LOG2E)
        l_i = l_i * alpha + tl.sum(tl.math.exp2((x - m_ref) * _LOG2E), axis=0)
        m_i = m_new

    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(Lse + row, lse)

    # Pass 2: y = exp(x - lse), or 0 for an all -inf row.
    lse_ref = tl.where(empty, float("inf"), lse)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + offs
        x = tl.load(x_row + cols * stride_xn, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        y = tl.math.exp2((x - lse_ref) * _LOG2E)
        if Y.dtype.element_ty == tl.bfloat16:
            # Round to nearest even on the bits, so the cast below is exact: Triton's interpreter
            # truncates float32 -> bfloat16 casts (a GPU rounds them to nearest; the result is the same).
            bits = y.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            y = bits.to(tl.float32, bitcast=True)
        tl.store(y_row + cols * stride_yn, y.to(Y.dtype.element_ty), mask=cols < n_cols)


# --------------------------------------------------------------------------------------------------
# Launcher and public function
# --------------------------------------------------------------------------------------------------

def softmax(x: torch.Tensor, *, block_n: int | None = None):
    """Online softmax of each row of the 2-D tensor ``x``: returns ``(y, lse)``.

    ``y`` has ``x``'s dtype and shape; ``lse`` is float32 ``[rows]``, natural log. ``block_n`` is the
    number of elements read per step (a power of two >= 16); ``None`` picks the row length rounded up to
    a power of two, at most 1024. Raises TypeError or ValueError for bad inputs before any launch.
    """
    _check(x, block_n, kernel="triton_softmax")
    rows, n = x.shape
    block = _default_block_n(n) if block_n is None else block_n
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    lse = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if rows == 0:
        return y, lse
    _softmax_rows[(rows,)](x, y, lse, n, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                           BLOCK_N=block, num_warps=_num_warps(block))
    return y, lse
