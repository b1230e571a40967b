"""The documentation's code runs, and its links resolve.

Every ```python block of README.md and docs/**/*.md is executed. Blocks of one file run in order
in one namespace (a page builds up its example like a notebook). All pages run in one separate
Python process (one torch import instead of one per page), so a page that sets global state (a
process group, Dynamo caches) cannot leak into the tests. A block that is illustrative only is
marked with a `<!-- skip-test -->` line right before it; use that sparingly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP_MARK = "<!-- skip-test -->"
MARKDOWN_FILES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])

# Runs the pages it is given on stdin, each in a fresh namespace, and prints one JSON line after
# _MARKER: page -> traceback or None. Each block is compiled under its Markdown file's name, padded
# so that traceback line numbers are the line numbers in that file.
_MARKER = "@@tqcompile-docs@@"
_RUNNER = """
import json, sys, traceback
results = {}
for filename, blocks in json.load(sys.stdin):
    namespace = {"__name__": "__main__"}
    try:
        for first_line, code in blocks:
            exec(compile("\\n" * (first_line - 1) + code, filename, "exec"), namespace)
        results[filename] = None
    except BaseException:
        results[filename] = traceback.format_exc()
print("MARKER" + json.dumps(results))
""".replace("MARKER", _MARKER)


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number of the block's first code line, code) of each runnable ```python block."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip().startswith("```python"):
            previous = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
            start = i + 1
            end = next((j for j in range(start, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise ValueError(f"{path}:{i + 1}: unterminated ```python block")
            if previous != SKIP_MARK:
                blocks.append((start + 1, "\n".join(lines[start:end]) + "\n"))
            i = end
        i += 1
    return blocks


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


FILES_WITH_CODE = [p for p in MARKDOWN_FILES if python_blocks(p)]


@pytest.fixture(scope="module")
def doc_results() -> dict[str, str | None]:
    """Run every page's blocks once, in one subprocess; page -> traceback (None: it ran)."""
    payload = json.dumps([(_rel(p), python_blocks(p)) for p in FILES_WITH_CODE])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER], input=payload, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARKER)]
    assert proc.returncode == 0 and lines, f"the docs runner itself failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len(_MARKER) :])


@pytest.mark.parametrize("path", FILES_WITH_CODE, ids=_rel)
def test_doc_examples_run(path: Path, doc_results):
    error = doc_results[_rel(path)]
    assert error is None, f"a code block of {_rel(path)} failed:\n{error}"


def test_the_core_pages_have_examples():
    # Guards the extractor as much as the pages: a fence it failed to see would silently pass.
    core = [ROOT / "README.md", DOCS / "concepts.md", *sorted((DOCS / "numerics").glob("*.md"))]
    assert len(core) >= 6
    for path in core:
        assert python_blocks(path), f"{_rel(path)} has no runnable ```python block"


def test_python_blocks_parser(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\na = 1\n```\n\n<!-- skip-test -->\n\n```python\nraise SystemExit\n```\n```bash\nls\n```\n")
    assert python_blocks(page) == [(3, "a = 1\n")]


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links inside code are not links
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=_rel)
def test_relative_links_resolve(path: Path):
    for target in _relative_links(path):
        assert (path.parent / target.split("#")[0]).exists(), f"{_rel(path)} links to {target}, which does not exist"


def test_index_links_every_page():
    index = DOCS / "index.md"
    linked = {(DOCS / t.split("#")[0]).resolve() for t in _relative_links(index)}
    missing = [_rel(p) for p in DOCS.rglob("*.md") if p != index and p.resolve() not in linked]
    assert not missing, f"docs/index.md does not link to {missing}; add them to its list of pages"
