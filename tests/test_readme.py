"""The README's two set-up commands stay true: CI runs exactly the README's test command, and the
main-job command names an installed entry point."""

import re
from pathlib import Path

import pytest

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


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_main_job_installs_what_it_needs():
    # `pip install -e .` alone must give the demo its picture (matplotlib) and torch its NumPy
    # (without it every command prints "Failed to initialize NumPy"): core dependencies, not extras.
    names = {re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].strip().lower() for dep in _pyproject()["project"]["dependencies"]}
    missing = {"torch", "numpy", "matplotlib"} - names
    assert not missing, f"pyproject [project] dependencies lack {sorted(missing)}"


def test_the_version_has_one_source():
    project = _pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tqcompile.__version__"}
    import tqcompile

    assert re.fullmatch(r"\d+\.\d+\.\d+", tqcompile.__version__)


def test_triton_is_an_extra_not_a_dependency():
    # Triton (about 1 GB) runs only the CUDA quantize kernels, and CPU use never imports it
    # (tests/test_without_triton.py): a CPU-only `pip install -e .` must not pull it in. The tests
    # need it (the kernels run under Triton's interpreter), so the test extra keeps it.
    project = _pyproject()["project"]
    assert not any(dep.lower().startswith("triton") for dep in project["dependencies"]), project["dependencies"]
    for extra in ("cuda", "test"):
        assert "triton; platform_system == 'Linux'" in project["optional-dependencies"][extra], extra
