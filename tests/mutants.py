"""Deliberately broken variants of the blocked FA2 kernel, for the mutation self-check.

Each variant is the source of ``flashverify_kernels/pytorch/blocked.py`` with one small textual change (the kind of bug
people really write), loaded as its own module. Every variant is an attribute of this module, so the
suite can be pointed at it like at any outside kernel::

    pytest verify --impl tests/mutants.py:causal_off_by_one --hypothesis-profile=ci

A change whose original text no longer occurs exactly as many times as expected raises at import:
when the kernel is edited, the self-check cannot silently turn into a no-op.

``python tests/mutants.py`` runs the suite against every variant (one session, :func:`run_all`) and prints a
Markdown table of the property each one fails first.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flashverify_kernels.pytorch import blocked  # noqa: E402
from flashverify_kernels.registry import Implementation, registry  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    old: str
    new: str
    occurrence: int | None = None  # which occurrence to change (0-based); None: the text must be unique


MUTATIONS = (
    Mutation("causal_off_by_one", "key i + Nk - Nq is hidden from query i",
             "return cols <= rows + (len_k - len_q)", "return cols < rows + (len_k - len_q)"),
    Mutation("causal_top_left", "causal mask aligned top-left instead of bottom-right",
             "return cols <= rows + (len_k - len_q)", "return cols <= rows"),
    Mutation("causal_block_skip_off_by_one", "the KV loop stops one key early for the last row of a tile",
             "return max(0, min(len_k, m1 + len_k - len_q))", "return max(0, min(len_k, m1 - 1 + len_k - len_q))"),
    Mutation("no_accumulator_rescale", "the accumulator is not rescaled when the running max grows",
             "acc = acc * alpha[..., None] + pv", "acc = acc + pv"),
    Mutation("no_l_rescale", "the running sum l is not rescaled when the running max grows",
             "l_i = l_i * alpha + p.sum(dim=-1)", "l_i = l_i + p.sum(dim=-1)"),
    Mutation("lse_base2", "LSE written in base 2",
             "torch.where(empty, NEG_INF, m_i + torch.log(l_i))",
             "torch.where(empty, NEG_INF, (m_i + torch.log(l_i)) / math.log(2.0))"),
    Mutation("lse_without_max", "LSE = log(l), the running max left out",
             "torch.where(empty, NEG_INF, m_i + torch.log(l_i))", "torch.where(empty, NEG_INF, torch.log(l_i))"),
    Mutation("scale_from_padded_head_dim", "default scale 1/sqrt of the head dim padded to a power of two",
             "return 1.0 / math.sqrt(head_dim)", "return 1.0 / math.sqrt(1 << (head_dim - 1).bit_length())"),
    Mutation("no_max_subtraction", "scores exponentiated without subtracting the running max",
             "m_ref = torch.where(m_new == NEG_INF, 0.0, m_new)", "m_ref = torch.zeros_like(m_new)", occurrence=0),
    Mutation("mask_by_multiplication", "masked scores multiplied by 0 instead of set to -inf",
             "s = s.masked_fill(~visible, NEG_INF)", "s = s * visible"),
    Mutation("partial_last_key_block_dropped", "keys of a partial last key block are ignored",
             "for n0 in range(k0, min(k1, kv_end), block_n):",
             "for n0 in range(k0, min(k1, kv_end, len_k - len_k % block_n), block_n):"),
    Mutation("low_precision_accumulator", "the output accumulator rounded to the input dtype every step",
             "acc = acc * alpha[..., None] + pv", "acc = (acc * alpha[..., None] + pv).to(q.dtype).to(acc_dtype)"),
    Mutation("fully_masked_rows_nan", "rows with no visible key divide 0 by 0",
             "parts.append((acc / torch.where(empty, 1.0, l_i)[..., None],", "parts.append((acc / l_i[..., None],"),
    Mutation("gqa_wrong_head_mapping", "query head h reads K/V head h % Hkv instead of h // group",
             "return t.repeat_interleave(group, dim=1) if group > 1 else t",
             "return t.repeat(1, group, 1, 1) if group > 1 else t"),
    Mutation("dkdv_not_summed_over_group", "GQA: dK/dV keep the first query head of a group only",
             "return grad.view(b, heads_kv, hq // heads_kv, n, d).sum(dim=2)",
             "return grad.view(b, heads_kv, hq // heads_kv, n, d)[:, :, 0]"),
    Mutation("delta_dropped", "backward uses Delta = 0",
             "delta = (do * out.to(acc_dtype)).sum(dim=-1)",
             "delta = torch.zeros(do.shape[:3], dtype=acc_dtype, device=q.device)"),
    Mutation("dk_without_scale", "dK misses the softmax scale",
             "dk[:, :, n0:n1] = dk_acc * scale", "dk[:, :, n0:n1] = dk_acc"),
    Mutation("backward_skips_visible_q_tiles", "backward starts at the Q tile of row n0, ignoring Nk - Nq",
             "first_row = max(0, n0 - (len_k - len_q))", "first_row = max(0, n0)"),
    # Bugs that live in one boundary class (strategies/attention.py): none of these inputs was drawn
    # before each property drew its own cases from the shape classes.
    Mutation("ignores_storage_offset", "K is read from the start of its storage (a packed qkv's k is q)",
             "k_all, v_all = _expand_kv(k, hq), _expand_kv(v, hq)",
             "k_all, v_all = _expand_kv(k.as_strided(k.shape, k.stride(), 0), hq), _expand_kv(v, hq)",
             occurrence=0),
    Mutation("decode_gqa_wrong_heads", "a decode fast path (Nq = 1) maps query head h to K/V head h % Hkv",
             "k_all, v_all = _expand_kv(k, hq), _expand_kv(v, hq)",
             "k_all, v_all = ((k.repeat(1, hq // k.shape[1], 1, 1), v.repeat(1, hq // v.shape[1], 1, 1))\n"
             "                    if len_q == 1 else (_expand_kv(k, hq), _expand_kv(v, hq)))", occurrence=0),
    Mutation("masked_q_tiles_skipped", "a Q tile that sees no key is skipped: out and lse are never written",
             "kv_end = _kv_end(m1, len_q, len_k, causal)\n        parts = []",
             "kv_end = _kv_end(m1, len_q, len_k, causal)\n        if kv_end == 0:\n            continue\n"
             "        parts = []"),
    Mutation("scale_rounded_to_float16", "the softmax scale rounded to float16 before use (a bug found in a public "
             "Triton kernel): every score is off by up to 2^-11 of itself",
             "return _default_scale(q.shape[-1]) if scale is None else float(scale)",
             "return float(torch.tensor(_default_scale(q.shape[-1]) if scale is None else float(scale)).half())"),
    Mutation("negative_scale_as_positive", "the softmax scale's sign is dropped",
             "return _default_scale(q.shape[-1]) if scale is None else float(scale)",
             "return _default_scale(q.shape[-1]) if scale is None else abs(float(scale))"),
    Mutation("keys_beyond_64_dropped", "the KV loop stops at 64 keys (a fixed-size bound)",
             "for n0 in range(k0, min(k1, kv_end), block_n):", "for n0 in range(k0, min(k1, kv_end, 64), block_n):"),
    Mutation("window_off_by_one", "the sliding window's left edge lets in one key too many",
             "inside &= cols >= rows - left", "inside &= cols >= rows - left - 1"),
    Mutation("window_top_left", "the sliding window placed around the top-left diagonal (i, not i + Nk - Nq)",
             "rows = torch.arange(m0, m1, device=device)[:, None] + (len_k - len_q)",
             "rows = torch.arange(m0, m1, device=device)[:, None]"),
    Mutation("softcap_after_masking", "the softcap applied after the masks: a hidden score -inf becomes -c",
             "s = _modify(s, m0, m1, n0, n1, len_q, len_k, var.softcap, var.slopes)\n"
             "                s = _mask(s, causal, m0, m1, n0, n1, len_q, len_k, var.window, var.chunk)",
             "s = _mask(s, causal, m0, m1, n0, n1, len_q, len_k, var.window, var.chunk)\n"
             "                s = _modify(s, m0, m1, n0, n1, len_q, len_k, var.softcap, var.slopes)", occurrence=0),
    Mutation("softcap_wrong_sign", "the softcap's tanh taken of -s / c: every capped score changes sign",
             "s = softcap * torch.tanh(s / softcap)", "s = softcap * torch.tanh(-s / softcap)"),
    Mutation("softcap_backward_no_chain_rule", "the backward leaves out softcap's 1 - tanh^2",
             "ds = torch.where(p > 0, ds * (1.0 - torch.tanh(raw / var.softcap) ** 2), 0.0)", "ds = ds"),
    Mutation("alibi_slope_of_wrong_head", "ALiBi slopes read in reverse head order (head h gets Hq - 1 - h's)",
             "slopes = alibi_slopes.to(acc_dtype)", "slopes = alibi_slopes.to(acc_dtype).flip(-1)"),
    Mutation("alibi_top_left", "ALiBi distances around the top-left diagonal (|i - j|, not |i + Nk - Nq - j|)",
             "rows = torch.arange(m0, m1, device=s.device)[:, None] + (len_k - len_q)",
             "rows = torch.arange(m0, m1, device=s.device)[:, None]"),
    # Bugs of the variants real kernels compute (varlen, paged KV, split-KV, sinks, chunks): each lives in
    # what that variant adds, so only a case that has the variant can show it.
    Mutation("varlen_keys_from_cu_seqlens_q", "packed sequences: each sequence's keys start at its cu_seqlens_q "
             "entry instead of its cu_seqlens_k entry",
             "return [t[a:b].transpose(0, 1)[None] for a, b in zip(self.ck, self.ck[1:])]",
             "return [t[a:a + (d - c)].transpose(0, 1)[None] for a, c, d in zip(self.cq, self.ck, self.ck[1:])]"),
    Mutation("paged_logical_pages", "paged KV: a sequence's logical page index used as the physical page (the "
             "block table is not read)",
             "pages = torch.tensor(self.table[s][:used], dtype=torch.long, device=t.device)",
             "pages = torch.arange(used, device=t.device)"),
    Mutation("split_merge_log2", "split-KV: the merge weighs the splits by exp2 of natural-log LSE differences",
             "out = sum(torch.exp(lse_t - lse_ref)[..., None] * out_t for out_t, lse_t in parts)",
             "out = sum(torch.exp2(lse_t - lse_ref)[..., None] * out_t for out_t, lse_t in parts)"),
    Mutation("sink_missing_from_denominator", "sinks: the running sum starts at 0, not at the sink's exp(0) = 1",
             "return sink[None, :, None].expand(shape).clone(), torch.ones(shape, dtype=acc_dtype, device=device)",
             "return sink[None, :, None].expand(shape).clone(), torch.zeros(shape, dtype=acc_dtype, device=device)"),
    Mutation("chunks_top_left", "chunked attention: chunks placed around the top-left diagonal (i, not i + Nk - Nq)",
             "position = torch.arange(m0, m1, device=device)[:, None] + len_k - len_q",
             "position = torch.arange(m0, m1, device=device)[:, None]"),
    # Bugs of the shapes production models run, which only the draws past the few reach: a group above 4
    # query heads per KV head, and more than 64 splits.
    Mutation("gqa_large_group_packed_by_4", "GQA: a group above 4 heads is packed 4 query heads to a tile and each "
             "tile reads the K/V head of its first query head as if the group were a multiple of 4",
             "    return t.repeat_interleave(group, dim=1) if group > 1 else t",
             "    if group > 4:\n"
             "        return t[:, torch.arange(heads_q, device=t.device) // 4 * 4 // group]\n"
             "    return t.repeat_interleave(group, dim=1) if group > 1 else t"),
    Mutation("split_partials_in_64_slots", "split-KV: the partials live in 64 slots indexed by split % 64 (a "
             "workspace sized for 64 splits): past 64 splits the later, empty ones overwrite the first",
             "            parts.append((acc / torch.where(empty, 1.0, l_i)[..., None],\n"
             "                          torch.where(empty, NEG_INF, m_i + torch.log(l_i))))",
             "            parts[run % 64:run % 64 + 1] = [(acc / torch.where(empty, 1.0, l_i)[..., None],\n"
             "                                            torch.where(empty, NEG_INF, m_i + torch.log(l_i)))]"),
    # Bugs of a value head dim of its own (multi-head latent attention): with v as wide as q and k they change
    # nothing.
    Mutation("scale_from_value_head_dim", "the default scale taken as 1/sqrt of v's head dim instead of q's and k's",
             "return _default_scale(q.shape[-1]) if scale is None else float(scale)",
             "return _default_scale(v.shape[-1]) if scale is None else float(scale)"),
    Mutation("delta_over_query_head_dim", "the backward's Delta = rowsum(dO * O) summed over q's head dim, not v's",
             "delta = (do * out.to(acc_dtype)).sum(dim=-1)",
             "delta = (do[..., :d] * out.to(acc_dtype)[..., :d]).sum(dim=-1)"),
    # Bugs of float8 inputs with descales: without descales (or with every factor 1) they change nothing.
    Mutation("k_descale_from_q", "float8: the scores scaled by q's descale twice, k's never",
             ") * _descale_heads(kd, hq, q.device)", ") * _descale_heads(qd, hq, q.device)"),
    Mutation("v_descale_dropped", "float8: v's descale never multiplies the output",
             "out[:, :, m0:m1] = (o * v_factor).to(out.dtype)", "out[:, :, m0:m1] = o.to(out.dtype)"),
    Mutation("second_head_dim_half_not_rescaled", "for D > 64 the accumulator's second half is not rescaled",
             "acc = acc * alpha[..., None] + pv",
             "acc = torch.cat([acc[..., :64] * alpha[..., None], acc[..., 64:]], dim=-1) + pv"),
)


def _mutated_source(m: Mutation) -> str:
    source = Path(blocked.__file__).read_text(encoding="utf-8")
    count = source.count(m.old)
    if m.occurrence is None and count != 1:
        raise RuntimeError(f"mutation {m.name}: expected the text once in flashverify_kernels/pytorch/blocked.py, found it {count} times")
    if m.occurrence is not None and count <= m.occurrence:
        raise RuntimeError(f"mutation {m.name}: occurrence {m.occurrence} requested, text found {count} times")
    start = -1
    for _ in range((m.occurrence or 0) + 1):
        start = source.index(m.old, start + 1)
    return source[:start] + m.new + source[start + len(m.old):]


def _load(name: str, source: str):
    spec = importlib.util.spec_from_loader(f"flashverify_mutant_{name}", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = f"<mutant {name} of flashverify_kernels/pytorch/blocked.py>"
    sys.modules[spec.name] = module  # dataclasses look their module up there
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102 - our own kernel source
    return module


def _declare(name: str, module, what: str) -> Implementation:
    """The shipped ``fa2_blocked`` declaration, with the variant's forward and backward."""
    return dataclasses.replace(registry()["fa2_blocked"], name=f"mutant_{name}", forward=module.fa2_forward,
                               backward=module.fa2_backward, description=what)


