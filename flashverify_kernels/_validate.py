"""Input validation shared by the shipped kernels: clear exceptions before any work starts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``float16`` for ``torch.float16``: how messages name a dtype."""
    return str(dtype).removeprefix("torch.")


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(dtype_name(d) for d in dtypes)


def check_window(window_size, *, kernel: str) -> tuple[int, int]:
    """``window_size`` as ``(left, right)``: a pair of ints >= -1 (-1 unbounded, flash_attn's convention)."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    if not ok:
        raise ValueError(f"{kernel}: window_size={window_size!r}, but should be a pair (left, right) of ints >= -1 "
                         "(-1: unbounded)")
    return int(window_size[0]), int(window_size[1])


def check_softcap(softcap, *, kernel: str) -> float:
    """``softcap`` as a float: a finite number >= 0 (flash_attn's convention: 0.0 means no softcap)."""
    if (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap)
            or softcap < 0):
        raise ValueError(f"{kernel}: softcap={softcap!r}, but should be a finite number >= 0 (0.0: no softcap; "
                         "c > 0: scores s become c * tanh(s / c))")
    return float(softcap)


def check_alibi_slopes(alibi_slopes, q: torch.Tensor, *, kernel: str,
                       batch: int | None = None) -> torch.Tensor | None:
    """``alibi_slopes`` (flash_attn's convention): None, or a float32 tensor of finite slopes on ``q``'s
    device, shaped ``[Hq]`` (one slope per query head) or ``[B, Hq]`` (per batch and head; ``batch``: the
    sequences of a packed batch, else ``q``'s batch). Call it after :func:`check_attention_inputs` (``q`` is a
    valid 4-D tensor)."""
    if alibi_slopes is None:
        return None
    b, hq = (q.shape[0] if batch is None else batch), q.shape[1]
    allowed = (f"a float32 torch.Tensor of shape [Hq]=[{hq}] or [B, Hq]=[{b}, {hq}] on q's device {q.device}, "
               "or None (no ALiBi)")
    if not isinstance(alibi_slopes, torch.Tensor):
        raise ValueError(f"{kernel}: alibi_slopes is a {type(alibi_slopes).__name__}, but should be {allowed}")
    if alibi_slopes.dtype != torch.float32:
        raise ValueError(f"{kernel}: alibi_slopes.dtype={dtype_name(alibi_slopes.dtype)}, but should be {allowed}")
    if tuple(alibi_slopes.shape) not in ((hq,), (b, hq)):
        raise ValueError(f"{kernel}: alibi_slopes.shape={tuple(alibi_slopes.shape)}, but should be {allowed}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"{kernel}: alibi_slopes is on {alibi_slopes.device}, but should be {allowed}")
    if not bool(torch.isfinite(alibi_slopes).all()):
        raise ValueError(f"{kernel}: alibi_slopes holds non-finite values {alibi_slopes.tolist()}, but should be "
                         f"finite: {allowed}")
    return alibi_slopes


def check_block(name: str, value, *, kernel: str, allowed: Iterable[int] | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{kernel}: {name}={value!r}, but should be a positive int")
    if allowed is not None and value not in tuple(allowed):
        raise ValueError(f"{kernel}: {name}={value}, but should be one of {tuple(allowed)}")
    return value


def check_attention_inputs(q, k, v, *, kernel: str, dtypes: Iterable[torch.dtype],
                           devices: Iterable[str] = ("cpu", "cuda"), gqa: bool = True,
                           head_dims: Iterable[int] | None = None,
                           scale: float | None = None, head_dim_v: bool = False) -> float:
    """Validate ``q, k, v`` against the contract and return the softmax scale to use.

    ``head_dim_v``: the kernel takes a value head dim of its own (``v`` is ``[B, Hkv, Nk, Dv]`` with ``Dv``
    other than ``q``'s and ``k``'s ``D``, as multi-head latent attention's 192/128); ``head_dims`` then
    bounds both. The default scale is ``1/sqrt(D)``, from the q/k head dim, whatever ``Dv`` is.
    Raises TypeError for non-tensors, ValueError for wrong ranks, shapes, dtypes, devices, head dims.
    """
    dtypes = tuple(dtypes)
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kernel}: {label} is a {type(t).__name__}, but should be a torch.Tensor")
        if t.dim() != 4:
            raise ValueError(
                f"{kernel}: {label}.shape={tuple(t.shape)}, but should be 4-D [batch, heads, seq_len, head_dim]"
            )
        if t.dtype not in dtypes:
            raise ValueError(
                f"{kernel}: {label}.dtype={dtype_name(t.dtype)}, "
                f"but should be one of {dtype_names(dtypes)}"
            )
        if t.device.type not in tuple(devices):
            raise ValueError(
                f"{kernel}: {label} is on {t.device}, but this kernel runs on {', '.join(devices)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"{kernel}: q, k, v dtypes are {dtype_names((q.dtype, k.dtype, v.dtype))}, but should be equal"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"{kernel}: q, k, v are on {q.device}, {k.device}, {v.device}, but should share a device")
    b, hq, _, d = q.shape
    bk, hkv, _, dk = k.shape
    dv = v.shape[-1]
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{kernel}: k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} should agree in "
                         "[batch, heads, seq_len]")
    if dv != dk and not head_dim_v:
        raise ValueError(f"{kernel}: k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} should be equal: this "
                         f"kernel takes no value head dim of its own (v's {dv} against q's and k's {dk})")
    if bk != b:
        raise ValueError(f"{kernel}: q has batch {b} but k and v have batch {bk}; they should be equal")
    if dk != d:
        raise ValueError(f"{kernel}: q has head_dim {d} but k has head_dim {dk}; they should be equal")
    for label, dim in (("head_dim", d), ("v's head_dim", dv)):
        if dim < 1:
            raise ValueError(f"{kernel}: {label}={dim}, but should be at least 1")
        if head_dims is not None:
            allowed = tuple(head_dims)
            if dim not in allowed:
                lo, hi = min(allowed), max(allowed)
                raise ValueError(f"{kernel}: {label}={dim} is not supported; supported head dims are {lo}..{hi}"
                                 f" ({len(allowed)} values: {allowed[:6]}{'...' if len(allowed) > 6 else ''})")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(
            f"{kernel}: q has {hq} heads and k, v have {hkv}; the query heads should be a multiple of the key/value heads"
        )
    if hkv != hq and not gqa:
        raise ValueError(f"{kernel}: grouped-query attention (q has {hq} heads, k, v have {hkv}) is not supported")
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{kernel}: scale={scale!r}, but should be a finite float or None (1/sqrt(head_dim))")
    return float(scale)


