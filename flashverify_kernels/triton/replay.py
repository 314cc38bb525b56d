"""Launch plans: a call's allocations, kernel launches and copies, recorded once per signature and replayed.

A call of :func:`flashverify_kernels.triton.attention.fa2_forward` or its backward spends most of its host time
deciding what to run (validation, the Gluon and descriptor rules, tile choices) and in Triton's launch
path, which re-specializes every argument of every kernel on every call; for a short call that can take
longer on the host than its kernels take on the GPU. All of that is a function of the
call's *signature*: the shapes, strides, dtypes, devices and 16-byte alignment of its tensors and the
values of its other arguments. So the first call of a signature runs the full path while a :class:`Recorder`
writes down what it did, in terms of the call's input tensors:

- ``empty``/``zeros``: a new tensor (shape, dtype, device);
- ``provided``: a tensor a function gives (a buffer kept across calls), asked for again at each replay;
- ``launch``: a kernel, its grid, and its arguments, each tensor argument (or tensor descriptor over one)
  named by the tensor it was (an input or an earlier allocation), every other argument kept as it was;
- ``copy``: one named tensor copied into another.

Later calls with the same signature (:func:`signature`) replay that :class:`Plan`: the same allocations,
the same launches with the new tensors put in, each through the compiled kernel the first call's launch
returned (Triton's own launcher of a compiled kernel, as ``CompiledKernel.__getitem__`` runs it), the
argument specialization skipped: the signature fixes every property Triton specializes on.

What makes this safe: a call records only when every launch, allocation and copy of it went through
this module's functions, and every tensor it handed a kernel or returned is one it knows; anything else
(a contiguous copy of an unreadable input, a launch through the autotuner, an in-place fill of an empty
case) calls :func:`unrecordable` or refers to a tensor the recorder does not know, and the signature
then takes the full path again next time. Under Triton's interpreter, and where a launch returned no
compiled kernel, the plan replays through ``kernel[grid](...)`` (the allocations and arguments still
replayed), so the CPU suite runs the same plans. ``FLASHVERIFY_REPLAY=0`` turns plans off;
:func:`clear` forgets them: a plan keeps the kernels its first call launched, so code that patches or
swaps the functions or kernel modules a plan skips (as tests do) clears plans or turns them off.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import os
import threading

import torch
from triton import knobs
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

try:  # Gluon's host descriptor is its own class
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
    DESCRIPTORS: tuple = (TensorDescriptor, _GluonDescriptor)
except ImportError:  # pragma: no cover - a Triton without Gluon
    DESCRIPTORS = (TensorDescriptor,)

ENV_OFF = "FLASHVERIFY_REPLAY"  # "0": no plans; every call takes the full path
MAX_PLANS = 512  # signatures kept; the oldest is dropped first
PLANS: "collections.OrderedDict[tuple, Plan]" = collections.OrderedDict()
_state = threading.local()


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1") != "0"


def clear() -> None:
    """Forget every plan (the next call of each signature takes the full path and records again)."""
    PLANS.clear()


def tensor_key(t: torch.Tensor) -> tuple:
    """What a plan depends on of one tensor: type, dtype, device, shape, strides, base 16-byte aligned."""
    return type(t), t.dtype, t.device, t.shape, t.stride(), t.data_ptr() % 16 == 0


def current_device():
    """The device Triton launches on (its compiled kernels are loaded per device); None before CUDA starts."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


# --------------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------------

class Recorder:
    """Writes down one call's steps; see the module docstring."""

    def __init__(self, inputs):
        self.tensors = list(inputs)  # slot -> tensor (kept alive, so that ids stay unique)
        self.slots = {id(t): i for i, t in enumerate(self.tensors)}
        self.steps: list[tuple] = []
        self.failed = ""

    def fail(self, why: str) -> None:
        self.failed = self.failed or why

    def slot(self, t) -> int | None:
        i = self.slots.get(id(t))
        return i if i is not None and self.tensors[i] is t else None

    def add(self, t: torch.Tensor, zero: bool) -> None:
        self.slots[id(t)] = len(self.tensors)
        self.tensors.append(t)
        self.steps.append(("alloc", tuple(t.shape), t.dtype, t.device, zero))

    def provide(self, t: torch.Tensor, fn, args: tuple) -> None:
        self.slots[id(t)] = len(self.tensors)
        self.tensors.append(t)
        self.steps.append(("provide", fn, args))

    def copy(self, dst, src) -> None:
        d, s = self.slot(dst), self.slot(src)
        if d is None or s is None:
            self.fail("a copy between tensors the plan does not know")
        self.steps.append(("copy", d, s))

    def launch(self, kernel, grid, args: tuple, kwargs: dict, compiled) -> None:
        if callable(grid):
            self.fail("a grid computed at launch")
            return
        names = _parameters(kernel)
        if names is None:
            self.fail(f"no parameter list for {kernel!r}")
            return
        bound = dict(zip(names, args))
        if len(args) > len(names) or any(name in bound for name in kwargs):
            self.fail("arguments that do not bind")
            return
        bound.update((name, value) for name, value in kwargs.items() if name in names)
        values, tensors, descriptors = [], [], []
        for i, name in enumerate(names):
            if name in bound:
                value = bound[name]
            elif names[name] is inspect.Parameter.empty:
                self.fail(f"parameter {name} not given")
                return
            else:
                value = names[name]
            if isinstance(value, torch.Tensor):
                slot = self.slot(value)
                if slot is None:
                    self.fail(f"argument {name}: a tensor the plan does not know")
                    return
                tensors.append((i, slot))
                value = None
            elif isinstance(value, DESCRIPTORS):
                slot = self.slot(value.base)
                if slot is None:
                    self.fail(f"argument {name}: a descriptor over a tensor the plan does not know")
                    return
                template = object.__new__(type(value))
                vars(template).update(vars(value), base=None)
                descriptors.append((i, slot, template))
                value = None
            values.append(value)
        options = {name: value for name, value in kwargs.items() if name not in names}
        if compiled is not None and hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
            compiled = None
        grid = tuple(grid) + (1,) * (3 - len(grid))
        self.steps.append(("launch", kernel, grid, values, tuple(tensors), tuple(descriptors), options, compiled))

    def plan(self, outputs) -> "Plan | None":
        if self.failed:
            return None
        slots = tuple(self.slot(t) for t in outputs)
        if None in slots:
            return None
        return Plan(tuple(self.steps), slots)


