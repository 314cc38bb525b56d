"""Triton FlashAttention: FA1 (inner-scaled) and FA2 (outer-scaled) forward, FA2 backward.

The algorithms are those of :mod:`flashverify_kernels.pytorch.blocked`, written as Triton programs with the same
conventions and the same precision behaviour:

* scores ``s = scale * q k^T`` and the statistics ``m`` (running max) and ``l`` (running sum) in
  float32; ``p`` cast to the input dtype before the ``p @ v`` dot; float32 accumulators; the output
  rounded once. Float32 inputs use IEEE float32 dots (``input_precision="ieee"``, never TF32).
* Exponentials are base 2, the GPU's native one: the kernels scale the scores by ``scale * log2(e)``,
  so ``s2 = log2(e) * s`` and the running max ``m2`` are in log2 units and ``p = exp2(s2 - m2)`` equals
  ``exp(s - m)``. The LSE is converted back to the natural log: ``lse = ln(2) * m2 + log(l)``.
  The forward keeps its running max in raw units (``m = max sign(scale) q.k``) and forms the exponent
  as ``(q.k - m) * |scale| * log2(e)``: the difference is exact near the max, so each ``p`` errs by a
  rounding of ``s2 - m2``, not of ``s2`` (with logits near 1e4, about 1e-7 instead of 1e-3 relative),
  and the largest ``p`` of a row is exactly 1. The backward recomputes ``p = exp2(s2 - log2(e) lse)``
  with ``s2`` rounded as before; the forward's LSE is built from the same rounded ``s2`` of the row's
  max, so that rounding cancels at the entries that matter most.

Forward, one program per (Q block, batch * query head), looping over KV blocks::

    s     = scale * q @ k^T, set to -inf where a key is not visible     (held as s2 = log2(e) * s)
    m_new = max(m, rowmax(s));  alpha = exp(m - m_new);  p = exp(s - m_new)
    l_new = alpha * l + rowsum(p)
    FA2 (outer-scaled):  acc = alpha * acc + p @ v               out = acc / l   (once, at the end)
    FA1 (inner-scaled):  acc = (alpha * l * acc + p @ v) / l_new  out = acc       (renormalised each step)
    lse = m + log(l)

Causal masking is bottom-right aligned: key ``j`` is visible to query ``i`` iff ``j <= i + Nk - Nq``.
The KV loop of a Q block runs in two stages: the blocks every row of the Q block sees entirely, with no
mask at all, then the blocks that cross the diagonal or the end of the keys, where the scores are masked
with ``where(visible, s, -inf)`` (float32 runs every block through the masked loop: see
:func:`_split_stages`). KV blocks that no row of the Q block can see are never visited. A row
that sees no key keeps ``(m, l) = (-inf, 0)`` (``exp(-inf - 0) = 0`` guards the subtraction) and gets
``out = 0``, ``lse = -inf``.

On Hopper (compute capability 9.0) the FA2 forward of a plain float16/bfloat16 call at head dim 64 or
128 runs :mod:`flashverify_kernels.hopper.forward` instead, the same algorithm written in Gluon (each exponent one
fused multiply-add there: its module's doc), with
its products overlapped with the softmax (which Triton's compiler does not do) and, but for causal
attention over more than 16384 keys, one program per SM walking the tiles
(:func:`flashverify_kernels.hopper.forward.persistent`), and the backward's dK/dV
kernel runs :mod:`flashverify_kernels.hopper.backward`, which at head dim 128 also adds dQ (in a fixed order where the
backward is deterministic, so that no dQ kernel runs: :func:`flashverify_kernels.hopper.backward.ordered_dq`);
``gluon=False`` or ``FLASHVERIFY_GLUON=0`` keeps the Triton kernels (:func:`fa2_forward`).

Backward (three launches, no atomics, so it is deterministic)::

    Delta = rowsum(dO * O)                     one program per (Q block, batch * query head)
    dK/dV: one program per (KV block, batch * kv head), looping over the query heads of the group
           and over the Q blocks that see the KV block:
           p^T = exp(s^T - lse)        (computed as exp2(log2(e) * scale * k q^T - log2(e) * lse))
           dV += p^T dO;  dP^T = V dO^T;  dS^T = p^T (dP^T - Delta);  dK += dS^T Q
           finally dK *= scale
    dQ:    one program per (Q block, batch * query head), looping over the visible KV blocks:
           p = exp(s - lse);  dP = dO V^T;  dS = p (dP - Delta);  dQ += dS K
           finally dQ *= scale

``p`` and ``dS`` are cast to the input dtype before their dots. A row with ``lse = -inf`` gets ``p = 0``.
With ``deterministic=False`` there is no dQ launch: the dK/dV program also forms ``dQ_rows += scale dS K``
for each Q block it visits and adds it to a float32 buffer with atomics (five tile products per pair of
tiles instead of seven; the order of the additions, and so dQ's last bits, vary from run to run).

Boundaries: any ``Nq``, ``Nk``; head dims 16 to 256 in steps of 8, padded inside the kernel to a power of
two with masked loads (the scale uses the true head dim). Every load of a row past the end of a tensor,
or of a head-dim column past ``D``, is masked with ``other=0``; keys past the last one a Q block can see
are loaded as zero, and their scores are masked, so such values never reach the output. Inputs are read
through their strides (no copies); grouped-query attention maps query head ``h`` to key/value head
``h // (Hq // Hkv)``.

Value head dim: ``v`` may have a head dim ``Dv`` of its own (``v [B, Hkv, Nk, Dv]``, as multi-head latent
attention's D = 192 with Dv = 128, FlashAttention-3's ``headdim_v``); ``out`` and ``dO`` then have ``Dv``
columns, ``dQ`` and ``dK`` ``D``, ``dV`` ``Dv``, and ``Delta = rowsum(dO * O)`` runs over ``Dv``. The kernels
tile q, k, dq and dk ``BLOCK_D`` wide (``head_dim``, ``EVEN_D``) and v, out, dO, dV and the output
accumulator ``BLOCK_DV`` wide (``head_dim_v``, ``EVEN_DV``); with ``Dv = D`` (``SAME_DV``) the two are the
same tiles and masks, and the compiled kernels, tiles and configurations those of a single head dim. The
default scale is ``1/sqrt(D)`` whatever ``Dv`` is. Descriptors (below) and the Gluon kernels take ``Dv = D``
only.

Tensor descriptors: on Hopper (and under the interpreter, which emulates them) the tiles of the unmasked
loops, where every key of a tile is visible to every row (forward and dQ: K and V; dK/dV: Q and dO), are
read through ``[B, H, N, D]`` descriptors built once per launch on the host (TMA), for dense
float16/bfloat16 rows with unit column stride and 16-byte aligned strides and a head dim that is a power of
two up to 128. Masked tiles keep pointer loads (keys past a tile's last visible one read as 0), except in
the backward at head dim 128, where they come through the descriptors too (rows past the end read as 0
there as well; at 64 the masked pointer loads are the faster).

Block sizes are powers of two >= 16. With ``block_m=None, block_n=None`` the tiles, warps and pipeline
stages are autotuned on the GPU (per padded head dim, dtype, causal flag and a coarse sequence-length
bucket; the choice is kept per launch signature and later calls launch with it directly, without Triton's
autotuning wrapper); under the Triton interpreter one small fixed configuration is used.
"""

from __future__ import annotations

import functools
import inspect
import math
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

try:  # the portable entry point (CUDA's libdevice on NVIDIA GPUs)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    from triton.language.extra.cuda import libdevice

from flashverify_kernels import _autograd, _validate
from references.fp8 import FP8_DTYPES, out_dtype

from flashverify_kernels.hopper import backward as gluon_backward, forward as gluon_forward

from flashverify_kernels.triton import replay

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The FA2 forward also takes float8 (forward only, out in bfloat16, FlashAttention-3's descales: fa2_forward).
FORWARD_DTYPES = (*DTYPES, *FP8_DTYPES)
# float8 tiles: the float8 matrix instructions add 32 products a step, so the head-dim tile and the key tile
# (the K of P @ V) are at least 32 wide.
FP8_MIN_TILE = 32
DEVICES = ("cpu", "cuda") if INTERPRET else ("cuda",)
HEAD_DIMS = range(16, 257, 8)
# Block sizes accepted by the launchers: powers of two, at least 16 (tl.dot's smallest tile).
BLOCK_SIZES = (16, 32, 64, 128, 256)
# Fixed tiles used when a block size is not given: under the interpreter for every call (small tiles
# keep it fast), on the GPU when only one of block_m, block_n is given.
INTERPRET_BLOCKS = (16, 32)
DEFAULT_BLOCKS = (64, 64)

LOG2E = math.log2(math.e)
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(math.log(2.0))


# --------------------------------------------------------------------------------------------------
# Capability helpers
# --------------------------------------------------------------------------------------------------

def _padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _seq_bucket(length: int) -> int:
    """Coarse sequence-length class for the autotuning key (multiples of 16: no extra specialisation)."""
    return 1024 if length <= 1024 else 4096 if length <= 4096 else 16384


def _launch_options(block_m: int, block_n: int, block_d: int, dtype: torch.dtype) -> dict:
    """Warps and pipeline depth for explicitly given tiles (``block_d``: the wider head-dim tile,
    :func:`_tile_width`). Float32 IEEE dots run on the FMA units, unrolled per thread: more warps keep each
    thread's code, and the compile time, smaller."""
    if dtype == torch.float32:
        # About 512 FMAs per thread per dot: 64x64 tiles with head dim 256 compile in seconds, not minutes.
        warps = min(16, max(4, triton.next_power_of_2(block_m * block_n * block_d // (32 * 512))))
        return {"num_warps": warps, "num_stages": 1 if block_d > 128 else 2}
    return {"num_warps": 8 if block_m * block_n >= 128 * 64 else 4, "num_stages": 2 if block_d > 128 else 3}


# Integer arguments Triton would otherwise compile a variant for by value (divisible by 16, equal to 1):
# the head dims (q/k's and v's) and the lengths and head counts only bound masks and loops, so one compiled
# kernel per padded head dim serves them all (31 accepted head dims, 5 padded ones). EVEN_D (head dim = padded
# head dim) keeps the unmasked column loads of the common head dims. The batch and head strides change
# with every length (Nq * D, Hq * Nq * D): one flag, ALIGNED (every one of them a multiple of 16), tells
# the kernel what the per-stride specialisation did, so that aligned tiles still load in vectors; the
# row and column strides stay specialised.
_ALIGNABLE = ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_vb", "stride_vh", "stride_ob", "stride_oh",
              "stride_gb", "stride_gh", "stride_dkb", "stride_dkh", "stride_dvb", "stride_dvh", "stride_dqb",
              "stride_dqh")
_NOT_SPECIALIZED = ("head_dim", "head_dim_v", "len_q", "len_k", "heads_q", "heads_kv", "group", "stride_lb", "stride_xb",
                    "stride_lh", "stride_db", "stride_dh", "stride_sb", "window_left", "window_right", "chunk",
                    *_ALIGNABLE)


def _kernel(fn):
    """``triton.jit`` for a launched kernel: no value specialisation of :data:`_NOT_SPECIALIZED`."""
    params = inspect.signature(fn).parameters
    return triton.jit(fn, do_not_specialize=[name for name in _NOT_SPECIALIZED if name in params])


def _head_dim_meta(head_dim: int, head_dim_v: int | None = None, *, least: int = 16) -> dict:
    """A kernel's head-dim arguments: ``head_dim`` (q's and k's) padded to BLOCK_D (EVEN_D: no padding) and,
    given, ``head_dim_v`` (v's: v, out, dO, dV, the output accumulator) padded to BLOCK_DV (EVEN_DV), and
    SAME_DV (Dv = D: :func:`_v_columns`). The Delta kernel, which reads out and dO only, takes v's head dim
    as its one ``head_dim``. ``least``: the narrowest tile (float8's :data:`FP8_MIN_TILE`)."""
    block_d = max(least, _padded_head_dim(head_dim))
    meta = {"head_dim": head_dim, "BLOCK_D": block_d, "EVEN_D": head_dim == block_d}
    if head_dim_v is not None:
        block_dv = max(least, _padded_head_dim(head_dim_v))
        meta.update(head_dim_v=head_dim_v, BLOCK_DV=block_dv, EVEN_DV=head_dim_v == block_dv,
                    SAME_DV=head_dim_v == head_dim)
    return meta


def _tile_width(meta: dict) -> int:
    """The wider of a launch's two head-dim tiles (BLOCK_D, BLOCK_DV): what its shared memory, registers
    and per-thread work grow with, so what its tile class and warps are chosen by (BLOCK_D when Dv = D)."""
    return max(meta["BLOCK_D"], meta["BLOCK_DV"])


def _aligned(*tensors) -> bool:
    """ALIGNED: the batch and head strides of every tensor (dims 0 and 1) are multiples of 16."""
    return all(t.stride(dim) % 16 == 0 for t in tensors for dim in (0, 1))


def _split_stages(dtype: torch.dtype) -> bool:
    """Run the blocks that need no mask through their own unmasked loop (the fast path). Not for float32:
    its IEEE dots are unrolled into FMAs per thread, and one masked loop keeps the code and the compile
    time several times smaller; float32 is for accuracy, not speed."""
    return dtype != torch.float32


def _tma_capable(device: torch.device) -> bool:
    """Tensor descriptors (TMA) on this device: the interpreter (which emulates them, so the CPU runs the
    same code path) or an NVIDIA GPU of compute capability 9.0 or above (Hopper)."""
    if INTERPRET:
        return True
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_rows(*tensors) -> bool:
    """Whether ``[B, H, N, D]`` tensors can be read through a ``[B, H, N, D]`` descriptor: no empty
    dimension, unit column stride, the base address and every other stride multiples of 16 bytes, and no
    broadcast (stride 0) dimension of more than one element."""
    return all(t.numel() > 0 and t.stride(3) == 1 and t.data_ptr() % 16 == 0
               and all((t.stride(dim) * t.element_size()) % 16 == 0 and (t.stride(dim) > 0 or t.shape[dim] == 1)
                       for dim in (0, 1, 2)) for t in tensors)


# Bulk reduce-add through a descriptor (the atomic dQ's tiles): compiled for the GPU; Triton's interpreter
# has no descriptor reductions, so there the same tiles take the per-element atomics.
_DESC_REDUCE = tl.constexpr(not INTERPRET)


def _use_tma(call: "_Call", head_dim: int, block_d: int, *tensors) -> bool:
    """Descriptors for a call's unmasked tiles: dense float16/bfloat16 rows (``tensors`` readable through
    them), head dim a power of two up to 128, v's head dim the same, Hopper or later. A value head dim of
    its own keeps pointer loads: the descriptors' tiles are sized per operand (:func:`_set_tiles`), but the
    descriptor path and its choices (MASKED_TMA by the head dim) have been timed and checked on Hopper with
    one head dim only."""
    return (_split_stages(call.q.dtype) and not call.varlen and head_dim == block_d <= 128
            and call.v.shape[3] == head_dim and _tma_capable(call.q.device) and _tma_rows(*tensors))


def _descriptors(tensors, tma: bool) -> tuple:
    """Host-built ``[B, H, N, D]`` tensor descriptors of ``tensors`` (their tile shape is set per launch
    by :func:`_set_tiles`), or, without TMA, the tensors themselves (never read through those arguments)."""
    if not tma:
        return tuple(tensors)
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, t.shape[3]]) for t in tensors)


