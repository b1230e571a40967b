"""tqcompile without Triton: Triton is the `cuda` extra, not a dependency (about 1 GB installed).

One child process, in which triton cannot be found (the path finder is replaced by one that finds
no triton: `find_spec` gives None and `import triton` raises ModuleNotFoundError, as on a machine
without it; torch's own `has_triton` then answers False), runs
docs/examples/train_your_model.py (a user's model converted, compiled with inductor on CPU,
AdamW steps) and then the CUDA quantize kernel on a CPU tensor, which must fall back to the
reference kernel and warn once, naming the extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "train_your_model.py"
_MARKER = "@@tqcompile-no-triton@@"
pytestmark = pytest.mark.slow  # one child process that compiles with inductor: 25-45 s of CPU time

_CHILD = """
import importlib.machinery, importlib.util, json, runpy, sys, warnings

class NoTriton(importlib.machinery.PathFinder):
    # Takes the place of the path finder and finds no triton: find_spec gives None and `import
    # triton` raises ModuleNotFoundError, as without the package. (torch 2.14's own `import torch`
    # asks importlib.util.find_spec("triton"): a finder that raised there broke `import torch`.)
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [NoTriton if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
assert NoTriton in sys.meta_path and importlib.util.find_spec("triton") is None
sys.argv = ["train_your_model.py", "mxfp8"]
runpy.run_path(EXAMPLE, run_name="__main__")

import torch
import tqcompile as tq
from tqcompile.kernels import reference
from tqcompile.ops.codec import _quantize_cuda

q = tq.MXQuantizer()
x = torch.randn(64, 128)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    fallback = [_quantize_cuda(x, q, None, None) for _ in range(2)]
expected = reference.quantize(x, q, None, None)
print(MARKER + json.dumps({
    "triton_imported": sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.")),
    "warnings": [str(w.message) for w in caught],
    "bit_exact": all(torch.equal(a, b) for out in fallback for a, b in zip(out, expected)),
}))
""".replace("MARKER", repr(_MARKER)).replace("EXAMPLE", repr(str(EXAMPLE)))


@pytest.fixture(scope="module")
def child() -> tuple[str, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARKER)]
    assert proc.returncode == 0 and lines, (
        f"the child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc.stdout, json.loads(lines[-1][len(_MARKER) :])


def test_the_inductor_example_trains_without_triton(child):
    stdout, result = child
    losses = [float(line.rsplit(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("mxfp8 step ")]
    assert len(losses) == 8, stdout
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses  # the example asserts it too; this says what it printed
    assert result["triton_imported"] == [], "nothing may import Triton on the CPU path"


def test_cuda_quantize_without_triton_falls_back_and_warns_once(child):
    _, result = child
    assert result["bit_exact"], "the fallback must be the reference kernel, bit for bit"
    assert len(result["warnings"]) == 1, result["warnings"]
    message = result["warnings"][0]
    assert 'pip install "tqcompile[cuda]"' in message and "No module named 'triton'" in message, message
