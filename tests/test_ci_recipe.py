"""The CI recipe (.github/workflows/flashverify.yml) runs what the docs say: `pytest verify` under the gpu
profile with pytest-xdist on a self-hosted GPU runner, its report uploaded whatever the outcome, beside a
CPU job that runs .ci/run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "flashverify.yml"


def _job(text: str, name: str) -> str:
    """The lines of one job of the workflow (from ``  name:`` to the next job or the end)."""
    match = re.search(rf"^  {name}:\n(.*?)(?=^  \S|\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no job {name!r} in {WORKFLOW}"
    return match.group(1)


def test_the_gpu_job_runs_verify_on_a_gpu_runner_and_uploads_the_report():
    gpu = _job(WORKFLOW.read_text(), "gpu")
    assert "runs-on: [self-hosted, gpu]" in gpu
    assert "pip install -e '.[test]'" in gpu  # the test extra brings pytest-xdist and triton
    assert re.search(r"^\s+pytest verify --hypothesis-profile=gpu -n auto$", gpu, re.MULTILINE)
    upload = gpu[gpu.index("uses: actions/upload-artifact"):]
    assert "path: flashverify-report/" in upload
    assert "if: always()" in gpu[gpu.rindex("- name:", 0, gpu.index("uses: actions/upload-artifact")):]


def test_the_cpu_job_runs_the_ci_script_on_python_3_11():
    cpu = _job(WORKFLOW.read_text(), "cpu")
    assert "runs-on: ubuntu-latest" in cpu and 'python-version: "3.11"' in cpu
    assert "run: bash .ci/run" in cpu and (ROOT / ".ci" / "run").exists()


def test_the_docs_show_a_kernel_repository_how_to_add_the_gpu_job():
    doc = (ROOT / "docs" / "gpu-runs.md").read_text()
    section = doc[doc.index("## Adding flashverify to your kernel's CI"):]
    assert "runs-on: [self-hosted, gpu]" in section and "if: always()" in section
    assert "pytest --pyargs verify --impl my_kernels/attention.py:attention --hypothesis-profile=gpu -n auto" in section
