"""The suite's own tests run the Triton kernels in Triton's interpreter on a machine without a GPU.

``TRITON_INTERPRET=1`` must be set before ``triton`` is imported; this file is loaded before any test
module is (and in every pytest-xdist worker), so ``pytest tests`` covers the Triton tests on CPU with no
variable to remember. A value already set is kept (``TRITON_INTERPRET=0`` on a GPU machine).

Under pytest-xdist (``pytest tests -n 2``, the README's command) the run is scheduled for its wall time:

- the tests marked ``slow`` (each runs a whole ``pytest verify`` session in a subprocess, up to minutes) run
  first, longest first by their ``slow(seconds=...)`` estimate, so that no worker starts a long one while
  the other has nothing left to do;
- the default ``--dist load`` hands out tests one at a time (``--maxschedchunk 1`` unless given), so the
  short tests fill in behind the long ones on whichever worker is free;
- each worker's torch gets its share of the cores it may use (one thread each for ``-n 2`` on 2 cores; the
  affinity and the cgroup quota count, not the host's cores: ``verify.plugin.available_cores``): more threads
  than cores slow every test down, most of all the subprocess runs, which use one thread each;
- a few dozen tests start a ``pytest verify`` of their own. Where ``PYTHONDONTWRITEBYTECODE`` is set, each
  of them would compile the suite's modules and redo pytest's assertion rewriting of them from the source
  (2 of the 7 seconds a subprocess takes to start on one core): the run keeps compiled files instead, under
  one cache folder outside the checkout (``PYTHONPYCACHEPREFIX``, ``<tmp>/flashverify-pycache`` unless one
  is set), so the checkout stays as clean as the variable keeps it.
"""

import os
import sys
import tempfile

import pytest

if sys.pycache_prefix is None:
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = os.path.join(tempfile.gettempdir(),
                                                                          "flashverify-pycache")
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    from verify.plugin import available_cores

    torch.set_num_threads(max(1, available_cores() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)))


def _slow_seconds(item) -> float:
    """The largest ``seconds`` estimate of the test's ``slow`` markers (the function's, or one of its
    parameters'; a ``slow`` marker without one counts as 30 s), 0 for a test not marked ``slow``."""
    return max((float(m.kwargs.get("seconds", 30)) for m in item.iter_markers("slow")), default=0.0)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Longest first (stable: tests of equal weight keep their order). Every worker collects the same
    order, as pytest-xdist requires."""
    items.sort(key=lambda item: -_slow_seconds(item))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist load`` (the default of ``-n``) with one test per hand-out unless ``--maxschedchunk`` is given:
    with the longest tests first, a worker that finishes takes the next test, whatever the other is running."""
    from verify.shards import one_test_at_a_time

    return one_test_at_a_time(config, log)


@pytest.fixture(autouse=True)
def _fresh_launch_plans(request):
    """Every test starts and ends with no launch plan (flashverify_kernels/triton/replay.py), so that none recorded in one
    test replays in another. A test that patches with ``monkeypatch`` runs with plans off: a plan replays
    the launches a signature's first call made and skips the functions that decided them, so a patched
    function would run once and then be skipped (tests/test_replay.py turns plans back on where it means to)."""
    from flashverify_kernels.triton import replay

    replay.clear()
    before = os.environ.get(replay.ENV_OFF)
    if "monkeypatch" in request.fixturenames:
        os.environ[replay.ENV_OFF] = "0"
    yield
    if before is None:
        os.environ.pop(replay.ENV_OFF, None)
    else:
        os.environ[replay.ENV_OFF] = before
    replay.clear()
