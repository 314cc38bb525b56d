"""Registers and local memory (spills) of the Triton FA2 kernels as the GPU compiled them: every
autotuning candidate of the forward, dQ and dK/dV kernels, read from Triton's kernel cache after a forward
and a backward per row (float16; D = 128 and 64; N = 1024 and 16384; causal and not).

    PYTHONPATH=. python docs/experiments/gpu_spills.py
    EXP_MODULE=path/to/other_triton_attention.py PYTHONPATH=. python docs/experiments/gpu_spills.py

A compile made offline for sm_90 (``triton.compile`` with a signature written by hand) spills only as the
launch does if it also has the launch's specialisations: the unit head-dim strides become the constant 1,
16-byte-divisible pointers and integers are marked so. Without them the same forward read 792 bytes per
thread where the GPU's compile has none; this script reads the compiled kernels themselves
(``CompiledKernel.n_regs``, ``n_spills`` in 4-byte words, from ``CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES``).
``EXP_MODULE``: the same for another version of the module, after the working tree's.

A record of an experiment, not tested code.
"""

from __future__ import annotations

import os

import torch
import triton

from kernels import triton_attention as this
from module_ab import _load  # the neighbouring script's loader of another module version

SHOWN = ("BLOCK_D", "CAUSAL", "EVEN_KV", "GQA", "ATOMIC_DQ", "BLOCK_M", "BLOCK_N")


def _compiled(fn):
    """``(constexprs, CompiledKernel)`` of every kernel ``fn`` compiled in this process."""
    for cache, *_ in fn.device_caches.values():
        for kernel in cache.values():
            kernel._init_handles()  # loads the binary: n_regs, n_spills
            names = {(i, ): name for i, name in enumerate(fn.arg_names)}
            consts = {names[k]: v for k, v in kernel.src.constants.items() if k in names}
            yield consts, kernel


def report(module, tag: str) -> None:
    for d in (128, 64):
        for n in (1024, 16384):
            for causal in (False, True):
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, dout = (torch.randn((16384 // n, 2048 // d, n, d), generator=gen, device="cuda",
                                             dtype=torch.float16) for _ in range(4))
                out, lse = module.fa2_forward_raw(q, k, v, causal=causal)
                module.fa2_backward(q, k, v, out, lse, dout, causal=causal)
    torch.cuda.synchronize()
    chosen = set()
    for tuned in (module._attn_fwd_tuned, module._attn_bwd_dq_tuned, module._attn_bwd_dkdv_tuned):
        for key, config in tuned.cache.items():
            # key: the autotuning key's values in order (BLOCK_D, CAUSAL, ...); config: the tiles chosen
            chosen.add((tuned.base_fn.__name__, key[0], key[1], config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"],
                        config.num_warps))
    for fn in (module._attn_fwd, module._attn_bwd_dq, module._attn_bwd_dkdv):
        rows = []
        for consts, kernel in _compiled(fn):
            mark = (fn.__name__, consts.get("BLOCK_D"), consts.get("CAUSAL"), consts.get("BLOCK_M"),
                    consts.get("BLOCK_N"), kernel.metadata.num_warps) in chosen
            rows.append((" ".join(f"{name}={consts[name]}" for name in SHOWN if name in consts),
                         kernel.metadata.num_warps, kernel.n_regs, kernel.n_spills, "chosen" if mark else ""))
        for shown, warps, regs, spills, mark in sorted(rows):
            print(f"{tag} {fn.__name__:15s} {shown:70s} warps {warps:2d} regs {regs:3d} spilled words {spills:4d} "
                  f"{mark}", flush=True)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    report(this, "this")
    if os.environ.get("EXP_MODULE"):
        report(_load(os.environ["EXP_MODULE"]), "other")


if __name__ == "__main__":
    main()
