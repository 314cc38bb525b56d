"""``--impl`` against outside kernels: a correct plain callable passes the catalogue, a broken one
fails with exit status 1 and prints a shrunk case and its replay command, and the replay fails again."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashverify_kernels import registry

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/outside_kernels.py"


def _pytest_verify(impl, tmp_path, *extra):
    cmd = [sys.executable, "-m", "pytest", "verify", "--impl", impl, "--hypothesis-profile=ci", "-q",
           "-p", "no:cacheprovider", "--report-dir", str(tmp_path / "report"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)


def test_load_registry_name_module_attr_and_file_attr():
    assert registry.load("fa2_blocked", device="cpu").name == "fa2_blocked"
    by_module = registry.load("flashverify_kernels.registry:FA1_BLOCKED", device="cpu")
    assert by_module.name == "fa1_blocked" and by_module.cli_name == "flashverify_kernels.registry:FA1_BLOCKED"
    plain = registry.load(f"{FIXTURE}:attention", device="cpu")
    assert plain.name == f"{FIXTURE}:attention"
    assert plain.gqa is False and plain.causal_alignment == "bottom_right" and plain.devices == ("cpu",)
    assert set(plain.dtypes) == {torch.float16, torch.bfloat16, torch.float32, torch.float64}


@pytest.mark.parametrize("spec, words", [
    ("no_such_kernel", "neither a registered name (eager, fa1_blocked, fa2_blocked,"),
    ("tests/fixtures/missing.py:fn", "does not exist"),
    (f"{FIXTURE}:nope", "has no attribute 'nope'"),
    ("no.such.module:fn", "cannot import module"),
    ("flashverify_kernels.pytorch.blocked:NEG_INF", "should name an Implementation or a callable"),
])
def test_bad_impl_specs_raise_clear_errors(spec, words):
    with pytest.raises(registry.ImplementationError, match=re.escape(words)):
        registry.load(spec, device="cpu")


def test_kernel_file_folder_is_importable_and_import_errors_are_named(tmp_path):
    (tmp_path / "helper_next_to_it.py").write_text("ANSWER = 42\n")
    (tmp_path / "uses_helper.py").write_text("from helper_next_to_it import ANSWER\n\n"
                                             "def attention(q, k, v, *, causal, scale):\n    return q\n")
    assert registry.load(f"{tmp_path}/uses_helper.py:attention", device="cpu").forward.__module__
    (tmp_path / "raises_on_import.py").write_text("x = 1\nraise RuntimeError('no GPU found')\n")
    with pytest.raises(registry.ImplementationError,
                       match=re.escape("failed: RuntimeError: no GPU found (") + r".*raises_on_import\.py:2\)"):
        registry.load(f"{tmp_path}/raises_on_import.py:attention", device="cpu")
    (tmp_path / "bad_syntax.py").write_text("def attention(:\n")
    with pytest.raises(registry.ImplementationError, match="failed: SyntaxError"):
        registry.load(f"{tmp_path}/bad_syntax.py:attention", device="cpu")


def test_bad_impl_spec_is_a_usage_error(tmp_path):
    proc = _pytest_verify("no_such_kernel", tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "neither a registered name" in proc.stderr and "fa2_blocked" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_out_only_callable_skips_lse_properties_with_the_reason(tmp_path):
    proc = _pytest_verify(f"{FIXTURE}:attention_out_only", tmp_path, "-rs", "-k",
                          "lse_matches or (test_out_matches_reference and float32)")  # out: a verdict on it
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "returns out alone (no LSE)" in proc.stdout


@pytest.mark.slow
def test_broken_outside_callable_fails_with_a_shrunk_case_that_replays(tmp_path):
    impl = f"{FIXTURE}:attention_broken_drops_last_key"
    proc = _pytest_verify(impl, tmp_path, "-x")
    assert proc.returncode == 1, proc.stdout[-4000:]
    case = re.search(r"case: (B=\d+ Hq=\d+ Hkv=\d+ Nq=(\d+) Nk=(\d+) .*)", proc.stdout)
    assert case, proc.stdout[-4000:]
    assert case.group(1).startswith("B=1 Hq=1 Hkv=1"), case.group(1)
    assert int(case.group(3)) <= 2, f"the shrunk case should have Nk <= 2: {case.group(1)}"
    replay = re.search(r"replay: (python -m verify\.replay .*)", proc.stdout).group(1)
    again = subprocess.run(replay.replace("python", sys.executable, 1), shell=True, cwd=ROOT,
                           capture_output=True, text=True)
    assert again.returncode == 1, again.stdout + again.stderr
    assert "FAILED" in again.stdout


def test_loading_the_plugin_does_not_import_triton():
    """The installed plugin loads before tests/conftest.py sets TRITON_INTERPRET=1, and Triton reads the variable
    when it is imported: were Triton imported with the plugin, a one-process ``pytest tests/...`` on a machine
    without a GPU would get Triton without its interpreter and skip every Triton test (this test lives outside
    tests/test_triton_smoke.py, whose tests that very failure would skip)."""
    probe = "import sys, verify.plugin; print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton')[:3])"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"importing verify.plugin imported Triton modules: {proc.stdout.strip()}"


def _user_repository(root: Path) -> None:
    """A kernel author's repository with packages named like the suite's (kernels, verify, reports, references,
    strategies) and no conftest.py: its kernel in kernels/my_attn.py imports a helper through its own package,
    and kernels/broken.py drops the last key."""
    for package in ("kernels", "verify", "reports", "references", "strategies"):
        (root / package).mkdir()
        (root / package / "__init__.py").write_text(f"# the user's own {package} package\n")
    (root / "kernels" / "common.py").write_text("import math\n\ndef default_scale(d):\n    return 1 / math.sqrt(d)\n")
    source = (ROOT / "examples" / "reference_attention.py").read_text()
    source = source.replace("import torch\n", "import torch\n\nfrom kernels.common import default_scale\n", 1)
    source = source.replace("scale = 1.0 / math.sqrt(head_dim)", "scale = default_scale(head_dim)")
    assert "default_scale(head_dim)" in source
    (root / "kernels" / "my_attn.py").write_text(source)
    (root / "kernels" / "broken.py").write_text(
        "from kernels.my_attn import attention as _attention\n\n\n"
        "def attention(q, k, v, *, causal=False, scale=None):\n"
        "    if k.shape[2] > 1:\n"
        "        k, v = k[:, :, :-1], v[:, :, :-1]\n"
        "    return _attention(q, k, v, causal=causal, scale=scale)\n")


@pytest.mark.slow(seconds=20)
def test_a_user_repository_with_packages_named_like_ours_names_its_kernel_both_ways(tmp_path):
    """--impl path/file.py:fn, --impl pkg.module:fn and the replay command all reach the user's kernels package
    from its repository's root, and the suite's own packages are never shadowed by the user's."""
    _user_repository(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}

    def verify(impl):
        cmd = ["pytest", "--pyargs", "verify", "--impl", impl, "-k", "test_out_matches_reference and float32",
               "--hypothesis-profile=ci", "-q", "-p", "no:cacheprovider", "--report-dir", str(tmp_path / "report")]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env)

    for impl in ("kernels/my_attn.py:attention", "kernels.my_attn:attention"):
        proc = verify(impl)
        assert proc.returncode == 0 and f"flashverify: {impl}: 1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr
    proc = verify("kernels/broken.py:attention")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    replay = re.search(r"^  replay: (python -m verify\.replay .*)$", proc.stdout, flags=re.MULTILINE).group(1)
    again = subprocess.run(replay, shell=True, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert again.returncode == 1 and "out differs from the float64 reference" in again.stdout + again.stderr, (
        again.stdout + again.stderr)
