"""The FA2 forward on Hopper (compute capability 9.0), written in Gluon, Triton's lower-level language.

:func:`flashverify_kernels.triton.attention.fa2_forward` runs this kernel instead of its Triton one where
:func:`unsupported` has no objection (plain attention: no window, chunk, softcap, ALiBi, sinks or packed sequences;
float16/bfloat16; head dim 64 or 128; a positive scale; tensors a descriptor can read; the tiles left to the
launcher). The Triton forward's numerics (running max ``m`` in raw ``q.k`` units, ``p`` rounded to the input
dtype before ``p @ v``, float32 accumulators, natural-log LSE; bottom-right causal alignment; rows that see
no key give ``out = 0``, ``lse = -inf``) but for the exponent: one fused multiply-add ``fma(q.k, c, -fl(m c))``,
``c = scale * log2(e)``, where the Triton forward subtracts, then multiplies (``(q.k - m) * c``). The
offset ``fl(m c)`` is carried with ``m``, so that every ``p`` of a row, the rescale ``2^(fl(m_old c) -
fl(m_new c))`` (exactly 1 where the max held) and the LSE take the same one. One fused multiply-add an
exponent instead of a subtraction and a multiply: at head dim 64 the loop is bound by its issued
instructions. What it costs: the largest ``p`` of a row is ``2^d``, ``|d|`` at most half a float32 ulp of
``m c``, not exactly 1; with logits near 1e4 its rounding to the input dtype errs, and a one-hot row's output
errs by up to about one ulp of the output instead of half (docs/benchmarks.md, "Exponents").

Why a second forward: Triton's compiler waits for every tensor-core product right after issuing it, so a
tile's exponentials never overlap a product. Here each program has three or four partitions (warp
specialization): one warp issues every TMA load into shared-memory stages (K: 3, V: 2) and two or three
consumer warpgroups (:func:`warpgroups`) of four warps, 64 query rows each, run the loop below, releasing
the stages through "empty" barriers::

    S_0 = Q K_0^T;  P_0 = softmax step(S_0)
    for j in 0 .. n - 2:
        issue S_{j+1} = Q K_{j+1}^T          (asynchronous)
        acc *= alpha_j;  issue acc += P_j V_j  (asynchronous)
        wait for S_{j+1};  P_{j+1} = softmax step(S_{j+1})   <- could overlap P_j V_j ...
        wait for P_j V_j
    acc *= alpha_{n-1};  acc += P_{n-1} V_{n-1}

... but ptxas (Triton 3.6 and 3.9, sm_90a) issues the wait for P_j V_j before the step's exponentials (the compiled
loop: DEPBAR on P_j V_j right after the mask, then the exponentials, the conversion of P and the rescale), so a
warpgroup's softmax runs while the other warpgroups' products do, not its own. Keeping that wait after the
exponentials needs an already-complete barrier wait before it, whose loop ends a basic block: at head dim 64,
where the loop is bound by its issued instructions, that costs more than the overlap brings, and at 128 it is
no faster, so the loop is left to ptxas.

Mostly (:func:`persistent`: not causal, and causal up to 16384 keys) one program per SM walks the tiles
(:func:`_walk`), with Q in two buffers: the producer loads the next tile's Q while the current tile runs, and the
K/V ring runs on across tiles. That is the persistent kernel: a tile starts without waiting for its first loads,
and no program is launched per tile (that wait, the launch and the epilogue are most of a tile's fixed cost).
Not causal the walk takes a head's Q tiles one after another, program p the tiles p, p + P, ... (:func:`_walk`).
Causal the programs take their tiles as they free up (:func:`unit`): the producer warp takes its first unit of
the walk by its program's number and each next one with one atomic add on a counter that each call's kernel
leaves at 0 (:func:`walk_counter`), and hands each tile to the consumers through shared memory with its Q. The
units (:func:`_unit`): a head's Q tiles paired, the k-th longest with the k-th shortest, a head after another,
then the last heads' tiles one at a time, longest first, so that the walk ends on its shortest tiles. Causal
tiles do unequal work, and programs given their tiles by a fixed walk, even in pairs of equal work, finish
further apart than the walk's own imbalance; taking units as programs free up, and ending on the shortest,
lets them finish together. Causal over more than 16384 keys, one program per tile, the longest rows first,
leaves that balancing to the hardware's scheduling of programs.

Causal, a head's Q tiles end at its last row (:func:`first_row`): where the rows are not a whole number of
tiles, the rows missing are the first tile's, which sees fewest keys, not the last one's, which sees most (a
warpgroup without rows of its own still runs its tile's loop, and the first tile's loop is the shortest); a
warpgroup whose rows would start before row 0 runs rows from row 0 on (:func:`wg_row`). Outputs bitwise those
of tiles from row 0 (a row's arithmetic does not depend on its tile). Three warpgroups at head dim 64 from
2048 causal keys on (:func:`warpgroups`) rest on this placement of the padding.

Both kernels are launched programmatically (:data:`PROGRAMMATIC_LAUNCH`, CUDA's programmatic dependent launch): a
kernel may start while the one before it on the stream ends, and each partition waits for that one's writes
(``griddepcontrol.wait``) before it touches global memory.

No product is in flight across the loop's back edge: when an accumulator in flight is copied there, ptxas
serializes every product of the kernel (its "C7514" note), which removes every overlap this design exists for
(tests/test_gluon_forward.py checks that no kernel here gets the note). Today's figures beside cuDNN and the
other peers: docs/benchmarks.md.

Not available under Triton's interpreter (the CPU runs the Triton forward); tests/test_gluon_forward.py
compiles it for sm_90 without a GPU and checks it against float64 on one.
"""
from __future__ import annotations

import functools
import math
import os

import torch

from flashverify_kernels.triton import replay

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, \
        warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError as exc:  # a Triton without Gluon: the Triton forward runs everywhere
    AVAILABLE = False
    UNAVAILABLE_REASON = f"{type(exc).__name__}: {exc}"
else:
    AVAILABLE = True
    UNAVAILABLE_REASON = ""

LOG2E = math.log2(math.e)
HEAD_DIMS = (64, 128)
BLOCK_M = 64  # query rows per consumer warpgroup; a program covers warpgroups(...) * BLOCK_M
BLOCK_N = 128  # keys per KV block
CONSUMER_REGS = 160  # registers per thread of a consumer warpgroup where there are three (240 with two)
THREE_WARPGROUPS_CAUSAL_MIN_KEYS = 2048
THREE_WARPGROUPS_MAX_PADDING = 1.05  # 192-row tiles' rows over 128-row tiles' (warpgroups()): three warpgroups
# at Nq = 2048 and 4096 (1.03), two at 1024 (1.125)


