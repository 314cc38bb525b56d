"""The README's commands are the ones that run: .ci/run runs command 2 exactly, command 1 installs what it
uses, and the example kernel the README offers to copy is the one the tests run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.DOTALL)]


def _setup_commands() -> list[str]:
    start = README.index("## Set up and run the suite")
    section = README[start:README.index("\n## ", start + 1)]
    return _bash_blocks(section)


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


def test_the_readme_opens_with_its_two_commands_then_the_fast_path():
    assert "__CMD" not in README and "__FAST__" not in README, "placeholders left for the measured times"
    assert re.search(r"command 1: about \d+ min", README) and re.search(r"command 2: about \d+ min", README)
    # The README opens with its two commands (the ones .ci/run and a newcomer copy), and the fast path
    # for one's own kernel comes next, before the contract.
    command_1, command_2 = _setup_commands()
    assert _bash_blocks(README)[:2] == [command_1, command_2]
    assert README.index("## Set up and run the suite") < README.index("--impl path/to/my_kernel.py:attention -x") \
        < README.index("## The contract")
    assert (ROOT / "examples" / "reference_attention.py").exists()
