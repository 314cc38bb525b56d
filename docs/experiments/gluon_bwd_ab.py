"""The Gluon dK/dV kernel of several versions of kernels/gluon_backward.py (module files, ``MODS``: names
of ``EXP_DIR/<name>.py``), with dQ added in order (head dim 128), timed interleaved with cuDNN's whole
backward as kernels.bench times calls (:func:`kernels.bench.timed_interleaved`), after checking that each
version's dK, dV and dQ repeat bitwise and comparing them with the first version's.

    cp <an older kernels/gluon_backward.py> ab/gb_base.py; cp kernels/gluon_backward.py ab/gb_new.py
    EXP_DIR=ab MODS="gb_base gb_new" ROUNDS=3 PYTHONPATH=. python docs/experiments/gluon_bwd_ab.py

``ROWS``: ``D:N`` with ``c`` for causal (default the five rows of docs/benchmarks.md's thirteenth-session
table); float16, kernels.bench's shapes. Each line: the times (us, and each round's median in ms) and each
version's speed over the first. A record of how "dK's product first" was measured, not tested code.
"""
import importlib.util, os, torch
from kernels import triton_attention as ta, bench
from torch.nn.attention import SDPBackend, sdpa_kernel
F = torch.nn.functional
mods = {}
for name in os.environ["MODS"].split():
    path = os.path.join(os.environ.get("EXP_DIR", "ab"), name + ".py")
    spec = importlib.util.spec_from_file_location("gb_" + name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); mods[name] = m
for spec in os.environ.get("ROWS", "128:1024 128:4096 128:16384 128:4096c 128:16384c").split():
    causal = spec.endswith("c"); d, n = (int(x) for x in spec.rstrip("c").split(":"))
    b, h = 16384 // n, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = ta.fa2_forward_raw(qd, kd, vd, causal=causal)
    delta = (out.float() * dout.float()).sum(-1)
    base = next(iter(mods.values()))
    rows = base.fill_rows(base.rows_buffer(lse), lse, delta)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        oc = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    res = {}
    meas = {"cudnn": lambda: torch.autograd.grad(oc, (q, k, v), dout, retain_graph=True)}
    for name, m in mods.items():
        dk, dv = torch.empty_like(kd), torch.empty_like(vd)
        dq = torch.zeros(qd.shape, dtype=torch.float32, device="cuda")
        def call(m=m, dk=dk, dv=dv, dq=dq):
            dq.zero_()
            m.dkdv(qd, kd, vd, dout, lse, delta, dk, dv, causal=causal, scale=d ** -0.5, dq_sum=dq, rows=rows,
                   ordered=True)
        call(); torch.cuda.synchronize()
        res[name] = (dk.clone(), dv.clone(), dq.clone())
        call(); torch.cuda.synchronize()
        same = all(torch.equal(a, c) for a, c in zip(res[name], (dk, dv, dq)))
        meas[name] = call
        first = res[next(iter(res))]
        print(f"  {spec} {name}: repeat bitwise {same}, equal to {next(iter(res))}: "
              f"{[torch.equal(a, c) for a, c in zip(first, res[name])]}, max|d| "
              f"{max((a.float() - c.float()).abs().max().item() for a, c in zip(first, res[name])):.2e}", flush=True)
    t = bench.timed_interleaved(meas, int(os.environ.get("ROUNDS", "3")))
    names = list(mods)
    print(f"{spec}: " + ", ".join(f"{k2} {t[k2]*1e3:.0f} us {t['rounds_ms'][k2]}" for k2 in meas if k2 != 'rounds_ms')
          + " | " + ", ".join(f"{nm}/{names[0]} {t[names[0]]/t[nm]:.3f}" for nm in names[1:]), flush=True)
    del q, k, v, dout, qd, kd, vd, out, lse, oc, res, meas
    torch.cuda.empty_cache()
