"""A pytest plugin for the mutation self-check's runs of ``pytest verify`` (``-p tests.accuracy_first``,
tests/mutants.py): out, the LSE and the gradients against the float64 reference, in every dtype, run before
the rest of the catalogue, which keeps its own order (forward, backward, the longest cases, the softmax laws).

Each property draws its own derandomized examples (verify/runner.py: the seed comes from the property and
its arguments, not from what ran before), so the order changes no test's verdict: a variant fails the run
in any order exactly when it fails one of its properties. Under ``-x`` (or tests/first_failure_per_kernel.py,
its per-kernel form) it changes how long a broken variant takes to fail: a bug in the backward alone fails
``gradients_match_reference`` at once instead of after the whole forward catalogue has passed (about 80 s of
one core per such variant).
"""

import pytest

FIRST = ("test_out_matches_reference", "test_lse_matches_reference", "test_gradients_match_reference")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Stable: after verify/plugin.py's forward-before-backward sort, within each group."""
    items.sort(key=lambda item: 0 if getattr(item, "originalname", item.name) in FIRST else 1)