def check_backward_inputs(q, k, v, out, lse, dout, *, kernel: str) -> None:
    """Validate the extra tensors of a direct backward call."""
    for label, t in (("out", out), ("lse", lse), ("dout", dout)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kernel}: {label} is a {type(t).__name__}, but should be a torch.Tensor")
        if t.device != q.device:
            raise ValueError(f"{kernel}: {label} is on {t.device}, but q is on {q.device}")
    want = (*q.shape[:3], v.shape[-1])
    if tuple(out.shape) != want or tuple(dout.shape) != want:
        raise ValueError(
            f"{kernel}: out.shape={tuple(out.shape)} and dout.shape={tuple(dout.shape)} should be {want} (q's "
            "[batch, heads_q, len_q] and v's head_dim)"
        )
    if lse.shape != q.shape[:3]:
        raise ValueError(f"{kernel}: lse.shape={tuple(lse.shape)}, but should be {tuple(q.shape[:3])}")
    if dout.dtype != q.dtype or out.dtype != q.dtype:
        raise ValueError(f"{kernel}: out and dout should have q's dtype {q.dtype}, got {out.dtype} and {dout.dtype}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, last)`` a tensor's elements can occupy (non-negative strides)."""
    start = t.data_ptr()
    last = start + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * t.element_size()
    return start, last + t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory spans overlap (conservative: interleaved views count as overlapping)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def check_out_buffers(q, k, v, out, lse, *, kernel: str, lse_dtypes: Iterable[torch.dtype]) -> None:
    """Validate caller-provided output buffers (``out=``, ``lse=``; either may be None).

    Any strides are accepted (views into larger buffers, transposed storage). Raises TypeError for
    non-tensors and ValueError for a wrong shape, dtype or device, a buffer that requires grad, one whose
    elements overlap each other (stride 0, an expanded view), or one overlapping q, k, v or the other.
    """
    lse_dtypes = tuple(lse_dtypes)
    wanted = {"out": ((*q.shape[:3], v.shape[-1]), (q.dtype,), "q's [batch, heads_q, len_q] and v's head_dim"),
              "lse": (tuple(q.shape[:3]), lse_dtypes, "q's shape without head_dim [batch, heads_q, len_q]")}
    given = [(label, t) for label, t in (("out", out), ("lse", lse)) if t is not None]
    for label, t in given:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kernel}: {label}= is a {type(t).__name__}, but should be a torch.Tensor or None")
        shape, dtypes, words = wanted[label]
        if tuple(t.shape) != shape:
            raise ValueError(f"{kernel}: {label}.shape={tuple(t.shape)}, but should be {shape} ({words})")
        if t.dtype not in dtypes:
            raise ValueError(f"{kernel}: {label}.dtype={dtype_name(t.dtype)}, but should be "
                             f"{dtype_names(dtypes)} for {dtype_name(q.dtype)} inputs")
        if t.device != q.device:
            raise ValueError(f"{kernel}: {label} is on {t.device}, but should be on q's device {q.device}")
        if t.requires_grad:
            raise ValueError(f"{kernel}: {label} requires grad; pass a buffer that does not (gradients flow "
                             "to q, k, v through the returned out)")
        for dim, (n, s) in enumerate(zip(t.shape, t.stride())):
            if n > 1 and s == 0:
                raise ValueError(f"{kernel}: {label} has stride 0 in dim {dim} (size {n}): an expanded view "
                                 "whose elements overlap cannot be written; any other strides are allowed")
        for other_label, other in (("q", q), ("k", k), ("v", v)):
            if _overlaps(t, other):
                raise ValueError(f"{kernel}: {label} overlaps {other_label} in memory; the kernel reads "
                                 f"{other_label} while it writes {label}: pass a separate buffer")
    if out is not None and lse is not None and _overlaps(out, lse):
        raise ValueError(f"{kernel}: out and lse overlap in memory: pass separate buffers")


