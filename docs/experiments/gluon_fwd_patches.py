"""Changes to the Gluon forward tried in the eighth session and not adopted (docs/benchmarks.md, "Tried, not
adopted: the output store waited for a tile later, warpgroups started apart, the wait for P V kept after the
softmax"), as copies of kernels/gluon_forward.py patched in text and timed against the unpatched file in one
process on one GPU:

- ``defer``: a consumer warpgroup issues its tile's output store and goes on; it waits for the store (and
  releases the tile's Q buffer, which staged the output) only after issuing the next tile's first scores.
- ``lag3000``: consumer warpgroup W > 0 spins W x 3000 cycles before its first tile, so that the warpgroups
  run their tiles' fixed phases (first scores and softmax, last ``P V``, epilogue) apart rather than together;
  the K/V ring (3 K, 2 V stages) lets one run up to about a block ahead of the other.
- ``deferlag3000``: both.
- ``wait_after_softmax`` (``EXP_VARIANTS=wait_after_softmax``, run apart): in the loop of ``_attend``, V_j's
  barrier waited for again (complete: it returns at once) between the softmax step and the wait for P_j V_j. Its
  wait loop ends a basic block, so ptxas no longer issues the wait for P_j V_j before the exponentials (the
  compiled loop, Triton 3.6's ptxas and nvdisasm for sm_90a, every configuration, by
  docs/experiments/gluon_fwd_sass.py: all 64 exponentials of a thread's step before that DEPBAR, none before
  it without the patch).

The variants compile for sm_90a without C7514 (Triton 3.6's ptxas); defer and lag without spills. They
are timed and checked by docs/experiments/gluon_fwd_ab_parallel.py (the run of the eighth session, from 12a40e1:
the same rows and cases, its harness then inline, writing ``ab_multi.jsonl``).

    PYTHONPATH=. OUT=. python docs/experiments/gluon_fwd_patches.py
    EXP_VARIANTS=wait_after_softmax PYTHONPATH=. OUT=. python docs/experiments/gluon_fwd_patches.py

A record of an experiment, not tested code.
"""
import os
import pathlib
import sys
import tempfile

src = pathlib.Path("kernels/gluon_forward.py").read_text()
DIR = os.environ.get("EXP_DIR") or tempfile.mkdtemp(prefix="gf_variants_")


def sub(text, old, new, count=1):
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)

