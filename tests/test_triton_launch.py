"""The Triton launchers' autotuned path: the first launch of a signature goes through Triton's autotuner,
later ones launch the kernel directly with the tiles it chose (skipping its per-call wrapper, the host
time of short calls). The autotuner runs only on a GPU, so these tests drive ``_run`` with stand-ins for
the kernel and its autotuned twin that record what they are asked to launch.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from flashverify_kernels.triton import attention as ta  # noqa: E402

NAMES = ["Q", "DescK", "seq_bucket", "len_q"]


class Kernel:
    """A JIT function's launch interface: ``kernel[grid](*args, **kwargs)``, recorded."""

    def __init__(self, name="_attn_fwd"):
        self.__name__, self.arg_names, self.launches = name, NAMES, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


class Tuned:
    """An autotuner: launches with the tiles it picks and remembers them as ``best_config``."""

    def __init__(self, kernel, block_m=64, block_n=32, warps=4):
        self.kernel, self.calls = kernel, 0
        self.config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=3,
                                    pre_hook=ta._set_tiles)

    def __getitem__(self, grid_of):
        def launch(*args, **kwargs):
            self.calls += 1
            self.best_config = self.config
            tiles = self.config.all_kwargs()
            self.config.pre_hook({**dict(zip(NAMES, args)), **kwargs, **tiles})
            self.kernel[grid_of(tiles)](*args, **kwargs, **tiles)
        return launch


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(ta, "_CHOSEN", {})


def _args(n=256, dtype=torch.float16, bucket=1024):
    q = torch.zeros(1, 2, n, 64, dtype=dtype)
    k = torch.zeros(1, 2, n, 64, dtype=dtype)
    return (q, TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, 16, 64]), bucket, n)


def _launch(kernel, tuned, args, meta=None):
    ta._run(kernel, tuned, lambda bm, bn: (args[3] // bm, 2), args, meta or {"BLOCK_D": 64, "CAUSAL": False},
            None, 64, args[0].dtype, name="test")


def test_a_repeated_signature_launches_the_autotuners_choice_without_the_autotuner():
    kernel = Kernel()
    tuned = Tuned(kernel)
    args = _args()
    _launch(kernel, tuned, args)
    args[1].block_shape = [1, 1, 16, 64]  # as a fresh call's descriptor arrives
    _launch(kernel, tuned, args)
    assert tuned.calls == 1
    (_, first_args, first_kwargs), (grid, again_args, again_kwargs) = kernel.launches
    assert grid == (256 // 64, 2)
    assert again_args == first_args
    assert again_kwargs == first_kwargs == {"BLOCK_D": 64, "CAUSAL": False, "BLOCK_M": 64, "BLOCK_N": 32,
                                            "num_warps": 4, "num_ctas": 1, "num_stages": 3}
    assert args[1].block_shape == [1, 1, 32, 64]  # the descriptor's tile set for the chosen KV tile


@pytest.mark.parametrize("change", ["sequence bucket", "dtype", "constexpr", "kernel"])
def test_a_signature_not_seen_goes_through_the_autotuner(change):
    kernel = Kernel()
    tuned = Tuned(kernel)
    _launch(kernel, tuned, _args())
    other_kernel = Kernel("_attn_bwd_dq")
    if change == "sequence bucket":
        _launch(kernel, tuned, _args(bucket=4096))
    elif change == "dtype":
        _launch(kernel, tuned, _args(dtype=torch.bfloat16))
    elif change == "constexpr":
        _launch(kernel, tuned, _args(), {"BLOCK_D": 64, "CAUSAL": True})
    else:
        _launch(other_kernel, Tuned(other_kernel), _args())
        assert len(other_kernel.launches) == 1
        return
    assert tuned.calls == 2


def test_the_remembered_choice_is_the_one_the_autotuner_made_for_that_signature():
    kernel = Kernel()
    _launch(kernel, Tuned(kernel, 128, 64, 8), _args())
    _launch(kernel, Tuned(kernel, 32, 16, 4), _args(bucket=4096))
    _launch(kernel, Tuned(kernel, 16, 16, 4), _args())
    tiles = [(kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"]) for _, _, kw in kernel.launches]
    assert tiles == [(128, 64, 8), (32, 16, 4), (128, 64, 8)]