# Descriptor arguments and the tile dimensions each one's tiles span: KV rows or Q rows, and q/k's head-dim
# tile or v's (V and dO).
_DESCRIPTOR_TILES = {"DescK": ("BLOCK_N", "BLOCK_D"), "DescV": ("BLOCK_N", "BLOCK_DV"),
                     "DescQ": ("BLOCK_M", "BLOCK_D"), "DescDO": ("BLOCK_M", "BLOCK_DV"),
                     "DescDQ": ("BLOCK_M", "BLOCK_D")}


def _set_tiles(nargs: dict) -> None:
    """Give a launch's descriptors (``nargs``: the kernel's arguments by name, tile sizes included) the
    ``[1, 1, rows, columns]`` tile of its configuration: an autotuning configuration's pre-hook, and
    called before a launch with fixed tiles."""
    for name, (rows, columns) in _DESCRIPTOR_TILES.items():
        desc = nargs.get(name)
        if isinstance(desc, TensorDescriptor):
            desc.block_shape = [1, 1, nargs[rows], nargs[columns]]


def _check_blocks(block_m, block_n, *, kernel: str) -> tuple[int | None, int | None]:
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None:
            _validate.check_block(name, value, kernel=kernel, allowed=BLOCK_SIZES)
    return block_m, block_n


def _fixed_blocks(block_m, block_n) -> tuple[int, int] | None:
    """The tiles to use, or None to autotune (GPU, neither given)."""
    if INTERPRET:
        return (block_m or INTERPRET_BLOCKS[0], block_n or INTERPRET_BLOCKS[1])
    if block_m is None and block_n is None:
        return None
    return (block_m or DEFAULT_BLOCKS[0], block_n or DEFAULT_BLOCKS[1])


def _check_inputs(q, k, v, *, kernel: str, scale, block_m, block_n, dtypes=DTYPES) -> float:
    _check_blocks(block_m, block_n, kernel=kernel)
    # v may have a head dim of its own (module docstring); the default scale is 1/sqrt(q's head dim)
    scale = _validate.check_attention_inputs(q, k, v, kernel=kernel, dtypes=dtypes, devices=DEVICES,
                                             gqa=True, head_dims=HEAD_DIMS, scale=scale, head_dim_v=True)
    return scale


# Autotuning candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) by tile class. In the backward, dK/dV
# programs hold a KV tile of BLOCK_N rows and loop over Q tiles of BLOCK_M rows; dQ programs the reverse.
_FWD_TILES = {
    "half": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
    "half_wide": [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
    "fp32": [(64, 64, 16, 1)],
    "fp32_wide": [(64, 64, 16, 1)],
}
_BWD_TILES = {
    "half": [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3)],
    "half_wide": [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2)],
    "fp32": [(64, 64, 16, 1)],
    "fp32_wide": [(32, 32, 16, 1)],
}


def _tile_class(block_d: int, dtype: torch.dtype) -> str:
    """float16/bfloat16 ("half") or float32, with padded head dim (the wider of q/k's and v's:
    :func:`_tile_width`) up to 128 or above ("wide")."""
    return ("fp32" if dtype == torch.float32 else "half") + ("_wide" if block_d > 128 else "")


def _configs(table: dict) -> list[triton.Config]:
    tiles = sorted({t for tiles in table.values() for t in tiles})
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=_set_tiles)
            for bm, bn, w, s in tiles]


def _pruner(table: dict):
    """Keep the candidates of the call's tile class (shared memory and registers grow with the head dim
    and the element size; float32 IEEE dots compile to long FMA sequences, so they get one config)."""
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        wanted = set(table[_tile_class(_tile_width(args), args["Q"].dtype)])
        return [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]
    return prune


def _bwd_tiles(block_m: int, block_n: int, block_d: int, dtype: torch.dtype):
    """Tiles of the (dK/dV, dQ) kernels for given block sizes. The backward holds more tiles at once
    than the forward, so with a padded head dim of 256 (``block_d``, the wider of q/k's and v's:
    :func:`_tile_width`) it caps them to fit shared memory: at 64 for
    float16/bfloat16, and for float32 the inner tile of each kernel (dK/dV: Q rows, dQ: KV rows) at 32
    and the outer one at 64. The gradients are the same sums; only their order changes."""
    tile_class = _tile_class(block_d, dtype)
    if tile_class == "half_wide":
        tiles = (min(block_m, 64), min(block_n, 64))
        return tiles, tiles
    if tile_class == "fp32_wide":
        return (min(block_m, 32), min(block_n, 64)), (min(block_m, 64), min(block_n, 32))
    return (block_m, block_n), (block_m, block_n)


# --------------------------------------------------------------------------------------------------
# Tile helpers and the forward inner loop
# --------------------------------------------------------------------------------------------------

