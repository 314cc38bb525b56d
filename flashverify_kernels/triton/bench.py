"""Speed of the Triton FA2 kernels beside every fast attention on the same GPU.

    python -m flashverify_kernels.triton.bench [--out FILE] [--jsonl FILE] [--dims 64 128] [--lengths 1024 ... 16384]
                            [--dtypes fp16 bf16] [--causal both|yes|no] [--peers sdpa_flash sdpa_cudnn ...]
                            [--atomic-dq] [--rounds 3]

For each head dim, sequence length N (Nq = Nk), causal flag and dtype it times, in one process, the
forward and the backward of ``flashverify_kernels.triton.attention.fa2_forward`` (autotuned tiles) and of each peer
this card and torch build offer:

``sdpa_flash``      ``scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``
``sdpa_cudnn``      the same under ``SDPBackend.CUDNN_ATTENTION``
``sdpa_efficient``  the same under ``SDPBackend.EFFICIENT_ATTENTION``
``flex``            ``torch.compile(flex_attention)`` with a causal block mask (none when not causal)

each call timed alone with CUDA events after a cache flush (as ``triton.testing.do_bench`` times one),
the calls of all the row's measurements interleaved one by one, in ``--rounds`` rounds (default 3) of about
100 ms of calls per measurement; each figure is the median of every call's time, and each ratio is shown
with the lowest and highest of the rounds' ratios.
``--atomic-dq`` also times the backward with ``deterministic=False`` (dQ added with atomics by the dK/dV
kernel: the Gluon one on Hopper), beside the deterministic one, in two more columns. A peer that cannot
run a configuration (no cuDNN, a head dim a backend refuses) is listed with torch's reason and left out
of that row. The table gives TFLOP/s, the fastest peer of each
row and the ratio Triton / fastest peer, forward and backward apart, and a second table every peer's
figures. With Nq == Nk SDPA's top-left and the Triton kernel's bottom-right causal masks coincide;
``max|dout|`` is the largest difference of any peer's output from Triton's.

FLOPs: forward ``4 * B * H * N * N * D`` (two matrix products), halved for causal; backward 2.5 times
the forward (five matrix products). The batch and head counts keep ``B * N = 16384`` tokens and
``H * D = 2048``, so every row does about the same work.

Rows are written as they are measured: ``--jsonl`` gets one JSON line per row (appended), and ``--out``
is replaced (atomically) by the table of the rows so far after each row, so a run cut short leaves
what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex")
KINDS = ("fwd", "bwd")


def _flops(batch: int, heads: int, n: int, d: int, causal: bool, backward: bool) -> float:
    f = 4.0 * batch * heads * n * n * d
    if causal:
        f /= 2
    return 2.5 * f if backward else f


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


FLUSH_BYTES = 256 * 1024 * 1024  # zeroed before every timed call (as do_bench does): no call finds its data in L2
BUDGET_MS = 100.0  # GPU time per measurement and round


def interleaved_order(keys: list, reps: int, seed: int = 0) -> list:
    """The order of the calls of one round: ``reps`` passes over ``keys``, each pass in its own order (drawn
    with ``seed``), so that a call follows each of the others, and itself across passes, about equally
    often: a clock or memory state that drifts over a round, or one that a call leaves to the next (an
    H200 lowers its clock under its power limit), reaches all measurements alike."""
    import random

    rng = random.Random(seed)
    return [key for _ in range(reps) for key in rng.sample(keys, len(keys))]


def _gpu_times(fns: list) -> list[float]:
    """Each call's time (ms, CUDA events around it), run in the given order, each after a cache flush."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
    for fn, (start, end) in zip(fns, events):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def timed_interleaved(measurements: dict, rounds: int, times=_gpu_times, budget_ms: float = BUDGET_MS) -> dict:
    """Time every measurement's call (``{key: fn}``) interleaved with the others' (:func:`interleaved_order`),
    ``rounds`` rounds of about ``budget_ms`` of calls each per measurement, every call timed alone after a
    cache flush (``times``: the calls' times in ms, in their order). Returns ``{key: median ms of all its
    calls}`` and, under ``"rounds_ms"``, ``{key: [each round's median]}``. The first pass of each round,
    which fixes the number of passes from the calls' times, is not counted. Call by call, not measurement
    by measurement as ``do_bench`` one after another would: a clock that drifts over a whole ``do_bench``
    would slow one measurement and not another, and a kernel timed alone runs at the clock its own power
    draw leaves it under the card's power limit, so that a kernel drawing less power a cycle reads faster
    alone than among the others."""
    keys = list(measurements)
    samples: dict = {key: [] for key in keys}
    per_round: dict = {key: [] for key in keys}
    for r in range(rounds):
        first = times([measurements[key] for key in keys])
        reps = max(3, min(1000, round(budget_ms / max(sum(first), 1e-3) * len(keys))))
        order = interleaved_order(keys, reps, seed=r)
        got: dict = {key: [] for key in keys}
        for key, ms in zip(order, times([measurements[key] for key in order])):
            got[key].append(ms)
        for key in keys:
            samples[key] += got[key]
            per_round[key].append(statistics.median(got[key]))
    return {**{key: statistics.median(samples[key]) for key in keys}, "rounds_ms": per_round}


