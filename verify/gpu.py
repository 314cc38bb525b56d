"""Device memory and device faults of a ``pytest verify`` run on a GPU.

Memory budget. Workers of ``pytest -n K`` that share one GPU share its memory: each gets a budget, the
free memory of the device when the run starts (or ``--gpu-memory GIB``, to emulate a smaller card)
divided by the number of workers on that device, less :data:`CONTEXT_RESERVE` for what every process
holds outside PyTorch's caching allocator (its CUDA context, library workspaces, compiled Triton
modules). The budget is enforced with ``torch.cuda.set_per_process_memory_fraction``, so one worker's
allocation fails in that worker instead of starving the others, and it sets how large a drawn case may
get (:func:`limits_within`): ``max_scores`` is what the suite's own work per example
(:func:`suite_peak_bytes`) fits in the budget, ``max_len`` at most twice its square root. Under
pytest-xdist the controller measures the free memory once, before any worker starts, and hands the plan
to every worker, replacements included; without xdist the process measures it itself.

Between tests the plugin resets the peak-memory counter, reads the test's peak
(``torch.cuda.max_memory_allocated``) into the report, and returns the cached blocks to the device.

Sticky CUDA errors. Some CUDA errors (an illegal memory access, a launch failure, a device-side assert,
"unknown error") leave the process's CUDA context unusable: every later CUDA call in it fails too.
:func:`sticky_cuda_error` recognises them; the plugin then fails the test with its case, marks the
process poisoned and ends it after its report is written (see ``verify/failures.py``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

from strategies.attention import ROW_HEADS, Limits

GIB = 2 ** 30
MIB = 2 ** 20

# Per process, outside the caching allocator's cap: the CUDA context (300-600 MiB on recent cards),
# cuBLAS/cuDNN workspaces and compiled Triton modules.
CONTEXT_RESERVE = 1 * GIB
# Below this, a worker cannot hold even the smallest cases of every property with room to spare.
MIN_WORKER_BUDGET = 256 * MIB
# Bytes per score element of the suite's own work per example: about twenty float64 [B, Hq, Nq, Nk]
# tensors alive at once (reference probabilities and their gradient, baseline, bounds, masks).
BYTES_PER_SCORE = 8 * 20
# Bytes per row element (B * Hq * (Nq + Nk) * D): q, k, v, out, dout and their gradients in float64,
# the kernel's copies, the reference's accumulators. The most measured: a float64 decode step of a group
# of 64 query heads on one KV head (gqa_gradients_sum_over_group on the eager kernel, which copies K and
# V per query head, twice over, with their gradients) holds about 31 such float64 tensors, 248 bytes per
# element of its rows; such a case, one query against many keys, is drawn within half the rows
# (``strategies.attention``: the decode and long_context classes), 124 bytes per element of the most.
BYTES_PER_ROW_ELEMENT = 8 * 24
# Bytes per element of a split-KV kernel's partial outputs (num_splits * B * Hq * Nq * D, float64 at most),
# which it holds until it merges them; the strategies keep them within ``Limits.max_rows`` elements.
BYTES_PER_PARTIAL = 8
# The longest length a budget allows is at most this (a time limit, not a memory one: the gpu profile's
# tests must finish in minutes).
MAX_LEN_CEILING = 8192


def suite_peak_bytes(*, batch: int, heads_q: int, len_q: int, len_k: int, head_dim: int,
                     num_splits: int = 1) -> int:
    """Estimated peak device memory (bytes) of the suite's own work on one example of this shape:
    ``BYTES_PER_SCORE * B*Hq*Nq*Nk + BYTES_PER_ROW_ELEMENT * B*Hq*(Nq+Nk)*D``, and with split-KV
    ``BYTES_PER_PARTIAL * num_splits * B*Hq*Nq*D`` for the kernel's partial outputs.

    A documented over-estimate for the whole example, the kernel's own memory included (a kernel that
    is not fused, like the eager one checked as a kernel, holds its score matrices; the references work in
    row chunks, whose peak ``references.attention.peak_bytes`` estimates without the kernel and inputs).
    The one function to swap for a measured estimate: the limits follow it.
    """
    for name, value in (("batch", batch), ("heads_q", heads_q), ("len_q", len_q), ("len_k", len_k),
                        ("head_dim", head_dim)):
        if value < 0:
            raise ValueError(f"{name}={value}, but should be at least 0")
    rows = batch * heads_q
    partials = BYTES_PER_PARTIAL * num_splits * rows * len_q * head_dim if num_splits > 1 else 0
    return (BYTES_PER_SCORE * rows * len_q * len_k + BYTES_PER_ROW_ELEMENT * rows * (len_q + len_k) * head_dim
            + partials)


class BudgetError(ValueError):
    """A memory budget that cannot be: ``--gpu-memory`` beyond the card, not positive, or too small to share."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """One worker's share of one device's memory."""

    device: int  # CUDA device index
    total_bytes: int  # the card's memory
    usable_bytes: int  # what the run may use on this device: its free memory at start, or --gpu-memory
    workers: int  # workers sharing the device
    worker_bytes: int  # this worker's cap on PyTorch's allocator
    source: str  # how usable_bytes was chosen, in words

    @property
    def fraction(self) -> float:
        """The argument of ``torch.cuda.set_per_process_memory_fraction``."""
        return self.worker_bytes / self.total_bytes

    def describe(self) -> str:
        return (f"cuda:{self.device}: {self.worker_bytes / GIB:.2f} GiB per worker ({self.source}; "
                f"{self.usable_bytes / GIB:.1f} GiB / {self.workers} worker(s) - "
                f"{CONTEXT_RESERVE / GIB:g} GiB each outside the allocator; card {self.total_bytes / GIB:.1f} GiB)")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "fraction": self.fraction}


def plan_budget(*, device: int, total_bytes: int, free_bytes: int, workers: int,
                gpu_memory_gib: float | None = None) -> Budget:
    """The budget of each of ``workers`` workers on one device with ``total_bytes`` of memory, of which
    ``free_bytes`` are free at the start; ``gpu_memory_gib`` caps what the run uses (a smaller card)."""
    if workers < 1:
        raise BudgetError(f"workers={workers}, but should be at least 1")
    if total_bytes <= 0:
        raise BudgetError(f"cuda:{device} reports {total_bytes} bytes of memory")
    source = "free memory at start"
    usable = max(0, min(free_bytes, total_bytes))
    if gpu_memory_gib is not None:
        if not math.isfinite(gpu_memory_gib) or gpu_memory_gib <= 0:
            raise BudgetError(f"--gpu-memory {gpu_memory_gib:g}: the memory cap must be a positive number of GiB")
        cap = int(gpu_memory_gib * GIB)
        if cap > total_bytes:
            raise BudgetError(f"--gpu-memory {gpu_memory_gib:g} GiB is more than cuda:{device} has "
                              f"({total_bytes / GIB:.1f} GiB)")
        if cap <= usable:
            usable, source = cap, f"--gpu-memory {gpu_memory_gib:g}"
        else:
            source = (f"--gpu-memory {gpu_memory_gib:g}, but only {usable / GIB:.1f} GiB were free at start, "
                      "so the free memory")
    worker = usable // workers - CONTEXT_RESERVE
    if worker < MIN_WORKER_BUDGET:
        raise BudgetError(f"cuda:{device}: {usable / GIB:.2f} GiB ({source}) shared by {workers} worker(s) leaves "
                          f"{max(worker, 0) / GIB:.2f} GiB per worker after {CONTEXT_RESERVE / GIB:g} GiB each "
                          f"outside the allocator; at least {MIN_WORKER_BUDGET / GIB:.2f} GiB is needed: "
                          "use fewer workers (-n) or more memory")
    return Budget(device=device, total_bytes=total_bytes, usable_bytes=usable, workers=workers,
                  worker_bytes=worker, source=source)


def workers_on_device(*, device: int, workers: int, device_count: int, spread: bool) -> int:
    """How many of ``workers`` pytest-xdist workers share ``device``: all of them, or with ``spread``
    (worker ``gwN`` on device ``N mod device_count``) those whose index falls on it."""
    if workers < 1:
        raise ValueError(f"workers={workers}, but should be at least 1")
    if not spread or device_count < 2:
        return workers
    return max(1, len(range(device, workers, device_count)))


def max_scores_within(worker_bytes: int, limits: Limits) -> int:
    """The largest ``B*Hq*Nq*Nk`` whose :func:`suite_peak_bytes` fits in ``worker_bytes`` with the
    largest row term ``limits`` allow (every batch and head at ``max_len`` and ``max_head_dim``)."""
    heads = min(limits.max_batch * limits.max_heads_kv * limits.max_group, limits.max_batch_heads, ROW_HEADS)
    rows = suite_peak_bytes(batch=1, heads_q=heads, len_q=limits.max_len, len_k=limits.max_len,
                            head_dim=limits.max_head_dim) - BYTES_PER_SCORE * heads * limits.max_len ** 2
    rows += BYTES_PER_PARTIAL * limits.max_rows  # the most split-KV partial outputs a case may hold
    return max(0, (worker_bytes - rows) // BYTES_PER_SCORE)


def limits_within(limits: Limits, budget: Budget, *, from_budget: bool) -> Limits:
    """``limits`` fitted to one worker's budget.

    ``max_len`` is the longest length (at most :data:`MAX_LEN_CEILING` under ``from_budget``, the gpu
    profile, else the profile's own) at most twice the square root of the ``max_scores`` that fits beside
    its row term (:func:`max_scores_within`); ``max_scores`` is what the budget then holds, and without
    ``from_budget`` no more than the profile's own.
    """
    ceiling = MAX_LEN_CEILING if from_budget else limits.max_len

    def scores_at(max_len: int) -> int:
        return max_scores_within(budget.worker_bytes, dataclasses.replace(limits, max_len=max_len))

    def fits(max_len: int) -> bool:
        scores = scores_at(max_len)
        return scores >= 1 and max_len <= max(1, 2 * math.isqrt(scores))

    if not fits(1):
        raise BudgetError(f"{budget.describe()} holds no case at all (the suite needs "
                          f"{suite_peak_bytes(batch=1, heads_q=1, len_q=1, len_k=1, head_dim=1)} bytes for the smallest)")
    lo, hi = 1, ceiling  # fits() holds up to some length and fails beyond it: find the last that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    scores = scores_at(lo)
    if not from_budget:
        scores = min(scores, limits.max_scores)
    fitted = dataclasses.replace(limits, max_len=lo, max_scores=scores)
    if hasattr(limits, "short_len"):  # the plain class's length stays within max_len
        fitted = dataclasses.replace(fitted, short_len=min(limits.short_len, lo))
    return fitted


# --- the device (the only functions here that call torch.cuda) --------------------------------------------

def memory_at_start(device: int) -> tuple[int, int]:
    """``(free, total)`` bytes of CUDA device ``device`` now (``torch.cuda.mem_get_info``)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


# The share of a worker's budget the float64 reference's row chunks may take (references/attention.py:
# DEFAULT_BUDGET_BYTES, never lowered below its default): larger chunks cost less Python and launch overhead.
REFERENCE_CHUNK_SHARE = 8


def apply_budget(budget: Budget) -> None:
    """Cap this process's caching allocator on ``budget.device`` at the worker's budget: an allocation
    past it raises ``torch.OutOfMemoryError`` in this process, and the other workers keep their share.
    The reference's row chunks get ``1 / REFERENCE_CHUNK_SHARE`` of it."""
    import torch

    from references import attention as reference

    torch.cuda.set_per_process_memory_fraction(budget.fraction, budget.device)
    reference.DEFAULT_BUDGET_BYTES = max(reference.DEFAULT_BUDGET_BYTES, budget.worker_bytes // REFERENCE_CHUNK_SHARE)


def start_test(device: int) -> None:
    """Reset the peak-memory counter of ``device`` (before a test)."""
    import torch

    torch.cuda.reset_peak_memory_stats(device)


def end_test(device: int) -> int:
    """The peak bytes allocated on ``device`` since :func:`start_test`; then return the cached blocks
    to the device (after collecting the cycles tracebacks make), so the next test starts empty."""
    import gc

    import torch

    peak = int(torch.cuda.max_memory_allocated(device))
    gc.collect()
    torch.cuda.empty_cache()
    return peak


# --- sticky CUDA errors --------------------------------------------------------------------------------

# Messages of CUDA errors that corrupt the context (CUDA's "sticky" errors), as torch, Triton and the
# driver API word them.
STICKY_PATTERNS = (
    r"illegal memory access", r"unspecified launch failure", r"device-side assert",
    r"misaligned address", r"illegal instruction", r"invalid program counter", r"hardware stack error",
    r"launch timed out", r"uncorrectable ECC error", r"CUDA error: unknown error",
    r"\[CUDA\]: unknown error", r"CUDA_ERROR_(ILLEGAL_ADDRESS|LAUNCH_FAILED|ASSERT|MISALIGNED_ADDRESS|"
    r"ILLEGAL_INSTRUCTION|HARDWARE_STACK_ERROR|LAUNCH_TIMEOUT|ECC_UNCORRECTABLE|UNKNOWN)",
)
_STICKY = re.compile("|".join(STICKY_PATTERNS), re.IGNORECASE)


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, the exceptions of a group, and what each was raised from or during, each once."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [*(getattr(e, "exceptions", ()) or ()), e.__cause__, e.__context__]


def sticky_cuda_error(exc: BaseException | None) -> BaseException | None:
    """The exception in ``exc`` (itself, in a group, or one it was raised from) whose message is a
    sticky CUDA error, or None. An out-of-memory error is not one (the context survives it), nor is a
    property's own failure (an ``AssertionError``, whose message may quote anything)."""
    for e in exception_chain(exc):
        if isinstance(e, Exception) and not isinstance(e, AssertionError) and _STICKY.search(str(e)):
            return e
    return None
