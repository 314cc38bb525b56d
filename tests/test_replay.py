"""Launch plans (flashverify_kernels/triton/replay.py): a signature's first call records its launches, later calls replay them.

On CPU the plans replay through ``kernel[grid](...)`` under Triton's interpreter: what these tests hold is
that a replayed call computes what the full path computes, with the new call's tensors, and that a call
whose signature differs in anything the full path decides on takes the full path. The GPU test at the end
holds the same for the compiled launches (Triton's launcher of the compiled kernel, the Gluon kernels on
Hopper).
"""
import pytest
import torch

from flashverify_kernels.triton import replay
from flashverify_kernels.triton import attention as ta

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def plans(monkeypatch):
    """Plans on (tests/conftest.py turns them off for tests that patch), none recorded yet."""
    monkeypatch.setenv(replay.ENV_OFF, "1")
    replay.clear()
    yield replay.PLANS
    replay.clear()


def _inputs(shape=(2, 4, 40, 32), kv_heads=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, n, d = shape
    hk = kv_heads or h
    q = torch.randn(b, h, n, d, generator=g).to(DEVICE, dtype)
    k, v = (torch.randn(b, hk, n, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    dout = torch.randn(b, h, n, d, generator=g).to(DEVICE, dtype)
    return q, k, v, dout


def _forward_backward(q, k, v, dout, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ta.fa2_forward(*leaves, **kw)
    return (out, lse, *torch.autograd.grad(out, leaves, dout))


def _full_path(monkeypatch, *args, **kw):
    monkeypatch.setenv(replay.ENV_OFF, "0")
    try:
        return _forward_backward(*args, **kw)
    finally:
        monkeypatch.setenv(replay.ENV_OFF, "1")


def _count_full_calls(monkeypatch) -> list:
    calls = []
    for name in ("_forward_full", "_backward_full"):
        real = getattr(ta, name)
        def counted(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(ta, name, counted)
    return calls


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("kv_heads, causal, dtype", [(None, True, torch.float32), (2, False, torch.float32),
                                                     (2, True, torch.float16)])  # float16: through descriptors
def test_replayed_calls_compute_what_the_full_path_computes(plans, monkeypatch, deterministic, kv_heads, causal,
                                                            dtype):
    kw = dict(causal=causal, deterministic=deterministic)
    for _ in range(2):  # on a GPU the first call of a signature may go through the autotuner, which records nothing
        first = _forward_backward(*_inputs(kv_heads=kv_heads, dtype=dtype), **kw)
    assert len(plans) == 2, "the first call of a signature records a plan of its forward and one of its backward"
    calls = _count_full_calls(monkeypatch)
    other = _inputs(kv_heads=kv_heads, dtype=dtype, seed=1)  # new tensors, new values: the plan must use them
    replayed = _forward_backward(*other, **kw)
    assert calls == [], f"the second call took the full path ({calls}), not the plan"
    expected = _full_path(monkeypatch, *other, **kw)
    assert calls == ["_forward_full", "_backward_full"]
    for name, got, want, before in zip(("out", "lse", "dq", "dk", "dv"), replayed, expected, first):
        assert not torch.equal(got, before), f"{name}: the replay returned the first call's values"
        if name == "dq" and not deterministic and ON_GPU:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # atomics: the order of the sum varies
        else:
            assert torch.equal(got, want), f"{name}: the replayed call differs from the full path"


def test_each_plan_is_kept_under_its_signature(plans):
    q, k, v, dout = _inputs()

    def twice(q, k, v, dout, deterministic=True, **kw):  # on a GPU the first call may go through the autotuner
        for _ in range(2):  # without autograd, which would hand the kernels copies of q, k, v
            out, lse = ta.fa2_forward_raw(q, k, v, **kw)
            ta.fa2_backward(q, k, v, out, lse, dout, deterministic=deterministic, **kw)

    twice(q, k, v, dout, causal=True)
    assert len(plans) == 2
    variants = [
        dict(q=q.half(), k=k.half(), v=v.half(), dout=dout.half()),  # dtype
        dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)),  # strides
        dict(q=torch.empty(q.numel() + 1, device=DEVICE)[1:].view(q.shape).copy_(q)),  # a base 4 bytes off
    ]
    for n, change in enumerate(variants, start=1):
        inputs = {**dict(q=q, k=k, v=v, dout=dout), **change}
        twice(inputs["q"], inputs["k"], inputs["v"], inputs["dout"], causal=True)
        assert len(plans) == 2 + 2 * n, f"change {n} replayed an earlier signature's plan"
    settings = [dict(causal=False), dict(causal=True, scale=0.5), dict(causal=True, scale=1),
                dict(causal=True, block_m=32), dict(causal=True, deterministic=False)]
    for kw in settings:
        before = len(plans)
        twice(q, k, v, dout, **kw)
        assert len(plans) > before, f"{kw} replayed an earlier signature's plan"


def test_calls_with_variants_sinks_buffers_or_no_rows_keep_no_plan(plans):
    q, k, v, dout = _inputs()
    _forward_backward(q, k, v, dout, causal=True, window_size=(8, 0))
    _forward_backward(q, k, v, dout, softcap=5.0)
    _forward_backward(q, k, v, dout, sinks=torch.zeros(q.shape[1], device=DEVICE))
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=DEVICE)
    ta.fa2_forward(q, k, v, out=out, lse=lse)
    ta.fa2_forward(q[:, :, :0], k, v)
    assert len(plans) == 0, [key[0] for key in plans]


def test_bad_input_still_raises_after_a_plan_exists(plans):
    q, k, v, dout = _inputs()
    for _ in range(2):  # on a GPU the first call of a signature may go through the autotuner, which records nothing
        out, lse = ta.fa2_forward_raw(q, k, v)
        ta.fa2_backward(q, k, v, out, lse, dout)
    assert len(plans) == 2
    with pytest.raises(ValueError, match="lse.dtype=float16, but should be float32"):
        ta.fa2_backward(q, k, v, out, lse.half(), dout)
    with pytest.raises(ValueError, match=r"out.shape=\(2, 4, 39, 32\) and dout.shape=\(2, 4, 40, 32\) should be "
                                         r"\(2, 4, 40, 32\)"):
        ta.fa2_backward(q, k, v, out[:, :, :-1], lse, dout)
    with pytest.raises(ValueError, match="head_dim"):
        ta.fa2_forward_raw(q[..., :12], k[..., :12], v[..., :12])


def test_plans_off_records_nothing(plans, monkeypatch):
    monkeypatch.setenv(replay.ENV_OFF, "0")
    _forward_backward(*_inputs(), causal=True)
    assert len(plans) == 0


# --------------------------------------------------------------------------------------------------
# The recorder and the plan, with a stand-in kernel
# --------------------------------------------------------------------------------------------------

class _Compiled:
    """Stands in for a compiled kernel: records what its launcher is given."""
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.launches.append(((gx, gy, gz), args))


class _Kernel:
    """Stands in for a JIT function ``kernel(X, Desc, n, BLOCK: constexpr = 4)``."""

    def __init__(self):
        self.compiled = _Compiled()
        self.jit_launches = []

    @staticmethod
    def fn(X, Desc, n, BLOCK=4):
        pass

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_launches.append((grid, args, kwargs))
            return self.compiled
        return launch


def test_a_plan_launches_the_compiled_kernel_with_the_new_tensors(plans, monkeypatch):
    monkeypatch.setattr(replay, "_current_stream", lambda: "stream")
    kernel = _Kernel()
    x = torch.zeros(4, 16)
    with replay.recording(("test",), (x,)) as outputs:
        y = replay.empty((4, 16), dtype=torch.float32, device="cpu")
        acc = replay.zeros((2,), dtype=torch.float32, device="cpu")
        replay.launch(kernel, (3,), x, ta.TensorDescriptor(y, [4, 16], [16, 1], [1, 16]), 7, num_warps=4)
        replay.copy(y, x)
        outputs((y, acc))
    plan = plans[("test",)]
    x2 = torch.ones(4, 16)
    y2, acc2 = plan(x2)
    (grid, args), = kernel.compiled.launches
    assert grid == (3, 1, 1)
    assert args[0] is x2 and args[1].base is y2 and args[1].block_shape == [1, 16] and args[2:] == (7, 4)
    assert y2 is not y and torch.equal(y2, x2), "the copy step copies the new input into the new buffer"
    assert torch.equal(acc2, torch.zeros(2))
    assert len(kernel.jit_launches) == 1, "the replay went through kernel[grid], not the compiled kernel"


def test_a_provided_tensor_is_asked_for_again_at_each_replay(plans, monkeypatch):
    """``replay.provided``: a buffer kept across calls (the forward's walk counter, one a stream) is not an
    allocation of the plan: each replay calls its function again and launches with what it returns now."""
    monkeypatch.setattr(replay, "_current_stream", lambda: "stream")
    kernel = _Kernel()
    x = torch.zeros(4)
    buffers = [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)]
    asked = []

    def buffer(tag):
        asked.append(tag)
        return buffers[len(asked) - 1]

    with replay.recording(("provided",), (x,)) as outputs:
        got = replay.provided(buffer, "tag")
        replay.launch(kernel, (1,), x, got, 1)
        outputs((got,))
    plan = plans[("provided",)]
    for i in (1, 2):
        out, = plan(torch.ones(4))
        assert out is buffers[i] and kernel.compiled.launches[-1][1][1] is buffers[i]
    assert asked == ["tag"] * 3


def test_a_step_the_recorder_cannot_name_keeps_no_plan(plans):
    kernel = _Kernel()
    x = torch.zeros(4)
    with replay.recording(("unknown tensor",), (x,)) as outputs:
        stranger = torch.empty(4)
        replay.launch(kernel, (1,), stranger, stranger, 1)
        outputs((x,))
    with replay.recording(("unknown output",), (x,)) as outputs:
        outputs((torch.empty(4),))
    with replay.recording(("marked",), (x,)) as outputs:
        replay.unrecordable("test")
        outputs((x,))
    with replay.recording(("grid function",), (x,)) as outputs:
        replay.launch(kernel, lambda meta: (1,), x, x, 1)
        outputs((x,))
    with pytest.raises(RuntimeError), replay.recording(("raised",), (x,)) as outputs:
        raise RuntimeError("the call failed")
    assert len(plans) == 0, list(plans)


@pytest.mark.skipif(not ON_GPU, reason="compiled launches need a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_compiled_replay_on_the_gpu_equals_the_full_path(plans, monkeypatch, dtype, head_dim):
    shape = (2, 4, 300, head_dim)
    for deterministic in (True, False):
        for causal in (False, True):
            kw = dict(causal=causal, deterministic=deterministic)
            for seed in range(2):  # the first records (after the autotuner's call), then replays
                _forward_backward(*_inputs(shape, kv_heads=2, dtype=dtype, seed=seed), **kw)
            calls = _count_full_calls(monkeypatch)
            other = _inputs(shape, kv_heads=2, dtype=dtype, seed=5)
            replayed = _forward_backward(*other, **kw)
            assert calls == [], f"{kw}: the call took the full path ({calls}), not the plan"
            expected = _full_path(monkeypatch, *other, **kw)
            monkeypatch.undo()
            monkeypatch.setenv(replay.ENV_OFF, "1")
            for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), replayed, expected):
                if name == "dq" and not deterministic:
                    torch.testing.assert_close(got, want)
                else:
                    assert torch.equal(got, want), f"{name} {kw}: the replayed call differs from the full path"
