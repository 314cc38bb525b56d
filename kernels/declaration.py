"""What a kernel under test declares: :class:`Implementation`, its errors and its allowed values.

Only the declaration type lives here; it imports no kernel module. The declarations of the shipped
kernels are in :mod:`kernels.registry` (``SHIPPED``), which re-exports everything defined here: users
write ``from kernels.registry import Implementation``. What each field unlocks is described in
:mod:`kernels.registry`'s docstring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kernels._validate import dtype_name, dtype_names
from references.spec import ALIGNMENTS, AttentionSpec, require_spec

ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KINDS = ("attention", "softmax")


class ImplementationError(ValueError):
    """An implementation declaration or an ``--impl`` specification is invalid."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One kernel under test and what it declares it supports.

    Attention kernels (``kind="attention"``):
      forward(q, k, v, *, causal, scale[, block_m, block_n][, out, lse]) -> (out, lse) or out
      backward(q, k, v, out, lse, dout, *, causal, scale[, block_m, block_n]) -> (dq, dk, dv, delta)
    Softmax kernels (``kind="softmax"``):
      forward(x[, block_n=...]) -> (y, lse) over the last dimension of a 2-D float tensor.
    """

    name: str
    forward: Callable[..., Any]
    kind: str = "attention"
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    devices: tuple[str, ...] = ("cpu", "cuda")
    # Head dims accepted: None means any positive head dim.
    head_dims: Sequence[int] | None = None
    gqa: bool = False
    causal: bool = True
    causal_alignment: str = "bottom_right"
    # Tunable tiles: the block sizes the suite may draw (None: not tunable).
    block_m: Sequence[int] | None = None
    block_n: Sequence[int] | None = None
    returns_lse: bool = True
    autograd: bool = True
    backward: Callable[..., Any] | None = None
    # Repeated calls on the same inputs give bitwise identical results (see kernels/registry.py's docstring).
    deterministic: bool = True
    # The forward accepts out= and lse= views into caller buffers and writes its results there.
    out_buffers: bool = False
    # Largest sequence length and head dim the suite should try (None: no limit of the kernel's own).
    max_seq_len: int | None = None
    # Most (query tiles) x (key tiles) per head the suite should draw, for a kernel whose tile loop
    # runs in Python (one launch per tile: its time grows with the tile count, not the work); None: the
    # profile's own cap (verify/profiles.py).
    max_tiles: int | None = None
    # Cap on Hypothesis examples per property (for slow environments such as the Triton interpreter).
    max_examples: int | None = None
    # Dtypes for which the environment, not the kernel, makes results meaningless, with the reason
    # (for example the Triton interpreter's bfloat16 tl.dot). Properties skip these with the reason.
    environment_limits: tuple[tuple[torch.dtype, str], ...] = ()
    description: str = ""
    # Name of an implementation computing the same function another way (FA1 vs FA2): the suite
    # checks that the two agree when both are selected.
    sibling: str | None = None
    # How the user named it with --impl (for replay commands); None for registry names.
    selector: str | None = None
    # Part of the default selection (shipped kernels); adapters to peers run when named.
    in_default: bool = True

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ImplementationError(f"name={self.name!r}, but should be a non-empty string")
        if not callable(self.forward):
            raise ImplementationError(f"{self.name}: forward={self.forward!r} is not callable")
        if self.kind not in KINDS:
            raise ImplementationError(f"{self.name}: kind={self.kind!r}, but should be one of {KINDS}")
        if self.causal_alignment not in ALIGNMENTS:
            raise ImplementationError(
                f"{self.name}: causal_alignment={self.causal_alignment!r}, but should be one of {ALIGNMENTS}"
            )
        bad = [d for d in self.dtypes if d not in ALL_DTYPES]
        if bad or not self.dtypes:
            raise ImplementationError(f"{self.name}: dtypes={self.dtypes!r}; allowed: {ALL_DTYPES}")
        for field in ("block_m", "block_n"):
            sizes = getattr(self, field)
            if sizes is not None and (len(sizes) == 0 or any(int(s) < 1 for s in sizes)):
                raise ImplementationError(f"{self.name}: {field}={sizes!r} must hold positive ints")
        for field in ("max_seq_len", "max_tiles"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ImplementationError(f"{self.name}: {field}={value!r}, but should be a positive int or None")
        if self.backward is not None and not callable(self.backward):
            raise ImplementationError(f"{self.name}: backward={self.backward!r} is not callable")

    @property
    def tunable(self) -> bool:
        return self.block_m is not None and self.block_n is not None

    @property
    def exposes_delta(self) -> bool:
        return self.backward is not None

    @property
    def cli_name(self) -> str:
        """What to pass to --impl to select this implementation again."""
        return self.selector or self.name

    def environment_limit(self, dtype: torch.dtype) -> str | None:
        for d, why in self.environment_limits:
            if d == dtype:
                return why
        return None

    def supports_head_dim(self, d: int) -> bool:
        return self.head_dims is None or d in self.head_dims

    def unsupported(self, *, dtype: torch.dtype | None = None, device: str | None = None) -> str | None:
        """The reason this implementation cannot run with these settings, or None if it can."""
        if dtype is not None and dtype not in self.dtypes:
            return f"{self.name} declares dtypes {dtype_names(self.dtypes)}; {dtype_name(dtype)} is not among them"
        if device is not None and torch.device(device).type not in self.devices:
            return f"{self.name} declares devices {', '.join(self.devices)}; {device} is not among them"
        return None

    def unsupported_spec(self, spec: AttentionSpec) -> str | None:
        """The reason this implementation cannot compute the attention ``spec`` describes, or None."""
        if spec.causal and not self.causal:
            return f"{self.name} declares no causal masking"
        if spec.causal and spec.alignment != self.causal_alignment:
            return (f"{self.name} aligns causal masks {self.causal_alignment}; the case asks for "
                    f"{spec.alignment}")
        return None

    def _keywords(self, spec: AttentionSpec, scale, block_m, block_n) -> dict[str, Any]:
        """The kernel's own keywords for ``spec`` (refused when the declaration does not support it)."""
        require_spec(spec)
        why = self.unsupported_spec(spec)
        if why is not None:
            raise ImplementationError(why)
        kwargs: dict[str, Any] = {"causal": spec.causal, "scale": scale}
        if self.tunable and block_m is not None:
            kwargs["block_m"] = block_m
        if self.tunable and block_n is not None:
            kwargs["block_n"] = block_n
        return kwargs

    def call_backward(self, q, k, v, out, lse, dout, *, spec: AttentionSpec, scale: float | None = None,
                      block_m: int | None = None, block_n: int | None = None):
        """Run the declared backward on ``spec``'s attention: ``(dq, dk, dv, delta)``."""
        if self.backward is None:
            raise ImplementationError(f"{self.name} declares no backward")
        return self.backward(q, k, v, out, lse, dout, **self._keywords(spec, scale, block_m, block_n))

    def call(self, q, k, v, *, spec: AttentionSpec, scale: float | None = None,
             block_m: int | None = None, block_n: int | None = None,
             out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """Run the forward on the attention ``spec`` describes and normalise the result to
        ``(out, lse_or_None)``. The spec becomes the kernel's own keywords (``causal``); a spec the
        declaration does not support is refused. ``out``/``lse`` are passed on as the forward's
        ``out=``/``lse=`` buffers; only for a declaration with ``out_buffers``."""
        kwargs = self._keywords(spec, scale, block_m, block_n)
        if out is not None or lse is not None:
            if not self.out_buffers:
                raise ImplementationError(f"{self.name} declares no out_buffers: its forward takes no "
                                          "out=/lse= buffers")
            if out is not None:
                kwargs["out"] = out
            if lse is not None:
                kwargs["lse"] = lse
        result = self.forward(q, k, v, **kwargs)
        if isinstance(result, torch.Tensor):
            return result, None
        if isinstance(result, (tuple, list)) and len(result) == 2:
            return result[0], result[1]
        if isinstance(result, (tuple, list)) and len(result) == 1:
            return result[0], None
        raise TypeError(
            f"{self.name} returned {type(result).__name__}"
            f"{f' of length {len(result)}' if isinstance(result, (tuple, list)) else ''}, "
            "but should return out or (out, lse)"
        )