def variant(lag: int, defer: bool) -> str:
    t = src
    t = sub(t, "    _TIMELINE_SLOTS = gl.constexpr(TIMELINE_SLOTS)\n",
            "    _TIMELINE_SLOTS = gl.constexpr(TIMELINE_SLOTS)\n"
            f"    _LAG = gl.constexpr({lag})\n    _DEFER = gl.constexpr({defer})\n\n"
            "    @gluon.jit\n    def _clock():\n"
            "        return gl.inline_asm_elementwise(\"mov.u64 $0, %clock64;\", \"=l\", [], dtype=gl.int64,\n"
            "                                         is_pure=False, pack=1)\n")
    # _attend: the previous tile's Q buffer barrier and whether there is one
    t = sub(t, "                n_full, n_loaded, stamps, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,\n"
               "                D: gl.constexpr, TIMELINE: gl.constexpr):\n",
               "                n_full, n_loaded, stamps, prev_empty, has_prev, DEFER: gl.constexpr, CAUSAL: gl.constexpr,\n"
               "                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, TIMELINE: gl.constexpr):\n")
    t = sub(t, "                              use_acc=False, is_async=True)\n            s = warpgroup_mma_wait(0, deps=(s, ))\n",
               "                              use_acc=False, is_async=True)\n"
               "            if DEFER:\n                tma.store_wait(pendings=0)\n                if has_prev:\n"
               "                    mbarrier.arrive(prev_empty, count=1)\n"
               "            s = warpgroup_mma_wait(0, deps=(s, ))\n")
    t = sub(t, "        # Rows with no visible key: l = 0, acc = 0 -> out = 0, lse = -inf.\n",
               "        if DEFER:\n            if n_blocks <= 0:\n                tma.store_wait(pendings=0)\n"
               "                if has_prev:\n                    mbarrier.arrive(prev_empty, count=1)\n"
               "        # Rows with no visible key: l = 0, acc = 0 -> out = 0, lse = -inf.\n")
    t = sub(t, "            _tma_store(o_desc, [off_b, off_h, start_m, 0], q_smem)\n            tma.store_wait(pendings=0)\n",
               "            _tma_store(o_desc, [off_b, off_h, start_m, 0], q_smem)\n            if not DEFER:\n"
               "                tma.store_wait(pendings=0)\n")
    # per-tile consumer: no deferral
    t = sub(t, "                n_loaded, stamps, CAUSAL, BLOCK_M, BLOCK_N, D, TIMELINE)\n",
               "                n_loaded, stamps, q_bar, False, False, CAUSAL, BLOCK_M, BLOCK_N, D, TIMELINE)\n")
    # persistent consumer
    t = sub(t, "        ring = 0\n        i_t = 0\n        for it in range(_rounds(tiles_m, n_tiles, CAUSAL)):\n"
               "            valid, off_b, off_h, start_m, n_loaded = _walk(it, tiles_m, n_tiles, heads_q, len_q, len_k, CAUSAL,\n"
               "                                                           BLOCK_M, BLOCK_N, WARPGROUPS)\n            if valid:\n"
               "                n_blocks, n_full",
               "        if _LAG > 0:\n            if W > 0:\n                t0 = _clock()\n                t = t0\n"
               "                while t - t0 < _LAG * W:\n                    t = _clock()\n"
               "        ring = 0\n        i_t = 0\n        for it in range(_rounds(tiles_m, n_tiles, CAUSAL)):\n"
               "            valid, off_b, off_h, start_m, n_loaded = _walk(it, tiles_m, n_tiles, heads_q, len_q, len_k, CAUSAL,\n"
               "                                                           BLOCK_M, BLOCK_N, WARPGROUPS)\n            if valid:\n"
               "                n_blocks, n_full")
    t = sub(t, "                        n_full, n_loaded, stamps, CAUSAL, BLOCK_M, BLOCK_N, D, TIMELINE)\n"
               "                mbarrier.arrive(q_empty.index(buf), count=1)\n",
               "                        n_full, n_loaded, stamps, q_empty.index(1 - buf), i_t > 0, _DEFER, CAUSAL, BLOCK_M, BLOCK_N,\n"
               "                        D, TIMELINE)\n"
               "                if not _DEFER:\n                    mbarrier.arrive(q_empty.index(buf), count=1)\n")
    t = sub(t, "                ring += n_loaded\n                i_t += 1\n\n    @gluon.jit\n    def _producer_persistent(",
               "                ring += n_loaded\n                i_t += 1\n        if _DEFER:\n            tma.store_wait(pendings=0)\n\n"
               "    @gluon.jit\n    def _producer_persistent(")
    return t


def wait_after_softmax() -> str:
    old = "                acc = warpgroup_mma_wait(0, deps=(acc, ))\n                mbarrier.arrive(v_empty.index(vj), count=1)\n"
    return sub(src, old, "                mbarrier.wait(v_ready.index(vj), ((ring + j) // V_STAGES) & 1)\n" + old)


VARIANTS = {"defer": lambda: variant(0, True), "lag3000": lambda: variant(3000, False),
            "deferlag3000": lambda: variant(3000, True), "wait_after_softmax": wait_after_softmax}

if __name__ == "__main__":
    names = os.environ.get("EXP_VARIANTS", "defer lag3000 deferlag3000").split()
    pathlib.Path(DIR, "gf_base.py").write_text(src)
    for name in names:
        pathlib.Path(DIR, f"gf_{name}.py").write_text(VARIANTS[name]())
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gluon_fwd_ab_parallel
    gluon_fwd_ab_parallel.main({name: os.path.join(DIR, f"gf_{name}.py") for name in ["base", *names]})
