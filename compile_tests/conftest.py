"""Shared setup for the compile tests: a clean Dynamo state per test.

Dynamo's caches and counters are process-global, and it stops compiling a function after
`recompile_limit` recompiles: without a reset, one test's compiles would change another's counts.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()
