"""Speed of the Triton FA2 kernels beside PyTorch SDPA's flash backend, on one GPU.

    python -m kernels.bench [--out FILE] [--dims 64 128] [--lengths 1024 ... 16384] [--dtypes fp16 bf16]

For each head dim, sequence length N (Nq = Nk), causal flag and dtype it times the forward and the
backward of ``kernels.triton_attention.fa2_forward`` (autotuned tiles) and of
``torch.nn.functional.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``
with ``triton.testing.do_bench`` (CUDA events, median), and prints a Markdown table of TFLOP/s and the
Triton/SDPA ratio. SDPA aligns causal masks top-left and the Triton kernel bottom-right; with Nq == Nk
the two coincide, and the ``max|dout|`` column shows how far the two outputs are apart.

FLOPs: forward ``4 * B * H * N * N * D`` (two matrix products), halved for causal; backward 2.5 times
the forward (five matrix products). The batch and head counts keep ``B * N = 16384`` tokens and
``H * D = 2048``, so every row does about the same work.
"""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _flops(batch: int, heads: int, n: int, d: int, causal: bool, backward: bool) -> float:
    f = 4.0 * batch * heads * n * n * d
    if causal:
        f /= 2
    return 2.5 * f if backward else f


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def _time(fn) -> float:
    import triton.testing

    fn()  # compile and autotune outside the measurement
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_one(d: int, n: int, causal: bool, dtype: torch.dtype, *, tokens: int = 16384, width: int = 2048):
    """Time one configuration; returns a dict of times (ms), TFLOP/s and the output difference."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import triton_attention

    batch, heads = max(1, tokens // n), max(1, width // d)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, heads, n, d)
    q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)

    def tri_fwd():
        return triton_attention.fa2_forward(q, k, v, causal=causal)[0]

    def sdpa_fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    out_t, out_s = tri_fwd(), sdpa_fwd()
    diff = (out_t.float() - out_s.float()).abs().max().item()
    row = {"d": d, "n": n, "causal": causal, "dtype": dtype, "batch": batch, "heads": heads, "max_diff": diff}
    for name, fwd, out in (("triton", tri_fwd, out_t), ("sdpa", sdpa_fwd, out_s)):
        row[f"{name}_fwd_ms"] = _time(fwd)
        row[f"{name}_bwd_ms"] = _time(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    for kind, backward in (("fwd", False), ("bwd", True)):
        flops = _flops(batch, heads, n, d, causal, backward)
        for name in ("triton", "sdpa"):
            row[f"{name}_{kind}_tflops"] = _tflops(flops, row[f"{name}_{kind}_ms"])
        row[f"{kind}_ratio"] = row[f"triton_{kind}_tflops"] / row[f"sdpa_{kind}_tflops"]
    del q, k, v, dout, out_t, out_s
    torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "",
             "| D | N | B x H | causal | dtype | fwd Triton | fwd SDPA | fwd ratio "
             "| bwd Triton | bwd SDPA | bwd ratio | max\\|dout\\| |",
             "| ---: | ---: | ---: | :---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        dtype = next(k for k, v in DTYPES.items() if v == r["dtype"])
        lines.append(
            f"| {r['d']} | {r['n']} | {r['batch']} x {r['heads']} | {'yes' if r['causal'] else 'no'} | {dtype} "
            f"| {r['triton_fwd_tflops']:.0f} | {r['sdpa_fwd_tflops']:.0f} | {r['fwd_ratio']:.2f} "
            f"| {r['triton_bwd_tflops']:.0f} | {r['sdpa_bwd_tflops']:.0f} | {r['bwd_ratio']:.2f} "
            f"| {r['max_diff']:.1e} |")
    lines += ["", "TFLOP/s; forward FLOPs 4·B·H·N²·D (halved if causal), backward 2.5× that; "
              "ratio = Triton / SDPA flash."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the Markdown table to this file")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp16", "bf16"])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.bench needs a CUDA GPU (SDPA's flash backend and compiled Triton kernels)", file=sys.stderr)
        return 2
    import triton

    causal_flags = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows = []
    for d in args.dims:
        for causal in causal_flags:
            for dtype in args.dtypes:
                for n in args.lengths:
                    row = bench_one(d, n, causal, DTYPES[dtype])
                    rows.append(row)
                    print(f"D={d} N={n} causal={causal} {dtype}: fwd {row['triton_fwd_tflops']:.0f} vs "
                          f"{row['sdpa_fwd_tflops']:.0f}, bwd {row['triton_bwd_tflops']:.0f} vs "
                          f"{row['sdpa_bwd_tflops']:.0f} TFLOP/s", file=sys.stderr, flush=True)
    header = (f"Triton FA2 vs SDPA flash on {torch.cuda.get_device_name()} "
              f"(torch {torch.__version__}, triton {triton.__version__})")
    table = markdown(rows, header)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
