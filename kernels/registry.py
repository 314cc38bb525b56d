"""Registry of attention and softmax implementations under test.

Note
----
Why it exists: the suite checks kernels it has never seen. Each kernel is declared once, with what it
supports (dtypes, devices, head dims, grouped-query attention, causal alignment, tunable block sizes,
backward, an exposed Delta, determinism), and the generic properties in ``verify/`` run over those
declarations. A property that a declaration says is unsupported is skipped with a visible reason.

What is tested: every ``Implementation`` of kind ``"attention"`` runs the forward and backward
catalogue; every one of kind ``"softmax"`` runs the online-softmax catalogue.

How to add a kernel: write a function with the contract in README.md ("The contract"; a copyable
example is ``examples/reference_attention.py``),
``forward(q, k, v, *, causal, scale) -> (out, lse)`` (or ``out`` alone), declare it::

    MY_KERNEL = Implementation(name="my_kernel", forward=my_forward, gqa=True,
                               block_m=(64, 128), block_n=(32, 64))

and either add it to ``SHIPPED`` below or point the suite at it with
``pytest verify --impl package.module:MY_KERNEL`` or ``--impl path/to/file.py:MY_KERNEL``. A plain
callable also works: ``--impl path/to/file.py:my_forward`` gets the defaults of :func:`from_callable`.

Optional capabilities a declaration may add (each unlocks the properties that need it):

``deterministic`` (default True)
    Repeated calls on the same inputs give bitwise identical results (forward and autograd backward).
    ``run_to_run_identical`` holds a declared-deterministic kernel to that; for one declared
    ``deterministic=False`` (atomics in its backward, say) it measures the run-to-run difference,
    records it in the report and skips with the measured values in the reason.
``out_buffers`` (default False)
    The forward also accepts keyword tensors ``out=`` (q's shape and dtype) and ``lse=``
    (``[B, Hq, Nq]``, the LSE dtype), each optional: views with any strides into caller buffers. It writes
    its results there, touches no memory outside the views, and returns them as ``(out, lse)``.
    ``outputs_stay_in_bounds`` passes views into NaN-filled buffers and checks that every padding
    element is bitwise unchanged afterwards.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ALIGNMENTS = ("bottom_right", "top_left")
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
    # Repeated calls on the same inputs give bitwise identical results (see the module docstring).
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
    spec: str | None = None
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
        return self.spec or self.name

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
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"{self.name} declares dtypes {names}; {str(dtype).removeprefix('torch.')} is not among them"
        if device is not None and torch.device(device).type not in self.devices:
            return f"{self.name} declares devices {', '.join(self.devices)}; {device} is not among them"
        return None

    def call(self, q, k, v, *, causal: bool, scale: float | None = None,
             block_m: int | None = None, block_n: int | None = None,
             out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """Run the forward and normalise the result to ``(out, lse_or_None)``. ``out``/``lse`` are passed
        on as the forward's ``out=``/``lse=`` buffers; only for a declaration with ``out_buffers``."""
        kwargs: dict[str, Any] = {"causal": causal, "scale": scale}
        if self.tunable and block_m is not None:
            kwargs["block_m"] = block_m
        if self.tunable and block_n is not None:
            kwargs["block_n"] = block_n
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


def from_callable(fn: Callable[..., Any], name: str, *, device: str) -> Implementation:
    """Declare a plain callable with the defaults of the contract (README.md): float16, bfloat16,
    float32 and float64 on the suite's device, bottom-right causal, autograd, any head dim, no GQA,
    fixed tiles.
    Whether it returns the LSE is found out when it is called."""
    return Implementation(
        name=name,
        forward=fn,
        spec=name,
        devices=(torch.device(device).type,),
        description=f"plain callable {name}",
    )


_REGISTRY: dict[str, Implementation] = {}


def register(impl: Implementation) -> Implementation:
    if impl.name in _REGISTRY and _REGISTRY[impl.name] is not impl:
        raise ImplementationError(f"an implementation named {impl.name!r} is already registered")
    _REGISTRY[impl.name] = impl
    return impl


def registry() -> dict[str, Implementation]:
    """Every shipped implementation, by name (importing the kernel modules registers them)."""
    _import_shipped()
    return dict(_REGISTRY)


def _import_shipped() -> None:
    importlib.import_module("kernels.online_softmax")
    importlib.import_module("kernels.blocked")
    importlib.import_module("kernels.eager")
    try:
        importlib.import_module("kernels.triton_kernels")
    except ImportError:  # triton is an optional extra
        pass


def _error_with_place(exc: BaseException) -> str:
    """``Type: message (file:line)`` for an error raised while importing a user's kernel: the line of
    the innermost frame outside importlib, or the syntax error's own place."""
    import traceback

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError):
        return text  # its message already names the file and line
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    if frames:
        text += f" ({frames[-1].filename}:{frames[-1].lineno})"
    return text


def _load_attr(spec: str, names: Sequence[str] = ()) -> Any:
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        known = f" ({', '.join(sorted(names))})" if names else ""
        raise ImplementationError(
            f"--impl {spec!r} is neither a registered name{known} nor of the form "
            "package.module:attr or path/to/file.py:attr"
        )
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise ImplementationError(f"--impl {spec!r}: file {target!r} does not exist")
        # The kernel file's own folder is importable from it (as for `python file.py`): its helper
        # modules next to it can be imported by name.
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module_name = "flashverify_impl_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise ImplementationError(f"--impl {spec!r}: cannot load {target!r} as a Python file")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001 - any error in the user's file is a usage error
                del sys.modules[module_name]
                raise ImplementationError(f"--impl {spec!r}: importing {target!r} failed: "
                                          f"{_error_with_place(exc)}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # noqa: BLE001 - ImportError, or any error raised while importing it
            raise ImplementationError(f"--impl {spec!r}: cannot import module {target!r}: "
                                      f"{_error_with_place(exc)}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImplementationError(f"--impl {spec!r}: module {target!r} has no attribute {attr!r}") from None


def load(spec: str, *, device: str) -> Implementation:
    """Resolve one ``--impl`` value: a registry name, ``package.module:attr`` or ``path/file.py:attr``."""
    shipped = registry()
    if spec in shipped:
        return shipped[spec]
    obj = _load_attr(spec, names=list(shipped))
    if isinstance(obj, Implementation):
        return dataclasses.replace(obj, spec=spec)
    if callable(obj):
        return from_callable(obj, spec, device=device)
    raise ImplementationError(
        f"--impl {spec!r} names a {type(obj).__name__}, but should name an Implementation or a callable"
    )


def default_selection(*, device: str) -> list[Implementation]:
    """Every shipped kernel that runs on this device (adapters to peers only when named)."""
    dev = torch.device(device).type
    return [impl for impl in registry().values() if dev in impl.devices and impl.in_default]