# --- variants: chunks, sinks, split-KV and the sequences of variable-length and paged attention --------------
def check_descales(q: torch.Tensor, k: torch.Tensor, descales, *, kernel: str):
    """Validate float8 inputs' ``(q_descale, k_descale, v_descale)`` (any may be None: a factor of 1) and return
    them: each a float32 ``[B, Hkv]`` tensor on q's device with finite positive entries; only with float8
    q, k, v (``torch.float8_e4m3fn``, ``torch.float8_e5m2``)."""
    given = [(name, d) for name, d in zip(("q_descale", "k_descale", "v_descale"), descales) if d is not None]
    if given and q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{kernel}: {', '.join(name for name, _ in given)} given with {dtype_name(q.dtype)} inputs; "
                         "descales come with float8 inputs (float8_e4m3fn, float8_e5m2) only")
    b, hkv = q.shape[0], k.shape[1]
    for name, d in given:
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{kernel}: {name} is a {type(d).__name__}, but should be a torch.Tensor")
        if tuple(d.shape) != (b, hkv):
            raise ValueError(f"{kernel}: {name}.shape={tuple(d.shape)}, but should be [batch, kv_heads] = [{b}, {hkv}]")
        if d.dtype != torch.float32:
            raise ValueError(f"{kernel}: {name}.dtype={dtype_name(d.dtype)}, but should be float32")
        if d.device != q.device:
            raise ValueError(f"{kernel}: {name} is on {d.device}, but should be on q's device {q.device}")
        if d.numel() and not bool((torch.isfinite(d) & (d > 0)).all()):
            raise ValueError(f"{kernel}: {name} holds {d.flatten()[~(torch.isfinite(d.flatten()) & (d.flatten() > 0))][0].item()!r}, "
                             "but should hold finite positive factors")
    return tuple(descales)


