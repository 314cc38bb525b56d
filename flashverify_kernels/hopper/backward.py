"""The FA2 dK/dV kernel on Hopper (compute capability 9.0), written in Gluon, with dQ added in it or not.

:func:`flashverify_kernels.triton.attention.fa2_backward` runs this kernel instead of its Triton dK/dV kernel where
:func:`unsupported` has no objection (the cases of :func:`flashverify_kernels.hopper.forward.unsupported`). Same
numerics as the Triton kernel: ``p^T = exp2(k q^T * scale * log2(e) - lse * log2(e))`` in float32, ``p`` and ``dS``
rounded to the input dtype before their products, float32 accumulators, ``dK`` scaled once at the end;
dK and dV summed in a fixed order (the query heads of a GQA group one after another, each head's Q tiles
in order).

Each program owns ``2 * BLOCK_N`` keys of one (batch, KV head) (``3 * BLOCK_N`` at head dim 64 without dQ:
:func:`warpgroups`). One warp issues the TMA loads (the
program's K and V tiles once, then Q, dO and their rows' ``lse * log2(e)`` and Delta tile by tile into
shared-memory stages, the rows from the padded buffer of :func:`rows_buffer`, which the backward's Delta
kernel fills, read where the step uses them: in registers across the step they would make it spill); two (or three)
consumer warpgroups of four warps, ``BLOCK_N`` keys each, run per Q tile, in the transposed form (rows are keys)::

    issue S^T = K Q^T, dP^T = V dO^T             (asynchronous)
    wait for S^T;  P^T = exp2(S^T c - lse)        <- overlaps dP^T
    issue dV += P^T dO                            (P^T from registers)
    wait for dP^T;  dS^T = P^T (dP^T - Delta)     <- overlaps dV's product
    issue dK += dS^T Q;  wait for both

Without ``ATOMIC_DQ`` this is the whole kernel, and the Triton dQ kernel runs after it (7 tile products per
(Q tile, KV tile) pair in all): the deterministic backward at head dim 64. With ``ATOMIC_DQ`` (5 products,
no dQ kernel) each warpgroup also writes its dS^T to shared memory; once both have (an mbarrier), warpgroup
``w`` issues ``dQ[:, w half of D] = dS K[:, w half]`` over the program's 128 keys (K loaded a second time,
in column halves), and that float32 tile is added to a ``[B, Hq, Nq, D]`` buffer by a TMA reduce. At head
dim 128 (``DK_FIRST``) ``dK += dS^T Q`` is issued before all that, from registers, so that dS^T's store and
the wait for the other warpgroup overlap it; at 64 after the barrier, from shared memory. Not causal, each
program walks a head's Q tiles from its own start (:func:`_tile`), so that the programs of a head add to
different tiles at a time.

- ``deterministic=False``: each warpgroup issues its reduce itself; dQ's sum follows the order the reduces
  arrive in.
- ``ORDERED`` (the deterministic backward at head dim 128, :func:`ordered_dq`): the warpgroups stage their
  tiles for a fifth partition, one warp, which adds them to each Q tile in a fixed order of the programs
  (a counter per tile in global memory; the warp waits for its program's turn, adds, waits until the
  reduce is written, counts up). The order (:func:`dq_order`) is the order in which the programs reach
  the tile, so a program finds its turn come, or about to come: its predecessor reached the tile at the
  same step of its walk or earlier. It needs every program of a (batch, KV head) resident at once (each
  waits on others of its head): :func:`ordered_dq` takes it only where a head's programs fit the GPU's SMs.

dK and dV are summed in the program's walk order in every form: bitwise the deterministic backward's
causal, and in the rotated order otherwise.

No product is in flight across the loop's back edge (see flashverify_kernels/hopper/forward.py: ptxas would serialize
every product). The two warpgroups share each stage and release it once each.

Not available under Triton's interpreter; tests/test_gluon_backward.py compiles it for sm_90 without a
GPU and checks it against float64 on one.
"""
from __future__ import annotations

import functools
import math
import os

import torch

from flashverify_kernels.hopper import forward as gluon_forward

from flashverify_kernels.triton import replay

AVAILABLE = gluon_forward.AVAILABLE
if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, \
        warpgroup_mma, warpgroup_mma_wait

LOG2E = math.log2(math.e)
HEAD_DIMS = gluon_forward.HEAD_DIMS
BLOCK_N = 64  # keys per consumer warpgroup; a program covers 2 * BLOCK_N
BLOCK_M = 64  # query rows per stage (128 at head dim 64 spills registers)
STAGES = 2
# the atomic-dQ loop's order per head dim: dK's product first, from registers, overlapping dS^T's store and
# the warpgroups' barrier (True, at 128), or after the barrier from shared memory, with dQ's (False, at 64); the
# same sums either way
DK_FIRST = {64: False, 128: True}
DS_BUFS = 2  # dS^T buffers of the atomic-dQ form: a warpgroup may write one while the other's dQ reads the other


