"""How the suite calls a kernel under test: its forward, its backward through autograd and its declared
backward, on a case's spec, and the contract on what they return (type, shape, dtype, device, not an input).

A broken contract, a resource the kernel cannot have and an out-of-memory error each fail the example in
words; a sticky CUDA error ends the test (:class:`verify.context.StickyDeviceError`).
"""

from __future__ import annotations

from typing import Any

import torch

from flashverify_kernels.conventions import ContractError
from flashverify_kernels.declaration import sinks_tensor
from references.fp8 import out_dtype
from strategies.cases import dtype_name
from verify.context import Context, NotForThisKernel, StickyDeviceError
from verify.faults import OutOfMemoryError, release_out_of_memory, resource_failures_fail
from verify.stages import stage


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensor(ctx: Context, *, label: str, actual: Any, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, inputs: tuple[torch.Tensor, ...] = ()) -> None:
    """The contract on one returned tensor: type, shape, dtype, device, and not an input object."""
    __tracebackhide__ = True
    if not isinstance(actual, torch.Tensor):
        ctx.fail(f"{label} is a {type(actual).__name__}, but should be a torch.Tensor")
    if tuple(actual.shape) != tuple(shape):
        ctx.fail(f"{label}.shape={tuple(actual.shape)}, but should be {tuple(shape)}")
    if actual.dtype != dtype:
        ctx.fail(f"{label}.dtype={dtype_name(actual.dtype)}, but should be {dtype_name(dtype)}")
    if actual.device != device:
        ctx.fail(f"{label} is on {actual.device}, but should be on {device} (the inputs' device)")
    for t in inputs:
        if actual is t or (actual.numel() and t.numel() and actual.data_ptr() == t.data_ptr()
                           and actual.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()):
            ctx.fail(f"{label} is (a view of) one of the input tensors, not a newly computed result")


def run_forward(ctx: Context, case, q, k, v, *, sinks: torch.Tensor | None = None, handed=None, descales=None):
    """Call the implementation's forward and check the output contract; returns ``(out, lse|None)`` in the
    references' frame (``Implementation.call``). ``sinks``: the sinks tensor to pass (a leaf whose gradient
    the caller reads), instead of one made from the spec; ``handed``: ``Implementation.call``'s;
    ``descales``: a float8 case's (``Tensors.descales``), required when the case has them."""
    __tracebackhide__ = True
    if getattr(case, "descale", False) and descales is None:
        raise ValueError(f"{ctx.prop}: the case has descales, and the property passed none to run_forward")
    out_of_memory = None
    contract = None
    try:
        with resource_failures_fail(ctx, case, device=q.device, where="forward"), stage("kernel"):
            out, lse = ctx.impl.call(q, k, v, spec=case.spec, scale=case.scale, block_m=case.block_m,
                                     block_n=case.block_n, sinks=sinks, handed=handed, descales=descales)
    except ContractError as exc:
        contract = str(exc)
    except OutOfMemoryError as exc:
        out_of_memory = release_out_of_memory(exc)
    except Exception as exc:
        from verify.gpu import sticky_cuda_error

        if sticky_cuda_error(exc) is not None:
            raise StickyDeviceError(ctx, exc, where="forward") from exc
        raise
    if contract is not None:
        ctx.fail(contract)
    if out_of_memory is not None:  # failed outside the except block: the new failure holds no traceback
        ctx.fail(f"the kernel ran out of device memory in its forward ({out_of_memory}); "
                 "its memory was released and the run goes on")
    check_tensor(ctx, label="out", actual=out, shape=(*q.shape[:3], v.shape[-1]), dtype=out_dtype(q.dtype),
                 device=q.device, inputs=(q, k, v))
    if lse is not None:
        check_tensor(ctx, label="lse", actual=lse, shape=tuple(q.shape[:3]), dtype=lse_dtype(q.dtype),
                     device=q.device, inputs=(q, k, v))
    return out, lse


def run_direct_backward(ctx: Context, case, q, k, v, out, lse, dout):
    """The implementation's declared backward (``Implementation.call_backward``) on ``case``'s spec:
    ``(dq, dk, dv, delta)`` (and ``dsinks`` with sinks); a resource failure or a result of the wrong
    shape fails ``ctx`` in words, as in :func:`run_backward`."""
    __tracebackhide__ = True
    contract = None
    with resource_failures_fail(ctx, case, device=q.device, where="backward"), stage("kernel"):
        try:
            return ctx.impl.call_backward(q, k, v, out, lse, dout, spec=case.spec, scale=case.scale,
                                          block_m=case.block_m, block_n=case.block_n)
        except ContractError as exc:
            contract = str(exc)
    ctx.fail(contract)


def run_backward(ctx: Context, case, q, k, v, dout, *, handed=None) -> dict[str, torch.Tensor]:
    """The forward on fresh leaves of ``q, k, v`` (and of the sinks, with sinks), then
    ``out.backward(dout)``: ``out`` (detached), ``lse`` (when returned), ``dq``, ``dk``, ``dv`` (and
    ``dsinks``). A broken contract fails ``ctx``, and so does a backward that cannot run the case for a
    resource reason (:func:`verify.faults.resource_failure`). ``handed``: ``Implementation.call``'s."""
    __tracebackhide__ = True
    if not ctx.impl.autograd:
        raise NotForThisKernel(f"{ctx.impl.name} declares no autograd backward")
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    sinks = None
    if case.spec.sinks is not None:
        sinks = sinks_tensor(ctx.impl.name, case.spec, device=q.device, dtype=q.dtype).requires_grad_(True)
    out, lse = run_forward(ctx, case, q, k, v, sinks=sinks, handed=handed)
    if not out.requires_grad:
        ctx.fail("out does not require grad although q, k, v do: no gradient flows through out")
    with resource_failures_fail(ctx, case, device=q.device, where="backward"), stage("kernel"):
        out.backward(dout)
    results = {"out": out.detach(), **({"lse": lse.detach()} if lse is not None else {})}
    for label, x in (("dq", q), ("dk", k), ("dv", v), ("dsinks", sinks)):
        if x is None:
            continue
        if x.grad is None and x.numel() == 0:  # an empty input (Nk = 0): a kernel that returns early without
            results[label] = torch.zeros_like(x)  # reading it leaves no gradient, and its gradient is empty
            continue
        if x.grad is None:
            ctx.fail(f"{label} is None after out.backward(dout)" + (
                " (the sinks tensor the forward was given gets no gradient)" if label == "dsinks" else ""))
        results[label] = x.grad
    return results
