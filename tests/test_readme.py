"""The docs' mechanics: the README's commands are the ones that run (.ci/run runs command 2 exactly,
command 1 installs what it uses, the README opens with both), every relative link resolves, the docs stay
short, and they carry no diary (no "sessions", no commit hashes: `git log` keeps the history)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = {"README.md": 200, "docs/benchmarks.md": 150, "docs/gpu-runs.md": 150}


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.DOTALL)]


def _setup_commands() -> list[str]:
    start = README.index("## Set up and run the suite")
    section = README[start:README.index("\n## ", start + 1)]
    return _bash_blocks(section)


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_ci_runs_the_readme_test_command_exactly():
    command_1, command_2 = _setup_commands()
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert command_2 in lines, f".ci/run should run the README's command 2:\n{command_2}\n.ci/run:\n" + "\n".join(lines)


def test_command_1_installs_pytest_xdist_when_it_runs_with_n():
    command_1, _ = _setup_commands()
    if " -n " in command_1:
        extras = re.search(r"pip install -e '\.\[([a-z,]+)\]'", command_1).group(1).split(",")
        pyproject = (ROOT / "pyproject.toml").read_text()
        assert any(re.search(rf'^{e} = \[[^]]*"pytest-xdist', pyproject, re.MULTILINE) for e in extras), extras


def test_the_readme_opens_with_its_two_commands():
    # The first two ```bash blocks of the README are the two of "## Set up and run the suite", and that
    # section is the first of the README.
    commands = _setup_commands()
    assert len(commands) == 2, commands
    assert _bash_blocks(README)[:2] == commands
    assert README.index("## Set up and run the suite") == README.index("\n## ") + 1


def _links(text: str) -> list[str]:
    """The targets of the Markdown links (inline and reference-style) outside fenced code blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    reference = re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", text, flags=re.MULTILINE)
    return inline + reference


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_relative_link_resolves(doc):
    missing = []
    for target in _links(doc.read_text()):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s), mailto, ...; anchors within the file
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            missing.append(target)
    assert not missing, f"{_name(doc)} links to what does not exist: {missing}"


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_the_docs_stay_short(name):
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= MAX_LINES[name], f"{name} has {lines} lines, at most {MAX_LINES[name]}"


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_no_sessions(doc):
    found = [f"{i}: {line.strip()}" for i, line in enumerate(doc.read_text().splitlines(), 1)
             if re.search(r"\bsessions?\b", line, re.IGNORECASE)]
    assert not found, f"{_name(doc)} speaks of sessions (history belongs in git log):\n" + "\n".join(found)


def _is_commit(candidate: str) -> bool:
    result = subprocess.run(["git", "cat-file", "-e", f"{candidate}^{{commit}}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return result.returncode == 0


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_no_commit_hashes(doc):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    found = []
    for i, line in enumerate(doc.read_text().splitlines(), 1):
        for candidate in sorted(set(re.findall(r"\b[0-9a-fA-F]{7,12}\b", line))):
            if _is_commit(candidate):
                found.append(f"{i}: {candidate} in {line.strip()}")
    assert not found, f"{_name(doc)} names commits of this repository (git log keeps them):\n" + "\n".join(found)
