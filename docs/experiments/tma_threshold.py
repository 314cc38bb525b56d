"""Experiment behind TMA_MIN_LENGTH (kernels/triton_attention.py until 072fe1c, which builds the descriptors
on the host and dropped the threshold): the autotuned Triton FA2 at N = 1024, fp16, with tensor
descriptors and with pointer loads, forward and backward TFLOP/s (kernels.bench's bench_one, no peers).
On a GPU:

    PYTHONPATH=. OUT=. python docs/experiments/tma_threshold.py
"""
import os
import torch
from kernels import triton_attention as ta
from kernels.bench import bench_one

def main():
    out = os.environ.get("OUT", ".")
    for d in (64, 128):
        for causal in (True, False):
            for n in (1024,):
                res = {}
                use_tma = ta._use_tma
                for label, thr in (("tma", 0), ("ptr", 10**9)):
                    ta.TMA_MIN_LENGTH = thr  # read by modules before 072fe1c only
                    ta._use_tma = use_tma if label == "tma" else (lambda *args: False)
                    r = bench_one(d, n, causal, torch.float16, peers=())
                    res[label] = (round(r["triton_fwd_tflops"]), round(r["triton_bwd_tflops"]))
                ta._use_tma = use_tma
                line = f"D={d} causal={causal} N={n}: tma fwd/bwd {res['tma']}  pointers {res['ptr']}"
                print(line, flush=True)
                with open(os.path.join(out, "tma_threshold.txt"), "a") as fh:
                    fh.write(line + "\n")


if __name__ == "__main__":
    main()