def _sdpa(backend_name: str) -> Callable:
    def make(q, k, v, causal: bool):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)

        def fwd():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return fwd
    return make


_FLEX: dict = {}


def _flex(q, k, v, causal: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        import torch._dynamo
        import torch._functorch.config

        # One compiled graph per shape and mask, and never the unfused fallback Dynamo takes past its
        # recompile limit (it materialises the scores: a peer timed that way would be meaningless).
        torch._dynamo.config.recompile_limit = 256
        if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
            torch._dynamo.config.fail_on_recompile_limit_hit = True
        # The backward is timed with retain_graph=True, which donated buffers forbid.
        torch._functorch.config.donated_buffer = False
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    mask = None
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        mask = create_block_mask(lambda b, h, i, j: j <= i + (n_k - n_q), B=None, H=None, Q_LEN=n_q, KV_LEN=n_k,
                                 device=q.device)

    def fwd():
        return _FLEX["fn"](q, k, v, block_mask=mask)
    return fwd


PEER_MAKERS = {"sdpa_flash": _sdpa("FLASH_ATTENTION"), "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
               "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"), "flex": _flex}


def _ratio_range(row: dict, mine: str, best: str) -> list[float] | None:
    """The lowest and highest of the rounds' ratios (the peer's round median over ours), where ``row`` has
    the rounds' medians (``rounds_ms``)."""
    rounds = row.get("rounds_ms", {})
    if mine not in rounds or best not in rounds:
        return None
    ratios = [theirs / ours for ours, theirs in zip(rounds[mine], rounds[best])]
    return [min(ratios), max(ratios)]


def finish_row(row: dict) -> dict:
    """Add TFLOP/s, each kind's fastest peer and the ratio Triton / fastest peer to ``row`` (which holds
    ``{name}_{kind}_ms`` for triton and the peers that ran), and where it has each round's medians
    (``rounds_ms``) the lowest and highest round's ratio (``{kind}_ratio_range``)."""
    names = ["triton", *row["peers"]]
    flops = {kind: _flops(row["batch"], row["heads"], row["n"], row["d"], row["causal"], kind == "bwd")
             for kind in KINDS}
    for kind in KINDS:
        for name in names:
            row[f"{name}_{kind}_tflops"] = _tflops(flops[kind], row[f"{name}_{kind}_ms"])
        best = max(row["peers"], key=lambda p: row[f"{p}_{kind}_tflops"], default=None)
        row[f"best_{kind}"] = best
        row[f"{kind}_ratio"] = row[f"triton_{kind}_tflops"] / row[f"{best}_{kind}_tflops"] if best else None
        row[f"{kind}_ratio_range"] = _ratio_range(row, f"triton_{kind}_ms", f"{best}_{kind}_ms") if best else None
    if "triton_atomic_bwd_ms" in row:  # --atomic-dq: against the same fastest backward peer
        row["triton_atomic_bwd_tflops"] = _tflops(flops["bwd"], row["triton_atomic_bwd_ms"])
        best = row["best_bwd"]
        row["atomic_bwd_ratio"] = row["triton_atomic_bwd_tflops"] / row[f"{best}_bwd_tflops"] if best else None
        row["atomic_bwd_ratio_range"] = _ratio_range(row, "triton_atomic_bwd_ms", f"{best}_bwd_ms") if best else None
    return row


