"""The cases of the accuracy sweep: shapes x magnitude classes x dtypes x causal, or the variants real kernels
compute, per preset.

A :class:`Sweep` lists its cases (:class:`strategies.cases.AttentionCase`, inputs from the seed, magnitude
classes included), and :data:`PRESETS` name the sweeps of the accuracy report (``python -m verify.accuracy``):
``quick`` and ``gpu`` (the dense grid), ``fa3`` (the FlashAttention-3 paper's accuracy protocol: its input
distribution, the ``fa3_outliers`` class), ``variants`` (:data:`VARIANTS`: packed sequences, a sliding window,
a logit softcap, decoding from a paged KV cache, beside the dense case). The driver (:mod:`verify.accuracy`)
runs them and :mod:`reports.accuracy` renders what it recorded; both read the sweep from here.
"""

from __future__ import annotations

import dataclasses
import json

from references.spec import AttentionSpec
from strategies.cases import FP8_NAMES, AttentionCase

SWEEP_MAGNITUDES = ("normal", "sparse_outliers", "large_logits")


# Adapters to peers measured by default next to the shipped kernels, where they run on the device.
PEERS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_attention")


FA3_MAGNITUDE = "fa3_outliers"


# The implementations of the protocol's table: the paper's baseline (flashverify_kernels/pytorch/standard.py), criterion 1's
# eager attention, the suite's FlashAttention-2 and, where they run, the Triton FA2 and the peers.
FA3_IMPLEMENTATIONS = ("flashverify_kernels.pytorch.standard:STANDARD", "eager", "fa2_blocked")


FA3_IMPLEMENTATIONS_CUDA = (*FA3_IMPLEMENTATIONS, "triton_fa2", *PEERS)


FA3_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")


# The variants the report measures (:func:`variant_case`), the dense case first as the point of comparison.
VARIANTS = ("dense", "packed", "window", "softcap", "paged_decode")


VARIANT_SOFTCAP = 30.0  # Grok-1's attention logit cap (Gemma 2's is 50)


VARIANT_PAGE_SEED = 1  # pages out of order in the cache, as a serving engine hands them out


VARIANT_WORDS = {
    "dense": "one dense batch, none of the variants (the point of comparison)",
    "packed": "variable-length sequences packed one after another (flash_attn's varlen layout, cu_seqlens): "
              "4 sequences of N, N/2 + 3, N/4 + 1 and 1 tokens, each with as many keys as queries",
    "window": "a sliding window of N/4 keys before the diagonal (and N/4 after it without a causal mask)",
    "softcap": f"a logit softcap of {VARIANT_SOFTCAP:g} (scores s -> {VARIANT_SOFTCAP:g} tanh(s / "
               f"{VARIANT_SOFTCAP:g}))",
    "paged_decode": "decoding from a paged KV cache: one query per sequence (Nq = 1), 4 sequences with N, N/2 + 3, "
                    "N/4 + 1 and 1 cached keys, in pages of page_size keys out of order (flash_attn_with_kvcache's "
                    "block table), grouped-query attention with Hkv = H/4 (1 when H < 4)",
}


# The variants preset's implementations: the blocked kernels and eager (every variant), the Triton FA2/FA1
# kernels (dense and packed sequences, windows, softcaps) and Triton's paged decoding (paged_decode only,
# forward only); the report names, variant by variant, each one that was not measured and why.
VARIANT_IMPLEMENTATIONS = ("fa2_blocked", "fa1_blocked", "eager", "triton_fa2", "triton_fa1", "triton_decode")


