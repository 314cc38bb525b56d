"""How a case's tensors reach a kernel, and how its results come back: dense, packed, padded, paged.

The suite holds every case in the references' frame (``references.spec``): ``[B, H, N, D]`` tensors,
and for variable-length sequences one packed batch, ``[1, H, total, D]``, the sequences one after
another. A kernel takes them in its own convention, the spec's ``sequences``:

``dense``   ``q [B, Hq, Nq, D]``, ``k``, ``v [B, Hkv, Nk, D]``, as the references hold them.
``packed``  flash_attn's variable-length layout: ``q [total_q, Hq, D]``, ``k``, ``v [total_k, Hkv, D]``
            (contiguous, the sequences one after another), with ``cu_seqlens_q``, ``cu_seqlens_k`` (int32
            ``[S + 1]``, 0 first) and ``max_seqlen_q``, ``max_seqlen_k`` (ints). Returns ``out [total_q, Hq,
            D]`` and ``lse [Hq, total_q]``.
``padded``  one row of a batch per sequence: ``q [S, Hq, max Nq, D]``, ``k``, ``v [S, Hkv, max Nk, D]``
            with ``seqlens_q``, ``seqlens_k`` (int32 ``[S]``); sequence ``s`` holds its first
            ``seqlens_q[s]`` query rows and ``seqlens_k[s]`` keys, the rest is padding. Returns
            ``out [S, Hq, max Nq, D]`` and ``lse [S, Hq, max Nq]``; their padding rows are not compared.
``paged``   flash_attn_with_kvcache's KV cache: ``q [S, Hq, Nq, D]`` (one length for every sequence),
            ``k``, ``v [num_pages, page_size, Hkv, D]`` read through ``block_table`` (int32 ``[S,
            max pages]``: sequence ``s``'s key ``j`` is slot ``j % page_size`` of page
            ``block_table[s, j // page_size]``) and ``seqlens_k`` (int32 ``[S]``, the cache lengths).
            Returns ``out [S, Hq, Nq, D]`` and ``lse [S, Hq, Nq]``.

Every convention keeps canaries where a kernel must not read: NaN in the rows after a packed tensor's
last sequence (inside the same buffer), in a padded tensor's padding, in the unused slots of a sequence's
last page and in the pages no sequence uses, to which the block table's unused entries point. The page
order is the spec's ``page_seed``: 0 keeps the pages in the sequences' order, any other value permutes
them (with one to three unused pages among them).

The conversions are differentiable (indexing and copies), so gradients reach the references' frame
through autograd, and :meth:`Layout.queries_in` / :meth:`Layout.keys_out` convert a declared backward's
inputs and results. A result of the wrong shape raises :class:`ContractError`, naming what was expected.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from references.spec import AttentionSpec, require_spec

# NaN rows after a packed tensor's last sequence, in the same buffer.
PACKED_SLACK = 2


class ContractError(TypeError):
    """A kernel's result does not have the shape its convention asks for."""