def unsupported(**forward_rules) -> str:
    """Why the dK/dV kernel of a backward call does not run here ("" where it does): the forward's rules
    (:func:`flashverify_kernels.hopper.forward.unsupported`; ``tensors`` are q, k, v and dO), deterministic backward or
    not (without dQ then, or adding it)."""
    return gluon_forward.unsupported(**forward_rules)

if AVAILABLE:
    @functools.lru_cache(maxsize=None)
    def _ds_layout(dtype: torch.dtype):
        """The shared-memory layout of a warpgroup's ``[BLOCK_N, BLOCK_M]`` dS^T (atomic-dQ form)."""
        return gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gluon_forward._GLUON_DTYPES[dtype])

    _tma_load = gluon_forward._tma_load
    _tma_store = gluon_forward._tma_store
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # (Triton 3.6's name, and later ones')
    _tma_add = getattr(tma, "async_atomic_add", None)
    from triton.experimental.gluon.language._core import builtin as _builtin
    if _tma_add is None:  # Triton 3.6's Gluon has the builder's reduce but no function for it
        from triton._C.libtriton import ir as _ir

        @_builtin
        def _tma_add(tensor_desc, coord, src, _semantic=None):
            """global[tile at coord] += src (shared memory), by a TMA reduce; waited for as a TMA store."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)

    @_builtin
    def _smem_as(desc, shape, layout, _semantic=None):
        """``desc`` (shared memory) seen with another shape and layout: Gluon's ``reinterpret``, which Triton
        3.6 names ``_reinterpret``."""
        shape = [gl._core._unwrap_if_constexpr(n) for n in shape]
        return _semantic.memdesc_reinterpret(desc, desc.dtype, shape, gl._core._unwrap_if_constexpr(layout))

    @gluon.jit
    def _issue_dq(ds_smem, kh_smem, buf, WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  DH: gl.constexpr, Q_LAYOUT: gl.constexpr):
        """Issue (asynchronously) warpgroup ``WG``'s dQ tile, ``dS K[:, WG half]`` over both warpgroups' keys:
        their dS^T in ``ds_smem`` buffer ``buf``, transposed, against K's column-half tiles."""
        dq = warpgroup_mma(ds_smem.index(buf * 2).permute((1, 0)), kh_smem.index(WG).reshape([BLOCK_N, DH]),
                           gl.zeros([BLOCK_M, DH], gl.float32, layout=Q_LAYOUT), use_acc=False, is_async=True)
        return warpgroup_mma(ds_smem.index(buf * 2 + 1).permute((1, 0)), kh_smem.index(2 + WG).reshape([BLOCK_N, DH]),
                             dq, is_async=True)

    @gluon.jit
    def _share_ds(ds, ds_smem, ds_free, ds_ready, buf, step, WG: gl.constexpr, DS_BUFS: gl.constexpr):
        """Warpgroup ``WG``'s dS^T into ``ds_smem`` buffer ``buf`` (free once both warpgroups' dQ products of
        ``DS_BUFS`` steps ago are done), then wait until the other warpgroup has written its own."""
        mbarrier.wait(ds_free.index(buf), ((step // DS_BUFS) & 1) ^ 1, pred=step >= DS_BUFS)
        ds_smem.index(buf * 2 + WG).store(ds)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(buf), count=1)
        mbarrier.wait(ds_ready.index(buf), (step // DS_BUFS) & 1)

    @gluon.jit
    def _add_dq(dq, scale, dq_smem, dq_desc, at, dq_full, dq_empty, step, ORDERED: gl.constexpr):
        """Add the float32 tile ``dq * scale`` to ``dq_desc``'s buffer at ``at`` by a TMA reduce, staged in
        ``dq_smem`` once the previous reduce has read it. ``ORDERED``: staged only, for :func:`_dq_writer`
        (``dq_full`` arrived on once staged, ``dq_empty`` waited on before, from the step before)."""
        if ORDERED:
            mbarrier.wait(dq_empty, (step & 1) ^ 1, pred=step > 0)
            dq_smem.reshape(dq.shape).store(dq * scale)
            fence_async_shared()
            mbarrier.arrive(dq_full, count=1)
        else:
            tma.store_wait(pendings=0)
            dq_smem.reshape(dq.shape).store(dq * scale)
            fence_async_shared()
            _tma_add(dq_desc, at, dq_smem)

    @gluon.jit
    def _dq_writer(dq_smem, dq_desc, dq_full, dq_empty, lock_ptr, off_b, off_hkv, group, lo, n_tiles, pid_n, n_prog,
                   heads_q, t_all, causal_offset, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, ROTATE: gl.constexpr):
        """One warp (dQ added in order): per step, both warpgroups' staged dQ tiles added by TMA reduces once
        the tile's counter says that the programs before this one in its order have added theirs (the
        order of :func:`_tile`), then, once they are written, the counter counted up."""
        DH: gl.constexpr = dq_desc.block_type.shape[3]
        n_tiles_nz = gl.maximum(n_tiles, 1)
        lock_base = (off_b * heads_q + off_hkv * group) * t_all
        for step in range(group * n_tiles):
            g = step // n_tiles_nz
            start_m, rank = _tile(step - g * n_tiles_nz, lo, n_tiles_nz, pid_n, n_prog, causal_offset, CAUSAL,
                                  BLOCK_M, BLOCK_N, ROTATE)
            lock = lock_ptr + lock_base + g * t_all + start_m // BLOCK_M
            mbarrier.wait(dq_full.index(0), step & 1)
            mbarrier.wait(dq_full.index(1), step & 1)
            # every lane waits for the tile's turn (one asm loop; acquire: the reduces before it are written)
            gl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b32 v; WAIT_TURN: ld.acquire.gpu.global.b32 v, [$1]; setp.ne.s32 p, v, $2; "
                "@p bra WAIT_TURN; mov.b32 $0, v; }", "=r,l,r", [lock, rank], dtype=gl.int32, is_pure=False, pack=1)
            for w in gl.static_range(2):
                _tma_add(dq_desc, [off_b, off_hkv * group + g, start_m, w * DH], dq_smem.index(w))
            tma.store_wait(pendings=0)  # read: the staging buffers free
            mbarrier.arrive(dq_empty.index(0), count=1)
            mbarrier.arrive(dq_empty.index(1), count=1)
            # written (the wait that tma.store_wait does not do), then counted by one lane with release semantics
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            _thread_barrier()
            gl.atomic_add(lock, 1, sem="release", scope="gpu")

    @gluon.jit
    def _tile(t, lo, n_tiles, pid_n, n_prog, causal_offset, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, ROTATE: gl.constexpr):
        """The first row of a head's ``t``-th Q tile in a program's walk, and the program's rank in the order
        in which the programs of a (batch, head) add to that tile's dQ (with dQ added in order: two
        warpgroups, ``2 * BLOCK_N`` keys a program). The walk: from ``lo`` up (``ROTATE``, not causal: from
        tile ``pid_n * n_tiles // n_prog`` up, around the end); the order: the order in which the programs
        reach the tile (at their how-many-th step), the higher index first of two that reach it at the same
        step. Causal: the programs that see the tile, the last first; rotated: program p's predecessor is
        the one that starts after p (steps ahead of it); else the programs in order (each then waits on the
        one before, which the dispatch never asks for: they fall a step behind each other). :func:`dq_order` is
        this function in Python."""
        if ROTATE:
            m = (pid_n * n_tiles) // n_prog + t  # unwrapped: from the start tile to n_tiles past it
            start_m = (m % n_tiles) * BLOCK_M
            rank = gl.minimum(n_prog - 1, (n_prog * (m + 1) - 1) // n_tiles - pid_n)
        else:
            start_m = lo + t * BLOCK_M
            if CAUSAL:  # the last program that sees the tile's last row is first
                rank = gl.minimum(n_prog - 1, (start_m + BLOCK_M - 1 + causal_offset) // (2 * BLOCK_N)) - pid_n
            else:
                rank = pid_n
        return start_m, rank

    @gluon.jit
    def _consumer(k_smem, v_smem, q_smem, do_smem, rows_smem, kh_smem, ds_smem, dq_smem, kv_bar, kh_bar, ready,
                  empty, ds_ready, ds_free, dq_full, dq_empty, dk_desc, dv_desc, dq_desc, c, scale, off_b, off_hkv,
                  group, start_n, lo, n_tiles, len_k, causal_offset, pid_n, n_prog,
                  CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  D: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                  DS_BUFS: gl.constexpr, DK_FIRST: gl.constexpr, WARPGROUPS: gl.constexpr, ROTATE: gl.constexpr,
                  ORDERED: gl.constexpr):
        """One warpgroup (``WG``: 0 or 1, or 2 where there are three, without dQ): keys [start_n, start_n +
        BLOCK_N) against every Q tile of the group's heads. ``ATOMIC_DQ``: also dQ's columns [WG * D / 2, (WG
        + 1) * D / 2) of each Q tile over the program's 2 * BLOCK_N keys, from both warpgroups' dS^T in shared
        memory, added to ``dq_desc``'s float32 buffer by a TMA reduce (``ORDERED``: staged for the writer
        warp, which adds it). ``ROTATE``: the walk of :func:`_tile`."""
        dtype: gl.constexpr = dk_desc.dtype
        DH: gl.constexpr = D // 2
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        A_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=A_LAYOUT, k_width=2)
        Q_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DH, 16])
        COL: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        k_tile = k_smem.reshape([BLOCK_N, D])
        v_tile = v_smem.reshape([BLOCK_N, D])
        dk = gl.zeros([BLOCK_N, D], gl.float32, layout=A_LAYOUT)
        dv = gl.zeros([BLOCK_N, D], gl.float32, layout=A_LAYOUT)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=S_LAYOUT)
        keys = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=ROW), 1)
        cols = gl.arange(0, BLOCK_M, layout=COL)
        # Q tiles whose first row sees the last key see the whole tile: the mask is for tiles before that.
        unmasked_from = start_n + BLOCK_N - 1 - causal_offset
        mbarrier.wait(kv_bar, 0)
        if ATOMIC_DQ:
            mbarrier.wait(kh_bar, 0)
        n_tiles_nz = gl.maximum(n_tiles, 1)
        steps = group * n_tiles
        if WARPGROUPS == 3:  # (without dQ only) keys all past the end: no product, the stages released
            if start_n >= len_k:
                steps = 0
        for step in range(steps):
            g = step // n_tiles_nz
            start_m, _ = _tile(step - g * n_tiles_nz, lo, n_tiles_nz, pid_n, n_prog, causal_offset, CAUSAL, BLOCK_M,
                               BLOCK_N, ROTATE)
            off_h = off_hkv * group + g
            st = step % STAGES
            # the stage's rows: LSE * log2(e) and Delta, read from shared memory where used (loaded into
            # registers at the top of the step, with their indices and mask, they would make the loop spill)
            rows_tile = _smem_as(rows_smem.index(st), [2, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            mbarrier.wait(ready.index(st), (step // STAGES) & 1)
            q_tile = q_smem.index(st).reshape([BLOCK_M, D])
            do_tile = do_smem.index(st).reshape([BLOCK_M, D])
            if ATOMIC_DQ:  # zeros made here: one kept across the loop would hold 32 registers
                s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=S_LAYOUT)
            s = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))  # S^T done, dP^T still running ...
            arg = s * c - gl.expand_dims(rows_tile.index(0).load(COL), 0)
            if CAUSAL:  # (a row that sees a key past the end is past the end itself)
                if start_m < unmasked_from:
                    arg = gl.where(keys <= gl.expand_dims(start_m + cols, 0) + causal_offset, arg, float("-inf"))
            elif ATOMIC_DQ:  # keys past the end: K's rows are 0 there, but p * 0 is NaN where p overflows
                if start_n + BLOCK_N > len_k:
                    arg = gl.where(keys < len_k, arg, float("-inf"))
            p = gl.exp2(arg)  # ... during this
            dv = warpgroup_mma(gl.convert_layout(p.to(dtype), P_LAYOUT), do_tile, dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=(dp, ))  # dP^T done, dV's product still running ...
            ds = (p * (dp - gl.expand_dims(rows_tile.index(1).load(COL), 0))).to(dtype)  # ... during this
            if ATOMIC_DQ:
                # dK += dS^T Q, and dS^T to shared memory for dQ[:, cols] = dS K[:, cols] over both
                # warpgroups' keys (their dS^T transposed), issued once both have written theirs
                buf = step % DS_BUFS
                dq_at = [off_b, off_h, start_m, WG * DH]
                if DK_FIRST:  # dK's product first, from registers: dS^T's store and the barrier overlap it
                    dk = warpgroup_mma(gl.convert_layout(ds, P_LAYOUT), q_tile, dk, is_async=True)
                    _share_ds(ds, ds_smem, ds_free, ds_ready, buf, step, WG, DS_BUFS)
                else:
                    _share_ds(ds, ds_smem, ds_free, ds_ready, buf, step, WG, DS_BUFS)
                    dk = warpgroup_mma(ds_smem.index(buf * 2 + WG), q_tile, dk, is_async=True)
                dq = _issue_dq(ds_smem, kh_smem, buf, WG, BLOCK_M, BLOCK_N, DH, Q_LAYOUT)
                dk, dv, dq = warpgroup_mma_wait(0, deps=(dk, dv, dq))
                mbarrier.arrive(ds_free.index(buf), count=1)
                mbarrier.arrive(empty.index(st), count=1)
                _add_dq(dq, scale, dq_smem.index(WG), dq_desc, dq_at, dq_full.index(WG), dq_empty.index(WG), step,
                        ORDERED)
            else:
                dk = warpgroup_mma(gl.convert_layout(ds, P_LAYOUT), q_tile, dk, is_async=True)
                dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
                mbarrier.arrive(empty.index(st), count=1)
        for step in range(steps, group * n_tiles):
            st = step % STAGES
            mbarrier.wait(ready.index(st), (step // STAGES) & 1)
            mbarrier.arrive(empty.index(st), count=1)
        if start_n < len_k:
            # K and V are read no more: their buffers stage dK and dV (keys past the end clipped by the store)
            k_tile.store((dk * scale).to(dtype))
            v_tile.store(dv.to(dtype))
            fence_async_shared()
            _tma_store(dk_desc, [off_b, off_hkv, start_n, 0], k_smem)
            _tma_store(dv_desc, [off_b, off_hkv, start_n, 0], v_smem)
            tma.store_wait(pendings=0)

    @gluon.jit
    def _producer(k_desc, v_desc, q_desc, do_desc, rows_desc, kh_desc, k_smem, v_smem, q_smem, do_smem, rows_smem,
                  kh_smem, kv_bar, kh_bar, ready, empty, off_b, off_hkv, group, start_n, lo, n_tiles, pid_n, n_prog,
                  causal_offset, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, ATOMIC_DQ: gl.constexpr, WARPGROUPS: gl.constexpr, ROTATE: gl.constexpr):
        """One warp: every warpgroup's K and V tiles (with ``ATOMIC_DQ`` K once more, in column halves, the dQ
        products' operands), then Q, dO and their rows' LSE * log2(e) and Delta tile by tile as the stages are
        freed."""
        for w in gl.static_range(WARPGROUPS):
            mbarrier.expect(kv_bar.index(w), 2 * k_desc.block_type.nbytes)
            _tma_load(k_desc, [off_b, off_hkv, start_n + w * BLOCK_N, 0], kv_bar.index(w), k_smem.index(w))
            _tma_load(v_desc, [off_b, off_hkv, start_n + w * BLOCK_N, 0], kv_bar.index(w), v_smem.index(w))
        if ATOMIC_DQ:
            DH: gl.constexpr = kh_desc.block_type.shape[3]
            mbarrier.expect(kh_bar, 4 * kh_desc.block_type.nbytes)
            for h in gl.static_range(2):
                for w in gl.static_range(2):
                    _tma_load(kh_desc, [off_b, off_hkv, start_n + h * BLOCK_N, w * DH], kh_bar,
                              kh_smem.index(h * 2 + w))
        n_tiles_nz = gl.maximum(n_tiles, 1)
        for step in range(group * n_tiles):
            g = step // n_tiles_nz
            start_m, _ = _tile(step - g * n_tiles_nz, lo, n_tiles_nz, pid_n, n_prog, causal_offset, CAUSAL, BLOCK_M,
                               BLOCK_N, ROTATE)
            off_h = off_hkv * group + g
            st = step % STAGES
            mbarrier.wait(empty.index(st), ((step // STAGES) & 1) ^ 1, pred=step >= STAGES)
            mbarrier.expect(ready.index(st), 2 * q_desc.block_type.nbytes + rows_desc.block_type.nbytes)
            _tma_load(q_desc, [off_b, off_h, start_m, 0], ready.index(st), q_smem.index(st))
            _tma_load(do_desc, [off_b, off_h, start_m, 0], ready.index(st), do_smem.index(st))
            _tma_load(rows_desc, [off_b, off_h, 0, start_m], ready.index(st), rows_smem.index(st))

    @gluon.jit
    def _attn_bwd_dkdv_ws(q_desc, k_desc, v_desc, do_desc, rows_desc, dk_desc, dv_desc, kh_desc, dq_desc, lock_ptr,
                          c, scale, heads_kv, group, len_q, len_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                          DS_BUFS: gl.constexpr, DS_LAYOUT: gl.constexpr, DK_FIRST: gl.constexpr,
                          WARPGROUPS: gl.constexpr, ROTATE: gl.constexpr, ORDERED: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        pid_n = gl.program_id(0)  # causal: the first key tiles have the most Q tiles, and run first
        pid_bh = gl.program_id(1)
        off_b = pid_bh // heads_kv
        off_hkv = pid_bh % heads_kv
        start_n = pid_n * WARPGROUPS * BLOCK_N
        causal_offset = len_k - len_q
        if CAUSAL:  # the first query row that sees the program's first key
            lo = (gl.maximum(start_n - causal_offset, 0) // BLOCK_M) * BLOCK_M
        else:
            lo = start_n * 0
        n_tiles = gl.maximum(gl.cdiv(len_q - lo, BLOCK_M), 0)
        n_prog = gl.num_programs(0)
        heads_q = heads_kv * group
        t_all = gl.cdiv(len_q, BLOCK_M)

        k_smem = gl.allocate_shared_memory(dtype, [WARPGROUPS, 1, 1, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [WARPGROUPS, 1, 1, BLOCK_N, D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, D], do_desc.layout)
        rows_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 1, 2, BLOCK_M], rows_desc.layout)
        if ATOMIC_DQ:  # K in (key half, column half) tiles; both warpgroups' dS^T; each one's dQ columns
            kh_smem = gl.allocate_shared_memory(dtype, [4, 1, 1, BLOCK_N, D // 2], kh_desc.layout)
            ds_smem = gl.allocate_shared_memory(dtype, [2 * DS_BUFS, BLOCK_N, BLOCK_M], DS_LAYOUT)
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, D // 2], dq_desc.layout)
        else:  # never read
            kh_smem = k_smem
            ds_smem = k_smem
            dq_smem = k_smem
        kv_bar = gl.allocate_shared_memory(gl.int64, [WARPGROUPS, 1], mbarrier.MBarrierLayout())
        kh_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(WARPGROUPS):
            mbarrier.init(kv_bar.index(i), count=1)
        mbarrier.init(kh_bar.index(0), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=WARPGROUPS)  # one release per consumer warpgroup
        for i in gl.static_range(DS_BUFS):
            mbarrier.init(ds_ready.index(i), count=2)
            mbarrier.init(ds_free.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(dq_full.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)
        # the partitions spelled out in each branch: see flashverify_kernels/hopper/forward.py
        if ORDERED:  # dQ added in order: a warp of its own adds the consumers' dQ tiles
            gl.warp_specialize([
                (_consumer, (k_smem.index(0), v_smem.index(0), q_smem, do_smem, rows_smem, kh_smem, ds_smem, dq_smem,
                             kv_bar.index(0), kh_bar.index(0), ready, empty, ds_ready, ds_free, dq_full, dq_empty,
                             dk_desc, dv_desc, dq_desc, c, scale, off_b, off_hkv, group, start_n, lo, n_tiles,
                             len_k, causal_offset, pid_n, n_prog, CAUSAL, BLOCK_M, BLOCK_N, D, STAGES, 0, True,
                             DS_BUFS, DK_FIRST, WARPGROUPS, ROTATE, True)),
                (_consumer, (k_smem.index(1), v_smem.index(1), q_smem, do_smem, rows_smem, kh_smem, ds_smem, dq_smem,
                             kv_bar.index(1), kh_bar.index(0), ready, empty, ds_ready, ds_free, dq_full, dq_empty,
                             dk_desc, dv_desc, dq_desc, c, scale, off_b, off_hkv, group, start_n + BLOCK_N, lo, n_tiles,
                             len_k, causal_offset, pid_n, n_prog, CAUSAL, BLOCK_M, BLOCK_N, D, STAGES, 1, True,
                             DS_BUFS, DK_FIRST, WARPGROUPS, ROTATE, True)),
                (_producer, (k_desc, v_desc, q_desc, do_desc, rows_desc, kh_desc, k_smem, v_smem, q_smem, do_smem,
                             rows_smem, kh_smem, kv_bar, kh_bar.index(0), ready, empty, off_b, off_hkv, group, start_n,
                             lo, n_tiles, pid_n, n_prog, causal_offset, CAUSAL, BLOCK_M, BLOCK_N, STAGES, True,
                             WARPGROUPS, ROTATE)),
                (_dq_writer, (dq_smem, dq_desc, dq_full, dq_empty, lock_ptr, off_b, off_hkv, group, lo, n_tiles, pid_n,
                              n_prog, heads_q, t_all, causal_offset, CAUSAL, BLOCK_M, BLOCK_N, ROTATE)),
            ], [4, 1, 1], [240, 24, 24])  # (with a writer of 32 registers ptxas serializes the causal products)
        elif WARPGROUPS == 2:
            gl.warp_specialize([
                (_consumer, (k_smem.index(0), v_smem.index(0), q_smem, do_smem, rows_smem, kh_smem, ds_smem, dq_smem,
                             kv_bar.index(0), kh_bar.index(0), ready, empty, ds_ready, ds_free, dq_full, dq_empty,
                             dk_desc, dv_desc, dq_desc, c, scale, off_b, off_hkv, group, start_n, lo, n_tiles,
                             len_k, causal_offset, pid_n, n_prog, CAUSAL, BLOCK_M, BLOCK_N, D, STAGES, 0, ATOMIC_DQ,
                             DS_BUFS, DK_FIRST, WARPGROUPS, ROTATE, False)),
                (_consumer, (k_smem.index(1), v_smem.index(1), q_smem, do_smem, rows_smem, kh_smem, ds_smem, dq_smem,
                             kv_bar.index(1), kh_bar.index(0), ready, empty, ds_ready, ds_free, dq_full, dq_empty,
                             dk_desc, dv_desc, dq_desc, c, scale, off_b, off_hkv, group, start_n + BLOCK_N, lo, n_tiles,
                             len_k, causal_offset, pid_n, n_prog, CAUSAL, BLOCK_M, BLOCK_N, D, STAGES, 1, ATOMIC_DQ,
                             DS_BUFS, DK_FIRST, WARPGROUPS, ROTATE, False)),
                (_producer, (k_desc, v_desc, q_desc, do_desc, rows_desc, kh_desc, k_smem, v_smem, q_smem, do_smem,
                             rows_smem, kh_smem, kv_bar, kh_bar.index(0), ready, empty, off_b, off_hkv, group, start_n,
                             lo, n_tiles, pid_n, n_prog, causal_offset, CAUSAL, BLOCK_M, BLOCK_N, STAGES, ATOMIC_DQ,
                             WARPGROUPS, ROTATE)),
            ], [4, 1], [240, 24])
        else:  # three warpgroups: without dQ only
            gl.warp_specialize([
                (_consumer, (k_smem.index(0), v_smem.index(0), q_smem, do_smem, rows_smem, kh_smem, ds_smem, dq_smem,
                             kv_bar.index(0), kh_bar.index(0), ready, empty, ds_ready, ds_free, dq_full, dq_empty,
                             dk_desc, dv_desc, dq_desc, c, scale, off_b, off_hkv, group, start_n, lo, n_tiles,
                             len_k, causal_offset, pid_n, n_prog, CAUSAL, BLOCK_M, BLOCK_N, D, STAGES, 0, False,
                             DS_BUFS, DK_FIRST, WARPGROUPS, False, False)),
                (_consumer, (k_smem.index(1), v_smem.index(1), q_smem, do_smem, rows_smem, kh_smem, ds_smem, dq_smem,
                             kv_bar.index(1), kh_bar.index(0), ready, empty, ds_ready, ds_free, dq_full, dq_empty,
                             dk_desc, dv_desc, dq_desc, c, scale, off_b, off_hkv, group, start_n + BLOCK_N, lo, n_tiles,
                             len_k, causal_offset, pid_n, n_prog, CAUSAL, BLOCK_M, BLOCK_N, D, STAGES, 1, False,
                             DS_BUFS, DK_FIRST, WARPGROUPS, False, False)),
                (_consumer, (k_smem.index(2), v_smem.index(2), q_smem, do_smem, rows_smem, kh_smem, ds_smem, dq_smem,
                             kv_bar.index(2), kh_bar.index(0), ready, empty, ds_ready, ds_free, dq_full, dq_empty,
                             dk_desc, dv_desc, dq_desc, c, scale, off_b, off_hkv, group, start_n + 2 * BLOCK_N, lo,
                             n_tiles, len_k, causal_offset, pid_n, n_prog, CAUSAL, BLOCK_M, BLOCK_N, D, STAGES, 2,
                             False, DS_BUFS, DK_FIRST, WARPGROUPS, False, False)),
                (_producer, (k_desc, v_desc, q_desc, do_desc, rows_desc, kh_desc, k_smem, v_smem, q_smem, do_smem,
                             rows_smem, kh_smem, kv_bar, kh_bar.index(0), ready, empty, off_b, off_hkv, group, start_n,
                             lo, n_tiles, pid_n, n_prog, causal_offset, CAUSAL, BLOCK_M, BLOCK_N, STAGES, False,
                             WARPGROUPS, False)),
            ], [4, 4, 1], [160, 160, 24])  # as the forward's three


def warpgroups(head_dim: int, atomic_dq: bool) -> int:
    """Consumer warpgroups (each ``BLOCK_N`` keys) per program: three at head dim 64 without dQ (192 keys
    share each Q and dO tile loaded; 160 registers a thread hold their accumulators; dK and dV bitwise those
    of two), two otherwise (the dQ-added form splits dQ's columns between two)."""
    return 3 if head_dim == 64 and not atomic_dq else 2


ORDERED_ENV = "FLASHVERIFY_ORDERED_DQ"  # "0": the deterministic backward keeps the Triton dQ kernel


def ordered_dq(head_dim: int, len_k: int, device) -> bool:
    """Whether the deterministic backward adds dQ in the dK/dV kernel in a fixed order (``ORDERED``: 5 tile
    products, no dQ kernel) rather than running the Triton dQ kernel: at head dim 128 (at 64 the form
    without dQ runs three warpgroups, which the dQ-added form cannot: :func:`warpgroups`), where every program of a
    (batch, KV head), ``2 * BLOCK_N`` keys each, fits the SMs at once (one program a SM: their shared memory),
    which the programs' waits on each other need. The SMs counted are those the device reports, times
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` where that is set (an MPS client may get fewer SMs than the device
    has); :data:`ORDERED_ENV` ``=0`` keeps the dQ kernel everywhere (where SMs are taken some other way)."""
    if head_dim != 128 or os.environ.get(ORDERED_ENV, "1") == "0":
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    try:
        share = float(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"))
    except ValueError:
        share = 100.0
    if 0 < share < 100:
        sms = int(sms * share / 100)
    return -(-len_k // (2 * BLOCK_N)) <= sms


def dq_order(pid: int, programs: int, len_q: int, len_k: int, causal: bool, rotate: bool) -> list[tuple[int, int]]:
    """The kernel's walk (``_tile``) for the program ``pid`` of ``programs`` (``2 * BLOCK_N`` keys each) of
    one head, written again in Python for tests: ``(Q tile, rank)`` per step, the rank being the number of
    the head's programs whose dQ the ordered form adds to that tile before this one's."""
    off = len_k - len_q
    lo = (max(pid * 2 * BLOCK_N - off, 0) // BLOCK_M) * BLOCK_M if causal else 0
    n_tiles = max(-(-(len_q - lo) // BLOCK_M), 0)
    walk = []
    for t in range(n_tiles):
        if rotate:
            m = pid * n_tiles // programs + t
            start_m = (m % n_tiles) * BLOCK_M
            rank = min(programs - 1, (programs * (m + 1) - 1) // n_tiles - pid)
        else:
            start_m = lo + t * BLOCK_M
            rank = min(programs - 1, (start_m + BLOCK_M - 1 + off) // (2 * BLOCK_N)) - pid if causal else pid
        walk.append((start_m // BLOCK_M, rank))
    return walk


def rows_buffer(lse: torch.Tensor) -> torch.Tensor:
    """An empty ``[B, Hq, 2, Np]`` float32 buffer for :func:`dkdv`'s ``rows`` (``lse``'s ``[B, Hq, Nq]``;
    ``Np`` is Nq rounded up to whole ``BLOCK_M`` tiles): LSE * log2(e) (+inf where LSE is -inf, and on the
    padding rows) at ``[:, :, 0]``, Delta (0 on the padding) at ``[:, :, 1]``."""
    b, hq, len_q = lse.shape
    return replay.empty((b, hq, 2, -(-len_q // BLOCK_M) * BLOCK_M), dtype=torch.float32, device=lse.device)


def fill_rows(rows: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Fill a :func:`rows_buffer` from ``lse`` and ``delta`` with torch operations (the backward's Delta
    kernel writes it in the same pass as Delta instead); returns it."""
    len_q = lse.shape[2]
    torch.mul(lse, LOG2E, out=rows[:, :, 0, :len_q])
    rows[:, :, 0, :len_q].masked_fill_(lse == float("-inf"), float("inf"))
    rows[:, :, 0, len_q:] = float("inf")
    rows[:, :, 1, :len_q] = delta
    rows[:, :, 1, len_q:] = 0.0
    return rows


def dkdv(q, k, v, dout, lse, delta, dk, dv, *, causal: bool, scale: float, dq_sum=None, rows=None,
         ordered: bool = False) -> None:
    """Write dK and dV of the FA2 backward of ``[B, H, N, D]`` float16/bfloat16 tensors into ``dk``, ``dv``
    (``k``'s shape, contiguous); ``lse`` and ``delta`` (``rowsum(dO * O)``) are ``[B, Hq, Nq]`` float32.
    ``rows``: a :func:`rows_buffer` holding them as the kernel reads them (``None``: made here by
    :func:`fill_rows`). ``dq_sum``: a contiguous float32 tensor of ``q``'s shape, zeros, to
    which the kernel adds dQ (each program its keys' share, by TMA reduces), in the order the additions
    arrive in (dQ's last bits vary from run to run), or with ``ordered`` in a fixed one (:func:`dq_order`;
    only where :func:`ordered_dq` allows it: the programs of a head wait on each other); ``None``: no dQ
    (the deterministic backward's dQ kernel computes it). Where dQ is added and not causal, the programs walk
    a head's Q tiles from different starts (``ROTATE``: :func:`dq_order`). Tensors no descriptor reads go
    through contiguous copies."""
    b, hkv, len_k, d = k.shape
    hq, len_q = q.shape[1], q.shape[2]
    if b * hkv * len_k == 0:
        return
    if len_q == 0:
        replay.unrecordable("no query: dk and dv zeroed in place")
        dk.zero_()
        dv.zero_()
        return
    if rows is None:
        replay.unrecordable("the rows buffer filled by torch operations")
        rows = fill_rows(rows_buffer(lse), lse, delta)
    readable = gluon_forward.readable
    q, k, v, dout = (t if readable(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
                     for t in (q, k, v, dout))
    targets = [t if readable(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (dk, dv)]
    descriptor = gluon_forward._descriptor
    atomic = dq_sum is not None
    k_desc, dk_desc = descriptor(k, BLOCK_N), descriptor(targets[0], BLOCK_N)
    # without dQ the kernel reads neither: any descriptor of the right kind stands in
    kh_desc = descriptor(k, BLOCK_N, d // 2) if atomic else k_desc
    dq_desc = descriptor(dq_sum, BLOCK_M, d // 2) if atomic else dk_desc
    groups = warpgroups(d, atomic)
    if ordered and not atomic:
        raise ValueError("gluon_backward.dkdv: ordered=True adds dQ: it needs dq_sum")
    rotate = atomic and not causal
    if ordered:
        locks = replay.zeros((b * hq * -(-len_q // BLOCK_M), ), dtype=torch.int32, device=q.device)
    else:  # never read
        locks = replay.empty((1, ), dtype=torch.int32, device=q.device)
    replay.launch(
        _attn_bwd_dkdv_ws, (-(-len_k // (groups * BLOCK_N)), b * hkv),
        descriptor(q, BLOCK_M), k_desc, descriptor(v, BLOCK_N), descriptor(dout, BLOCK_M),
        descriptor(rows, 2, BLOCK_M, swizzled=False), dk_desc, descriptor(targets[1], BLOCK_N), kh_desc, dq_desc,
        locks, scale * LOG2E, scale, hkv, hq // hkv, len_q, len_k, CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=d,
        STAGES=STAGES, ATOMIC_DQ=atomic, DS_BUFS=DS_BUFS, DS_LAYOUT=_ds_layout(q.dtype), DK_FIRST=DK_FIRST[d],
        WARPGROUPS=groups, ROTATE=rotate, ORDERED=ordered, num_warps=4)
    for target, given in zip(targets, (dk, dv)):
        if target is not given:
            given.copy_(target)
