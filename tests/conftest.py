"""Shared test settings.

Hypothesis deadlines are off: a 2-core CI machine shared with other jobs makes per-example wall
time meaningless, and nothing here asserts on time. Each property test sets its own
`max_examples`, sized so the whole `tests/` directory stays fast.
"""

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "tqcompile",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("tqcompile")


_FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


@pytest.fixture
def float8_comparable(monkeypatch):
    """Let `torch.library.opcheck`'s schema check compare float8 tensors.

    Its SchemaCheckMode (torch 2.13) checks that an op left its inputs unchanged with
    `torch.allclose`, which has no CPU kernel for float8 dtypes. Comparing their bits instead is
    exact: a stricter check than allclose, not a looser one.
    """
    allclose = torch.allclose

    def allclose_bits(a, b, *args, **kwargs):
        if a.dtype in _FLOAT8_DTYPES or b.dtype in _FLOAT8_DTYPES:
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", allclose_bits)
