"""How long the host takes to launch one Triton FA2 forward or backward, beside the GPU time of the call:
where the host takes longer, a timing with CUDA events (kernels.bench's ``do_bench``) measures the host.

    PYTHONPATH=. python docs/experiments/host_overhead.py
    EXP_PROFILE=1 PYTHONPATH=. python docs/experiments/host_overhead.py   # where the host time goes

N = 1024 (the shortest rows of kernels.bench: B x H = 16 x 32 at D = 64, 16 x 16 at D = 128), float16
and bfloat16, causal and not. Per row: the GPU time (median of ``do_bench``, as kernels.bench), the
host time per call (the mean over 200 calls launched back to back without synchronising, after a warm-up:
what Python, the launcher's checks and Triton's launch cost), and the same two for SDPA's cuDNN forward.
``EXP_PROFILE=1``: instead, cProfile over 200 forward and 100 backward calls (D = 64, float16, causal),
the functions that take the most time themselves. ``EXP_MODULE=path/to/other_triton_attention.py``: the
host times of that version of the module too, beside this one's (each timed twice, alternately, the
lower kept).

A record of an experiment, not tested code.
"""

from __future__ import annotations

import cProfile
import os
import pstats

import torch
import triton
import triton.testing

from kernels import triton_attention as ta
from kernels.bench import PEER_MAKERS
from short_n import _host_us as short_n_host_us  # this script's neighbour: its folder is on the import path
from module_ab import _load  # the neighbouring script's loader of another module version


def _host_us(fn, calls: int = 200) -> float:
    for _ in range(10):  # warm: nothing left to compile or tune
        fn()
    return short_n_host_us(fn, calls)


def _gpu_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _profile() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn((16, 32, 1024, 64), generator=gen, device="cuda", dtype=torch.float16)
                     for _ in range(4))
    out, lse = ta.fa2_forward_raw(q, k, v, causal=True)
    for label, fn, calls in (("forward", lambda: ta.fa2_forward_raw(q, k, v, causal=True), 200),
                             ("backward", lambda: ta.fa2_backward(q, k, v, out, lse, dout, causal=True), 100)):
        _host_us(fn, 20)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        print(f"--- {label}, {calls} calls", flush=True)
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    if os.environ.get("EXP_PROFILE") == "1":
        _profile()
        return
    other = _load(os.environ["EXP_MODULE"]) if os.environ.get("EXP_MODULE") else None
    n = 1024
    for d in (64, 128):
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                batch, heads = 16384 // n, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, dout = (torch.randn((batch, heads, n, d), generator=gen, device="cuda", dtype=dtype)
                                 for _ in range(4))
                out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
                fwd = lambda: ta.fa2_forward_raw(q, k, v, causal=causal)  # noqa: E731
                bwd = lambda: ta.fa2_backward(q, k, v, out, lse, dout, causal=causal)  # noqa: E731
                cudnn = PEER_MAKERS["sdpa_cudnn"](q, k, v, causal)
                cells = []
                for name, fn in (("fwd", fwd), ("bwd", bwd), ("cudnn fwd", cudnn)):
                    gpu = _gpu_us(fn)
                    cells.append(f"{name} gpu {gpu:6.0f} host {_host_us(fn):5.0f} us")
                if other is not None:
                    other_fwd = lambda: other.fa2_forward_raw(q, k, v, causal=causal)  # noqa: E731
                    other_bwd = lambda: other.fa2_backward(q, k, v, out, lse, dout, causal=causal)  # noqa: E731
                    for name, mine, theirs in (("fwd", fwd, other_fwd), ("bwd", bwd, other_bwd)):
                        times = [_host_us(fn) for fn in (mine, theirs, mine, theirs)]
                        cells.append(f"{name} host {min(times[0::2]):5.0f} other {min(times[1::2]):5.0f} us")
                print(f"D={d} {str(dtype)[6:]} causal={causal!s:5}: " + "; ".join(cells), flush=True)
                del q, k, v, dout, out, lse


if __name__ == "__main__":
    main()