@triton.jit
def _load_rows(ptrs, rows, row_end, offs_d, head_dim, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """Load a [rows, BLOCK_D] tile; rows >= row_end and columns >= head_dim read as 0. EVEN_D: every
    column is read, without a column mask (a mask against the runtime head dim, even one that is all
    true, costs registers: the dK/dV kernel spills with it)."""
    if CHECK_ROWS and EVEN_D:
        tile = tl.load(ptrs, mask=rows[:, None] < row_end, other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=(rows[:, None] < row_end) & (offs_d[None, :] < head_dim), other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
    return tile


@triton.jit
def _hint16(stride, ALIGNED: tl.constexpr):
    """``stride``, known to the compiler as a multiple of 16 when ALIGNED (the launcher checked it)."""
    if ALIGNED:
        stride = (stride // 16) * 16
    return stride


@triton.jit
def _v_columns(head_dim, head_dim_v, SAME_DV: tl.constexpr):
    """The bound of v's columns (v, out, dO, dV): with Dv = D (SAME_DV) q's and k's ``head_dim`` itself, so
    that v's column masks are theirs and the kernel compiles exactly as for one head dim (a second runtime
    bound, equal but not known to be, makes second masks, which take registers of their own)."""
    if SAME_DV:
        head_dim_v = head_dim
    return head_dim_v


@triton.jit
def _store_rows(ptrs, tile, rows, row_end, offs_d, head_dim, EVEN_D: tl.constexpr):
    """Store a [rows, BLOCK_D] tile's rows < row_end and columns < head_dim (EVEN_D: every column)."""
    if EVEN_D:
        tl.store(ptrs, tile, mask=rows[:, None] < row_end)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < row_end) & (offs_d[None, :] < head_dim))


@triton.jit
def _chunk_start(position, chunk, len_q):
    """The first position of ``position``'s chunk, ``floor(position / chunk) * chunk`` for positions down to
    ``-len_q`` (shifted to non-negative first: integer division truncates differently across backends)."""
    bias = (len_q // chunk + 1) * chunk
    return ((position + bias) // chunk) * chunk - bias


@triton.jit
def _visible(q_idx, k_idx, kv_end, causal_offset, window_left, window_right, chunk, len_q,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr):
    """Whether query ``q_idx`` sees key ``k_idx`` (broadcastable index arrays): below ``kv_end``, and the
    causal mask, the window ``(left, right)`` (-1 unbounded) and the chunks, all around the bottom-right
    diagonal ``q_idx + causal_offset``."""
    visible = k_idx < kv_end
    diag = q_idx + causal_offset
    if CAUSAL:
        visible = visible & (k_idx <= diag)
    if WINDOW:
        visible = visible & ((window_left < 0) | (k_idx >= diag - window_left))
        visible = visible & ((window_right < 0) | (k_idx <= diag + window_right))
    if CHUNK:
        start = _chunk_start(diag, chunk, len_q)
        visible = visible & (k_idx >= start) & (k_idx < start + chunk)
    return visible


@triton.jit
def _tanh(x, LIBDEVICE: tl.constexpr):
    """tanh in float32: CUDA's (within 2 ulps) on the GPU; under the interpreter, which has no libdevice,
    ``sign(x) e / (e + 2)`` with ``e = expm1(2|x|)`` (its Taylor series below 0.5, where exp(y) - 1 would
    cancel), within 4 ulps (tests/test_triton_variants.py measures it)."""
    if LIBDEVICE:
        t = libdevice.tanh(x)
    else:
        a = tl.minimum(tl.abs(x), 15.0)  # tanh(15) rounds to 1 in float32
        y = 2.0 * a
        series = y * (1.0 + y / 2.0 * (1.0 + y / 3.0 * (1.0 + y / 4.0 * (1.0 + y / 5.0 * (1.0 + y / 6.0 * (
            1.0 + y / 7.0 * (1.0 + y / 8.0 * (1.0 + y / 9.0))))))))
        e = tl.where(y < 0.5, series, tl.exp(y) - 1.0)
        t = e / (e + 2.0)
        t = tl.where(x < 0, -t, t)
    return t


@triton.jit
def _modified(qk, sm_scale, softcap, slope, q_idx, k_idx, causal_offset,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The scores the softmax sees, in natural units, from raw ``q.k``: ``s = scale q.k``, then the softcap
    ``c tanh(s / c)``, then ALiBi's ``-slope |diag - j|`` (flash_attn's order). Returns ``(s', tanh)``
    (``tanh`` is 0 without a softcap)."""
    s = qk * sm_scale
    t = s * 0.0
    if SOFTCAP:
        t = _tanh(s / softcap, LIBDEVICE)
        s = softcap * t
    if ALIBI:
        s = s - slope * tl.abs(q_idx + causal_offset - k_idx).to(tl.float32)
    return s, t


@triton.jit
def _attn_fwd_inner(acc, m_i, l_i, q, K, V, desc_k, desc_v, tma_b, tma_h, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                    offs_dv, lo, hi, kv_end, causal_offset, qk_scale, sm_scale, softcap, slope,
                    window_left, window_right, chunk, len_q,
                    head_dim, head_dim_v, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    EVEN_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, MASKED: tl.constexpr, INNER_SCALED: tl.constexpr,
                    WINDOW: tl.constexpr, CHUNK: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                    NATURAL: tl.constexpr, LIBDEVICE: tl.constexpr, TMA: tl.constexpr):
    """Consume the KV blocks lo, lo + BLOCK_N, ... < hi into the running (acc, m, l) of one Q tile;
    ``qk_scale = scale * log2(e)``; ``m`` is the running max of ``q.k`` with ``q`` already multiplied by
    ``sign(scale)`` (raw units), or, NATURAL (a softcap, ALiBi or sinks: ``q`` as given), of the modified
    scores ``s'`` in natural units.

    MASKED: keys at or past ``kv_end`` are loaded as 0 and their scores (and those of keys a row may not
    see: CAUSAL, WINDOW, CHUNK) are set to -inf; otherwise every key in [lo, hi) is visible to every row.
    TMA (unmasked blocks only): K and V tiles come through the ``[B, Hkv, Nk, D]`` tensor descriptors
    ``desc_k``, ``desc_v``, at batch ``tma_b`` and KV head ``tma_h``. ``V`` points at v's columns
    ``offs_dv`` (``head_dim_v`` of them; BLOCK_DV wide, as ``acc``), ``K`` at k's ``offs_d``.
    """
    sign = tl.where(qk_scale < 0, -1.0, 1.0)
    c_abs = qk_scale * sign
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if TMA:
            k = desc_k.load([tma_b, tma_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
            v = desc_v.load([tma_b, tma_h, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        else:
            k = _load_rows(K + cols[:, None] * stride_kn, cols, kv_end, offs_d, head_dim, BLOCK_D, EVEN_D, MASKED)
            v = _load_rows(V + cols[:, None] * stride_vn, cols, kv_end, offs_dv, head_dim_v, BLOCK_DV, EVEN_DV,
                           MASKED)
        if NATURAL:  # -- the modified scores s' in natural units
            qk, _ = _modified(tl.dot(q, tl.trans(k), input_precision="ieee", max_num_imprecise_acc=0), sm_scale,
                              softcap, slope,
                              offs_m[:, None], cols[None, :], causal_offset, SOFTCAP, ALIBI, LIBDEVICE)
        else:  # -- raw scores q.k in float32 (q carries sign(scale): the largest is the largest scaled score)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee", max_num_imprecise_acc=0)
        if MASKED:
            visible = _visible(offs_m[:, None], cols[None, :], kv_end, causal_offset, window_left, window_right,
                               chunk, len_q, CAUSAL, WINDOW, CHUNK)
            qk = tl.where(visible, qk, float("-inf"))
        # -- new running max (raw units); a row that has seen only masked keys subtracts 0, not -inf
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        if MASKED:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        # p = exp2((qk - m) * |scale| log2(e)): qk - m is exact for the keys near the max (Sterbenz), so
        # each p errs by a rounding of its exponent s - m, not of s (about 1e-7 against 1e-3 relative for
        # scores near 1e4), and the max itself gets p = 1 exactly. NATURAL: exp2((s' - m) log2(e)).
        if NATURAL:
            factor = _LOG2E + 0.0 * c_abs
        else:
            factor = c_abs
        alpha = tl.where(m_i == float("-inf"), 0.0, tl.math.exp2((m_i - m_ref) * factor))
        arg = (qk - m_ref[:, None]) * factor
        if MASKED:
            arg = tl.where(visible, arg, float("-inf"))
        p = tl.math.exp2(arg)
        l_new = l_i * alpha + tl.sum(p, axis=1)
        # -- p in the input dtype for the P @ V dot, accumulated in float32 (float8 dots too: every matrix
        # instruction's sum is added to the float32 accumulator, max_num_imprecise_acc=0; a no-op otherwise)
        p_low = p.to(v.dtype)
        if INNER_SCALED:
            pv = tl.dot(p_low, v, input_precision="ieee", max_num_imprecise_acc=0)
            numer = acc * (alpha * l_i)[:, None] + pv
            acc = numer / tl.where(l_new == 0.0, 1.0, l_new)[:, None]
        else:
            acc = tl.dot(p_low, v, acc * alpha[:, None], input_precision="ieee", max_num_imprecise_acc=0)
        m_i = m_new
        l_i = l_new
    return acc, m_i, l_i


# --------------------------------------------------------------------------------------------------
# Forward kernel
# --------------------------------------------------------------------------------------------------

@triton.jit
def _kv_window(start_m, last_row, len_k, len_q, causal_offset, window_left, window_right, chunk,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lo, kv_end, full_end)`` of a Q tile of rows ``start_m .. last_row``: the keys some row sees lie in
    ``[lo, kv_end)`` (``lo`` a multiple of BLOCK_N), those every row sees (causal alone) in ``[0, full_end)``."""
    lo = 0
    if CAUSAL:
        kv_end = tl.maximum(tl.minimum(last_row + 1 + causal_offset, len_k), 0)
        full_end = tl.maximum(tl.minimum(start_m + causal_offset + 1, kv_end), 0)
    else:
        kv_end = len_k
        full_end = len_k
    if WINDOW:
        kv_end = tl.where(window_right >= 0,
                          tl.maximum(tl.minimum(kv_end, last_row + causal_offset + window_right + 1), 0), kv_end)
        lo = tl.where(window_left >= 0, tl.maximum(start_m + causal_offset - window_left, 0), lo)
    if CHUNK:
        lo = tl.maximum(lo, _chunk_start(start_m + causal_offset, chunk, len_q))
        kv_end = tl.maximum(tl.minimum(kv_end, _chunk_start(last_row + causal_offset, chunk, len_q) + chunk), 0)
    lo = (tl.minimum(lo, kv_end) // BLOCK_N) * BLOCK_N
    return lo, kv_end, full_end


@_kernel
def _attn_fwd(Q, K, V, Out, Lse, DescK, DescV, qk_scale, sm_scale, Slopes, Sinks, CuQ, CuK,
              QDescale, KDescale, VDescale, stride_xb, stride_xh,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_lb, stride_lh, stride_lm, stride_sb,
              heads_q, group, len_q, len_k, seq_bucket, window_left, window_right, chunk, softcap,
              head_dim, head_dim_v, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              EVEN_DV: tl.constexpr, SAME_DV: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
              INNER_SCALED: tl.constexpr, ALIGNED: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr, VARLEN: tl.constexpr,
              NATURAL: tl.constexpr, LIBDEVICE: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, DESCALE: tl.constexpr = False):
    head_dim_v = _v_columns(head_dim, head_dim_v, SAME_DV)
    stride_qb, stride_qh = _hint16(stride_qb, ALIGNED), _hint16(stride_qh, ALIGNED)
    stride_kb, stride_kh = _hint16(stride_kb, ALIGNED), _hint16(stride_kh, ALIGNED)
    stride_vb, stride_vh = _hint16(stride_vb, ALIGNED), _hint16(stride_vh, ALIGNED)
    stride_ob, stride_oh = _hint16(stride_ob, ALIGNED), _hint16(stride_oh, ALIGNED)
    # Causal: heavy (late) Q blocks first, so the light ones fill the last wave.
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    off_hkv = off_h // group
    if DESCALE:  # float8 descales (FlashAttention-3's): the scores' factor times q's and k's, [B, Hkv] each
        qk_descale = (tl.load(QDescale + off_b * stride_xb + off_hkv * stride_xh)
                      * tl.load(KDescale + off_b * stride_xb + off_hkv * stride_xh))
        qk_scale = qk_scale * qk_descale
        sm_scale = sm_scale * qk_descale
    start_m = pid_m * BLOCK_M
    q_start = 0
    k_start = 0
    if VARLEN:  # sequence off_b: its rows and keys in the packed tensors (the batch strides are 0)
        q_start = tl.load(CuQ + off_b).to(tl.int64)
        len_q = (tl.load(CuQ + off_b + 1) - q_start).to(tl.int32)
        k_start = tl.load(CuK + off_b).to(tl.int64)
        len_k = (tl.load(CuK + off_b + 1) - k_start).to(tl.int32)
    if start_m < len_q:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)  # v's columns: those of acc and out
        q = _load_rows(Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm
                       + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                       offs_m, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, True)
        if not NATURAL:  # raw units: q times sign(scale) (exact), so that the loop's largest q.k is the max
            q = (q * tl.where(qk_scale < 0, -1.0, 1.0)).to(Q.dtype.element_ty)
        # [1, BLOCK_D] (v: [1, BLOCK_DV]) pointers to the head-dim columns of this (batch, kv head); the loop
        # adds the key rows.
        K_cols = K + off_b * stride_kb + off_hkv * stride_kh + k_start * stride_kn + offs_d[None, :] * stride_kd
        V_cols = V + off_b * stride_vb + off_hkv * stride_vh + k_start * stride_vn + offs_dv[None, :] * stride_vd
        slope = 0.0
        if ALIBI:
            slope = tl.load(Slopes + off_b * stride_sb + off_h).to(tl.float32)

        if SINKS:  # the sink starts the running state: m = t, l = exp(t - t) = 1 (natural units)
            m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(Sinks + off_h).to(tl.float32)
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        # KV range: [lo, kv_end) is what some row of this block sees; [0, full_end) what every row sees.
        causal_offset = len_k - len_q
        last_row = tl.minimum(start_m + BLOCK_M, len_q) - 1
        lo, kv_end, full_end = _kv_window(start_m, last_row, len_k, len_q, causal_offset, window_left,
                                          window_right, chunk, CAUSAL, WINDOW, CHUNK, BLOCK_N)
        if SPLIT and not WINDOW and not CHUNK:
            # Stage 1: blocks visible to every row, no masks.
            full_end = (full_end // BLOCK_N) * BLOCK_N
            acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, K_cols, V_cols, DescK, DescV, off_b.to(tl.int32),
                                            off_hkv.to(tl.int32), stride_kn, stride_vn,
                                            offs_m, offs_n, offs_d, offs_dv, 0, full_end, kv_end, causal_offset,
                                            qk_scale, sm_scale, softcap, slope, window_left, window_right, chunk,
                                            len_q, head_dim, head_dim_v, BLOCK_D, EVEN_D, BLOCK_DV, EVEN_DV, BLOCK_N,
                                            CAUSAL, False, INNER_SCALED,
                                            WINDOW, CHUNK, SOFTCAP, ALIBI, NATURAL, LIBDEVICE, TMA)
        else:
            full_end = lo
        # Stage 2: blocks crossing the diagonal, a window's or chunk's edges or the end of the keys, masked
        # (every block the tile sees if not SPLIT).
        acc, m_i, l_i = _attn_fwd_inner(acc, m_i, l_i, q, K_cols, V_cols, DescK, DescV, off_b.to(tl.int32),
                                        off_hkv.to(tl.int32), stride_kn, stride_vn,
                                        offs_m, offs_n, offs_d, offs_dv, full_end, kv_end, kv_end, causal_offset,
                                        qk_scale, sm_scale, softcap, slope, window_left, window_right, chunk, len_q,
                                        head_dim, head_dim_v, BLOCK_D, EVEN_D, BLOCK_DV, EVEN_DV, BLOCK_N, CAUSAL,
                                        True, INNER_SCALED,
                                        WINDOW, CHUNK, SOFTCAP, ALIBI, NATURAL, LIBDEVICE, False)

        # Epilogue: rows with no visible key have l = 0, acc = 0: out = 0, lse = -inf (with a sink l = 1 and
        # m = t there: out = 0, lse = t). Natural-log LSE.
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        if INNER_SCALED:
            out = acc
        else:
            out = acc / l_safe[:, None]
        # m is in raw units: lse = ln(2) (m |scale| log2(e) + log2(l)). m * |scale| log2(e) is rounded exactly
        # as the backward rounds q.k * scale log2(e) (one product of the same two numbers), so at a row's
        # largest score the backward's exponent s2 - lse2 sees that rounding cancel, as the forward's did.
        # NATURAL: m is in natural units, lse = ln(2) (m log2(e) + log2(l)).
        if NATURAL:
            c_abs = _LOG2E + 0.0 * qk_scale
        else:
            c_abs = tl.where(qk_scale < 0, -qk_scale, qk_scale)
        lse = tl.where(empty, float("-inf"), (m_i * c_abs + tl.log2(l_safe)) * _LN2)
        if DESCALE:  # v's descale on the normalised output (a common factor of every weighted v row)
            out = out * tl.load(VDescale + off_b * stride_xb + off_hkv * stride_xh)
        _store_rows(Out + off_b * stride_ob + off_h * stride_oh + q_start * stride_om
                    + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
                    out.to(Out.dtype.element_ty), offs_m, len_q, offs_dv, head_dim_v, EVEN_DV)
        tl.store(Lse + off_b * stride_lb + off_h * stride_lh + (q_start + offs_m) * stride_lm, lse,
                 mask=offs_m < len_q)


_VARIANT_KEY = ["WINDOW", "CHUNK", "SOFTCAP", "ALIBI", "SINKS", "VARLEN"]
_attn_fwd_tuned = triton.autotune(
    configs=_configs(_FWD_TILES),
    key=["BLOCK_D", "BLOCK_DV", "CAUSAL", "INNER_SCALED", "seq_bucket", "TMA", *_VARIANT_KEY],
    prune_configs_by={"early_config_prune": _pruner(_FWD_TILES)},
)(_attn_fwd)


# --------------------------------------------------------------------------------------------------
# Backward kernels
# --------------------------------------------------------------------------------------------------

@_kernel
def _attn_bwd_delta(Out, DOut, Delta, CuQ, Lse, Rows,
                    stride_ob, stride_oh, stride_om, stride_od,
                    stride_gb, stride_gh, stride_gm, stride_gd,
                    stride_db, stride_dh, stride_lb, stride_lh, stride_lm, stride_rb, stride_rh, stride_rs,
                    heads_q, len_q,
                    head_dim, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, ALIGNED: tl.constexpr,
                    VARLEN: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Delta = rowsum(dO * O) in float32, stored with the LSE's layout ([B, Hq, Nq]; [Hq, total] packed).
    It reads out and dO only: ``head_dim`` (BLOCK_D, EVEN_D) is v's head dim here.
    ROWS (dense batches; the grid covers the padding rows): also the Gluon dK/dV kernel's rows buffer
    (flashverify_kernels/hopper/backward.py, ``rows_buffer``): LSE * log2(e) at ``Rows``, +inf where LSE is -inf and
    past Nq, and Delta ``stride_rs`` after it, 0 past Nq."""
    stride_ob, stride_oh = _hint16(stride_ob, ALIGNED), _hint16(stride_oh, ALIGNED)
    stride_gb, stride_gh = _hint16(stride_gb, ALIGNED), _hint16(stride_gh, ALIGNED)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    q_start = 0
    if VARLEN:
        q_start = tl.load(CuQ + off_b).to(tl.int64)
        len_q = (tl.load(CuQ + off_b + 1) - q_start).to(tl.int32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(Out + off_b * stride_ob + off_h * stride_oh + q_start * stride_om
                   + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                   offs_m, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, True)
    do = _load_rows(DOut + off_b * stride_gb + off_h * stride_gh + q_start * stride_gm
                    + offs_m[:, None] * stride_gm + offs_d[None, :] * stride_gd,
                    offs_m, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + off_b * stride_db + off_h * stride_dh + q_start + offs_m, delta, mask=offs_m < len_q)
    if ROWS:
        lse = tl.load(Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm, mask=offs_m < len_q,
                      other=float("-inf"))
        # a row that sees no key has lse = -inf: +inf makes its p 0 (not NaN)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        rows = Rows + off_b * stride_rb + off_h * stride_rh + offs_m
        tl.store(rows, lse2)
        tl.store(rows + stride_rs, delta)


@triton.jit
def _attn_bwd_dkdv_block(dk, dv, k, v, start_m, off_h, Q, DO, Lse, Delta, DQ, Slopes, desc_q, desc_do, desc_dq, tma_b,
                         stride_qh, stride_qm, stride_gh, stride_gm, stride_lh, stride_lm, stride_dh, stride_dqh,
                         stride_dqm, stride_dqd, offs_n, offs_d, offs_dv, len_q, len_k, causal_offset,
                         qk_scale, sm_scale, softcap, window_left, window_right, chunk,
                         head_dim, head_dim_v, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                         EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                         CAUSAL: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
                         SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, NATURAL: tl.constexpr,
                         LIBDEVICE: tl.constexpr, TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """Add the Q block at row ``start_m`` of query head ``off_h`` to a KV tile's dK, dV (transposed form:
    rows are keys, columns queries). ``Q``, ``DO``, ``Lse``, ``Delta``, ``DQ`` and ``Slopes`` point at the
    batch's rows (head 0); MASKED: rows past len_q are read as 0, and scores of keys a query may not see
    (CAUSAL, WINDOW, CHUNK) are set to -inf. NATURAL: the scores are the modified ones (softcap, ALiBi),
    and a softcap's 1 - tanh^2 multiplies dS. TMA (unmasked blocks, and masked ones with the launch's
    MASKED_TMA; rows past Nq read as 0): the Q and dO tiles come through the ``[B, Hq, Nq, D]``
    descriptors ``desc_q``, ``desc_do``, at batch ``tma_b``. ATOMIC_DQ: the
    block's share of dQ, ``scale * dS K``, is added to the float32 rows at ``DQ`` with atomics (the fifth
    tile product; no dQ kernel then), with TMA as one reduce-add of the tile through ``desc_dq``. ``DO`` points
    at dO's columns ``offs_dv`` (v's head dim), ``Q`` and ``DQ`` are ``offs_d`` wide."""
    rows = start_m + tl.arange(0, BLOCK_M)
    if TMA:
        q = desc_q.load([tma_b, off_h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        do = desc_do.load([tma_b, off_h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, BLOCK_DV)
    else:
        q = _load_rows(Q + off_h * stride_qh + rows[:, None] * stride_qm, rows, len_q, offs_d, head_dim,
                       BLOCK_D, EVEN_D, MASKED)
        do = _load_rows(DO + off_h * stride_gh + rows[:, None] * stride_gm, rows, len_q, offs_dv, head_dim_v,
                        BLOCK_DV, EVEN_DV, MASKED)
    lse_ptrs = Lse + off_h * stride_lh + rows * stride_lm
    delta_ptrs = Delta + off_h * stride_dh + rows
    if MASKED:
        lse = tl.load(lse_ptrs, mask=rows < len_q, other=float("inf"))
        delta = tl.load(delta_ptrs, mask=rows < len_q, other=0.0)
    else:
        lse = tl.load(lse_ptrs)
        delta = tl.load(delta_ptrs)
    # A row that sees no key has lse = -inf: use +inf so that p = exp2(-inf) = 0, not exp2(NaN).
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    # -- p^T = exp(s^T - lse) = exp2(qk_scale * k q^T - log2(e) * lse)
    kq = tl.dot(k, tl.trans(q), input_precision="ieee")
    if NATURAL:
        slope = 0.0
        if ALIBI:
            slope = tl.load(Slopes + off_h).to(tl.float32)
        s, t = _modified(kq, sm_scale, softcap, slope, rows[None, :], offs_n[:, None], causal_offset,
                         SOFTCAP, ALIBI, LIBDEVICE)
        arg = s * _LOG2E - lse2[None, :]
    else:
        arg = kq * qk_scale - lse2[None, :]
    if MASKED:
        visible = (rows[None, :] < len_q) & _visible(rows[None, :], offs_n[:, None], len_k, causal_offset,
                                                     window_left, window_right, chunk, len_q,
                                                     CAUSAL, WINDOW, CHUNK)
        arg = tl.where(visible, arg, float("-inf"))
    p_t = tl.math.exp2(arg)
    # -- dV += p^T dO
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
    # -- dS^T = p^T (dP^T - Delta), dP^T = v dO^T;  dK += dS^T q
    dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:  # the chain rule through c tanh(s / c), where p > 0 (a hidden key may hold NaN)
        ds_t = tl.where(p_t > 0, ds_t * (1.0 - t * t), 0.0)
    ds_low = ds_t.to(q.dtype)
    dk = tl.dot(ds_low, q, dk, input_precision="ieee")
    if ATOMIC_DQ:  # dQ_rows += scale * dS K, summed over the KV tiles in whatever order they arrive
        dq_part = tl.dot(tl.trans(ds_low), k, input_precision="ieee") * sm_scale
        if TMA and _DESC_REDUCE:  # one bulk reduce-add of the whole tile (TMA), not an atomic per element
            desc_dq.atomic_add([tma_b, off_h.to(tl.int32), start_m, 0], dq_part.reshape(1, 1, BLOCK_M, BLOCK_D))
        else:
            tl.atomic_add(DQ + off_h * stride_dqh + rows[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
                          dq_part, mask=(rows[:, None] < len_q) & (offs_d[None, :] < head_dim), sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, Lse, Delta, DQ, Slopes, desc_q, desc_do, desc_dq, tma_b,
                         stride_qh, stride_qm, stride_gh, stride_gm, stride_lh, stride_lm, stride_dh, stride_dqh,
                         stride_dqm, stride_dqd, off_hkv, group, offs_n, offs_d, offs_dv, lo, hi, len_q, len_k,
                         causal_offset, qk_scale, sm_scale, softcap, window_left, window_right, chunk,
                         head_dim, head_dim_v, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                         EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                         CAUSAL: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
                         SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, NATURAL: tl.constexpr,
                         LIBDEVICE: tl.constexpr, TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr, GQA: tl.constexpr):
    """Add the Q blocks lo, lo + BLOCK_M, ... < hi of each of the ``group`` query heads of KV head
    ``off_hkv`` to a KV tile's dK, dV (:func:`_attn_bwd_dkdv_block`). GQA (group > 1): head by head in
    one loop over (head, block), so that no loop nested in another carries the accumulators (with one,
    the compiled kernel spills); otherwise a plain loop over the blocks (without a group to step through, the
    combined loop's index arithmetic would only add instructions)."""
    if GQA:
        blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
        # The divisor is kept >= 1: a pipelined loop computes its first iterations' addresses before it
        # tests the trip count, and with no block, step // 0 (undefined on the GPU) would make them point
        # outside the tensor (an illegal memory access where a loop has no block: the diagonal loop, not causal).
        blocks_nonzero = tl.maximum(blocks, 1)
        for step in range(0, group * blocks):
            g = step // blocks_nonzero
            start_m = tl.multiple_of(lo + (step - g * blocks_nonzero) * BLOCK_M, BLOCK_M)
            dk, dv = _attn_bwd_dkdv_block(dk, dv, k, v, start_m, off_hkv * group + g, Q, DO, Lse, Delta, DQ, Slopes,
                                          desc_q, desc_do, desc_dq, tma_b, stride_qh, stride_qm, stride_gh, stride_gm,
                                          stride_lh, stride_lm, stride_dh, stride_dqh, stride_dqm, stride_dqd, offs_n,
                                          offs_d, offs_dv, len_q, len_k, causal_offset, qk_scale, sm_scale, softcap,
                                          window_left, window_right, chunk, head_dim, head_dim_v, BLOCK_D, EVEN_D,
                                          BLOCK_DV, EVEN_DV, BLOCK_M,
                                          CAUSAL, MASKED, WINDOW, CHUNK, SOFTCAP, ALIBI, NATURAL, LIBDEVICE, TMA,
                                          ATOMIC_DQ)
    else:
        for start_m in range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            dk, dv = _attn_bwd_dkdv_block(dk, dv, k, v, start_m, off_hkv, Q, DO, Lse, Delta, DQ, Slopes,
                                          desc_q, desc_do, desc_dq, tma_b, stride_qh, stride_qm, stride_gh, stride_gm,
                                          stride_lh, stride_lm, stride_dh, stride_dqh, stride_dqm, stride_dqd, offs_n,
                                          offs_d, offs_dv, len_q, len_k, causal_offset, qk_scale, sm_scale, softcap,
                                          window_left, window_right, chunk, head_dim, head_dim_v, BLOCK_D, EVEN_D,
                                          BLOCK_DV, EVEN_DV, BLOCK_M,
                                          CAUSAL, MASKED, WINDOW, CHUNK, SOFTCAP, ALIBI, NATURAL, LIBDEVICE, TMA,
                                          ATOMIC_DQ)
    return dk, dv


@triton.jit
def _q_window(start_n, len_q, len_k, causal_offset, window_left, window_right, chunk,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lo, diag_end, hi)`` of the query rows of the KV tile at ``start_n``: rows in ``[lo, hi)`` may see
    a key of it (``lo`` a multiple of BLOCK_M); causally, rows from ``diag_end`` on see all of it."""
    len_q_blocks = tl.cdiv(len_q, BLOCK_M) * BLOCK_M
    last_key = start_n + BLOCK_N - 1
    hi = len_q
    if CAUSAL:
        first_row = tl.maximum(start_n - causal_offset, 0)
        diag_end = tl.cdiv(tl.maximum(last_key - causal_offset, 0), BLOCK_M) * BLOCK_M
    else:
        first_row = 0
        diag_end = 0
    if WINDOW:  # query i sees key j iff diag_i - left <= j <= diag_i + right
        first_row = tl.where(window_right >= 0, tl.maximum(first_row, start_n - causal_offset - window_right),
                             first_row)
        hi = tl.where(window_left >= 0, tl.minimum(hi, last_key - causal_offset + window_left + 1), hi)
    if CHUNK:  # query i sees key j iff they share a chunk of the diagonal's positions
        first_row = tl.maximum(first_row, (start_n // chunk) * chunk - causal_offset)
        hi = tl.minimum(hi, (last_key // chunk) * chunk + chunk - causal_offset)
    hi = tl.maximum(hi, 0)
    lo = tl.minimum((tl.minimum(first_row, hi) // BLOCK_M) * BLOCK_M, len_q_blocks)
    diag_end = tl.minimum(tl.maximum(diag_end, lo), len_q_blocks)
    return lo, diag_end, hi


@_kernel
def _attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV, DQ, DescQ, DescDO, DescDQ, sm_scale, qk_scale, Slopes, CuQ, CuK,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_gb, stride_gh, stride_gm, stride_gd,
                   stride_lb, stride_lh, stride_lm, stride_db, stride_dh, stride_sb,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                   heads_q, heads_kv, group, len_q, len_k, seq_bucket, window_left, window_right, chunk, softcap,
                   head_dim, head_dim_v, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   EVEN_DV: tl.constexpr, SAME_DV: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
                   ALIGNED: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr, SOFTCAP: tl.constexpr,
                   ALIBI: tl.constexpr, VARLEN: tl.constexpr, NATURAL: tl.constexpr, LIBDEVICE: tl.constexpr,
                   TMA: tl.constexpr, MASKED_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr, GQA: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    head_dim_v = _v_columns(head_dim, head_dim_v, SAME_DV)
    stride_qb, stride_qh = _hint16(stride_qb, ALIGNED), _hint16(stride_qh, ALIGNED)
    stride_kb, stride_kh = _hint16(stride_kb, ALIGNED), _hint16(stride_kh, ALIGNED)
    stride_vb, stride_vh = _hint16(stride_vb, ALIGNED), _hint16(stride_vh, ALIGNED)
    stride_gb, stride_gh = _hint16(stride_gb, ALIGNED), _hint16(stride_gh, ALIGNED)
    stride_dkb, stride_dkh = _hint16(stride_dkb, ALIGNED), _hint16(stride_dkh, ALIGNED)
    stride_dvb, stride_dvh = _hint16(stride_dvb, ALIGNED), _hint16(stride_dvh, ALIGNED)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_kv).to(tl.int64)
    off_hkv = (pid_bh % heads_kv).to(tl.int64)
    start_n = pid_n * BLOCK_N
    q_start = 0
    k_start = 0
    if VARLEN:
        q_start = tl.load(CuQ + off_b).to(tl.int64)
        len_q = (tl.load(CuQ + off_b + 1) - q_start).to(tl.int32)
        k_start = tl.load(CuK + off_b).to(tl.int64)
        len_k = (tl.load(CuK + off_b + 1) - k_start).to(tl.int32)
    if start_n < len_k:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)  # v's columns: those of dO and dV
        # The KV tile stays in registers for the whole program; keys past len_k read as 0 (never stored).
        k = _load_rows(K + off_b * stride_kb + off_hkv * stride_kh + k_start * stride_kn
                       + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                       offs_n, len_k, offs_d, head_dim, BLOCK_D, EVEN_D, True)
        v = _load_rows(V + off_b * stride_vb + off_hkv * stride_vh + k_start * stride_vn
                       + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                       offs_n, len_k, offs_dv, head_dim_v, BLOCK_DV, EVEN_DV, True)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

        # Q range: rows in [lo, hi) may see the tile; causally, rows >= diag_end see every key of it.
        causal_offset = len_k - len_q
        lo, diag_end, hi = _q_window(start_n, len_q, len_k, causal_offset, window_left, window_right, chunk,
                                     CAUSAL, WINDOW, CHUNK, BLOCK_M, BLOCK_N)
        even_end = tl.maximum((len_q // BLOCK_M) * BLOCK_M, diag_end)

        # The batch's rows (query head 0); the inner loops step through the group's query heads, each in
        # a fixed order (deterministic, no atomics).
        Qb = Q + off_b * stride_qb + q_start * stride_qm + offs_d[None, :] * stride_qd
        DOb = DO + off_b * stride_gb + q_start * stride_gm + offs_dv[None, :] * stride_gd
        Lseb = Lse + off_b * stride_lb + q_start * stride_lm
        Deltab = Delta + off_b * stride_db + q_start
        DQb = DQ + off_b * stride_dqb + q_start * stride_dqm
        Slopesb = Slopes + off_b * stride_sb
        tma_b = off_b.to(tl.int32)
        if SPLIT and not WINDOW and not CHUNK:
            # Q blocks crossing the diagonal (masked), those seeing the whole tile, then the ragged tail.
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qb, DOb, Lseb, Deltab, DQb, Slopesb,
                                          DescQ, DescDO, DescDQ, tma_b, stride_qh, stride_qm, stride_gh, stride_gm,
                                          stride_lh, stride_lm, stride_dh, stride_dqh, stride_dqm, stride_dqd,
                                          off_hkv, group, offs_n, offs_d, offs_dv,
                                          lo, diag_end, len_q, len_k, causal_offset, qk_scale, sm_scale, softcap,
                                          window_left, window_right, chunk, head_dim, head_dim_v, BLOCK_D, EVEN_D,
                                          BLOCK_DV, EVEN_DV, BLOCK_M, CAUSAL, True, WINDOW, CHUNK, SOFTCAP, ALIBI,
                                          NATURAL, LIBDEVICE, MASKED_TMA, ATOMIC_DQ, GQA)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qb, DOb, Lseb, Deltab, DQb, Slopesb,
                                          DescQ, DescDO, DescDQ, tma_b, stride_qh, stride_qm, stride_gh, stride_gm,
                                          stride_lh, stride_lm, stride_dh, stride_dqh, stride_dqm, stride_dqd,
                                          off_hkv, group, offs_n, offs_d, offs_dv,
                                          diag_end, even_end, len_q, len_k, causal_offset, qk_scale, sm_scale, softcap,
                                          window_left, window_right, chunk, head_dim, head_dim_v, BLOCK_D, EVEN_D,
                                          BLOCK_DV, EVEN_DV, BLOCK_M, CAUSAL, False, WINDOW, CHUNK, SOFTCAP, ALIBI,
                                          NATURAL, LIBDEVICE, TMA, ATOMIC_DQ, GQA)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qb, DOb, Lseb, Deltab, DQb, Slopesb,
                                          DescQ, DescDO, DescDQ, tma_b, stride_qh, stride_qm, stride_gh, stride_gm,
                                          stride_lh, stride_lm, stride_dh, stride_dqh, stride_dqm, stride_dqd,
                                          off_hkv, group, offs_n, offs_d, offs_dv,
                                          even_end, len_q, len_q, len_k, causal_offset, qk_scale, sm_scale, softcap,
                                          window_left, window_right, chunk, head_dim, head_dim_v, BLOCK_D, EVEN_D,
                                          BLOCK_DV, EVEN_DV, BLOCK_M, CAUSAL, True, WINDOW, CHUNK, SOFTCAP, ALIBI,
                                          NATURAL, LIBDEVICE, MASKED_TMA, ATOMIC_DQ, GQA)
        else:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qb, DOb, Lseb, Deltab, DQb, Slopesb,
                                          DescQ, DescDO, DescDQ, tma_b, stride_qh, stride_qm, stride_gh, stride_gm,
                                          stride_lh, stride_lm, stride_dh, stride_dqh, stride_dqm, stride_dqd,
                                          off_hkv, group, offs_n, offs_d, offs_dv,
                                          lo, hi, len_q, len_k, causal_offset, qk_scale, sm_scale, softcap,
                                          window_left, window_right, chunk, head_dim, head_dim_v, BLOCK_D, EVEN_D,
                                          BLOCK_DV, EVEN_DV, BLOCK_M, CAUSAL, True, WINDOW, CHUNK, SOFTCAP, ALIBI,
                                          NATURAL, LIBDEVICE, MASKED_TMA, ATOMIC_DQ, GQA)

        dk = dk * sm_scale
        _store_rows(DK + off_b * stride_dkb + off_hkv * stride_dkh + k_start * stride_dkn
                    + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
                    dk.to(DK.dtype.element_ty), offs_n, len_k, offs_d, head_dim, EVEN_D)
        _store_rows(DV + off_b * stride_dvb + off_hkv * stride_dvh + k_start * stride_dvn
                    + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
                    dv.to(DV.dtype.element_ty), offs_n, len_k, offs_dv, head_dim_v, EVEN_DV)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, K, V, desc_k, desc_v, tma_b, tma_h, stride_kn, stride_vn, offs_m,
                       offs_n, offs_d, offs_dv,
                       lo, hi, kv_end, len_q, causal_offset, qk_scale, sm_scale, softcap, slope,
                       window_left, window_right, chunk,
                       head_dim, head_dim_v, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       EVEN_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
                       SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, NATURAL: tl.constexpr, LIBDEVICE: tl.constexpr,
                       TMA: tl.constexpr):
    """Add the KV blocks lo, lo + BLOCK_N, ... < hi to a Q tile's dQ (masking as in the forward);
    ``lse2 = log2(e) * lse`` (+inf for rows that see no key), ``qk_scale = log2(e) * scale``. TMA
    (unmasked blocks, and masked ones with the launch's MASKED_TMA; rows past Nk read as 0): the K and V
    tiles come through the descriptors ``desc_k``, ``desc_v`` (as in the forward)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if TMA:
            k = desc_k.load([tma_b, tma_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
            v = desc_v.load([tma_b, tma_h, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        else:
            k = _load_rows(K + cols[:, None] * stride_kn, cols, kv_end, offs_d, head_dim, BLOCK_D, EVEN_D, MASKED)
            v = _load_rows(V + cols[:, None] * stride_vn, cols, kv_end, offs_dv, head_dim_v, BLOCK_DV, EVEN_DV,
                           MASKED)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        if NATURAL:
            s, t = _modified(qk, sm_scale, softcap, slope, offs_m[:, None], cols[None, :], causal_offset,
                             SOFTCAP, ALIBI, LIBDEVICE)
            arg = s * _LOG2E - lse2[:, None]
        else:
            arg = qk * qk_scale - lse2[:, None]
        if MASKED:
            visible = _visible(offs_m[:, None], cols[None, :], kv_end, causal_offset, window_left, window_right,
                               chunk, len_q, CAUSAL, WINDOW, CHUNK)
            arg = tl.where(visible, arg, float("-inf"))
        p = tl.math.exp2(arg)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        if SOFTCAP:  # the chain rule through c tanh(s / c), where p > 0 (a hidden key may hold NaN)
            ds = tl.where(p > 0, ds * (1.0 - t * t), 0.0)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
    return dq


@_kernel
def _attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ, DescK, DescV, sm_scale, qk_scale, Slopes, CuQ, CuK,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_gb, stride_gh, stride_gm, stride_gd,
                 stride_lb, stride_lh, stride_lm, stride_db, stride_dh, stride_sb,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 heads_q, group, len_q, len_k, seq_bucket, window_left, window_right, chunk, softcap,
                 head_dim, head_dim_v, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 EVEN_DV: tl.constexpr, SAME_DV: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
                 ALIGNED: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, VARLEN: tl.constexpr, NATURAL: tl.constexpr, LIBDEVICE: tl.constexpr,
                 TMA: tl.constexpr, MASKED_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    head_dim_v = _v_columns(head_dim, head_dim_v, SAME_DV)
    stride_qb, stride_qh = _hint16(stride_qb, ALIGNED), _hint16(stride_qh, ALIGNED)
    stride_kb, stride_kh = _hint16(stride_kb, ALIGNED), _hint16(stride_kh, ALIGNED)
    stride_vb, stride_vh = _hint16(stride_vb, ALIGNED), _hint16(stride_vh, ALIGNED)
    stride_gb, stride_gh = _hint16(stride_gb, ALIGNED), _hint16(stride_gh, ALIGNED)
    stride_dqb, stride_dqh = _hint16(stride_dqb, ALIGNED), _hint16(stride_dqh, ALIGNED)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    off_hkv = off_h // group
    start_m = pid_m * BLOCK_M
    q_start = 0
    k_start = 0
    if VARLEN:
        q_start = tl.load(CuQ + off_b).to(tl.int64)
        len_q = (tl.load(CuQ + off_b + 1) - q_start).to(tl.int32)
        k_start = tl.load(CuK + off_b).to(tl.int64)
        len_k = (tl.load(CuK + off_b + 1) - k_start).to(tl.int32)
    if start_m < len_q:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)  # v's columns: those of dO
        q = _load_rows(Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm
                       + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                       offs_m, len_q, offs_d, head_dim, BLOCK_D, EVEN_D, True)
        do = _load_rows(DO + off_b * stride_gb + off_h * stride_gh + q_start * stride_gm
                        + offs_m[:, None] * stride_gm + offs_dv[None, :] * stride_gd,
                        offs_m, len_q, offs_dv, head_dim_v, BLOCK_DV, EVEN_DV, True)
        lse = tl.load(Lse + off_b * stride_lb + off_h * stride_lh + (q_start + offs_m) * stride_lm,
                      mask=offs_m < len_q, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
        delta = tl.load(Delta + off_b * stride_db + off_h * stride_dh + q_start + offs_m, mask=offs_m < len_q,
                        other=0.0)
        slope = 0.0
        if ALIBI:
            slope = tl.load(Slopes + off_b * stride_sb + off_h).to(tl.float32)
        K_cols = K + off_b * stride_kb + off_hkv * stride_kh + k_start * stride_kn + offs_d[None, :] * stride_kd
        V_cols = V + off_b * stride_vb + off_hkv * stride_vh + k_start * stride_vn + offs_dv[None, :] * stride_vd
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        causal_offset = len_k - len_q
        last_row = tl.minimum(start_m + BLOCK_M, len_q) - 1
        lo, kv_end, full_end = _kv_window(start_m, last_row, len_k, len_q, causal_offset, window_left,
                                          window_right, chunk, CAUSAL, WINDOW, CHUNK, BLOCK_N)
        if SPLIT and not WINDOW and not CHUNK:
            full_end = (full_end // BLOCK_N) * BLOCK_N
            dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K_cols, V_cols, DescK, DescV, off_b.to(tl.int32),
                                    off_hkv.to(tl.int32), stride_kn, stride_vn,
                                    offs_m, offs_n, offs_d, offs_dv, 0, full_end, kv_end, len_q, causal_offset,
                                    qk_scale, sm_scale, softcap, slope, window_left, window_right, chunk, head_dim,
                                    head_dim_v, BLOCK_D, EVEN_D, BLOCK_DV, EVEN_DV, BLOCK_N, CAUSAL, False, WINDOW,
                                    CHUNK, SOFTCAP, ALIBI, NATURAL, LIBDEVICE, TMA)
        else:
            full_end = lo
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K_cols, V_cols, DescK, DescV, off_b.to(tl.int32),
                                off_hkv.to(tl.int32), stride_kn, stride_vn,
                                offs_m, offs_n, offs_d, offs_dv, full_end, kv_end, kv_end, len_q, causal_offset,
                                qk_scale, sm_scale, softcap, slope, window_left, window_right, chunk, head_dim,
                                head_dim_v, BLOCK_D, EVEN_D, BLOCK_DV, EVEN_DV, BLOCK_N, CAUSAL, True, WINDOW, CHUNK,
                                SOFTCAP, ALIBI, NATURAL, LIBDEVICE, MASKED_TMA)
        dq = dq * sm_scale
        _store_rows(DQ + off_b * stride_dqb + off_h * stride_dqh + q_start * stride_dqm
                    + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
                    dq.to(DQ.dtype.element_ty), offs_m, len_q, offs_d, head_dim, EVEN_D)


_bwd_key = ["BLOCK_D", "BLOCK_DV", "CAUSAL", "seq_bucket", "TMA", "WINDOW", "CHUNK", "SOFTCAP", "ALIBI", "VARLEN"]
# ATOMIC_DQ adds into DQ: each configuration timed while autotuning starts from zeros, and so does the real run.
_attn_bwd_dkdv_tuned = triton.autotune(configs=_configs(_BWD_TILES), key=[*_bwd_key, "ATOMIC_DQ", "GQA"],
                                       prune_configs_by={"early_config_prune": _pruner(_BWD_TILES)},
                                       reset_to_zero=["DQ"])(_attn_bwd_dkdv)
_attn_bwd_dq_tuned = triton.autotune(configs=_configs(_BWD_TILES), key=_bwd_key,
                                     prune_configs_by={"early_config_prune": _pruner(_BWD_TILES)})(_attn_bwd_dq)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

# The autotuner's choice for each launch signature seen, so that later launches skip Triton's autotuning
# wrapper, which rebuilds its key and argument dictionaries from the 40-odd arguments on every call: for a
# short call that host time is about as long as the kernel's GPU time.
# Keyed by a superset of the autotuner's own key (every constexpr passed, the sequence bucket, and the
# dtype of every tensor argument), so a signature new here is resolved through the autotuner once.
_CHOSEN: dict[tuple, triton.Config] = {}


def _signature(kernel, args: tuple, meta: dict) -> tuple:
    return (kernel.__name__, args[kernel.arg_names.index("seq_bucket")], *meta.items(),
            *(a.dtype for a in args if isinstance(a, torch.Tensor)))


def _run(kernel, tuned, grid_of, args: tuple, meta: dict, blocks, block_d: int, dtype, *, name: str):
    """Launch ``kernel`` with fixed tiles, or ``tuned`` (its autotuned twin) when ``blocks`` is None: the
    first launch of a signature through the autotuner, the next ones with its choice (``_CHOSEN``).
    ``block_d``: the launch's wider head-dim tile (:func:`_tile_width`), which fixed tiles' warps and
    stages follow."""
    if blocks is None:
        signature = _signature(kernel, args, meta)
        config = _CHOSEN.get(signature)
        if config is None:
            replay.unrecordable("the autotuner's first launch")
            tuned[lambda cfg: grid_of(cfg["BLOCK_M"], cfg["BLOCK_N"])](*args, **meta)
            _CHOSEN[signature] = tuned.best_config
            return
        tiles = config.all_kwargs()
        _set_tiles({**dict(zip(kernel.arg_names, args)), **meta, **tiles})
        replay.launch(kernel, grid_of(tiles["BLOCK_M"], tiles["BLOCK_N"]), *args, **meta, **tiles)
        return
    block_m, block_n = blocks
    grid = grid_of(block_m, block_n)
    if grid[0] * grid[1] == 0:
        return
    options = _launch_options(block_m, block_n, block_d, dtype)
    _set_tiles({**dict(zip(kernel.arg_names, args)), **meta, "BLOCK_M": block_m, "BLOCK_N": block_n})
    try:
        replay.launch(kernel, grid, *args, **meta, BLOCK_M=block_m, BLOCK_N=block_n, **options)
    except triton.runtime.errors.OutOfResources as exc:
        if options["num_stages"] == 1:
            raise ValueError(f"{name}: block_m={block_m}, block_n={block_n} do not fit this GPU for "
                             f"head dims padded to {block_d} at most and {dtype}: {exc}") from exc
        replay.launch(kernel, grid, *args, **meta, BLOCK_M=block_m, BLOCK_N=block_n,
                      num_warps=options["num_warps"], num_stages=1)


def _outputs(q, k, v, out, lse, *, kernel: str):
    """The ``(out, lse)`` tensors the forward writes: the caller's buffers where given (validated; the
    kernel writes through their strides, so any strided view works), else new contiguous ones."""
    _validate.check_out_buffers(q, k, v, out, lse, kernel=kernel, lse_dtypes=(torch.float32,))
    b, hq, len_q, _ = q.shape
    if out is None:  # [B, Hq, Nq, Dv]: v's head dim; bfloat16 for float8 inputs
        out = replay.empty((b, hq, len_q, v.shape[3]), dtype=out_dtype(q.dtype), device=q.device)
    if lse is None:
        lse = replay.empty((b, hq, len_q), dtype=torch.float32, device=q.device)
    return out, lse


class _Call:
    """One call's variant keywords, validated, and its tensors as the kernels index them: ``[B, H, N, D]``
    views (packed sequences: ``[1, H, total, D]`` transposed views of ``[total, H, D]``, one program row per
    sequence, the batch stride 0), the scalars and flags the kernels take, and the grid's batch size."""

    def __init__(self, q, k, v, *, kernel, causal, scale, block_m, block_n, window_size=(-1, -1),
                 attention_chunk=0, softcap=0.0, alibi_slopes=None, sinks=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, descales=None, dtypes=DTYPES):
        if not isinstance(causal, bool):
            raise TypeError(f"{kernel}: causal={causal!r}, but should be a bool")
        self.varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        if self.varlen:
            for label, t in (("q", q), ("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor) or t.dim() != 3:
                    raise ValueError(f"{kernel}: packed sequences take q [total_q, Hq, D], k [total_k, Hkv, D] and "
                                     f"v [total_k, Hkv, Dv]; {label} is "
                                     f"{tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}")
            q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
        else:
            q4, k4, v4 = q, k, v
        self.scale = _check_inputs(q4, k4, v4, kernel=kernel, scale=scale, block_m=block_m, block_n=block_n,
                                   dtypes=dtypes)
        self.q, self.k, self.v = q4, k4, v4
        self.fp8 = q4.dtype in FP8_DTYPES
        self.descales = None
        if descales is not None and any(d is not None for d in descales):
            if self.varlen:
                raise ValueError(f"{kernel}: descales are taken in a dense batch only, not with cu_seqlens")
            qd, kd, vd = _validate.check_descales(q4, k4, descales, kernel=kernel)
            ones = torch.ones((q4.shape[0], k4.shape[1]), dtype=torch.float32, device=q4.device)
            # contiguous: one stride pair serves the three
            self.descales = tuple((ones if d is None else d).contiguous() for d in (qd, kd, vd))
        self.causal, self.kernel = causal, kernel
        if self.varlen:
            cq = _validate.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total=q.shape[0], device=q.device,
                                            kernel=kernel)
            ck = _validate.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total=k.shape[0], device=q.device,
                                            kernel=kernel)
            if len(cq) != len(ck):
                raise ValueError(f"{kernel}: cu_seqlens_q has {len(cq) - 1} sequences and cu_seqlens_k "
                                 f"{len(ck) - 1}; both should describe the same sequences")
            lens_q, lens_k = [b - a for a, b in zip(cq, cq[1:])], [b - a for a, b in zip(ck, ck[1:])]
            self.max_q = _validate.check_max_seqlen("max_seqlen_q", max_seqlen_q, lens_q, kernel=kernel)
            self.max_k = _validate.check_max_seqlen("max_seqlen_k", max_seqlen_k, lens_k, kernel=kernel)
            self.cu_q, self.cu_k, self.batch = cu_seqlens_q, cu_seqlens_k, len(cq) - 1
        else:
            self.max_q, self.max_k = q.shape[2], k.shape[2]
            self.cu_q = self.cu_k = q  # never read without VARLEN
            self.batch = q.shape[0]
        self.variant = _validate.variant(q4, kernel=kernel, window_size=window_size,
                                         attention_chunk=attention_chunk, softcap=softcap,
                                         alibi_slopes=alibi_slopes, sinks=sinks, batch=self.batch)
        self.window, self.chunk, self.softcap = self.variant.window, self.variant.chunk, self.variant.softcap
        self.slopes, self.sinks = self.variant.alibi_slopes, self.variant.sinks
        self.stride_sb = 0 if self.slopes is None or self.slopes.dim() == 1 else self.slopes.stride(0)

    @property
    def flags(self) -> dict:
        return {"WINDOW": self.window != (-1, -1), "CHUNK": self.chunk > 0, "SOFTCAP": self.softcap > 0,
                "ALIBI": self.slopes is not None, "VARLEN": self.varlen, "LIBDEVICE": not INTERPRET}

    @property
    def scalars(self) -> tuple:
        return (*self.window, self.chunk, self.softcap)

    def pointers(self, like) -> tuple:
        """(Slopes, Sinks, CuQ, CuK): the tensors, or ``like`` where the kernel reads none."""
        return (like if self.slopes is None else self.slopes, like if self.sinks is None else self.sinks,
                self.cu_q, self.cu_k)

    def batch_strides(self, t: torch.Tensor) -> tuple:
        """``t``'s strides, the batch stride 0 for packed sequences (each program finds its rows)."""
        strides = t.stride()
        return (0, *strides[1:]) if self.varlen else strides

    def rows_buffer(self, dtype=torch.float32) -> torch.Tensor:
        """A row-wise result (lse, Delta) ``[B, Hq, N]``, or ``[1, Hq, total]`` over packed sequences (a
        ``[Hq, total]`` tensor, flash_attn's LSE layout)."""
        return replay.empty((1 if self.varlen else self.batch, self.q.shape[1], self.q.shape[2]), dtype=dtype,
                            device=self.q.device)

    def seq_bucket(self) -> int:
        return _seq_bucket(max(self.max_q, self.max_k))


def _check_gluon(gluon, *, kernel: str) -> None:
    """``gluon`` (see :func:`_gluon_plan`) is None, True or False, checked up front: also when there is no
    work to run."""
    if gluon is not None and not isinstance(gluon, bool):
        raise TypeError(f"{kernel}: gluon={gluon!r}, but should be None (where it applies), True or False")


def _gluon_plan(call: _Call, head_dim: int, tensors, *, inner_scaled: bool, fixed: bool, gluon,
                backward: bool = False) -> bool:
    """Whether the forward (or, ``backward``, the backward's dK/dV kernel) runs the Gluon kernel of Hopper:
    ``gluon=None`` where it takes the call as it is (:func:`flashverify_kernels.hopper.forward.unsupported`,
    :func:`flashverify_kernels.hopper.backward.unsupported`; tiles not fixed), ``False`` never, ``True`` always
    (the tiles then fix the Triton dQ kernel's only; tensors no descriptor reads go through contiguous copies),
    or a ValueError naming what rules the call out."""
    if gluon is False:
        return False
    if call.v.shape[3] != head_dim:  # the Gluon kernels tile q, k and v alike: one head dim
        if gluon:
            raise ValueError(f"{call.kernel}: gluon=True, but v's head dim {call.v.shape[3]} differs from q's and "
                             f"k's {head_dim}: the Gluon kernels take one head dim; only the Triton kernels "
                             "(gluon=None or False) take a value head dim of its own")
        return False
    variant = any(call.flags[name] for name in _VARIANT_KEY if name != "SINKS") or call.sinks is not None
    common = dict(device=call.q.device, dtype=call.q.dtype, head_dim=head_dim, scale=call.scale, variant=variant,
                  inner_scaled=inner_scaled)
    if backward:
        rules, what = gluon_backward.unsupported, "dK/dV kernel"
    else:
        rules, what = gluon_forward.unsupported, "forward"
    if not rules(**common, fixed_blocks=fixed and gluon is None, tensors=tensors):
        return True
    if gluon is None:
        return False
    reason = rules(**common, fixed_blocks=False, tensors=())
    if reason:
        raise ValueError(f"{call.kernel}: gluon=True, but the Gluon {what} does not take this call: {reason}")
    return True


# A plain call's variant keywords (those of fa2_forward), as a call that uses none passes them
_PLAIN = dict(window_size=(-1, -1), attention_chunk=0, softcap=0.0, alibi_slopes=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
_SETTING_TYPES = (type(None), bool, int, float, str)
_UNKNOWN = object()


def _plan_key(name: str, tensors: tuple, settings: tuple, variant: dict) -> tuple | None:
    """The signature under which :mod:`flashverify_kernels.triton.replay` keeps a launch plan of a plain dense call
    (every tensor non-empty, no variant keyword, settings of plain types), None for a call that takes the full
    path every time (and with plans off: ``FLASHVERIFY_REPLAY=0``). Besides the tensors' metadata and the
    settings, what the full path's choices read: the Gluon switch of the environment and the device
    Triton launches on."""
    if not replay.enabled():
        return None
    for value in settings:
        if type(value) not in _SETTING_TYPES:
            return None
    for label, value in variant.items():
        plain = _PLAIN.get(label, _UNKNOWN)
        if value is not plain and (plain is None or type(value) is not type(plain) or value != plain):
            return None
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return None
    return (name, *((type(value), value) for value in settings), os.environ.get(gluon_forward.ENV_OFF),
            replay.current_device(), *map(replay.tensor_key, tensors))


def _forward(q, k, v, *, causal: bool, scale, block_m, block_n, inner_scaled: bool, kernel: str,
             out=None, lse=None, sinks=None, gluon: bool | None = None, **variant):
    """Shared launcher of the FA1 and FA2 forward kernels: returns ``(out, lse)``, no autograd (``[total_q,
    Hq, Dv]`` and ``[Hq, total_q]`` for packed sequences). ``out``/``lse`` given (dense only): the kernel
    writes into them and they are returned. ``gluon``: see :func:`_gluon_plan`. A plain call replays the
    launch plan of its signature where one was recorded (:mod:`flashverify_kernels.triton.replay`)."""
    tensors = (q, k, v)
    key = None
    if out is None and lse is None and sinks is None:
        key = _plan_key("forward", tensors, (causal, scale, block_m, block_n, inner_scaled, gluon, kernel),
                        variant)
    return replay.run(key, tensors, lambda: _forward_full(
        q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, inner_scaled=inner_scaled,
        kernel=kernel, out=out, lse=lse, sinks=sinks, gluon=gluon, **variant))


def _forward_full(q, k, v, *, causal: bool, scale, block_m, block_n, inner_scaled: bool, kernel: str,
                  out=None, lse=None, sinks=None, gluon: bool | None = None, **variant):
    """:func:`_forward`'s full path: validation, the choice of kernel and tiles, the launch."""
    _check_gluon(gluon, kernel=kernel)
    call = _Call(q, k, v, kernel=kernel, causal=causal, scale=scale, block_m=block_m, block_n=block_n, sinks=sinks,
                 dtypes=DTYPES if inner_scaled else FORWARD_DTYPES, **variant)
    if call.fp8 and gluon:
        raise ValueError(f"{kernel}: gluon=True, but the Gluon forward takes float16 or bfloat16, not {q.dtype}")
    if call.fp8:  # tiles at least as wide as the float8 instructions' step
        gluon = False
        if block_m is not None or block_n is not None:
            block_m, block_n = (max(FP8_MIN_TILE, b or DEFAULT_BLOCKS[i]) for i, b in enumerate((block_m, block_n)))
    q4, k4, v4 = call.q, call.k, call.v
    if call.varlen:
        if out is not None or lse is not None:
            raise ValueError(f"{kernel}: out=/lse= buffers are taken for a dense batch only, not with cu_seqlens")
        # [total_q, Hq, Dv] (v's head dim), as [1, Hq, total_q, Dv]
        out4 = q.new_empty((*q.shape[:2], v.shape[2]), dtype=out_dtype(q.dtype)).transpose(0, 1)[None]
        lse4 = call.rows_buffer()
    else:
        out4, lse4 = _outputs(q, k, v, out, lse, kernel=kernel)
    hq, hkv, d, d_v = q4.shape[1], k4.shape[1], q4.shape[3], v4.shape[3]
    flags = call.flags
    work = call.batch * hq * call.max_q > 0
    gluon_plan = work and _gluon_plan(call, d, (call.q, call.k, call.v, out4), inner_scaled=inner_scaled,
                                      fixed=_fixed_blocks(block_m, block_n) is not None, gluon=gluon)
    if gluon_plan:
        # Hopper: the warp-specialized Gluon forward (flashverify_kernels/hopper/forward.py), same numerics.
        gluon_forward.forward(q4, k4, v4, out4, lse4, causal=causal, scale=call.scale)
    elif work:
        dims = _head_dim_meta(d, d_v, least=FP8_MIN_TILE if call.fp8 else 16)
        # Descriptors (TMA) for the unmasked KV tiles: dense float16/bfloat16 rows, head dim a power of two
        # up to 128 (v's the same), Hopper or later.
        tma = _use_tma(call, d, dims["BLOCK_D"], k4, v4)
        xd = call.descales or (lse4, lse4, lse4)  # never read without DESCALE
        args = (q4, k4, v4, out4, lse4, *_descriptors((k4, v4), tma), call.scale * LOG2E, call.scale,
                *call.pointers(q4), *xd, *xd[0].stride()[:2],
                *call.batch_strides(q4), *call.batch_strides(k4), *call.batch_strides(v4), *call.batch_strides(out4),
                *call.batch_strides(lse4), call.stride_sb,
                hq, hq // hkv, q4.shape[2], k4.shape[2], call.seq_bucket(), *call.scalars)
        meta = {**dims, "CAUSAL": causal, "SPLIT": _split_stages(q.dtype), "INNER_SCALED": inner_scaled,
                "ALIGNED": _aligned(q4, k4, v4, out4), **flags, "SINKS": call.sinks is not None, "TMA": tma,
                "NATURAL": flags["SOFTCAP"] or flags["ALIBI"] or call.sinks is not None,
                "DESCALE": call.descales is not None}
        _run(_attn_fwd, _attn_fwd_tuned, lambda bm, bn: (triton.cdiv(call.max_q, bm), call.batch * hq), args, meta,
             _fixed_blocks(block_m, block_n), _tile_width(dims), q.dtype, name=kernel)
    if call.varlen:
        return out4[0].transpose(0, 1), lse4[0]
    return out4, lse4


def fa2_forward_raw(q, k, v, *, causal: bool = False, scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, out=None, lse=None,
                    gluon: bool | None = None, **variant):
    """Triton FA2 forward (outer-scaled) without autograd: returns ``(out, lse)`` (written into the
    ``out``/``lse`` buffers when given); the variant keywords and ``gluon`` of :func:`fa2_forward`."""
    return _forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                    inner_scaled=False, kernel="triton_fa2", out=out, lse=lse, gluon=gluon, **variant)


def fa1_forward_raw(q, k, v, *, causal: bool = False, scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, out=None, lse=None, **variant):
    """Triton FA1 forward (inner-scaled: renormalised every KV step) without autograd: ``(out, lse)``
    (written into the ``out``/``lse`` buffers when given); the variant keywords of :func:`fa2_forward`."""
    return _forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                    inner_scaled=True, kernel="triton_fa1", out=out, lse=lse, **variant)


def fa2_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale: float | None = None,
                 block_m: int | None = None, block_n: int | None = None, sinks=None, deterministic: bool = True,
                 gluon: bool | None = None, **variant):
    """Triton FA2 backward: returns ``(dq, dk, dv, delta)`` with ``delta = rowsum(dO * O)`` (float32, the
    LSE's layout), and with ``sinks`` their gradient ``dsinks`` fifth (``-sum_{b, i} P_sink Delta``, a
    fixed-order torch sum).

    ``out`` and ``dout`` have v's head dim ``Dv`` (``[B, Hq, Nq, Dv]``), over which Delta sums; ``dq`` has
    ``q``'s shape, ``dk`` ``k``'s and ``dv`` ``v``'s (summed over the query heads of each group). Deterministic:
    every sum runs in a fixed order (no atomics, or adds in an order the programs wait for).
    ``deterministic=False``: no dQ kernel; the dK/dV kernel also adds each tile's share of dQ to a float32
    buffer with atomics (5 tile products per (Q, KV) tile pair instead of 7), so dQ's last bits depend on
    the order the additions arrive in. ``block_m``/``block_n`` are the Q and KV tiles of both kernels (see
    :func:`_bwd_tiles` for the float32 cap at head dims above 128); both ``None``
    autotunes each kernel's tiles on the GPU. The variant keywords are the forward's.

    On Hopper the dK/dV kernel of a plain call runs the warp-specialized Gluon kernel of
    :mod:`flashverify_kernels.hopper.backward` (same numerics; with ``deterministic=False`` it adds dQ by TMA
    reduces, and so does the deterministic backward at head dim 128, in a fixed order, with no dQ kernel:
    :func:`flashverify_kernels.hopper.backward.ordered_dq`); ``gluon`` decides it as it decides the forward's
    kernel in :func:`fa2_forward` (``True``: the fixed tiles are the dQ kernel's only, where one runs).
    A plain call replays the launch plan of its signature where one was recorded
    (:mod:`flashverify_kernels.triton.replay`).
    """
    tensors = (q, k, v, out, lse, dout)
    key = None
    if sinks is None:
        key = _plan_key("backward", tensors, (causal, scale, block_m, block_n, deterministic, gluon), variant)
    return replay.run(key, tensors, lambda: _backward_full(
        q, k, v, out, lse, dout, causal=causal, scale=scale, block_m=block_m, block_n=block_n, sinks=sinks,
        deterministic=deterministic, gluon=gluon, **variant))


def _backward_full(q, k, v, out, lse, dout, *, causal: bool, scale, block_m, block_n, sinks,
                   deterministic: bool, gluon: bool | None, **variant):
    """:func:`fa2_backward`'s full path: validation, the choice of kernels and tiles, the launches."""
    kernel = "triton_fa2 backward"
    if not isinstance(deterministic, bool):
        raise TypeError(f"{kernel}: deterministic={deterministic!r}, but should be a bool")
    _check_gluon(gluon, kernel=kernel)
    call = _Call(q, k, v, kernel=kernel, causal=causal, scale=scale, block_m=block_m, block_n=block_n, sinks=sinks,
                 **variant)
    q4, k4, v4 = call.q, call.k, call.v
    if call.varlen:
        out4, dout4 = (t.transpose(0, 1)[None] for t in (out, dout))
        lse4 = lse[None] if isinstance(lse, torch.Tensor) else lse
        _validate.check_backward_inputs(q4, k4, v4, out4, lse4, dout4, kernel=kernel)
    else:
        out4, lse4, dout4 = out, lse, dout
        _validate.check_backward_inputs(q, k, v, out, lse, dout, kernel=kernel)
    if lse4.dtype != torch.float32:
        raise ValueError(f"{kernel}: lse.dtype={_validate.dtype_name(lse4.dtype)}, but should be float32")
    hq, hkv, d, d_v = q4.shape[1], k4.shape[1], q4.shape[3], v4.shape[3]
    group = hq // hkv
    dims = _head_dim_meta(d, d_v)
    block_d, width = dims["BLOCK_D"], _tile_width(dims)
    bucket = call.seq_bucket()
    blocks = _fixed_blocks(block_m, block_n)
    dkdv_blocks, dq_blocks = (None, None) if blocks is None else _bwd_tiles(*blocks, width, q.dtype)
    dq, dk, dv = (replay.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dq4, dk4, dv4 = (t.transpose(0, 1)[None] for t in (dq, dk, dv)) if call.varlen else (dq, dk, dv)
    delta = call.rows_buffer()
    flags = call.flags
    variant_meta = {**flags, "NATURAL": flags["SOFTCAP"] or flags["ALIBI"]}
    pointers = call.pointers(q4)
    stride_lse, stride_delta = call.batch_strides(lse4), call.batch_strides(delta)
    # Hopper: the warp-specialized Gluon dK/dV kernel (flashverify_kernels/hopper/backward.py), same numerics; it reads
    # each Q tile's LSE * log2(e) and Delta from a padded buffer the Delta kernel fills
    gluon_dkdv = call.batch * hkv * call.max_k > 0 and _gluon_plan(
        call, d, (q4, k4, v4, dout4), inner_scaled=False, fixed=blocks is not None, gluon=gluon, backward=True)
    rows = gluon_backward.rows_buffer(lse4) if gluon_dkdv else None
    if call.batch * hq * call.max_q > 0:
        # out and dO, the Delta kernel's only tiles, are v's head dim wide
        delta_dims = _head_dim_meta(d_v)
        delta_block = 32 if INTERPRET or delta_dims["BLOCK_D"] > 128 else 64
        rows_args = (lse4, rows, *lse4.stride(), *rows.stride()[:3]) if gluon_dkdv else (delta, delta, *[0] * 6)
        replay.launch(
            _attn_bwd_delta, (triton.cdiv(rows.shape[3] if gluon_dkdv else call.max_q, delta_block), call.batch * hq),
            out4, dout4, delta, call.cu_q, *rows_args[:2], *call.batch_strides(out4), *call.batch_strides(dout4),
            *stride_delta[:2], *rows_args[2:], hq, q4.shape[2], **delta_dims,
            ALIGNED=_aligned(out4, dout4), VARLEN=call.varlen, ROWS=gluon_dkdv, BLOCK_M=delta_block)
    common = (call.scale, call.scale * LOG2E, pointers[0], pointers[2], pointers[3],
              *call.batch_strides(q4), *call.batch_strides(k4), *call.batch_strides(v4), *call.batch_strides(dout4),
              *stride_lse, *stride_delta[:2], call.stride_sb)
    # Descriptors for the unmasked tiles (Q and dO in dK/dV, K and V in dQ): as in the forward; at head dim
    # 128 for the masked ones too (MASKED_TMA: rows past the end read as 0, as masked pointer loads read
    # them); at 64 the masked pointer loads are the faster.
    tma = _use_tma(call, d, block_d, q4, k4, v4, dout4)
    meta = {**dims, "CAUSAL": causal, "SPLIT": _split_stages(q.dtype), "TMA": tma,
            "MASKED_TMA": tma and block_d == 128, **variant_meta}
    # deterministic at head dim 128 on Hopper: dQ added by the Gluon dK/dV kernel too, in a fixed order (fixed
    # tiles, which only gluon=True takes here, are the dQ kernel's: none runs)
    ordered = deterministic and gluon_dkdv and gluon_backward.ordered_dq(d, call.max_k, q.device)
    atomic = not deterministic or ordered
    dq_sum = replay.zeros(dq4.shape, dtype=torch.float32, device=q.device) if atomic else None  # dQ's sums
    if gluon_dkdv:
        gluon_backward.dkdv(q4, k4, v4, dout4, lse4, delta, dk4, dv4, causal=causal, scale=call.scale, dq_sum=dq_sum,
                            rows=rows, ordered=ordered)
    elif call.batch * hkv * call.max_k > 0:
        meta["ALIGNED"] = _aligned(q4, k4, v4, dout4, dk4, dv4)
        # without the atomics the kernel never reads its DQ argument: one element, left uninitialised
        dq_arg = dq_sum if atomic else replay.empty(1, dtype=torch.float32, device=q.device)
        _run(_attn_bwd_dkdv, _attn_bwd_dkdv_tuned, lambda bm, bn: (triton.cdiv(call.max_k, bn), call.batch * hkv),
             (q4, k4, v4, dout4, lse4, delta, dk4, dv4, dq_arg,
              *_descriptors((q4, dout4), tma), *_descriptors((dq_arg,), tma and atomic and _DESC_REDUCE.value),
              *common, *call.batch_strides(dk4),
              *call.batch_strides(dv4), *(call.batch_strides(dq_arg) if atomic else (0, 0, 0, 0)), hq, hkv, group,
              q4.shape[2], k4.shape[2], bucket, *call.scalars),
             {**meta, "ATOMIC_DQ": atomic, "GQA": group > 1}, dkdv_blocks, width, q.dtype, name=kernel)
    if atomic:
        replay.copy(dq4, dq_sum)
    elif call.batch * hq * call.max_q > 0:
        meta["ALIGNED"] = _aligned(q4, k4, v4, dout4, dq4)
        _run(_attn_bwd_dq, _attn_bwd_dq_tuned, lambda bm, bn: (triton.cdiv(call.max_q, bm), call.batch * hq),
             (q4, k4, v4, dout4, lse4, delta, dq4, *_descriptors((k4, v4), tma), *common, *call.batch_strides(dq4),
              hq, group, q4.shape[2],
              k4.shape[2], bucket, *call.scalars),
             meta, dq_blocks, width, q.dtype, name=kernel)
    delta = delta[0] if call.varlen else delta
    if call.sinks is None:
        return dq, dk, dv, delta
    # The sink's dS is P_sink (0 - Delta), summed over batch and rows (a fixed-order reduction).
    replay.unrecordable("the sinks' gradient, computed by torch operations")
    rows = lse4.to(torch.float32)
    p_sink = torch.exp(call.sinks.to(torch.float32)[None, :, None] - rows)
    dsinks = -(p_sink * (delta[None] if call.varlen else delta)).sum(dim=(0, 2))
    return dq, dk, dv, delta, dsinks.to(call.sinks.dtype)


# --------------------------------------------------------------------------------------------------
# Autograd and the public functions
# --------------------------------------------------------------------------------------------------

def _apply(q, k, v, causal, scale, block_m, block_n, inner_scaled: bool, out, lse, sinks, variant,
           deterministic: bool = True, gluon: bool | None = None):
    kernel = "triton_fa1" if inner_scaled else "triton_fa2"
    if not isinstance(deterministic, bool):
        raise TypeError(f"{kernel}: deterministic={deterministic!r}, but should be a bool")
    _check_gluon(gluon, kernel=kernel)
    buffers = None
    if out is not None or lse is not None:
        if variant.get("cu_seqlens_q") is not None or variant.get("cu_seqlens_k") is not None:
            raise ValueError(f"{kernel}: out=/lse= buffers are taken for a dense batch only, not with cu_seqlens")
        _check_inputs(q, k, v, kernel=kernel, scale=scale, block_m=block_m, block_n=block_n)
        buffers = _outputs(q, k, v, out, lse, kernel=kernel)
    return _autograd.apply(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                           forward=functools.partial(_forward, inner_scaled=inner_scaled, kernel=kernel, gluon=gluon,
                                                     **variant),
                           backward=functools.partial(fa2_backward, deterministic=deterministic, gluon=gluon,
                                                      **variant),
                           buffers=buffers, sinks=sinks)


def fa2_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                block_m: int | None = None, block_n: int | None = None, out=None, lse=None,
                window_size=(-1, -1), attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes=None, sinks=None,
                cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                deterministic: bool = True, gluon: bool | None = None, q_descale=None, k_descale=None,
                v_descale=None):
    """Triton FlashAttention-2 forward: ``(out, lse)``; gradients flow through ``out`` (and to ``sinks``).

    ``q`` is ``[B, Hq, Nq, D]``, ``k`` ``[B, Hkv, Nk, D]`` and ``v`` ``[B, Hkv, Nk, Dv]`` (``Hq % Hkv ==
    0``), any strides; float16, bfloat16 or float32; ``D`` and ``Dv`` in 16..256, multiples of 8 (``Dv`` may
    differ from ``D``, as multi-head latent attention's 192/128; ``out`` is then ``[B, Hq, Nq, Dv]``).
    ``causal`` is bottom-right aligned; ``scale=None`` means ``1/sqrt(D)``, whatever ``Dv`` is.
    ``block_m``/``block_n`` (powers of two >= 16) fix the tiles; both ``None`` autotunes them on the GPU.
    ``out=`` (``[B, Hq, Nq, Dv]``, q's dtype) and ``lse=`` (``[B, Hq, Nq]`` float32), views with any strides,
    receive the results and are returned (``out_buffers`` in :class:`flashverify_kernels.registry.Implementation`);
    gradients still flow to q, k, v through the returned out.

    Variants (flash_attn's keywords): ``window_size=(left, right)`` (-1 unbounded), ``attention_chunk``,
    ``softcap`` (0.0: none), ``alibi_slopes`` (float32 ``[Hq]`` or ``[B, Hq]``), ``sinks`` (``[Hq]``
    logits, float32) and packed variable-length sequences: ``q [total_q, Hq, D]``, ``k [total_k, Hkv, D]``,
    ``v [total_k, Hkv, Dv]`` with ``cu_seqlens_q``, ``cu_seqlens_k`` (int32) and ``max_seqlen_q``,
    ``max_seqlen_k``, returning ``out [total_q, Hq, Dv]`` and ``lse [Hq, total_q]``. ``deterministic=False``:
    the backward adds dQ with atomics (see :func:`fa2_backward`): fewer tile products and no dQ kernel, but dQ
    not bitwise reproducible.

    On Hopper (compute capability 9.0) the forward of a plain call (no variant keyword; float16/bfloat16;
    head dim 64 or 128; ``scale > 0``; tiles not fixed) runs the warp-specialized Gluon kernel of
    :mod:`flashverify_kernels.hopper.forward`, and its backward the Gluon dK/dV kernel of
    :mod:`flashverify_kernels.hopper.backward` (the Delta kernel, and in the deterministic backward the dQ kernel,
    stay Triton ones): same numerics.
    ``gluon=False`` keeps the Triton kernels; ``gluon=True`` requires the Gluon ones (a ValueError names
    what rules the call out, a value head dim of its own among them: the Gluon kernels take ``Dv = D``
    only; ``block_m``/``block_n`` then fix the dQ kernel's tiles only; inputs no descriptor reads are
    copied contiguous first).

    A plain call (no variant keyword, no sinks, no ``out``/``lse`` buffers) whose tensors have the shapes,
    strides, dtypes and alignment of an earlier call, with the same other arguments, replays the launches
    that call made (:mod:`flashverify_kernels.triton.replay`): the same kernels, a fraction of the host time.
    ``FLASHVERIFY_REPLAY=0`` runs the full path on every call.

    Float8 (``float8_e4m3fn``, ``float8_e5m2``; forward only, no gradients; the Triton kernel, never the
    Gluon one): ``out`` is bfloat16, and ``q_descale``, ``k_descale``, ``v_descale`` (float32 ``[B, Hkv]``,
    FlashAttention-3's; a dense batch only; each None for 1) make the attention that of the dequantised
    inputs: the scores' factor is ``scale q_descale k_descale``, p is cast to v's format for ``P @ V``, and
    the normalised output is multiplied by ``v_descale``. Float8 tiles are at least 32 wide (the float8
    matrix instructions' step): smaller ``block_m``/``block_n`` are raised to 32.
    """
    variant = dict(window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
                   alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    descales = (q_descale, k_descale, v_descale)
    if getattr(q, "dtype", None) in FP8_DTYPES or any(d is not None for d in descales):
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
            raise ValueError("triton_fa2: float8 inputs are taken in the forward only; q, k, v should not "
                             "require grad")
        return _forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n, inner_scaled=False,
                        kernel="triton_fa2", out=out, lse=lse, sinks=sinks, gluon=gluon, descales=descales,
                        **variant)
    return _apply(q, k, v, causal, scale, block_m, block_n, False, out, lse, sinks, variant, deterministic, gluon)


def fa1_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                block_m: int | None = None, block_n: int | None = None, out=None, lse=None,
                window_size=(-1, -1), attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes=None, sinks=None,
                cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                deterministic: bool = True):
    """Triton FlashAttention-1 forward (inner-scaled), same contract and variants as :func:`fa2_forward`;
    its backward is the FA2 backward, which needs only ``out`` and the LSE."""
    variant = dict(window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
                   alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return _apply(q, k, v, causal, scale, block_m, block_n, True, out, lse, sinks, variant, deterministic)
