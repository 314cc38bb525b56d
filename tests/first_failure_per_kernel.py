"""A pytest plugin for the mutation self-check's run of ``pytest verify`` (``-p tests.first_failure_per_kernel``,
tests/mutants.py): ``-x`` for each kernel of the session alone. Once a test of a kernel fails, the rest of that
kernel's tests are skipped, saying which test failed; the other kernels' tests run on.

Every mutant goes through one session this way, instead of one session per mutant: a session's start (torch,
Triton and the suite imported, the tests collected) and its report (the HTML page's plots) cost about as much
as a mutant's tests up to its first failure. Each property draws its own derandomized examples (verify/runner.py),
so which kernels share a session changes no test's verdict.
"""

import pytest

_FAILED: dict[str, str] = {}  # kernel name -> the node id of its first failing test


def _kernel(item) -> str | None:
    """The name of the kernel a test of ``pytest verify`` runs (None for a test of no kernel)."""
    impl = getattr(getattr(item, "callspec", None), "params", {}).get("impl")
    return getattr(impl, "name", None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    name = _kernel(item)
    if name in _FAILED:
        pytest.skip(f"{name} already failed {_FAILED[name]} (tests/first_failure_per_kernel.py: -x per kernel)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    name = _kernel(item)
    if report.failed and name is not None:
        _FAILED.setdefault(name, item.nodeid)
    return report
