"""The import graph of `tqcompile/` has no circles, and every module imports on its own.

The graph is read from the source with `ast`: every `import` / `from ... import` of a tqcompile
module, at module level or inside a function (a deferred import is still an arrow: it only hides
the circle until the function runs). Importing `tqcompile.a.b` runs `tqcompile/a/__init__.py`
first, so an import also points at the packages above its target, except those above the
importing module itself (already being imported) and the root `tqcompile` (whose `__init__` is the
public facade that imports everything).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tqcompile"

# What may import the demo package (tqcompile.demo): the command line, and the demo itself.
DEMO = "tqcompile.demo"
MAY_IMPORT_DEMO = {"tqcompile.cli"}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path) -> dict[str, Path]:
    return {_module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The modules one import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: resolve against the importing module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    # `from pkg import name`: a submodule when one of that name exists, else an attribute of pkg.
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules (and packages) of `package` that importing it runs."""
    known = _modules(package)
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, module, is_package, known):
                parts = target.split(".")
                if parts[0] != package.name:
                    continue
                for i in range(2, len(parts) + 1):  # the target and the packages above it, below the root
                    name = ".".join(parts[:i])
                    if name in known and name not in own:
                        edges.add(name)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan), each a set of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_import_graph_has_no_cycles():
    found = [sorted(c) for c in cycles(import_graph())]
    assert not found, f"import circles in tqcompile/: {found}"


def test_the_library_never_imports_the_demo():
    arrows = [
        (module, target)
        for module, targets in import_graph().items()
        for target in targets
        if (target == DEMO or target.startswith(DEMO + ".")) and not (module == DEMO or module.startswith(DEMO + "."))
    ]
    assert {m for m, _ in arrows} <= MAY_IMPORT_DEMO, f"library modules importing the demo: {sorted(arrows)}"
    assert arrows, "the check must see the CLI's import of the demo (is the graph empty?)"


def test_the_graph_sees_deferred_imports_and_package_inits(tmp_path: Path):
    # The circles this file guards against hid in exactly these two places: pkg.a imports pkg.b.x
    # inside a function, which runs pkg/b/__init__.py, which imports pkg.b.y, which imports pkg.a.
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg.b import x\n",
        "b/__init__.py": "from pkg.b import y\n",
        "b/x.py": "",
        "b/y.py": "import pkg.a\n",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg.a"] == {"pkg.b", "pkg.b.x"}
    assert cycles(graph) == [{"pkg.a", "pkg.b", "pkg.b.y"}]
    real = import_graph()
    assert {"tqcompile.ops", "tqcompile.groups"} <= real["tqcompile.tensor"], "from tqcompile import ops"
    assert "tqcompile.kernels.triton.quantize" in real["tqcompile.ops.codec"], "an import inside a function"


# Each imported first, as if tqcompile/__init__.py imported it before anything else: the order of
# the imports there, or in a user's code, must not matter. Before the circles were untied,
# `tqcompile.tensor` first ran tensor -> distributed.groups -> distributed/__init__ -> fsdp -> tensor
# (half-initialised): "cannot import name 'QuantizedTensor'".
FIRST_IMPORTS = [
    "tqcompile.tensor",
    "tqcompile.groups",
    "tqcompile.api",
    "tqcompile.nn.quantized_linear",
    "tqcompile.nn.grouped",
    "tqcompile.calibration",
    "tqcompile.distributed.fsdp",
    "tqcompile.distributed.recompute",
    "tqcompile.distributed.tensor_parallel",
]

# One process imports torch (the slow part) and forks a child per module, all at once. The child registers an
# empty `tqcompile` package, so that importing the module does not run tqcompile/__init__.py first
# (which would import everything in its own order), imports the module, then runs the real
# tqcompile/__init__.py and touches a few public names.
_FORKED_IMPORTS = r"""
import importlib, os, sys, traceback, types
import torch, torch.distributed.checkpoint.state_dict, torch.distributed.fsdp, torch.distributed.tensor.parallel  # noqa: F401
root = sys.argv[1]
children = {}
for name in sys.argv[2:]:  # all at once: the children only import
    pid = os.fork()
    if pid == 0:
        try:
            package = types.ModuleType("tqcompile")
            package.__path__ = [os.path.join(root, "tqcompile")]
            package.__file__ = os.path.join(root, "tqcompile", "__init__.py")
            sys.modules["tqcompile"] = package
            importlib.import_module(name)
            with open(package.__file__) as f:
                exec(compile(f.read(), package.__file__, "exec"), package.__dict__)
            tq = package
            tq.convert, tq.distributed.ColwiseParallel, tq.nn.is_converted, tq.distributed.all_reduce_amax
        except BaseException:
            sys.stderr.write(f"--- {name} first:\n{traceback.format_exc()}")
            os._exit(1)
        os._exit(0)
    children[pid] = name
failed = sorted(name for pid, name in children.items() if os.waitpid(pid, 0)[1])
print("failed:", failed)
sys.exit(1 if failed else 0)
"""


def test_any_module_imports_first():
    proc = subprocess.run(
        [sys.executable, "-c", _FORKED_IMPORTS, str(ROOT), *FIRST_IMPORTS], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"


def test_import_prints_nothing():
    # torch 2.14 renamed its opaque-type API and logs a deprecation line per use of an old name:
    # `import tqcompile` printed 13 lines before anything else (tqcompile/_opaque.py picks the names).
    proc = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", "import tqcompile"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout == "" and proc.stderr == "", f"torch {torch.__version__}:\n{proc.stdout}{proc.stderr}"
