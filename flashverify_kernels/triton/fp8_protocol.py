"""The FlashAttention-3 paper's accuracy protocol (its Table 3) for float8 inputs, on the Triton FA2 forward.

q, k, v are drawn in float64 from N(0, 1) + N(0, 100) x Bernoulli(0.001) (B=4, H=16, N=4096, D=128,
non-causal; a GPU is required), and O's RMSE against the float64 attention of those draws is printed for
float16 and bfloat16 inputs and for float8 e4m3 inputs quantised five ways: one scale for each whole
tensor (per tensor), one per batch entry and head (the descales ``q_descale``, ``k_descale``,
``v_descale`` carry them), one per block of 64 rows of each head (block quantization), and the last two
after incoherent processing (q and k multiplied by the same random orthogonal matrix, a Hadamard matrix
with random signs, which leaves q k^T unchanged and spreads the outliers over the head dim).

The kernel's descales are one factor per batch entry and head, so block quantization runs it once per key
block: every query block of a (batch, head) becomes a batch entry of its own with its own ``q_descale``,
meets one key block (its ``k_descale``, ``v_descale``) per call, and the calls' partial outputs are merged
through their float32 LSEs (the merge's own rounding, a few float32 and bfloat16 ulps of O, is far below
the float8 error measured). The paper's float8 figures are beside them::

    python -m flashverify_kernels.triton.fp8_protocol [--seed 0]
"""

from __future__ import annotations

import argparse
import math

import torch

# The FlashAttention-3 paper's float8 RMSE of O (Table 3): a per-tensor baseline and FlashAttention-3 with
# block quantization and incoherent processing.
PAPER_FP8 = {"per tensor": 2.4e-2, "per block of 64 rows, incoherent processing": 9.1e-3}
SHAPE = (4, 16, 4096, 128)
BLOCK = 64


def hadamard(n: int) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix divided by ``sqrt(n)`` (orthogonal; ``n`` a power of two)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def protocol_inputs(shape, *, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def draw():
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        extra = 10.0 * torch.randn(*shape, generator=g, dtype=torch.float64)
        hit = torch.rand(*shape, generator=g, dtype=torch.float64) < 0.001
        return (x + torch.where(hit, extra, 0.0)).to(device)

    return draw(), draw(), draw()


def reference(q, k, v) -> torch.Tensor:
    """float64 attention, one (batch, head) at a time (no ``[B, H, N, N]`` float64 tensor)."""
    out = torch.empty_like(v)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            out[b, h] = torch.softmax((q[b, h] @ k[b, h].T) * scale, dim=-1) @ v[b, h]
    return out


def quantise(x: torch.Tensor, dtype: torch.dtype, *, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in ``dtype`` and its float32 ``[B, H]`` descale: one amax-based factor for the whole tensor or per head."""
    top = torch.finfo(dtype).max
    amax = x.abs().amax() if per_tensor else x.abs().amax(dim=(2, 3))
    descale = (amax / top).to(torch.float32).expand(x.shape[:2]).contiguous()
    return (x / descale.double()[:, :, None, None]).clamp(-top, top).to(dtype), descale


def quantise_blocks(x: torch.Tensor, dtype: torch.dtype, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[B, H, N, D]`` in ``dtype`` with one amax-based float32 factor per block of ``block`` rows of
    each head: ``(x8 [B, H, N, D], descale [B, H, N // block])``."""
    b, h, n, d = x.shape
    # each block of rows as a head of its own: one scale per "head" is one per block
    x8, descale = quantise(x.reshape(b, h * (n // block), block, d), dtype, per_tensor=False)
    return x8.reshape(b, h, n, d), descale.reshape(b, h, n // block)


def block_quantised_attention(forward, q, k, v, *, dtype: torch.dtype, block: int) -> torch.Tensor:
    """Attention of q, k, v quantised to ``dtype`` per block of ``block`` rows, through ``forward`` (a
    float8 forward with ``[B, H]`` descales returning ``(out, lse)``): one call per key block, every query
    block a batch entry of its own, the partial outputs merged through their LSEs."""
    b, h, n, d = q.shape
    nb = n // block
    (q8, qd), (k8, kd), (v8, vd) = (quantise_blocks(x, dtype, block) for x in (q, k, v))
    # [B, H, nb, block, D] -> [B * nb, H, block, D]: query block i of batch entry b is batch entry b * nb + i.
    qb = q8.reshape(b, h, nb, block, d).transpose(1, 2).reshape(b * nb, h, block, d)
    qdb = qd.transpose(1, 2).reshape(b * nb, h)
    outs, lses = [], []
    for j in range(nb):
        kj = k8[:, :, j * block:(j + 1) * block].repeat_interleave(nb, dim=0)
        vj = v8[:, :, j * block:(j + 1) * block].repeat_interleave(nb, dim=0)
        o, lse = forward(qb, kj, vj, q_descale=qdb, k_descale=kd[:, :, j].repeat_interleave(nb, dim=0),
                         v_descale=vd[:, :, j].repeat_interleave(nb, dim=0))
        outs.append(o.float())
        lses.append(lse.float())
    lse = torch.stack(lses)                                    # [nb, B * nb, H, block]
    weights = torch.exp(lse - torch.logsumexp(lse, dim=0))     # each partial's share of the row's softmax
    out = (weights[..., None] * torch.stack(outs)).sum(dim=0)  # [B * nb, H, block, D]
    return out.reshape(b, nb, h, block, d).transpose(1, 2).reshape(b, h, n, d)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the float8 protocol runs the Triton kernel on a GPU; no GPU is available here")
    from flashverify_kernels.triton import attention

    q, k, v = protocol_inputs(SHAPE, seed=args.seed, device="cuda")
    ref = reference(q, k, v)

    def rmse(o) -> float:
        return float(((o.double() - ref) ** 2).mean().sqrt())

    print(f"{torch.cuda.get_device_name()}, B, H, N, D = {SHAPE}, seed {args.seed}: RMSE of O against float64")
    print("| inputs | scaling | triton_fa2 | paper (FlashAttention-3, Table 3) |\n|---|---|---|---|")
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        out, _ = attention.fa2_forward(q.to(dtype), k.to(dtype), v.to(dtype), gluon=False)
        print(f"| {name} | none | {rmse(out):.3e} | {'1.9e-04' if dtype == torch.float16 else ''} |")
    g = torch.Generator().manual_seed(args.seed + 1)
    signs = torch.where(torch.rand(SHAPE[3], generator=g) < 0.5, -1.0, 1.0).double()
    rotation = (hadamard(SHAPE[3]) * signs[None, :]).to("cuda")
    for scaling, per_tensor, rotate in (("per tensor", True, False), ("per head (descales)", False, False),
                                        (f"per block of {BLOCK} rows", None, False),
                                        ("per head, incoherent processing", False, True),
                                        (f"per block of {BLOCK} rows, incoherent processing", None, True)):
        qq, kk = (q @ rotation, k @ rotation) if rotate else (q, k)
        if per_tensor is None:
            out = block_quantised_attention(attention.fa2_forward, qq, kk, v, dtype=torch.float8_e4m3fn, block=BLOCK)
        else:
            (q8, qd), (k8, kd), (v8, vd) = (quantise(x, torch.float8_e4m3fn, per_tensor=per_tensor)
                                            for x in (qq, kk, v))
            out, _ = attention.fa2_forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
        paper = PAPER_FP8.get(scaling)
        print(f"| float8_e4m3fn | {scaling} | {rmse(out):.3e} | {'' if paper is None else f'{paper:.1e}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