def bench_one(d: int, n: int, causal: bool, dtype: torch.dtype, *, peers=PEERS, tokens: int = 16384,
              width: int = 2048, atomic_dq: bool = False, rounds: int = 3) -> dict:
    """Time one configuration; returns a dict of times (ms), TFLOP/s, the fastest peers and ratios, the
    peers that could not run (with torch's reason) and the largest output difference from Triton's.
    ``atomic_dq``: also the backward with ``deterministic=False`` (``triton_atomic_bwd_ms``). Each time is
    the median of every call's in ``rounds`` rounds of calls interleaved with the other measurements'
    (:func:`timed_interleaved`); every forward and backward runs once first, so that a peer that cannot run
    is found before the timing starts."""
    from flashverify_kernels.triton import attention as triton_attention

    batch, heads = max(1, tokens // n), max(1, width // d)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, heads, n, d)
    q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    row = {"d": d, "n": n, "causal": causal, "dtype": next(k for k, v in DTYPES.items() if v == dtype),
           "batch": batch, "heads": heads, "device": torch.cuda.get_device_name(), "peers": [],
           "not_run": {}, "max_diff": 0.0, "rounds": rounds}
    measurements = {}

    def measure(name: str, fwd) -> None:
        out = fwd()
        if name != "triton":
            row["max_diff"] = max(row["max_diff"], (out.float() - reference.float()).abs().max().item())
        bwd = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
        bwd()
        torch.cuda.synchronize()
        measurements[f"{name}_fwd_ms"], measurements[f"{name}_bwd_ms"] = fwd, bwd

    # which kernels fa2_forward runs for this row: the Gluon forward and dK/dV kernel on Hopper where they
    # take the call
    rules = dict(device=q.device, dtype=dtype, head_dim=d, scale=d ** -0.5, variant=False, inner_scaled=False,
                 fixed_blocks=False, tensors=(q, k, v))
    row["fwd_kernel"] = "triton" if triton_attention.gluon_forward.unsupported(**rules) else "gluon"
    row["bwd_kernel"] = "triton" if triton_attention.gluon_backward.unsupported(**rules) \
        else "gluon"
    reference = triton_attention.fa2_forward(q, k, v, causal=causal)[0]
    measure("triton", lambda: triton_attention.fa2_forward(q, k, v, causal=causal)[0])
    if atomic_dq:
        atomic_out = triton_attention.fa2_forward(q, k, v, causal=causal, deterministic=False)[0]
        measurements["triton_atomic_bwd_ms"] = lambda: torch.autograd.grad(atomic_out, (q, k, v), dout,
                                                                           retain_graph=True)
    for name in peers:
        try:
            measure(name, PEER_MAKERS[name](q, k, v, causal))
            row["peers"].append(name)
        except Exception as exc:  # noqa: BLE001 - a backend this card or build lacks is reported, not fatal
            row["not_run"][name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}" \
                if str(exc).strip() else type(exc).__name__
            torch.cuda.synchronize()
    row.update(timed_interleaved(measurements, rounds))
    del q, k, v, dout, reference, measurements
    torch.cuda.empty_cache()
    return finish_row(row)


def _ratio(r: dict, kind: str) -> str:
    """The ratio, and in brackets the lowest and highest round's where there were rounds."""
    if r[f"{kind}_ratio"] is None:
        return "-"
    spread = r.get(f"{kind}_ratio_range")
    return f"{r[f'{kind}_ratio']:.2f}" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread and r.get("rounds", 1) > 1
                                         else "")


def _best(r: dict, kind: str) -> str:
    best = r[f"best_{kind}"]
    return f"{r[f'{best}_{kind}_tflops']:.0f} ({best})" if best else "-"


def gluon_env() -> str:
    """The environment variable that turns the Gluon kernels off."""
    from flashverify_kernels.hopper import forward as gluon_forward
    return gluon_forward.ENV_OFF


