"""Public test helpers: hypothesis strategies, numerics assertions, compile assertions.

- `tqcompile.testing.numerics`: `sqnr`, `assert_sqnr`, `assert_payload_equal` (bit for bit), error bounds.
- `tqcompile.testing.compile`: `assert_no_graph_breaks`, `CompileCounter` (graph breaks and
  recompiles), `AotGraphRecorder`, `assert_bitwise_equal`.
- `tqcompile.testing.comm`: `count_collective_bytes` (bytes and calls of torch.distributed collectives).
- `tqcompile.testing.distributed`: `spawn` (a function on several gloo processes, failing fast, never hanging),
  `run_ranks` (its form for tests: a check per rank, what each rank saved returned) and `run_checks`
  (several named checks in one spawn; a failure names the check and the rank).
- `tqcompile.testing.strategies`: hypothesis strategies for quantizers and tensors (needs
  `hypothesis`, the `test` extra; imported on first use so the rest works without it).
"""

from __future__ import annotations

import importlib
from typing import Any

from tqcompile.testing.comm import CollectiveBytes, count_collective_bytes
from tqcompile.testing.compile import AotGraphRecorder, CompileCounter, assert_bitwise_equal, assert_no_graph_breaks, graph_code
from tqcompile.testing.distributed import CheckFailed, run_checks, run_ranks, spawn
from tqcompile.testing.numerics import assert_error_within, assert_payload_equal, assert_sqnr, error_bound, sqnr

__all__ = [
    "sqnr",
    "assert_sqnr",
    "assert_payload_equal",
    "error_bound",
    "assert_error_within",
    "CompileCounter",
    "assert_no_graph_breaks",
    "assert_bitwise_equal",
    "count_collective_bytes",
    "spawn",
    "strategies",
]


def __getattr__(name: str) -> Any:
    if name == "strategies":
        return importlib.import_module("tqcompile.testing.strategies")
    raise AttributeError(f"module 'tqcompile.testing' has no attribute {name!r}")
