"""The zoo: correct attention kernels, one per family of algorithm that real FlashAttention kernels use.

A verdict of the suite is sound only if no correct kernel fails it, whatever legitimate algorithm it runs;
``tests/test_zoo.py`` runs every kernel here through ``pytest verify`` and fails on any failure. Each is
small, written to the contract (dense ``[B, H, N, D]``, grouped-query attention, a value head dim of its own,
bottom-right causal masks, tunable ``block_m``/``block_n``, an FA2 backward exposing Delta), and none is registered by default: name
one with ``--impl tests.zoo:NAME``.

========================  =====================================================================================
name                      what it does, and where real kernels do it
========================  =====================================================================================
``fa2``                   our blocked FA2 (``flashverify_kernels/pytorch/blocked.py``): one online-softmax pass, one division at the
                          end, ``P`` rounded to the input dtype before ``P @ V`` (FlashAttention-2, every Triton
                          kernel)
``fa1``                   our blocked FA1: KV tiles outer, the output renormalised every step (FlashAttention-1)
``eager``                 the softmax materialised and normalised before the cast, autograd's backward
                          (PyTorch SDPA's math backend, eager reference code)
``reverse_tiles``         key tiles visited last-first (FlashAttention-2's CUDA forward walks ``n_block``
                          downwards)
``lazy_rescale``          the running max moves only when a score beats it by more than ``log(256)``
                          (FlashAttention-4's conditional rescaling on Blackwell)
``base2``                 ``log2(e)`` folded into the scale, ``exp2`` of one FMA, the LSE kept in base 2 and
                          converted (FlashAttention-3, FlexAttention, Triton's tutorial); base-2 backward
``two_pass``              a max pass, then a sum pass with no rescaling (decode kernels, fixed-max variants)
``split_kv``              split-KV chosen by the kernel (2 to 128 splits, some with no visible key), float32
                          partials merged through their LSEs in one pass (FlashAttention-2's split-KV combine,
                          FlashDecoding, flashinfer's ``merge_state``)
``ring``                  per-chunk float32 partials folded in one at a time through their LSEs, 2 to 8
                          chunks (ring attention across devices, as the ring attention paper's update)
``atomics``               gradients accumulated in a random order: dQ over key tiles, dK and dV over query
                          tiles and a group's heads (FlashAttention-2's atomic dQ, FlashAttention-3's GQA
                          backward); not deterministic
========================  =====================================================================================
"""

from __future__ import annotations

import dataclasses
import functools
import math

from flashverify_kernels.registry import Implementation, registry
from tests.zoo import base2, merges, online, two_pass
from tests.zoo.common import BLOCKS, fa2_backward, with_autograd


def _zoo(name: str, forward, description: str, backward=fa2_backward, **fields) -> Implementation:
    # max_tiles: the tile loops run in Python, a few launches a tile (as flashverify_kernels/pytorch/blocked.py's).
    return Implementation(name=f"zoo_{name}", forward=with_autograd(forward, backward), backward=backward,
                          gqa=True, head_dim_v=True, block_m=BLOCKS, block_n=BLOCKS, selector=f"tests.zoo:{name}",
                          max_tiles=1024, description=description, in_default=False, **fields)


def _ours(name: str, description: str) -> Implementation:
    """A shipped kernel as the zoo runs it: the dense algorithm alone (its variants are the suite's own
    business), under the zoo's name."""
    return dataclasses.replace(registry()[name], name=f"zoo_{name.split('_')[0]}", windows=False, chunks=False,
                               softcap=False, alibi=False, sinks=False, splits=False, sequences=("dense",),
                               out_buffers=False, selector=f"tests.zoo:{name.split('_')[0]}",
                               description=description, in_default=False, sibling=None)


fa2 = _ours("fa2_blocked", "our blocked FA2: one pass, P rounded to the input dtype before P @ V")
fa1 = _ours("fa1_blocked", "our blocked FA1: the output renormalised every step")
eager = dataclasses.replace(_ours("eager", "the softmax materialised, autograd's backward"), name="zoo_eager",
                            selector="tests.zoo:eager")
reverse_tiles = _zoo("reverse_tiles", functools.partial(online.forward, reverse=True), "key tiles last-first")
lazy_rescale = _zoo("lazy_rescale", functools.partial(online.forward, threshold=8 * math.log(2.0)),
                    "the running max moves only past a threshold of log(256)")
base2_exp = _zoo("base2", base2.forward, "exp2 of one FMA, the LSE in base 2",
                 backward=functools.partial(fa2_backward, probabilities=base2.probabilities))
two_pass_softmax = _zoo("two_pass", two_pass.forward, "a max pass, then a sum pass")
split_kv = _zoo("split_kv", merges.split_kv, "split-KV chosen by the kernel, merged through float32 LSEs")
ring = _zoo("ring", merges.ring, "ring attention's chunk-by-chunk merge through float32 LSEs")
atomics = _zoo("atomics", online.forward, "gradients summed in a random order",
               backward=functools.partial(fa2_backward, shuffle=True), deterministic=False)

ZOO: dict[str, Implementation] = {impl.selector.split(":")[1]: impl for impl in (
    fa2, fa1, eager, reverse_tiles, lazy_rescale, base2_exp, two_pass_softmax, split_kv, ring, atomics)}
# Every family under the name its --impl selector uses.
globals().update(ZOO)