def warpgroups(head_dim: int, causal: bool, len_q: int, len_k: int) -> int:
    """Consumer warpgroups per program. Three at head dim 64 (192 query rows share each K and V block loaded;
    their accumulators fit 160 registers a thread), except
    - causal attention over fewer than ``THREE_WARPGROUPS_CAUSAL_MIN_KEYS`` (2048) keys, where two are the
      faster. Causal tiles end at a head's last row (:func:`first_row`), so that a head's rows short of a whole
      tile are missing from its first tile, the one that sees fewest keys: a warpgroup without rows of its
      own runs the shortest loop, which is what lets three run causal attention from 2048 keys on;
    - where 192-row tiles would pad the last tile of a head by more than 128-row tiles do, beyond
      ``THREE_WARPGROUPS_MAX_PADDING``: a warpgroup past the end idles through its tile's whole loop (Nq =
      1024: 1152 rows against 1024, two warpgroups; 2048 and 4096: 2112 against 2048 and 4224 against 4096,
      three).
    Two at head dim 128 (three would need 64-key blocks, slower there)."""
    if head_dim != 64 or (causal and len_k < THREE_WARPGROUPS_CAUSAL_MIN_KEYS):
        return 2
    rows_three, rows_two = -(-len_q // (3 * BLOCK_M)) * 3 * BLOCK_M, -(-len_q // (2 * BLOCK_M)) * 2 * BLOCK_M
    return 3 if rows_three <= rows_two * THREE_WARPGROUPS_MAX_PADDING else 2


def first_row(pid_m: int, len_q: int, causal: bool, groups: int) -> int:
    """The first query row of Q tile ``pid_m`` of ``groups * BLOCK_M`` rows (the kernels' ``_first_row``): from
    row 0 on, but causal from the last row back: a head's tiles end at its last row, and the rows short of a
    whole tile are missing from its first tile, the one that sees fewest keys, not from its last, which sees
    most (the first row may then be negative: :func:`wg_row`)."""
    rows = groups * BLOCK_M
    return len_q - (-(-len_q // rows) - pid_m) * rows if causal else pid_m * rows


def wg_row(start: int, w: int) -> int:
    """The first of the ``BLOCK_M`` rows warpgroup ``w`` runs in the tile from row ``start`` (the kernels'
    ``_wg_row``): never before row 0; a warpgroup whose rows would start there runs rows from row 0 on, some
    of them also another warpgroup's (a row's arithmetic does not depend on the warpgroup that runs it, so
    both write the same bits), and no TMA box starts at a negative row (one that does raises an illegal
    instruction on the H200)."""
    return max(start + w * BLOCK_M, 0)


ENV_OFF = "FLASHVERIFY_GLUON"  # "0": never take the Gluon kernels (forward, backward dK/dV): the Triton ones run


def readable(t: torch.Tensor) -> bool:
    """Whether a descriptor reads the ``[B, H, N, D]`` tensor ``t`` in place: unit last stride, 16-byte aligned
    base and strides, no broadcast (zero-stride) dimension; a dimension of size 1 may have any stride."""
    size = t.element_size()
    # the common case, without the stride loop: a contiguous tensor's strides are multiples of its last dim
    if t.numel() and t.is_contiguous() and t.shape[3] * size % 16 == 0:
        return t.data_ptr() % 16 == 0
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and all(t.shape[i] == 1 or (t.stride(i) > 0 and t.stride(i) * size % 16 == 0) for i in range(3)))


def unsupported(*, device: torch.device, dtype: torch.dtype, head_dim: int, scale: float, variant: bool,
                inner_scaled: bool, fixed_blocks: bool, tensors) -> str:
    """Why the FA2 forward of a call does not run here ("" where it does). It runs for a plain FA2 call
    (no variant keyword, outer-scaled, tiles not fixed by the caller) of float16/bfloat16 ``[B, H, N, D]``
    tensors with head dim 64 or 128 and ``scale > 0``, each readable through a descriptor (unit last
    stride, 16-byte aligned base and strides, no broadcast dimension: :func:`readable`), on an NVIDIA GPU of
    compute capability 9.0, with Gluon importable and ``FLASHVERIFY_GLUON`` not "0"."""
    if not AVAILABLE:
        return f"Gluon is not importable ({UNAVAILABLE_REASON})"
    if os.environ.get(ENV_OFF, "1") == "0":
        return f"{ENV_OFF}=0"
    if variant or inner_scaled or fixed_blocks:
        return "a variant keyword, the inner-scaled (FA1) form or tiles fixed by the caller"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (float16 or bfloat16 only)"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} (one of {HEAD_DIMS} only)"
    if not scale > 0:
        return f"scale {scale} (positive only)"
    if device.type != "cuda" or torch.version.hip is not None:
        return f"device {device} (an NVIDIA GPU only)"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} (9.0 only: warpgroup MMA)"
    for t in tensors:
        if not readable(t):
            return f"a tensor of shape {tuple(t.shape)}, strides {t.stride()} that no descriptor reads"
    return ""


if AVAILABLE:
    # Renamed after Triton 3.6 (async_copy_global_to_shared -> async_load, async_copy_shared_to_global ->
    # async_store); the kernel calls whichever this Triton has.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    K_STAGES = gl.constexpr(3)
    V_STAGES = gl.constexpr(2)

    @gluon.jit
    def _softmax(s, m_i, mc_i, l_i, c, ROW_O: gl.constexpr, P_LAYOUT: gl.constexpr, dtype: gl.constexpr):
        """One online-softmax step on a block's scores ``s`` (raw ``q.k``; -inf where not visible): the new
        running max ``m`` (raw units) and its offset ``mc = fl(m c)``, the new running sum, the accumulator's
        rescale factor (in its row layout) and ``p = 2^fl(s c - mc)`` (one fused multiply-add) as the A operand
        of ``p @ v``. Every ``p`` of a row, the rescale ``2^(mc_old - mc_new)`` (exactly 1 where the max held)
        and the LSE take the same rounded offset. A row with no visible key so far keeps ``m = mc = -inf``,
        ``l = 0``, ``p = 0``."""
        m_new = gl.maximum(m_i, gl.max(s, 1))
        mc_new = m_new * c
        off = gl.where(m_new == float("-inf"), 0.0, mc_new)
        alpha = gl.exp2(mc_i - off)
        p = gl.exp2(gl.fma(s, gl.full(s.shape, c, gl.float32, s.type.layout), -gl.expand_dims(off, 1)))
        l_i = l_i * alpha + gl.sum(p, 1)
        return gl.convert_layout(p.to(dtype), P_LAYOUT), gl.convert_layout(alpha, ROW_O), m_new, mc_new, l_i

    @gluon.jit
    def _mask(s, j, n_full, start_m, len_k, causal_offset, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr):
        """-inf for keys past the end and (causal) past a row's diagonal, in blocks ``j >= n_full`` only. Causal,
        one test a score: a row that exists (``row < len_q``) sees keys up to ``row + len_k - len_q < len_k``, so
        the diagonal's bound covers the keys' end (rows past ``len_q`` are neither stored nor in the LSE), and a
        masked step, in a loop bound by its issued instructions, issues one test a score where both would issue
        two.

        The test, ``col <= row + causal_offset``, is written as ``col & ~6 <= row + causal_offset - (col & 6)``
        (the same integers: the two parts of ``col`` share no bit). In the scores' layout bits 1-2 of a block's
        column are a thread's lane in its quad and the other bits its register, so that ``col & ~6`` is a
        constant of the element and ``col & 6`` one of the thread: the compiled test is one compare with an
        immediate, where a column computed element by element costs one more instruction every other score. The
        outputs are bitwise those of the plain test."""
        if j >= n_full:
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
            if CAUSAL:
                rows = gl.expand_dims(start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_LAYOUT)), 1)
                own = gl.expand_dims(cols & (BLOCK_N - 7), 0)  # BLOCK_N - 1 less bits 1-2
                lane = gl.expand_dims(cols & 6, 0)
                visible = own <= rows + causal_offset - j * BLOCK_N - lane
            else:
                visible = gl.expand_dims(j * BLOCK_N + cols, 0) < len_k
            s = gl.where(visible, s, float("-inf"))
        return s

    @gluon.jit
    def _attend(q_smem, q_bar, q_phase, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, ring, o_desc, Lse,
                stride_lb, stride_lh, stride_ln, c, off_b, off_h, start_m, len_q, len_k, causal_offset, n_blocks,
                n_full, n_loaded, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                D: gl.constexpr):
        """One warpgroup, one tile: query rows [start_m, start_m + BLOCK_M) over KV blocks [0, n_blocks), whose
        K and V come through the stages as blocks ``ring + j`` of the producer's walk; then it releases the
        stages of the blocks the producer loaded for the other warpgroups only (up to ``n_loaded``), so that
        every stage gets one release per warpgroup, and stores the output through Q's buffer (the store read
        when it returns)."""
        dtype: gl.constexpr = o_desc.dtype
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        q_tile = q_smem.reshape([BLOCK_M, D])
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_S)
        mc_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=ROW_S)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT)
        mbarrier.wait(q_bar, q_phase)
        if n_blocks > 0:
            mbarrier.wait(k_ready.index(ring % K_STAGES), (ring // K_STAGES) & 1)
            s = warpgroup_mma(q_tile, k_smem.index(ring % K_STAGES).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            mbarrier.arrive(k_empty.index(ring % K_STAGES), count=1)
            s = _mask(s, 0, n_full, start_m, len_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N, S_LAYOUT)
            p, alpha, m_i, mc_i, l_i = _softmax(s, m_i, mc_i, l_i, c, ROW_O, P_LAYOUT, dtype)
            for j in range(0, n_blocks - 1):
                kn = (ring + j + 1) % K_STAGES
                vj = (ring + j) % V_STAGES
                mbarrier.wait(k_ready.index(kn), ((ring + j + 1) // K_STAGES) & 1)
                s = warpgroup_mma(q_tile, k_smem.index(kn).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
                acc = acc * gl.expand_dims(alpha, 1)
                mbarrier.wait(v_ready.index(vj), ((ring + j) // V_STAGES) & 1)
                acc = warpgroup_mma(p, v_smem.index(vj).reshape([BLOCK_N, D]), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=(s, ))  # S_{j+1} done; P_j V_j may still run (see the module's doc)
                mbarrier.arrive(k_empty.index(kn), count=1)
                s = _mask(s, j + 1, n_full, start_m, len_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N, S_LAYOUT)
                p, alpha, m_i, mc_i, l_i = _softmax(s, m_i, mc_i, l_i, c, ROW_O, P_LAYOUT, dtype)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(vj), count=1)
            vj = (ring + n_blocks - 1) % V_STAGES
            acc = acc * gl.expand_dims(alpha, 1)
            mbarrier.wait(v_ready.index(vj), ((ring + n_blocks - 1) // V_STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(vj).reshape([BLOCK_N, D]), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(vj), count=1)
        for i in range(ring + gl.maximum(n_blocks, 0), ring + n_loaded):
            mbarrier.wait(k_ready.index(i % K_STAGES), (i // K_STAGES) & 1)
            mbarrier.arrive(k_empty.index(i % K_STAGES), count=1)
            mbarrier.wait(v_ready.index(i % V_STAGES), (i // V_STAGES) & 1)
            mbarrier.arrive(v_empty.index(i % V_STAGES), count=1)

        # Rows with no visible key: l = 0, acc = 0 -> out = 0, lse = -inf. One reciprocal a row, then a product an
        # element: ``acc / l`` compiles to a full-range division an element (range tests and scalings around each
        # product; bitwise the same result where l is a normal float, as it is here: l >= 1 or the row is empty).
        # Then the output's store is issued before the LSE's, so that the fence before it does not wait for them.
        # Both shorten the epilogue, which no product of this warpgroup overlaps.
        l_o = gl.convert_layout(l_i, ROW_O)
        empty = l_o == 0.0
        l_safe = gl.where(empty, 1.0, l_o)
        if start_m < len_q:
            out = acc * gl.expand_dims(1.0 / l_safe, 1)
            q_tile.store(out.to(dtype))  # Q is read no more: its buffer stages the output (rows past the end clipped)
            fence_async_shared()
            _tma_store(o_desc, [off_b, off_h, start_m, 0], q_smem)
        lse = gl.where(empty, float("-inf"), (gl.convert_layout(mc_i, ROW_O) + gl.log2(l_safe)) * 0.6931471805599453)
        rows = start_m + gl.arange(0, BLOCK_M, layout=ROW_O)
        gl.store(Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + rows * stride_ln, lse,
                 mask=rows < len_q)
        if start_m < len_q:
            tma.store_wait(pendings=0)

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, o_desc, Lse, stride_lb,
                  stride_lh, stride_ln, c, off_b, off_h, start_m, len_q, len_k, causal_offset, n_blocks, n_full,
                  n_loaded, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr):
        """One warpgroup of a program of one tile."""
        _after_prior_grids()
        _attend(q_smem, q_bar, 0, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, 0, o_desc, Lse, stride_lb,
                stride_lh, stride_ln, c, off_b, off_h, start_m, len_q, len_k, causal_offset, n_blocks, n_full,
                n_loaded, CAUSAL, BLOCK_M, BLOCK_N, D)

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, off_b, off_hkv, ring, n_loaded,
                 BLOCK_N: gl.constexpr):
        """K and V blocks [0, n_loaded) of a tile into the stages as they are freed, as blocks ``ring + i`` of
        the producer's walk."""
        for i in range(n_loaded):
            r = ring + i
            ks = r % K_STAGES
            mbarrier.wait(k_empty.index(ks), ((r // K_STAGES) & 1) ^ 1, pred=r >= K_STAGES)
            mbarrier.expect(k_ready.index(ks), k_desc.block_type.nbytes)
            _tma_load(k_desc, [off_b, off_hkv, i * BLOCK_N, 0], k_ready.index(ks), k_smem.index(ks))
            vs = r % V_STAGES
            mbarrier.wait(v_empty.index(vs), ((r // V_STAGES) & 1) ^ 1, pred=r >= V_STAGES)
            mbarrier.expect(v_ready.index(vs), v_desc.block_type.nbytes)
            _tma_load(v_desc, [off_b, off_hkv, i * BLOCK_N, 0], v_ready.index(vs), v_smem.index(vs))

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, off_b,
                  off_h, off_hkv, start_m, n_loaded, WARPGROUPS: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr):
        """One warp: every warpgroup's Q tile, then K and V block by block into the stages as they are freed."""
        _after_prior_grids()
        for w in gl.static_range(WARPGROUPS):
            mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
            _tma_load(q_desc, [off_b, off_h, _wg_row(start_m, w, BLOCK_M), 0], q_bar.index(w), q_smem.index(w))
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, off_b, off_hkv, 0, n_loaded,
                 BLOCK_N)

    @gluon.jit
    def _rounds(tiles_m, n_tiles):
        """The rounds of a persistent program's loop where not causal (:func:`_walk`)."""
        return gl.cdiv(n_tiles, gl.num_programs(0))

    @gluon.jit
    def _walk(it, tiles_m, n_tiles, heads_q, len_q, len_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              WARPGROUPS: gl.constexpr):
        """A persistent program's tile of round ``it`` where not causal (causal: :func:`_unit`): (whether there
        is one, batch, head, first row, KV blocks loaded for it). Program p takes tile ``it * P + p`` of the
        walk, a head's Q tiles one after another, then the next head's."""
        i = it * gl.num_programs(0) + gl.program_id(0)
        pid_bh = i // tiles_m
        pid_m = i % tiles_m
        valid = i < n_tiles
        off_b, off_h, start_m, n_loaded = _tile(pid_bh, pid_m, heads_q, len_q, len_k, False, BLOCK_M, BLOCK_N,
                                                WARPGROUPS)
        return valid, off_b, off_h, start_m, n_loaded

    @gluon.jit
    def _first_row(pid_m, len_q, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, WARPGROUPS: gl.constexpr):
        """:func:`first_row` in the kernel."""
        rows: gl.constexpr = WARPGROUPS * BLOCK_M
        first = pid_m * rows
        if CAUSAL:
            first = len_q - (gl.cdiv(len_q, rows) - pid_m) * rows
        return first

    @gluon.jit
    def _wg_row(start_m, w, BLOCK_M: gl.constexpr):
        """:func:`wg_row` in the kernel."""
        return gl.maximum(start_m + w * BLOCK_M, 0)

    @gluon.jit
    def _after_prior_grids():
        """Wait for the kernels before this one on the stream to end and their writes to show
        (``griddepcontrol.wait``): the launch is programmatic (:data:`PROGRAMMATIC_LAUNCH`), so this kernel may
        start while the one before it ends; every partition calls this before it touches global memory. A
        no-op where the launch was not programmatic."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _tile(pid_bh, pid_m, heads_q, len_q, len_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, WARPGROUPS: gl.constexpr):
        """(batch, head, first row, KV blocks loaded) of Q tile ``pid_m`` of (batch x head) ``pid_bh``: the
        blocks its longest warpgroup reads."""
        start_m = _first_row(pid_m, len_q, CAUSAL, BLOCK_M, WARPGROUPS)
        n_loaded = 0
        for w in gl.static_range(WARPGROUPS):
            n, full = _blocks(_wg_row(start_m, w, BLOCK_M), len_q, len_k, len_k - len_q, CAUSAL, BLOCK_M, BLOCK_N)
            n_loaded = gl.maximum(n_loaded, n)
        return pid_bh // heads_q, pid_bh % heads_q, start_m, n_loaded

    @gluon.jit
    def _units(tiles_m, n_tiles, tail_heads):
        """The units of the dynamic walk (:func:`_unit`)."""
        return (n_tiles // tiles_m - tail_heads) * ((tiles_m + 1) // 2) + tail_heads * tiles_m

    @gluon.jit
    def _unit(u, tiles_m, n_tiles, tail_heads):
        """Unit ``u`` of the causal dynamic walk: (batch x head, its first Q tile, whether the pair's shorter
        tile follows). Heads but the last ``tail_heads``: a head's Q tiles in pairs, the k-th longest with the
        k-th shortest (the middle one alone where their number is odd), a head after another; then the last
        ``tail_heads`` heads' tiles one at a time, the longest of each of them, then the next longest, ..., so
        that the last units the programs take as they free up are the walk's shortest tiles."""
        pairs_m = (tiles_m + 1) // 2
        n_pairs = (n_tiles // tiles_m - tail_heads) * pairs_m
        if u < n_pairs:
            k = u % pairs_m
            return u // pairs_m, tiles_m - 1 - k, k != tiles_m - 1 - k
        rank = (u - n_pairs) // tail_heads
        return n_tiles // tiles_m - tail_heads + (u - n_pairs - rank * tail_heads), tiles_m - 1 - rank, False

    @gluon.jit
    def _claim(Counter):
        """Take the next unit of the dynamic walk: one atomic add on ``*Counter`` by the warp's first lane,
        whose old value it returns (0 in the other lanes); :func:`_claimed` waits for it. Apart, so that the
        atomic's round trip overlaps what the warp issues between them."""
        return gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 l; mov.u32 $0, 0; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
            "@p atom.global.add.u32 $0, [$1], 1; }",
            "=r,l", [Counter], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _claimed(r):
        """The unit :func:`_claim` took (``r``, its value), given to every lane."""
        return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", [r], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _clear(Counter):
        """``*Counter = 0``, by the warp's first lane (:func:`_producer_persistent`: after the walk's last claim)."""
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 r, l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
            "@p atom.global.exch.b32 r, [$1], 0; mov.u32 $0, 0; }",
            "=r,l", [Counter], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _put_tile(slots, buf, off_b, off_h, start_m, n_loaded):
        """The producer's (one warp) tile for the consumers: (batch, head, first row, KV blocks) in slot ``buf``
        (batch -1: no tile left)."""
        i = gl.arange(0, 4, layout=gl.BlockedLayout([4], [32], [1], [0]))
        slots.index(buf).store(gl.where(i == 0, off_b, gl.where(i == 1, off_h, gl.where(i == 2, start_m, n_loaded))))

    @gluon.jit
    def _take_tile(slots, buf):
        """A consumer warpgroup's read of slot ``buf`` (:func:`_put_tile`)."""
        i = gl.arange(0, 4, layout=gl.BlockedLayout([4], [32], [4], [0]))
        t = slots.index(buf).load(gl.BlockedLayout([4], [32], [4], [0]))
        return (gl.sum(gl.where(i == 0, t, 0), 0), gl.sum(gl.where(i == 1, t, 0), 0),
                gl.sum(gl.where(i == 2, t, 0), 0), gl.sum(gl.where(i == 3, t, 0), 0))

    @gluon.jit
    def _consume(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, Lse, stride_lb,
                 stride_lh, stride_ln, c, len_q, len_k, off_b, off_h, start_m, n_loaded, ring, i_t, W: gl.constexpr,
                 CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                 WARPGROUPS: gl.constexpr):
        """Consumer warpgroup ``W``'s rows of the program's ``i_t``-th tile, its K/V blocks from block ``ring`` of
        the ring on; then Q's buffer released."""
        row = _wg_row(start_m, W, BLOCK_M)
        n_blocks, n_full = _blocks(row, len_q, len_k, len_k - len_q, CAUSAL, BLOCK_M, BLOCK_N)
        buf = i_t % 2
        _attend(q_smem.index(buf * WARPGROUPS + W), q_ready.index(buf * WARPGROUPS + W), (i_t // 2) & 1, k_smem,
                v_smem, k_ready, v_ready, k_empty, v_empty, ring, o_desc, Lse, stride_lb, stride_lh, stride_ln, c,
                off_b, off_h, row, len_q, len_k, len_k - len_q, n_blocks, n_full, n_loaded, CAUSAL, BLOCK_M, BLOCK_N, D)
        mbarrier.arrive(q_empty.index(buf), count=1)

    @gluon.jit
    def _consumer_persistent(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, slots,
                             o_desc, Lse, stride_lb, stride_lh, stride_ln, c, heads_q, len_q, len_k, tiles_m, n_tiles,
                             W: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             D: gl.constexpr, WARPGROUPS: gl.constexpr):
        """Consumer warpgroup ``W`` of a persistent program: its rows of each of the program's tiles
        (:func:`_consume`), Q from the buffer of the tile's parity, which it releases once its output is stored;
        the tiles of the walk (:func:`_walk`) or, ``CAUSAL``, each as the producer leaves it in ``slots``
        (:func:`_put_tile`), slot of the tile's parity, ready with its Q."""
        _after_prior_grids()
        ring = 0
        i_t = 0
        if CAUSAL:
            mbarrier.wait(q_ready.index(W), 0)
            off_b, off_h, start_m, n_loaded = _take_tile(slots, 0)
            while off_b >= 0:
                _consume(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, Lse,
                         stride_lb, stride_lh, stride_ln, c, len_q, len_k, off_b, off_h, start_m, n_loaded, ring, i_t,
                         W, CAUSAL, BLOCK_M, BLOCK_N, D, WARPGROUPS)
                ring += n_loaded
                i_t += 1
                buf = i_t % 2
                mbarrier.wait(q_ready.index(buf * WARPGROUPS + W), (i_t // 2) & 1)
                off_b, off_h, start_m, n_loaded = _take_tile(slots, buf)
            return
        for it in range(_rounds(tiles_m, n_tiles)):
            valid, off_b, off_h, start_m, n_loaded = _walk(it, tiles_m, n_tiles, heads_q, len_q, len_k, BLOCK_M,
                                                           BLOCK_N, WARPGROUPS)
            if valid:
                _consume(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, Lse,
                         stride_lb, stride_lh, stride_ln, c, len_q, len_k, off_b, off_h, start_m, n_loaded, ring, i_t,
                         W, CAUSAL, BLOCK_M, BLOCK_N, D, WARPGROUPS)
                ring += n_loaded
                i_t += 1

    @gluon.jit
    def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                 slots, group, off_b, off_h, start_m, n_loaded, ring, i_t, CAUSAL: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WARPGROUPS: gl.constexpr):
        """The producer's ``i_t``-th tile: its Q tiles into the buffer of its parity once free (two tiles back;
        ``CAUSAL``: the tile left in the slot of that parity, :func:`_put_tile`), then its K and V blocks into the
        ring from block ``ring`` on."""
        buf = i_t % 2
        mbarrier.wait(q_empty.index(buf), ((i_t // 2) & 1) ^ 1, pred=i_t >= 2)
        if CAUSAL:
            _put_tile(slots, buf, off_b, off_h, start_m, n_loaded)
        for w in gl.static_range(WARPGROUPS):
            mbarrier.expect(q_ready.index(buf * WARPGROUPS + w), q_desc.block_type.nbytes)
            _tma_load(q_desc, [off_b, off_h, _wg_row(start_m, w, BLOCK_M), 0], q_ready.index(buf * WARPGROUPS + w),
                      q_smem.index(buf * WARPGROUPS + w))
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, off_b, off_h // group, ring,
                 n_loaded, BLOCK_N)

    @gluon.jit
    def _producer_persistent(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             k_empty, v_empty, slots, Counter, heads_q, group, len_q, len_k, tiles_m, n_tiles,
                             tail_heads, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             WARPGROUPS: gl.constexpr):
        """The producer warp of a persistent program: its tiles' loads (:func:`_produce`), the tiles of the walk
        (:func:`_walk`) or, ``CAUSAL``, those of the units it takes one at a time: program p's first is unit p,
        each next one ``programs`` past the count of ``Counter`` (:func:`_claim`, issued before the unit's loads
        and waited for after them, so that no atomic's round trip holds a load up), each left in ``slots`` for
        the consumers; past the last, batch -1 there and its Q barriers arrived on without a load."""
        _after_prior_grids()
        ring = 0
        i_t = 0
        if CAUSAL:
            n_units = _units(tiles_m, n_tiles, tail_heads)
            programs = gl.num_programs(0)
            u = gl.program_id(0)
            while u < n_units:
                r = _claim(Counter)
                pid_bh, pid_m, pair = _unit(u, tiles_m, n_tiles, tail_heads)
                for second in range(1 + pair.to(gl.int32)):
                    if second == 1:
                        pid_m = tiles_m - 1 - pid_m
                    off_b, off_h, start_m, n_loaded = _tile(pid_bh, pid_m, heads_q, len_q, len_k, CAUSAL, BLOCK_M,
                                                            BLOCK_N, WARPGROUPS)
                    _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             k_empty, v_empty, slots, group, off_b, off_h, start_m, n_loaded, ring, i_t, CAUSAL,
                             BLOCK_M, BLOCK_N, WARPGROUPS)
                    ring += n_loaded
                    i_t += 1
                u = _claimed(r) + programs
            # A program claims while it has a unit (its last claim is its first past the units), so that a call
            # claims n_units - programs + min(n_units, programs) = n_units times: the claim given the last
            # value, n_units - 1, comes after every other, and its program leaves the counter at 0 for the next
            # call (walk_counter).
            if u == n_units - 1 + programs:
                _clear(Counter)
            buf = i_t % 2
            mbarrier.wait(q_empty.index(buf), ((i_t // 2) & 1) ^ 1, pred=i_t >= 2)
            _put_tile(slots, buf, -1, 0, 0, 0)
            for w in gl.static_range(WARPGROUPS):
                mbarrier.arrive(q_ready.index(buf * WARPGROUPS + w), count=1)
            return
        for it in range(_rounds(tiles_m, n_tiles)):
            valid, off_b, off_h, start_m, n_loaded = _walk(it, tiles_m, n_tiles, heads_q, len_q, len_k, BLOCK_M,
                                                           BLOCK_N, WARPGROUPS)
            if valid:
                _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                         v_empty, slots, group, off_b, off_h, start_m, n_loaded, ring, i_t, CAUSAL, BLOCK_M, BLOCK_N,
                         WARPGROUPS)
                ring += n_loaded
                i_t += 1

    @gluon.jit
    def _blocks(start_m, len_q, len_k, causal_offset, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
        """(KV blocks to read, blocks every row sees whole) for query rows [start_m, start_m + BLOCK_M); no
        block where those rows are all past the end."""
        if CAUSAL:
            kv_end = gl.minimum(start_m + BLOCK_M + causal_offset, len_k)
            n_blocks = gl.maximum(gl.cdiv(kv_end, BLOCK_N), 0)
            n_full = gl.minimum(gl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N, len_k // BLOCK_N)
        else:
            n_blocks = gl.cdiv(len_k, BLOCK_N)
            n_full = len_k // BLOCK_N
        if start_m >= len_q:
            n_blocks = 0
        return n_blocks, n_full

    @gluon.jit
    def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, Lse, stride_lb, stride_lh, stride_ln, c, heads_q, group, len_q,
                     len_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                     WARPGROUPS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        if CAUSAL:  # the longest rows first
            pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        else:
            pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        off_b = pid_bh // heads_q
        off_h = pid_bh % heads_q
        start_m = _first_row(pid_m, len_q, CAUSAL, BLOCK_M, WARPGROUPS)
        row0, row1, row2 = _wg_row(start_m, 0, BLOCK_M), _wg_row(start_m, 1, BLOCK_M), _wg_row(start_m, 2, BLOCK_M)
        causal_offset = len_k - len_q
        n0, full0 = _blocks(row0, len_q, len_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
        n1, full1 = _blocks(row1, len_q, len_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
        n2, full2 = _blocks(row2, len_q, len_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
        if WARPGROUPS == 2:
            n2 = 0
        n_loaded = gl.maximum(gl.maximum(n0, n1), n2)

        q_smem = gl.allocate_shared_memory(dtype, [WARPGROUPS, 1, 1, BLOCK_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, 1, 1, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, 1, 1, BLOCK_N, D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [WARPGROUPS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(WARPGROUPS):
            mbarrier.init(q_bar.index(i), count=1)
        for i in gl.static_range(K_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=WARPGROUPS)  # one release per consumer warpgroup
        for i in gl.static_range(V_STAGES):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=WARPGROUPS)
        # Both branches spell the partitions out: a partition's function cannot be held in a variable, and
        # constexprs passed inside a tuple reach the partition as tensors.
        if WARPGROUPS == 2:
            gl.warp_specialize([
                (_consumer, (q_smem.index(0), k_smem, v_smem, q_bar.index(0), k_ready, v_ready, k_empty, v_empty,
                             o_desc, Lse, stride_lb, stride_lh, stride_ln, c, off_b, off_h, row0, len_q, len_k,
                             causal_offset, n0, full0, n_loaded, CAUSAL, BLOCK_M, BLOCK_N, D)),
                (_consumer, (q_smem.index(1), k_smem, v_smem, q_bar.index(1), k_ready, v_ready, k_empty, v_empty,
                             o_desc, Lse, stride_lb, stride_lh, stride_ln, c, off_b, off_h, row1, len_q,
                             len_k, causal_offset, n1, full1, n_loaded, CAUSAL, BLOCK_M, BLOCK_N, D)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                             v_empty, off_b, off_h, off_h // group, start_m, n_loaded, WARPGROUPS, BLOCK_M, BLOCK_N)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem.index(0), k_smem, v_smem, q_bar.index(0), k_ready, v_ready, k_empty, v_empty,
                             o_desc, Lse, stride_lb, stride_lh, stride_ln, c, off_b, off_h, row0, len_q, len_k,
                             causal_offset, n0, full0, n_loaded, CAUSAL, BLOCK_M, BLOCK_N, D)),
                (_consumer, (q_smem.index(1), k_smem, v_smem, q_bar.index(1), k_ready, v_ready, k_empty, v_empty,
                             o_desc, Lse, stride_lb, stride_lh, stride_ln, c, off_b, off_h, row1, len_q,
                             len_k, causal_offset, n1, full1, n_loaded, CAUSAL, BLOCK_M, BLOCK_N, D)),
                (_consumer, (q_smem.index(2), k_smem, v_smem, q_bar.index(2), k_ready, v_ready, k_empty, v_empty,
                             o_desc, Lse, stride_lb, stride_lh, stride_ln, c, off_b, off_h, row2,
                             len_q, len_k, causal_offset, n2, full2, n_loaded, CAUSAL, BLOCK_M, BLOCK_N,
                             D)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                             v_empty, off_b, off_h, off_h // group, start_m, n_loaded, WARPGROUPS, BLOCK_M, BLOCK_N)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])

    @gluon.jit
    def _attn_fwd_persistent(q_desc, k_desc, v_desc, o_desc, Lse, stride_lb, stride_lh, stride_ln, c, heads_q,
                             group, len_q, len_k, tiles_m, n_tiles, Counter, tail_heads, CAUSAL: gl.constexpr,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, WARPGROUPS: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr):
        """One program per SM: not causal over the tiles ``program_id, program_id + programs, ...`` of the walk
        (:func:`_walk`), causal over the units of the dynamic walk as it frees up (:func:`_unit`); Q in two
        buffers, so that the next tile's is loaded while this one runs, and the K/V ring runs on from tile to
        tile."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2 * WARPGROUPS, 1, 1, BLOCK_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, 1, 1, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, 1, 1, BLOCK_N, D], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2 * WARPGROUPS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
        slots = gl.allocate_shared_memory(gl.int32, [2, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        for i in gl.static_range(2 * WARPGROUPS):
            mbarrier.init(q_ready.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(q_empty.index(i), count=WARPGROUPS)
        for i in gl.static_range(K_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=WARPGROUPS)
        for i in gl.static_range(V_STAGES):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=WARPGROUPS)
        # spelled out as in _attn_fwd_ws
        if WARPGROUPS == 2:
            gl.warp_specialize([
                (_consumer_persistent, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                                        slots, o_desc, Lse, stride_lb, stride_lh, stride_ln, c, heads_q, len_q, len_k,
                                        tiles_m, n_tiles, 0, CAUSAL, BLOCK_M, BLOCK_N, D, WARPGROUPS)),
                (_consumer_persistent, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                                        slots, o_desc, Lse, stride_lb, stride_lh, stride_ln, c, heads_q, len_q, len_k,
                                        tiles_m, n_tiles, 1, CAUSAL, BLOCK_M, BLOCK_N, D, WARPGROUPS)),
                (_producer_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                        v_ready, k_empty, v_empty, slots, Counter, heads_q, group, len_q, len_k,
                                        tiles_m, n_tiles, tail_heads, CAUSAL, BLOCK_M, BLOCK_N, WARPGROUPS)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer_persistent, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                                        slots, o_desc, Lse, stride_lb, stride_lh, stride_ln, c, heads_q, len_q, len_k,
                                        tiles_m, n_tiles, 0, CAUSAL, BLOCK_M, BLOCK_N, D, WARPGROUPS)),
                (_consumer_persistent, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                                        slots, o_desc, Lse, stride_lb, stride_lh, stride_ln, c, heads_q, len_q, len_k,
                                        tiles_m, n_tiles, 1, CAUSAL, BLOCK_M, BLOCK_N, D, WARPGROUPS)),
                (_consumer_persistent, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                                        slots, o_desc, Lse, stride_lb, stride_lh, stride_ln, c, heads_q, len_q, len_k,
                                        tiles_m, n_tiles, 2, CAUSAL, BLOCK_M, BLOCK_N, D, WARPGROUPS)),
                (_producer_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                        v_ready, k_empty, v_empty, slots, Counter, heads_q, group, len_q, len_k,
                                        tiles_m, n_tiles, tail_heads, CAUSAL, BLOCK_M, BLOCK_N, WARPGROUPS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])

    _GLUON_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}

    @functools.lru_cache(maxsize=None)
    def _layout(rows: int, cols: int, dtype: torch.dtype, swizzled: bool = True) -> "gl.NVMMASharedLayout":
        """The shared-memory layout of a ``[1, 1, rows, cols]`` tile: computed once per tile shape and dtype
        (Gluon derives it through a constexpr function, a large part of a launch's host time otherwise);
        ``swizzled=False``: rows one after another, unpermuted (a tile read row by row as 1-D vectors)."""
        if not swizzled:
            return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=dtype.itemsize * 8, rank=4)
        return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], _GLUON_DTYPES[dtype])

    # (rows, cols, dtype) -> a checked descriptor's fields other than base, shape and strides
    _TILE_FIELDS: dict = {}

    def _descriptor(t: torch.Tensor, rows: int, cols: int | None = None, swizzled: bool = True) -> "TensorDescriptor":
        """A descriptor of ``[1, 1, rows, cols]`` tiles (``cols=None``: D; ``swizzled``: see :func:`_layout`)
        of the ``[B, H, N, D]`` tensor ``t``,
        which must be :func:`readable` (every caller checks, or passes a contiguous copy) with no empty
        dimension. The first one of a tile shape and dtype goes through ``TensorDescriptor``'s checks; the
        next ones take its tile fields (block shape, layout, padding) and set their own base, shape and
        strides, which ``readable`` has checked: the checks take as much host time as the rest of a
        launch's Python."""
        shape = list(t.shape)
        cols = shape[3] if cols is None else cols
        # a dimension of size 1 is never stepped over: give it the stride of a contiguous tensor
        strides = [t.stride(i) if shape[i] != 1 else math.prod(shape[i + 1:]) for i in range(4)]
        key = (rows, cols, t.dtype, swizzled)
        fields = _TILE_FIELDS.get(key)
        if fields is None:
            desc = TensorDescriptor(t, shape, strides, [1, 1, rows, cols], _layout(rows, cols, t.dtype, swizzled))
            _TILE_FIELDS[key] = {name: value for name, value in vars(desc).items()
                                 if name not in ("base", "shape", "strides")}
            return desc
        desc = object.__new__(TensorDescriptor)
        vars(desc).update(fields, base=t, shape=shape, strides=strides)
        return desc

PERSISTENT_CAUSAL_MAX_KEYS = 16384
# Launch the kernels programmatically (CUDA's programmatic dependent launch): a kernel may start while the one
# before it on the stream ends, its partitions waiting for that one's writes before they touch global memory
# (_after_prior_grids), so that its launch and its setup (shared memory, barriers, its tile's indices) overlap
# the end of the kernel before it.
PROGRAMMATIC_LAUNCH = True


def persistent(causal: bool, len_k: int) -> bool:
    """Whether :func:`forward` runs the persistent kernel (one program per SM walking the tiles) rather than one
    program per tile: not causal, and causal up to :data:`PERSISTENT_CAUSAL_MAX_KEYS` keys, the longest rows the
    bench times (``python -m flashverify_kernels.triton.bench``, N up to 16384), over which the dynamic walk
    (:func:`unit`) balances the causal tiles' unequal work. Over longer rows, one program per tile, the longest
    rows first, leaves that balancing to the hardware's scheduling of programs."""
    return not causal or len_k <= PERSISTENT_CAUSAL_MAX_KEYS


# Single tiles at the walk's end, about this many a program (tail_heads): the walk's shortest tiles, last, fill
# in for the programs that free up first, so that the programs end together.
TAIL_UNITS_PER_PROGRAM = 3


def tail_heads(programs: int, tiles_m: int, heads: int) -> int:
    """The heads whose tiles the dynamic walk hands out one at a time, longest first (:func:`unit`): about
    ``TAIL_UNITS_PER_PROGRAM`` tiles a program."""
    return min(heads, -(-TAIL_UNITS_PER_PROGRAM * programs // tiles_m))


def unit(u: int, tiles_m: int, n_tiles: int, tail: int) -> list:
    """:func:`_unit` in Python: the (batch x head, Q tile) of unit ``u`` of the causal dynamic walk, one or two."""
    pairs_m = (tiles_m + 1) // 2
    n_pairs = (n_tiles // tiles_m - tail) * pairs_m
    if u < n_pairs:
        h, k = divmod(u, pairs_m)
        return [(h, tiles_m - 1 - k)] + ([(h, k)] if k != tiles_m - 1 - k else [])
    rank, h = divmod(u - n_pairs, tail)
    return [(n_tiles // tiles_m - tail + h, tiles_m - 1 - rank)]


def units(tiles_m: int, n_tiles: int, tail: int) -> int:
    """:func:`_units` in Python."""
    return (n_tiles // tiles_m - tail) * ((tiles_m + 1) // 2) + tail * tiles_m


def walk(it: int, program: int, programs: int, tiles_m: int, n_tiles: int):
    """:func:`_walk` in Python: the (batch x head, Q tile) of a persistent program's round ``it`` where not causal,
    or None."""
    i = it * programs + program
    return (i // tiles_m, i % tiles_m) if i < n_tiles else None


def rounds(programs: int, tiles_m: int, n_tiles: int) -> int:
    """:func:`_rounds` in Python."""
    return -(-n_tiles // programs)


_COUNTERS: dict = {}


def walk_counter(device: torch.device) -> torch.Tensor:
    """The dynamic walk's counter for a call on ``device``'s current stream: one int32 a stream, zeroed when
    made and left at 0 by every call's kernel (its last claim clears it: :func:`_producer_persistent`), so that
    a call launches no zero fill before its kernel. Calls on one stream run one after another; a stream's
    own counter keeps calls on two streams apart. While a CUDA graph is captured, a new zeroed counter: the
    graph's own, its zero fill captured with it."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros((1, ), dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device)
    key = (stream.device_index, stream.cuda_stream)  # the default stream is 0 on every device
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = torch.zeros((1, ), dtype=torch.int32, device=stream.device)
    return counter


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def programs(q, k, causal: bool) -> tuple:
    """The launch grid of :func:`forward` for these ``q`` and ``k`` (Q tiles, batch x heads)."""
    b, hq, len_q, d = q.shape
    return -(-len_q // (warpgroups(d, causal, len_q, k.shape[2]) * BLOCK_M)), b * hq


def forward(q, k, v, out, lse, *, causal: bool, scale: float) -> None:
    """Write the FA2 forward of ``[B, H, N, D]`` float16/bfloat16 tensors into ``out`` and ``lse`` (``[B, Hq,
    Nq]`` float32, any strides); ``Hq`` a multiple of ``Hkv`` (GQA). A tensor no descriptor reads
    (:func:`readable`) goes through a contiguous copy; no key at all gives ``out = 0``, ``lse = -inf``."""
    b, hq, len_q, d = q.shape
    grid = programs(q, k, causal)
    if b * hq * len_q == 0:
        return
    if k.shape[2] == 0:
        replay.unrecordable("no key: out and lse filled in place")
        out.zero_()
        lse.fill_(float("-inf"))
        return
    q, k, v = (t if readable(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t) for t in (q, k, v))
    target = out if readable(out) else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    groups = warpgroups(d, causal, q.shape[2], k.shape[2])
    args = (_descriptor(q, BLOCK_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), _descriptor(target, BLOCK_M),
            lse, lse.stride(0), lse.stride(1), lse.stride(2), scale * LOG2E, hq, hq // k.shape[1], len_q, k.shape[2])
    meta = dict(CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=d, WARPGROUPS=groups, CONSUMER_REGS=CONSUMER_REGS,
                num_warps=4, launch_pdl=PROGRAMMATIC_LAUNCH)
    if persistent(causal, k.shape[2]):
        n_tiles = grid[0] * grid[1]
        n_prog = min(n_tiles, _sm_count(q.device))
        counter = replay.provided(walk_counter, q.device) if causal else lse  # unread where not causal
        replay.launch(_attn_fwd_persistent, (n_prog, ), *args, grid[0], n_tiles, counter,
                      tail_heads(n_prog, grid[0], grid[1]), **meta)
    else:
        replay.launch(_attn_fwd_ws, grid, *args, **meta)
    if target is not out:
        out.copy_(target)