def check_attention_chunk(chunk, *, kernel: str) -> int:
    """``attention_chunk`` (FlashAttention-3's convention): an int >= 0, 0 meaning no chunks."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"{kernel}: attention_chunk={chunk!r}, but should be an int >= 0 (0: no chunks; C > 0: a "
                         "query sees only the keys of its own chunk of C positions)")
    return chunk


def check_sinks(sinks, q: torch.Tensor, *, kernel: str) -> torch.Tensor | None:
    """``sinks``: None, or a tensor ``[Hq]`` of finite logits on ``q``'s device, float32 (float64 for float64
    inputs), one per query head. Call it after :func:`check_attention_inputs` (``q`` is valid)."""
    if sinks is None:
        return None
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq = q.shape[-2] if q.dim() == 3 else q.shape[1]
    allowed = f"a {dtype_name(dtype)} torch.Tensor of shape [Hq]=[{hq}] on q's device {q.device}, or None (no sinks)"
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"{kernel}: sinks is a {type(sinks).__name__}, but should be {allowed}")
    if sinks.dtype != dtype or tuple(sinks.shape) != (hq,) or sinks.device != q.device:
        raise ValueError(f"{kernel}: sinks is a {dtype_name(sinks.dtype)} tensor of shape {tuple(sinks.shape)} on "
                         f"{sinks.device}, but should be {allowed}")
    if not bool(torch.isfinite(sinks.detach()).all()):
        raise ValueError(f"{kernel}: sinks holds non-finite values {sinks.tolist()}, but should be finite: {allowed}")
    return sinks


def check_num_splits(num_splits, *, kernel: str) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{kernel}: num_splits={num_splits!r}, but should be an int >= 1 (1: no split-KV)")
    return num_splits


NO_WINDOW = (-1, -1)


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a call computes beyond causal attention, validated once for every shipped kernel (the blocked
    PyTorch kernels, the Triton forward and backward, Triton's decoding): the sliding window ``(left, right)``
    (-1 unbounded), the chunk width (0: none), the softcap (0.0: none), the ALiBi slopes and sinks tensors (or
    None) and the number of KV splits. The keywords it comes from are the ones the suite passes for the
    spec's variants (``flashverify_kernels.declaration.CAPABILITIES``)."""

    window: tuple[int, int] = NO_WINDOW
    chunk: int = 0
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    splits: int = 1

    @property
    def plain(self) -> bool:
        """No variant at all: plain (causal or not) attention."""
        return (self.window == NO_WINDOW and not self.chunk and not self.softcap and self.alibi_slopes is None
                and self.sinks is None and self.splits == 1)


def variant(q: torch.Tensor, *, kernel: str, window_size=NO_WINDOW, attention_chunk=0, softcap=0.0,
            alibi_slopes=None, sinks=None, num_splits=1, batch: int | None = None) -> Variant:
    """The call's :class:`Variant` from its keywords, each checked with a clear error (``q`` a valid query
    tensor ``[B, Hq, N, D]`` for the slopes' and sinks' shapes; ``batch``: the sequences of a packed batch,
    which per-sequence ``[S, Hq]`` slopes follow)."""
    return Variant(window=check_window(window_size, kernel=kernel),
                   chunk=check_attention_chunk(attention_chunk, kernel=kernel),
                   softcap=check_softcap(softcap, kernel=kernel),
                   alibi_slopes=check_alibi_slopes(alibi_slopes, q, kernel=kernel, batch=batch),
                   sinks=check_sinks(sinks, q, kernel=kernel),
                   splits=check_num_splits(num_splits, kernel=kernel))


