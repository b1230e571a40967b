"""The README's two set-up commands stay true: CI runs exactly the README's test command, and the
main-job command names an installed entry point."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_commands(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_ci_runs_the_readme_test_command():
    commands = _bash_commands((ROOT / "README.md").read_text())
    test_cmds = [c for c in commands if "pytest" in c]
    assert len(test_cmds) == 1, f"README should give one test command, found {test_cmds}"
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmds[0] in ci_lines, f".ci/run must run the README's test command verbatim: {test_cmds[0]!r}"


def test_readme_main_job_is_the_demo_entry_point():
    commands = _bash_commands((ROOT / "README.md").read_text())
    assert any(c.endswith("tqcompile demo") and "torch==2.13.0" in c for c in commands), commands
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'tqcompile = "tqcompile.cli:main"' in pyproject
    from tqcompile import cli

    assert callable(cli.main)