def _nan_buffer(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.full(shape, math.nan, dtype=like.dtype, device=like.device)


def _ints(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def _expect(what: str, t, shape: tuple[int, ...], words: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ContractError(f"{what} is a {type(t).__name__}, but should be a torch.Tensor {list(shape)} ({words})")
    if tuple(t.shape) != tuple(shape):
        raise ContractError(f"{what}.shape={tuple(t.shape)}, but should be {tuple(shape)} ({words})")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The conversions of one spec's convention (module docstring). ``q``-like tensors (q, out, dout,
    dq) are ``[1, H, total_q, D]`` in the references' frame, ``k``-like ones (k, v, dk, dv) ``[1, H,
    total_k, D]``, row-like ones (lse, Delta) ``[1, H, total_q]``; dense cases pass unchanged."""

    spec: AttentionSpec

    def __post_init__(self) -> None:
        require_spec(self.spec)

    @property
    def words(self) -> str:
        return f"{self.spec.sequences} sequences"

    # ------------------------------------------------------------------------------ geometry
    def _rows(self, lens, device):
        """``(sequence, row)`` int64 ``[total]``: where each packed row sits in a padded batch."""
        seq = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        starts = torch.tensor(self.spec._cumulative(lens)[:-1], device=device)
        return seq, torch.arange(seq.numel(), device=device) - starts[seq]

    def pages(self, device=None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(block_table [S, max pages] int32, slot [total_k] int64, num_pages)``: the page table and, for
        every packed key, its slot in the flat ``[num_pages * page_size]`` cache."""
        spec, size = self.spec, self.spec.page_size
        counts = [-(-n // size) for n in spec.seqlens_k]
        logical = sum(counts)
        if spec.page_seed == 0:
            extra = 1
            physical = torch.arange(logical + extra)
        else:
            extra = 1 + spec.page_seed % 3
            physical = torch.randperm(logical + extra, generator=torch.Generator().manual_seed(spec.page_seed))
        unused = int(physical[logical])  # the block table's unused entries point at a page of NaN
        width = max(1, max(counts))
        table = torch.full((len(counts), width), unused, dtype=torch.int64)
        start = 0
        for s, n in enumerate(counts):
            table[s, :n] = physical[start:start + n]
            start += n
        seq, key = self._rows(spec.seqlens_k, "cpu")
        slot = table[seq, key // size] * size + key % size
        return table.to(device=device, dtype=torch.int32), slot.to(device), logical + extra

    # ------------------------------------------------------------------------------ into the kernel
    def inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``(q, k, v, keywords)`` as the kernel takes them: the tensors and the convention's keywords."""
        spec = self.spec
        if not spec.varlen:
            return q, k, v, {}
        spec.check_lengths(q.shape[2], k.shape[2])
        device = q.device
        keywords: dict = {}
        if spec.sequences == "packed":
            keywords = {"cu_seqlens_q": _ints(spec.cu_seqlens_q, device), "cu_seqlens_k": _ints(spec.cu_seqlens_k, device),
                        "max_seqlen_q": max(spec.seqlens_q), "max_seqlen_k": max(spec.seqlens_k)}
        elif spec.sequences == "padded":
            keywords = {"seqlens_q": _ints(spec.seqlens_q, device), "seqlens_k": _ints(spec.seqlens_k, device)}
        else:
            table, _, _ = self.pages(device)
            keywords = {"block_table": table, "seqlens_k": _ints(spec.seqlens_k, device)}
        return self.queries_in(q), self.keys_in(k), self.keys_in(v), keywords

    def queries_in(self, t: torch.Tensor) -> torch.Tensor:
        """A ``q``-like tensor ``[1, H, total_q, D]`` in the kernel's convention."""
        spec = self.spec
        if not spec.varlen:
            return t
        rows = t[0].transpose(0, 1)  # [total_q, H, D]
        if spec.sequences == "packed":
            buf = _nan_buffer((rows.shape[0] + PACKED_SLACK, *rows.shape[1:]), t)
            buf[:rows.shape[0]] = rows
            return buf[:rows.shape[0]]
        if spec.sequences == "padded":
            seq, row = self._rows(spec.seqlens_q, t.device)
            buf = _nan_buffer((len(spec.seqlens_q), t.shape[1], max(spec.seqlens_q), t.shape[3]), t)
            buf[seq, :, row] = rows
            return buf
        n = spec.seqlens_q[0]  # paged: one query length for every sequence
        return rows.reshape(len(spec.seqlens_q), n, *rows.shape[1:]).transpose(1, 2)

    def keys_in(self, t: torch.Tensor) -> torch.Tensor:
        """A ``k``-like tensor ``[1, H, total_k, D]`` in the kernel's convention."""
        spec = self.spec
        if not spec.varlen:
            return t
        rows = t[0].transpose(0, 1)  # [total_k, H, D]
        if spec.sequences == "packed":
            buf = _nan_buffer((rows.shape[0] + PACKED_SLACK, *rows.shape[1:]), t)
            buf[:rows.shape[0]] = rows
            return buf[:rows.shape[0]]
        if spec.sequences == "padded":
            seq, row = self._rows(spec.seqlens_k, t.device)
            buf = _nan_buffer((len(spec.seqlens_k), t.shape[1], max(spec.seqlens_k), t.shape[3]), t)
            buf[seq, :, row] = rows
            return buf
        _, slot, num_pages = self.pages(t.device)
        buf = _nan_buffer((num_pages * spec.page_size, *rows.shape[1:]), t)
        buf[slot] = rows
        return buf.view(num_pages, spec.page_size, *rows.shape[1:])

    def rows_in(self, t: torch.Tensor) -> torch.Tensor:
        """A row-like tensor ``[1, H, total_q]`` (the LSE) in the kernel's convention."""
        spec = self.spec
        if not spec.varlen:
            return t
        if spec.sequences == "packed":
            return t[0]
        return self.queries_in(t[..., None])[..., 0]

    # ------------------------------------------------------------------------------ back from the kernel
    def queries_out(self, t, *, what: str, heads: int, head_dim: int) -> torch.Tensor:
        """A ``q``-like result of the kernel (``out``, ``dq``) in the references' frame."""
        spec = self.spec
        if not spec.varlen:
            return t
        total, s = sum(spec.seqlens_q), len(spec.seqlens_q)
        if spec.sequences == "packed":
            _expect(what, t, (total, heads, head_dim), self.words)
            rows = t
        elif spec.sequences == "padded":
            _expect(what, t, (s, heads, max(spec.seqlens_q), head_dim), self.words)
            seq, row = self._rows(spec.seqlens_q, t.device)
            rows = t[seq, :, row]
        else:
            _expect(what, t, (s, heads, spec.seqlens_q[0], head_dim), self.words)
            rows = t.transpose(1, 2).reshape(total, heads, head_dim)
        return rows.transpose(0, 1)[None]

    def keys_out(self, t, *, what: str, heads: int, head_dim: int) -> torch.Tensor:
        """A ``k``-like result of the kernel (``dk``, ``dv``) in the references' frame."""
        spec = self.spec
        if not spec.varlen:
            return t
        total, s = sum(spec.seqlens_k), len(spec.seqlens_k)
        if spec.sequences == "packed":
            _expect(what, t, (total, heads, head_dim), self.words)
            rows = t
        elif spec.sequences == "padded":
            _expect(what, t, (s, heads, max(spec.seqlens_k), head_dim), self.words)
            seq, row = self._rows(spec.seqlens_k, t.device)
            rows = t[seq, :, row]
        else:
            _, slot, num_pages = self.pages(t.device)
            _expect(what, t, (num_pages, spec.page_size, heads, head_dim), self.words)
            rows = t.reshape(num_pages * spec.page_size, heads, head_dim)[slot]
        return rows.transpose(0, 1)[None]

    def rows_out(self, t, *, what: str, heads: int) -> torch.Tensor:
        """A row-like result of the kernel (``lse``, Delta) in the references' frame."""
        spec = self.spec
        if not spec.varlen:
            return t
        total, s = sum(spec.seqlens_q), len(spec.seqlens_q)
        if spec.sequences == "packed":
            _expect(what, t, (heads, total), self.words)
            return t[None]
        width = max(spec.seqlens_q) if spec.sequences == "padded" else spec.seqlens_q[0]
        _expect(what, t, (s, heads, width), self.words)
        return self.queries_out(t[..., None], what=what, heads=heads, head_dim=1)[..., 0]


def layout(spec: AttentionSpec) -> Layout:
    """The conversions of ``spec``'s convention."""
    return Layout(spec)