def markdown(rows: list[dict], header: str) -> str:
    """The two tables: Triton against the fastest peer of each row (with ``--atomic-dq``'s two columns
    when a row has them), then every peer's TFLOP/s."""
    atomic = any("triton_atomic_bwd_tflops" in r for r in rows)
    lines = [header, "",
             "| D | N | B x H | causal | dtype | fwd Triton | fwd fastest peer | fwd ratio "
             "| bwd Triton | bwd fastest peer | bwd ratio |" + (" bwd Triton atomic dQ | its ratio |" if atomic else "")
             + " max\\|dout\\| |",
             "| ---: | ---: | ---: | :---: | :---: | ---: | :--- | ---: | ---: | :--- | ---: |"
             + (" ---: | ---: |" if atomic else "") + " ---: |"]
    for r in rows:
        extra = ""
        if atomic:
            extra = (f" {r['triton_atomic_bwd_tflops']:.0f} | {_ratio(r, 'atomic_bwd')} |"
                     if "triton_atomic_bwd_tflops" in r else " - | - |")
        lines.append(
            f"| {r['d']} | {r['n']} | {r['batch']} x {r['heads']} | {'yes' if r['causal'] else 'no'} | {r['dtype']} "
            f"| {r['triton_fwd_tflops']:.0f}{' (gluon)' if r.get('fwd_kernel') == 'gluon' else ''} "
            f"| {_best(r, 'fwd')} | {_ratio(r, 'fwd')} "
            f"| {r['triton_bwd_tflops']:.0f}{' (gluon)' if r.get('bwd_kernel') == 'gluon' else ''} "
            f"| {_best(r, 'bwd')} | {_ratio(r, 'bwd')} |{extra} {r['max_diff']:.1e} |")
    lines += ["", "TFLOP/s; forward FLOPs 4·B·H·N²·D (halved if causal), backward 2.5× that; "
              "ratio = Triton / the fastest peer of the row (in brackets the lowest and highest round's)."]
    if any(r.get("fwd_kernel") == "gluon" for r in rows):
        lines += ["fwd Triton \"(gluon)\": fa2_forward ran the Gluon forward of flashverify_kernels/hopper/forward.py (Hopper); "
                  f"{gluon_env()}=0 keeps the Triton one."]
    if any(r.get("bwd_kernel") == "gluon" for r in rows):
        lines += ["bwd Triton \"(gluon)\": its dK/dV kernel was the Gluon one of flashverify_kernels/hopper/backward.py (Hopper; "
                  "Delta Triton; the deterministic backward's dQ added by it in a fixed order at head dim 128, by the "
                  f"Triton dQ kernel at 64); {gluon_env()}=0 keeps the Triton one."]
    lines += [""]
    peers = [p for p in PEERS if any(p in r["peers"] or p in r["not_run"] for r in rows)]
    lines += ["Every peer (forward / backward TFLOP/s; - where it did not run):", "",
              "| D | N | causal | dtype | triton | " + " | ".join(peers) + " |",
              "| ---: | ---: | :---: | :---: | ---: | " + " | ".join("---:" for _ in peers) + " |"]
    for r in rows:
        cells = [f"{r[f'{p}_fwd_tflops']:.0f} / {r[f'{p}_bwd_tflops']:.0f}" if p in r["peers"] else "-"
                 for p in peers]
        lines.append(f"| {r['d']} | {r['n']} | {'yes' if r['causal'] else 'no'} | {r['dtype']} "
                     f"| {r['triton_fwd_tflops']:.0f} / {r['triton_bwd_tflops']:.0f} | " + " | ".join(cells) + " |")
    reasons = sorted({(p, why) for r in rows for p, why in r["not_run"].items()})
    if reasons:
        lines += ["", "Not run:", ""] + [f"- {p}: {why}" for p, why in reasons]
    return "\n".join(lines)


def write_atomically(path: str, text: str) -> None:
    """Replace ``path`` by ``text``: written to a temporary file beside it, then renamed over it."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".bench-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashverify_kernels.triton.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the Markdown tables, replaced after each row")
    parser.add_argument("--jsonl", help="one JSON line per row, appended as each is measured")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp16", "bf16"])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--atomic-dq", action="store_true",
                        help="also time the backward with deterministic=False (dQ added with atomics, no dQ "
                             "kernel), in two more columns")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS),
                        help="the peers to time (default: all; none: Triton alone)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of timing per row, each about 100 ms of calls per measurement, the calls "
                             "of all the row's measurements interleaved; each figure is the median of every "
                             "call, the ratio's lowest and highest round shown beside it (default: 3)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: should be 1 or more")
    if not torch.cuda.is_available():
        print("flashverify_kernels.triton.bench needs a CUDA GPU (the compiled Triton kernels and the peers run on one)",
              file=sys.stderr)
        return 2
    import triton

    header = (f"Triton FA2 beside the fastest attention on {torch.cuda.get_device_name()} "
              f"(torch {torch.__version__}, triton {triton.__version__})"
              + (", and its backward with dQ added by atomics (deterministic=False)" if args.atomic_dq else "")
              + f"; each time the median of every call in {args.rounds} round{'s' if args.rounds > 1 else ''} "
              "of calls interleaved with the row's other measurements")
    causal_flags = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows = []
    for d in args.dims:
        for causal in causal_flags:
            for dtype in args.dtypes:
                for n in args.lengths:
                    row = bench_one(d, n, causal, DTYPES[dtype], peers=args.peers, atomic_dq=args.atomic_dq,
                                    rounds=args.rounds)
                    rows.append(row)
                    atomic = f" (atomic dQ {row['triton_atomic_bwd_tflops']:.0f})" if args.atomic_dq else ""
                    print(f"D={d} N={n} causal={causal} {dtype}: fwd ({row['fwd_kernel']}) "
                          f"{row['triton_fwd_tflops']:.0f} vs "
                          f"{_best(row, 'fwd')}, bwd {row['triton_bwd_tflops']:.0f}{atomic} vs {_best(row, 'bwd')} "
                          "TFLOP/s", file=sys.stderr, flush=True)
                    if args.jsonl:
                        with open(args.jsonl, "a") as fh:
                            fh.write(json.dumps(row) + "\n")
                    if args.out:
                        write_atomically(args.out, markdown(rows, header) + "\n")
    print(markdown(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
