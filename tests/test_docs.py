"""The documentation's code runs, and its links resolve.

Every ```python block of README.md and docs/**/*.md (new pages are picked up by the glob) is
executed ALONE, in a fresh namespace: a reader pastes one block, not a page, so each block
carries its own imports and set-up. All blocks run in one separate Python process (one torch
import instead of one per block), so a block that sets global state (a process group, Dynamo
caches) cannot leak into the tests. A block that is illustrative only is marked with a
`<!-- skip-test -->` line right before it; use that sparingly.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP_MARK = "<!-- skip-test -->"
MARKDOWN_FILES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])

# Runs the blocks it is given on stdin, each in its own fresh namespace, and prints one JSON line
# after _MARKER: block id -> traceback or None. Each block is compiled under its Markdown file's
# name, padded so that traceback line numbers are the line numbers in that file.
_MARKER = "@@tqcompile-docs@@"
_RUNNER = """
import json, sys, traceback
results = {}
for block_id, filename, first_line, code in json.load(sys.stdin):
    namespace = {"__name__": "__main__"}
    try:
        exec(compile("\\n" * (first_line - 1) + code, filename, "exec"), namespace)
        results[block_id] = None
    except BaseException:
        results[block_id] = traceback.format_exc()
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


def run_blocks_alone(blocks: list[tuple[str, str, int, str]], cwd: Path = ROOT) -> dict[str, str | None]:
    """Run each (block id, file name, first line, code) alone in a fresh namespace, all in one
    subprocess; block id -> traceback (None: it ran)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER], input=json.dumps(blocks), capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARKER)]
    assert proc.returncode == 0 and lines, f"the docs runner itself failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len(_MARKER) :])


# One test per block, named "<page>:<first code line>", so a failure says which block to open.
BLOCKS = [(f"{_rel(p)}:{first}", _rel(p), first, code) for p in MARKDOWN_FILES for first, code in python_blocks(p)]


@pytest.fixture(scope="module")
def doc_results() -> dict[str, str | None]:
    """Run every block once, each alone; block id -> traceback (None: it ran)."""
    return run_blocks_alone(BLOCKS)


@pytest.mark.parametrize("block_id", [b[0] for b in BLOCKS])
def test_doc_block_runs_alone(block_id: str, doc_results):
    error = doc_results[block_id]
    assert error is None, f"the code block at {block_id} failed when run alone (does it import what it uses?):\n{error}"


def test_blocks_do_not_share_a_namespace(tmp_path: Path):
    # The regression this file guards: a block that leans on a name an earlier block defined.
    page = tmp_path / "page.md"
    page.write_text("```python\nimport math\nhalf = math.pi / 2\n```\n\n```python\nprint(half)\n```\n")
    blocks = [(f"page.md:{first}", str(page), first, code) for first, code in python_blocks(page)]
    results = run_blocks_alone(blocks, cwd=tmp_path)
    assert results["page.md:2"] is None
    assert "NameError: name 'half' is not defined" in results["page.md:7"], results


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


# --- docs/api.md is complete against every public __all__ -------------------------------------

API_PAGE = DOCS / "api.md"
_API_SECTION = re.compile(r"^## `(tqcompile(?:\.\w+)*)`\s*$")
_API_ENTRY = re.compile(r"^- \*\*`(\w+)`\*\*(.*)$")


def public_modules() -> dict[str, types.ModuleType]:
    """`tqcompile`, every subpackage with an `__all__` (new ones are picked up), and every module
    named in a public `__all__` (e.g. `tqcompile.testing.strategies`), by dotted name."""
    import tqcompile

    found = {"tqcompile": tqcompile}
    for info in pkgutil.iter_modules(tqcompile.__path__):
        if info.ispkg and not info.name.startswith("_"):
            module = importlib.import_module(f"tqcompile.{info.name}")
            if hasattr(module, "__all__"):
                found[module.__name__] = module
    todo = list(found.values())
    while todo:
        module = todo.pop()
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, types.ModuleType) and hasattr(value, "__all__") and value.__name__ not in found:
                found[value.__name__] = value
                todo.append(value)
    return found


def api_entries(path: Path = API_PAGE) -> dict[str, dict[str, str]]:
    """module -> {name: the entry's text after the name (signature, purpose)} of an API page.
    Sections are level-2 headings holding a backticked module name; entries are list items that
    start with the bold, backticked name."""
    entries: dict[str, dict[str, str]] = {}
    section = None
    for line in path.read_text().splitlines():
        if heading := _API_SECTION.match(line):
            section = entries.setdefault(heading.group(1), {})
        elif (entry := _API_ENTRY.match(line)) and section is not None:
            section[entry.group(1)] = entry.group(2)
    return entries


def _parameter_names(obj: object) -> list[str]:
    """The parameter names an entry's signature must show (none for enums, modules, constants and
    exception/warning classes, whose call signatures are not theirs)."""
    if (
        isinstance(obj, types.ModuleType)
        or not callable(obj)
        or (isinstance(obj, type) and issubclass(obj, (enum.Enum, BaseException)))
    ):
        return []
    schema = getattr(getattr(obj, "_opoverload", None), "_schema", None)  # a torch.library custom op
    if schema is not None:
        return [a.name for a in schema.arguments]
    try:
        return [p.name for p in inspect.signature(obj).parameters.values()]
    except (TypeError, ValueError):
        return []


def test_api_page_lists_every_public_name():
    documented = api_entries()
    missing, stale, no_purpose, wrong_signature = [], [], [], []
    for module_name, module in public_modules().items():
        entries = documented.get(module_name, {})
        missing += [f"{module_name}.{n}" for n in module.__all__ if n not in entries]
        stale += [f"{module_name}.{n}" for n in entries if n not in module.__all__]
        for name, text in entries.items():
            if name not in module.__all__:
                continue
            signature, _, purpose = text.partition(": ")
            if not purpose.strip():
                no_purpose.append(f"{module_name}.{name}")
            absent = [p for p in _parameter_names(getattr(module, name)) if not re.search(rf"\b{p}\b", signature)]
            if absent:
                wrong_signature.append(f"{module_name}.{name} (lacks {', '.join(absent)})")
    assert not missing, (
        f"docs/api.md has no entry for {missing}: add '- **`name`**`(signature)`: purpose.' under its module's heading"
    )
    assert not stale, f"docs/api.md documents names that are not in their module's __all__: {stale}"
    assert not no_purpose, f"docs/api.md entries without a one-line purpose: {no_purpose}"
    assert not wrong_signature, f"docs/api.md signatures that do not match the code: {wrong_signature}"


def test_api_page_parser_names_what_is_missing(tmp_path: Path):
    page = tmp_path / "api.md"
    page.write_text("## `tqcompile.optim`\n\n- **`compile_optimizer_step`**`(optimizer, **compile_kwargs)`: compiled step.\n")
    assert api_entries(page) == {"tqcompile.optim": {"compile_optimizer_step": "`(optimizer, **compile_kwargs)`: compiled step."}}
    assert "tqcompile.optim" in public_modules() and "tqcompile.testing.strategies" in public_modules()
    from tqcompile.ops import quantize

    assert _parameter_names(quantize) == ["x", "quantizer", "amax", "seed", "flat_scale"]
