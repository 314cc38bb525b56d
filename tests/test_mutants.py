"""The mutation self-check: every deliberately broken FA2 variant fails ``pytest verify`` under the
ci profile, with a replayable minimal case, while the unchanged kernel (loaded the same way) passes."""

import pytest

from tests import mutants


@pytest.mark.slow
def test_unmutated_kernel_passes(tmp_path):
    out = mutants.run_variant("unmutated", report_dir=tmp_path)
    assert out.returncode == 0, f"the unchanged kernel should pass pytest verify; it exited {out.returncode}:\n{out.output[-6000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in mutants.MUTATIONS])
def test_mutant_fails_the_suite(name, tmp_path):
    out = mutants.run_variant(name, report_dir=tmp_path)
    assert out.returncode == 1, (
        f"mutant {name} ({mutants.VARIANTS[name].description}) should fail pytest verify with exit status 1, "
        f"got {out.returncode}:\n{out.output[-6000:]}")
    assert out.first_failure is not None, f"no failing property found in the output of mutant {name}"
    assert "replay: python -m verify.replay" in out.output, f"mutant {name}: the failure shows no replay command"
    failures = list((tmp_path / "failures").glob("*.json"))
    assert failures, f"mutant {name}: the report holds no failure file"
