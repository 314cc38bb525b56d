"""The backward with dQ added inside the Gluon dK/dV kernel (``deterministic=False``, ba64477) beside the
deterministic backward, the Triton atomic-dQ backward (``gluon=False``) and cuDNN's, in one process.

    PYTHONPATH=. python docs/experiments/gluon_atomic_dq.py            # timing only
    PYTHONPATH=. python docs/experiments/gluon_atomic_dq.py --check    # first: gradients against float64

``--check``: over tails, Nq != Nk causal, GQA and [B, N, H, D] storage, float16 and bfloat16, the
largest error of dQ, dK, dV over the suite's bound (references/bounds.py; <= 1 passes), whether dK and dV
are bitwise the deterministic backward's, and dQ's largest difference from it and from the Triton
atomic form; exits 1 if a case fails. Timing: float16, B * N = 16384 tokens, H * D = 2048, median ms of
``triton.testing.do_bench`` per backward (cuDNN's through autograd on a retained graph) and cuDNN's time
over each of ours. Needs an H100/H200 (the Gluon kernel runs at compute capability 9.0 only).
"""
import sys
import torch
import triton
from triton.testing import do_bench
from kernels import triton_attention as ta, gluon_backward as gb
from references import attention as ref_attention, bounds
from references.spec import AttentionSpec
from triton.experimental.gluon.language.nvidia.hopper import tma

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "async_atomic_add:",
      hasattr(tma, "async_atomic_add"), flush=True)
SHAPES = [
    (1, 1, 1, 1, 257, 64, False, "bhnd"), (1, 2, 2, 63, 65, 128, True, "bhnd"), (2, 3, 3, 129, 127, 64, True, "bhnd"),
    (1, 4, 2, 200, 333, 128, False, "bhnd"), (1, 4, 1, 300, 100, 128, True, "bhnd"),
    (2, 2, 2, 256, 256, 64, True, "bnhd"), (1, 8, 2, 520, 520, 128, True, "bnhd"),
    (1, 2, 2, 100, 1024, 64, True, "bhnd"), (1, 2, 2, 517, 40, 64, False, "bnhd"),
    (2, 4, 4, 1024, 1024, 128, False, "bhnd"), (2, 4, 4, 1024, 1024, 128, True, "bhnd"),
]
bad = 0
for dtype in ((torch.float16, torch.bfloat16) if "--check" in sys.argv else ()):
    for shape in SHAPES:
        b, hq, hkv, nq, nk, d, causal, layout = shape
        gen = torch.Generator(device="cuda").manual_seed(nq * 7 + nk)

        def make(h, n):
            if layout == "bnhd":
                return torch.randn((b, n, h, d), generator=gen, device="cuda", dtype=dtype).transpose(1, 2)
            return torch.randn((b, h, n, d), generator=gen, device="cuda", dtype=dtype)

        q, k, v, dout = make(hq, nq), make(hkv, nk), make(hkv, nk), make(hq, nq)
        out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
        det = ta.fa2_backward(q, k, v, out, lse, dout, causal=causal)
        new = ta.fa2_backward(q, k, v, out, lse, dout, causal=causal, deterministic=False)
        old = ta.fa2_backward(q, k, v, out, lse, dout, causal=causal, deterministic=False, gluon=False)
        ref = ref_attention.attention(q, k, v, spec=AttentionSpec(causal=causal), dout=dout)
        bq, bk, bv, _ = bounds.backward_bounds(ref, q, k, v, dtype=dtype, out=out)
        ratios = []
        for got, exact, bound in ((new[0], ref.dq, bq), (new[1], ref.dk, bk), (new[2], ref.dv, bv)):
            err = (got.double() - exact).abs()
            ratios.append(torch.where(err == 0, 0.0, err / bound).max().item())
        ok = all(r <= 1 for r in ratios) and all(torch.isfinite(t).all() for t in new[:3])
        bad += not ok
        print(dtype, shape, "ok" if ok else "FAIL", "err/bound dq dk dv", [f"{r:.3f}" for r in ratios],
              "dk,dv == det:", torch.equal(new[1], det[1]), torch.equal(new[2], det[2]),
              "|dq-det|", (new[0].float() - det[0].float()).abs().max().item(),
              "|dq-old|", (new[0].float() - old[0].float()).abs().max().item(), flush=True)
print("correctness failures:", bad, flush=True)
if bad and "--force" not in sys.argv:
    sys.exit(1)

from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
print("D N causal | det gluon_atomic triton_atomic cudnn (ms) | cudnn/det cudnn/gluon_atomic")
for d in (128, 64):
    for n in (1024, 4096, 16384):
        for causal in (False, True):
            b, h = 16384 // n, 2048 // d
            q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(4))
            out, lse = ta.fa2_forward_raw(q, k, v, causal=causal)
            t_det = do_bench(lambda: ta.fa2_backward(q, k, v, out, lse, dout, causal=causal))
            t_new = do_bench(lambda: ta.fa2_backward(q, k, v, out, lse, dout, causal=causal, deterministic=False))
            t_old = do_bench(lambda: ta.fa2_backward(q, k, v, out, lse, dout, causal=causal, deterministic=False,
                                                     gluon=False))
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
            t_cud = do_bench(lambda: torch.autograd.grad(o, (qq, kk, vv), dout, retain_graph=True))
            print(f"{d} {n} {causal} | {t_det:.3f} {t_new:.3f} {t_old:.3f} {t_cud:.3f} | "
                  f"{t_cud / t_det:.2f} {t_cud / t_new:.2f}", flush=True)