PRESETS = {
    # Small enough for a CPU in about a minute (the Triton kernels too, in the interpreter).
    "quick": {"lengths": (64, 128), "head_dims": (32,)},
    # The GPU report in docs/: the sequence lengths and head dims of the FlashAttention papers' plots.
    "gpu": {"lengths": (512, 1024, 2048, 4096), "head_dims": (64, 128)},
    # The FlashAttention-3 paper's accuracy protocol (FA3_PAPER_SETUP): its magnitude class, no causal
    # mask, float16 (the paper's), bfloat16 and float8 e4m3 (its FP8 rows; with descales, as every float8
    # case of a sweep), the forward only (Table 3 measures O), three draws of the inputs, 16 heads of dim
    # 128. On a GPU B=4 x N=4096 (16k tokens); on a CPU one sequence of 1024, to run in a minute.
    # ``baselines``: selected to be compared with, not judged: their failed criteria are reported, but do
    # not set the exit status.
    "fa3": {"magnitudes": (FA3_MAGNITUDE,), "causal": (False,), "dtypes": FA3_DTYPES,
            "head_dims": (128,), "heads": 16, "seeds": (0, 1, 2), "backward": False,
            "lengths": (1024,), "batch": 1, "implementations": FA3_IMPLEMENTATIONS, "baselines": ("standard",),
            "cuda": {"lengths": (4096,), "batch": 4, "implementations": FA3_IMPLEMENTATIONS_CUDA}},
    # The variants real kernels compute (VARIANTS), causal, float16 and bfloat16, forward and backward, inputs
    # N(0, 1) and with large logits (where the softcap bites). ``list_all``: the preset's implementations are
    # listed even where they do not run (the Triton kernels on a CPU), each variant's reason in the report.
    "variants": {"variants": VARIANTS, "magnitudes": ("normal", "large_logits"), "causal": (True,),
                 "lengths": (96,), "head_dims": (32,), "heads": 4, "page_size": 16,
                 "implementations": VARIANT_IMPLEMENTATIONS, "list_all": True,
                 "cuda": {"lengths": (4096,), "head_dims": (128,), "heads": 16, "page_size": 256}},
}


def preset(name: str, *, device: str) -> dict:
    """The fields of preset ``name`` on ``device`` (a preset may set other values on a GPU)."""
    fields = dict(PRESETS[name])
    on_device = fields.pop("cuda", {})
    if torch_device_type(device) == "cuda":
        fields.update(on_device)
    return fields


def torch_device_type(device: str) -> str:
    import torch

    return torch.device(device).type


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The cases of a sweep: every combination, ``Nq = Nk = N``, ``Hq = Hkv = heads``; with ``variants``,
    each variant's case (:func:`variant_case`, ``page_size`` for the paged ones) for every combination.
    A float8 dtype's cases have descales (one scale per batch entry and head: ``references/fp8.py``), as
    FlashAttention-3's float8 forward takes its inputs."""

    lengths: tuple[int, ...]
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...] = ("float16", "bfloat16")
    magnitudes: tuple[str, ...] = SWEEP_MAGNITUDES
    causal: tuple[bool, ...] = (False, True)
    batch: int = 1
    heads: int = 2
    seeds: tuple[int, ...] = (0,)
    backward: bool = True
    variants: tuple[str, ...] = ()
    page_size: int = 16

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"variants={unknown}, but should be among {VARIANTS}")

    def cases(self):
        if self.variants:
            return [variant_case(variant, length=n, head_dim=d, dtype=dtype, magnitude=magnitude, causal=causal,
                                 seed=seed, batch=self.batch, heads=self.heads, page_size=self.page_size)
                    for n in self.lengths for d in self.head_dims for variant in self.variants
                    for dtype in self.dtypes for magnitude in self.magnitudes for causal in self.causal
                    for seed in self.seeds]
        return [AttentionCase(batch=self.batch, heads_q=self.heads, heads_kv=self.heads, len_q=n, len_k=n,
                              head_dim=d, dtype=dtype, spec=AttentionSpec(causal=causal), magnitude=magnitude,
                              seed=seed, descale=dtype in FP8_NAMES)
                for n in self.lengths for d in self.head_dims for dtype in self.dtypes
                for magnitude in self.magnitudes for causal in self.causal for seed in self.seeds]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------ variants
def _sequence_lengths(n: int) -> tuple[int, ...]:
    """Four sequence lengths from ``n``: ``n``, ``n/2 + 3``, ``n/4 + 1`` and 1 (lengths that are not
    multiples of a tile or a page, and the shortest; all different for ``n > 6``)."""
    return n, n // 2 + 3, n // 4 + 1, 1