def _int32_vector(name: str, t, *, device, kernel: str, length: int | None = None) -> list[int]:
    words = f"an int32 torch.Tensor{'' if length is None else f' of shape [{length}]'} on {device}"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{kernel}: {name} is a {type(t).__name__}, but should be {words}")
    if t.dtype != torch.int32 or t.dim() != 1 or t.device != device or (length is not None and t.numel() != length):
        raise ValueError(f"{kernel}: {name} is a {dtype_name(t.dtype)} tensor of shape {tuple(t.shape)} on {t.device}, "
                         f"but should be {words}")
    return [int(x) for x in t.tolist()]


def check_cu_seqlens(name: str, cu, *, total: int, device, kernel: str) -> list[int]:
    """``cu_seqlens_q`` / ``cu_seqlens_k`` (flash_attn's convention): int32 ``[S + 1]`` on the inputs'
    device, starting at 0, non-decreasing (empty sequences allowed), ending at the packed length."""
    values = _int32_vector(name, cu, device=device, kernel=kernel)
    if len(values) < 2:
        raise ValueError(f"{kernel}: {name} has {len(values)} entries, but should have S + 1 >= 2 (0, then where each "
                         "of the S sequences ends)")
    if values[0] != 0:
        raise ValueError(f"{kernel}: {name}={values}, but should start at 0")
    bad = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if bad:
        raise ValueError(f"{kernel}: {name}={values} decreases at entry {bad[0]} ({values[bad[0] - 1]} -> "
                         f"{values[bad[0]]}), but should be non-decreasing (a sequence's length is the difference)")
    if values[-1] != total:
        raise ValueError(f"{kernel}: {name}={values} ends at {values[-1]}, but the packed tensor holds {total} rows: "
                         "the last entry should be the total length")
    return values


def check_max_seqlen(name: str, value, lengths: list[int], *, kernel: str) -> int:
    """``max_seqlen_q`` / ``max_seqlen_k``: an int at least the longest sequence."""
    longest = max(lengths, default=0)
    if isinstance(value, bool) or not isinstance(value, int) or value < longest:
        raise ValueError(f"{kernel}: {name}={value!r}, but should be an int >= the longest sequence, {longest}")
    return value


def check_seqlens(name: str, t, *, batch: int, most: int, device, kernel: str) -> list[int]:
    """``seqlens_q`` / ``seqlens_k`` of padded sequences or a KV cache: int32 ``[S]``, each in ``0 .. most``
    (the padded length, or the keys the cache's pages hold)."""
    values = _int32_vector(name, t, device=device, kernel=kernel, length=batch)
    bad = [(i, n) for i, n in enumerate(values) if not 0 <= n <= most]
    if bad:
        i, n = bad[0]
        raise ValueError(f"{kernel}: {name}[{i}]={n}, but every length should be in 0..{most} (what the tensor holds)")
    return values


def check_block_table(table, *, batch: int, num_pages: int, page_size: int, seqlens_k: list[int], device,
                      kernel: str) -> list[list[int]]:
    """``block_table`` of a paged KV cache: int32 ``[S, max pages]`` on the inputs' device; sequence ``s``'s
    first ``ceil(seqlens_k[s] / page_size)`` entries are pages in ``0 .. num_pages - 1``."""
    words = f"an int32 torch.Tensor [S={batch}, max pages] on {device}"
    if not isinstance(table, torch.Tensor):
        raise ValueError(f"{kernel}: block_table is a {type(table).__name__}, but should be {words}")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != batch or table.device != device:
        raise ValueError(f"{kernel}: block_table is a {dtype_name(table.dtype)} tensor of shape {tuple(table.shape)} "
                         f"on {table.device}, but should be {words}")
    rows = table.tolist()
    for s, (row, n) in enumerate(zip(rows, seqlens_k)):
        used = -(-n // page_size)
        if used > len(row):
            raise ValueError(f"{kernel}: seqlens_k[{s}]={n} needs {used} pages of {page_size}, but block_table has "
                             f"{len(row)} entries per sequence")
        bad = [(i, p) for i, p in enumerate(row[:used]) if not 0 <= p < num_pages]
        if bad:
            i, p = bad[0]
            raise ValueError(f"{kernel}: block_table[{s}, {i}]={p} points past the cache: pages are 0..{num_pages - 1}")
    return rows