_PARAMETERS: dict = {}


def _parameters(kernel) -> dict | None:
    """A kernel's parameters in order, each with its default (``inspect.Parameter.empty`` where none)."""
    names = _PARAMETERS.get(kernel)
    if names is None:
        fn = getattr(kernel, "fn", None)
        if fn is None:
            return None
        names = {p.name: p.default for p in inspect.signature(fn).parameters.values()}
        _PARAMETERS[kernel] = names
    return names


@contextlib.contextmanager
def recording(key, inputs):
    """Record the call run inside the block under ``key`` (None, or plans off: nothing recorded); the
    block hands its outputs to the yielded function. A plan is kept only if the block ends normally
    and the recorder saw every step (see the module docstring)."""
    if key is None or getattr(_state, "recorder", None) is not None or not enabled():
        yield lambda outputs: None
        return
    recorder = Recorder(inputs)
    outputs = []
    _state.recorder = recorder
    try:
        yield outputs.append
    finally:
        _state.recorder = None
    if outputs:
        plan = recorder.plan(outputs[0])
        if plan is not None:
            PLANS[key] = plan
            while len(PLANS) > MAX_PLANS:
                PLANS.popitem(last=False)


def _active() -> Recorder | None:
    return getattr(_state, "recorder", None)


def unrecordable(why: str) -> None:
    """The call being recorded did something a plan cannot replay: keep no plan of it."""
    recorder = _active()
    if recorder is not None:
        recorder.fail(why)


def _allocate(shape, dtype, device, zero: bool) -> torch.Tensor:
    t = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    recorder = _active()
    if recorder is not None:
        recorder.add(t, zero=zero)
    return t


def empty(shape, *, dtype, device) -> torch.Tensor:
    """``torch.empty``, recorded."""
    return _allocate(shape, dtype, device, zero=False)


def zeros(shape, *, dtype, device) -> torch.Tensor:
    """``torch.zeros``, recorded."""
    return _allocate(shape, dtype, device, zero=True)


def provided(fn, *args) -> torch.Tensor:
    """``fn(*args)``: a tensor the call takes rather than allocates (a buffer kept across calls), recorded
    as the function that gave it, so that a replay asks ``fn`` again (and gets, say, the current stream's)."""
    t = fn(*args)
    recorder = _active()
    if recorder is not None:
        recorder.provide(t, fn, args)
    return t


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)
    recorder = _active()
    if recorder is not None:
        recorder.copy(dst, src)


def run(key, inputs: tuple, full):
    """A call: the plan kept under ``key`` replayed over ``inputs`` where there is one, else ``full()`` (the
    full path, which returns the call's outputs), recorded under ``key`` (None: not recorded)."""
    plan = PLANS.get(key) if key is not None else None
    if plan is not None:
        return plan(*inputs)
    with recording(key, inputs) as outputs:
        result = full()
        outputs(result)
    return result


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, recorded; returns what the launch returned (the compiled kernel)."""
    compiled = kernel[grid](*args, **kwargs)
    recorder = _active()
    if recorder is not None:
        recorder.launch(kernel, grid, args, kwargs, compiled)
    return compiled


# --------------------------------------------------------------------------------------------------
# Replaying
# --------------------------------------------------------------------------------------------------

def _current_stream():
    """The stream Triton's launch path would launch on (the current device's current stream)."""
    return driver.active.get_current_stream(driver.active.get_current_device())


class Plan:
    """A recorded call: ``plan(*inputs)`` runs its steps over new input tensors and returns its outputs."""

    def __init__(self, steps: tuple, outputs: tuple):
        self.steps, self.outputs = steps, outputs

    def __call__(self, *inputs):
        tensors = list(inputs)
        stream = None
        for step in self.steps:
            kind = step[0]
            if kind == "launch":
                _, kernel, grid, values, slots, descriptors, options, compiled = step
                values = list(values)
                for i, slot in slots:
                    values[i] = tensors[slot]
                for i, slot, template in descriptors:
                    desc = object.__new__(type(template))
                    vars(desc).update(vars(template), base=tensors[slot])
                    values[i] = desc
                if compiled is None:
                    kernel[grid](*values, **options)
                    continue
                if stream is None:
                    stream = _current_stream()
                compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                             compiled.launch_metadata(grid, stream, *values), knobs.runtime.launch_enter_hook,
                             knobs.runtime.launch_exit_hook, *values)
            elif kind == "alloc":
                _, shape, dtype, device, zero = step
                tensors.append((torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device))
            elif kind == "provide":
                tensors.append(step[1](*step[2]))
            else:
                tensors[step[1]].copy_(tensors[step[2]])
        return tuple(tensors[i] for i in self.outputs)