# The unchanged kernel loaded through the same machinery: it must pass.
unmutated = _declare("unmutated", _load("unmutated", Path(blocked.__file__).read_text(encoding="utf-8")),
                     "the blocked FA2, unchanged")
VARIANTS: dict[str, Implementation] = {}
for _m in MUTATIONS:
    VARIANTS[_m.name] = _declare(_m.name, _load(_m.name, _mutated_source(_m)), _m.what)
    globals()[_m.name] = VARIANTS[_m.name]


@dataclasses.dataclass
class Outcome:
    name: str
    returncode: int
    seconds: float
    first_failure: str | None
    output: str


def _verify(names: list[str], report_dir: str | os.PathLike, *args: str) -> tuple[int, float, str]:
    """``pytest verify`` under the ci profile on the variants ``names`` in a subprocess (one torch thread), out, the
    LSE and the gradients first (tests/accuracy_first.py: the order changes no verdict, only how soon a variant's
    run stops at its failure); (exit status, seconds, output)."""
    impls = [arg for name in names for arg in ("--impl", f"tests/mutants.py:{name}")]
    cmd = [sys.executable, "-m", "pytest", "verify", *impls, "-q", "--hypothesis-profile=ci",
           "-p", "tests.accuracy_first", "-p", "no:cacheprovider", "--report-dir", str(report_dir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    return proc.returncode, time.perf_counter() - start, proc.stdout + proc.stderr


def run_variant(name: str, *, report_dir: str | os.PathLike, extra: tuple[str, ...] = ()) -> Outcome:
    """Run ``pytest verify --impl tests/mutants.py:NAME -x`` (:func:`_verify`), ``extra`` appended."""
    returncode, seconds, output = _verify([name], report_dir, "-x", *extra)
    found = re.search(r"^FAILED verify/\S+::(test_\w+)\[", output, flags=re.MULTILINE)
    return Outcome(name, returncode, seconds, found.group(1) if found else None, output)


@dataclasses.dataclass
class Session:
    """One ``pytest verify`` session over many variants (:func:`run_all`)."""
    returncode: int
    seconds: float
    output: str
    failures: dict[str, list[dict]]  # variant name -> the failure files (failures/*.json) of its tests
    verdicts: dict[str, str]  # variant name -> the session's count of its tests ("149 passed, 3 skipped")


def run_all(names: list[str], *, report_dir: str | os.PathLike) -> Session:
    """Run ``pytest verify`` (:func:`_verify`) on every variant of ``names`` in one session, each variant stopped at
    its first failing test (tests/first_failure_per_kernel.py: ``-x`` per kernel)."""
    returncode, seconds, output = _verify(names, report_dir, "-p", "tests.first_failure_per_kernel")
    failures: dict[str, list[dict]] = {name: [] for name in names}
    for path in sorted(Path(report_dir, "failures").glob("*.json")):
        failure = json.loads(path.read_text(encoding="utf-8"))
        failures.setdefault(str(failure["implementation"]).removeprefix("mutant_"), []).append(failure)
    verdicts = {m.group(1): m.group(2) for m in re.finditer(r"^flashverify: mutant_(\w+): (.*)$", output, re.MULTILINE)}
    return Session(returncode, seconds, output, failures, verdicts)


def main() -> int:
    import tempfile

    rows = ["| variant | what it breaks | first property that failed |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        session = run_all(["unmutated", *VARIANTS], report_dir=tmp)
    ok = session.returncode == 1 and not session.failures["unmutated"]
    for m in (Mutation("unmutated", "nothing (must pass)", "", ""), *MUTATIONS):
        failed = session.failures.get(m.name) or []
        ok &= bool(failed) != (m.name == "unmutated")
        rows.append(f"| {m.name} | {m.what} | {failed[0]['property'] if failed else 'passed'} |")
    print("\n".join(rows))
    print(f"{session.seconds:.0f} s, pytest exit status {session.returncode}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
