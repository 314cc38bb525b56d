"""The Triton FA2 forward and backward of the working tree against another version of the kernels'
module (``EXP_MODULE``, as in dkdv_scaling.py), timed in one process on one GPU, with cuDNN's forward
beside them (its backward column is NaN: not timed).

    EXP_MODULE=path/to/old_triton_attention.py PYTHONPATH=. OUT=. python docs/experiments/module_ab.py

``EXP_DIMS`` (default "128 64"), ``EXP_LENGTHS`` ("1024 4096 16384"), ``EXP_DTYPE`` (fp16 or bf16),
``EXP_CAUSAL`` ("0 1"), ``EXP_BWD`` (1: time the backward too, 0: not). B * N = 16384 tokens and
H * D = 2048 as in kernels.bench; autotuned tiles; each module timed twice, alternately (this, other,
this, other: the better of each pair), median of ``triton.testing.do_bench``; TFLOP/s as kernels.bench
counts them. One line per row to stdout and to ``$OUT/module_ab.jsonl``, with the largest difference
between the two modules' outputs and LSEs. Two modules whose forward is the same code timed the forward
within about 1-3% of each other on one H100, but from -3% to +12% on another (an A/A reading of the
run's noise): one run does not settle a difference of a few percent; repeat it, or swap the roles.

A record of an experiment, not tested code.
"""

from __future__ import annotations

import importlib.util
import json
import os

import torch
import triton
import triton.testing

from kernels import triton_attention as this
from kernels.bench import PEER_MAKERS, _flops


def _load(path: str):
    spec = importlib.util.spec_from_file_location("other_triton_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    other = _load(os.environ["EXP_MODULE"])
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[os.environ.get("EXP_DTYPE", "fp16")]
    dims = [int(x) for x in os.environ.get("EXP_DIMS", "128 64").split()]
    lengths = [int(x) for x in os.environ.get("EXP_LENGTHS", "1024 4096 16384").split()]
    causals = [bool(int(x)) for x in os.environ.get("EXP_CAUSAL", "0 1").split()]
    backward = os.environ.get("EXP_BWD", "1") == "1"
    out_path = os.path.join(os.environ.get("OUT", "."), "module_ab.jsonl")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"other = {os.environ['EXP_MODULE']}", flush=True)
    for d in dims:
        for n in lengths:
            for causal in causals:
                batch, heads = 16384 // n, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, dout = (torch.randn((batch, heads, n, d), generator=gen, device="cuda", dtype=dtype)
                                 for _ in range(4))
                row = {"d": d, "n": n, "causal": causal, "dtype": str(dtype).split(".")[-1]}
                results = {}
                for name, module in (("this", this), ("other", other)):
                    out, lse = module.fa2_forward_raw(q, k, v, causal=causal)
                    results[name] = (out, lse)
                row["max_diff_out"] = (results["this"][0].float() - results["other"][0].float()).abs().max().item()
                row["max_diff_lse"] = (results["this"][1] - results["other"][1]).abs().max().item()
                times = {}
                for _ in range(2):
                    for name, module in (("this", this), ("other", other)):
                        out, lse = results[name]
                        fwd = _ms(lambda: module.fa2_forward_raw(q, k, v, causal=causal))
                        bwd = (_ms(lambda: module.fa2_backward(q, k, v, out, lse, dout, causal=causal))
                               if backward else float("nan"))
                        best = times.get(name, (float("inf"), float("inf")))
                        times[name] = (min(best[0], fwd), min(best[1], bwd))
                peer = PEER_MAKERS["sdpa_cudnn"](q, k, v, causal)
                times["cudnn"] = (_ms(peer), float("nan"))
                for name, (fwd, bwd) in times.items():
                    row[f"{name}_fwd"] = round(_flops(batch, heads, n, d, causal, False) / (fwd * 1e-3) / 1e12, 1)
                    row[f"{name}_bwd"] = round(_flops(batch, heads, n, d, causal, True) / (bwd * 1e-3) / 1e12, 1)
                print(json.dumps(row), flush=True)
                with open(out_path, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
                del q, k, v, dout, results


if __name__ == "__main__":
    main()