def decode_kv_heads(heads: int) -> int:
    """The key/value heads of the paged decode variant: a grouped-query group of 4 (1 head when fewer)."""
    return heads // 4 if heads % 4 == 0 else 1


def variant_case(variant: str, *, length: int, head_dim: int, dtype: str, magnitude: str = "normal",
                 causal: bool = True, seed: int = 0, batch: int = 1, heads: int = 2, page_size: int = 16):
    """The case of ``variant`` (:data:`VARIANT_WORDS`) at length ``N`` = ``length``. Variable-length
    sequences are one packed batch (``batch = 1``, ``len_q``/``len_k`` the sums of the sequences' lengths,
    as :class:`strategies.cases.AttentionCase` holds them); the others have ``batch`` rows of ``N`` queries
    and keys."""
    n, heads_kv = length, heads
    if variant == "dense":
        spec = AttentionSpec(causal=causal)
    elif variant == "packed":
        lens = _sequence_lengths(n)
        spec = AttentionSpec(causal=causal, sequences="packed", seqlens_q=lens, seqlens_k=lens)
    elif variant == "window":
        width = max(n // 4, 1)
        spec = AttentionSpec(causal=causal, window_left=width, window_right=0 if causal else width)
    elif variant == "softcap":
        spec = AttentionSpec(causal=causal, softcap=VARIANT_SOFTCAP)
    elif variant == "paged_decode":
        lens = _sequence_lengths(n)
        spec = AttentionSpec(causal=causal, sequences="paged", seqlens_q=(1,) * len(lens), seqlens_k=lens,
                             page_size=page_size, page_seed=VARIANT_PAGE_SEED)
        heads_kv = decode_kv_heads(heads)
    else:
        raise ValueError(f"variant={variant!r}, but should be one of {VARIANTS}")
    if spec.varlen:
        batch, len_q, len_k = 1, sum(spec.seqlens_q), sum(spec.seqlens_k)
    else:
        len_q = len_k = n
    return AttentionCase(batch=batch, heads_q=heads, heads_kv=heads_kv, len_q=len_q, len_k=len_k,
                         head_dim=head_dim, dtype=dtype, spec=spec, magnitude=magnitude, seed=seed)


def variant_of(spec) -> str:
    """The variant an :class:`references.spec.AttentionSpec` computes, in :data:`VARIANTS`' words ("dense"
    when none; parts joined with " + " for a spec that has several)."""
    parts = []
    if spec.sequences == "paged":
        parts.append("paged_decode" if set(spec.seqlens_q) == {1} else "paged")
    elif spec.varlen:
        parts.append(spec.sequences)
    for word, present in (("window", spec.windowed), ("chunks", spec.attention_chunk > 0),
                          ("softcap", spec.softcap is not None), ("alibi", spec.alibi_slopes is not None),
                          ("sinks", spec.sinks is not None), ("splits", spec.num_splits > 1)):
        if present:
            parts.append(word)
    return " + ".join(parts) or "dense"


def as_computed_by(case, alignment: str):
    """The sweep's case as a kernel with this causal ``alignment`` computes it (with Nq = Nk, as in the
    dense sweep, both alignments give the same mask: :func:`alignment_matters`)."""
    return case.replace(spec=dataclasses.replace(case.spec, alignment=alignment))


def alignment_matters(case) -> bool:
    """Whether the two causal alignments give ``case`` different attention: only through a diagonal (the
    causal mask, a window, chunks, ALiBi), and only where the two put it on different keys (``Nq != Nk``,
    in a dense batch or in a sequence)."""
    spec = case.spec
    if not (spec.causal or spec.windowed or spec.attention_chunk or spec.alibi_slopes is not None):
        return False
    bottom, top = (dataclasses.replace(spec, alignment=a).diagonal(case.len_q, case.len_k)
                   for a in ("bottom_right", "top_left"))
    return not bool((bottom == top).all())


def case_key(spec: str, case: dict) -> str:
    return spec + " " + json.dumps(case, sort_keys=True, separators=(",", ":"))
