"""tq's GPTQ against llmcompressor's on the same weight and Hessian (issue 28): the same algorithm
(group scales from the starting weight with static activation order, dampening 0.01 of the mean
diagonal, lazy blocks of 128), so the same codes up to floating-point ties and the same output
error. The fixture is llmcompressor 0.14's own result (tests/data/llmcompressor/gptq/make_fixture.py);
on the benchmark's Llama the two agree the same way layer by layer (docs/ptq.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tqcompile.calibration.gptq import GPTQ, gptq_quantize
from tqcompile.formats import Format
from tqcompile.quantizers import Granularity, IntGrid, IntQuantizer

FIXTURE = Path(__file__).resolve().parent / "data" / "llmcompressor" / "gptq" / "gptq_int4_g128.pt"


def weight_and_hessian() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixture's weight (64, 256) and ``2 X^T X / n`` (float64) of correlated inputs (make_fixture.py has a copy)."""
    g = torch.Generator().manual_seed(28)
    x = torch.randn(2048, 16, generator=g) @ torch.randn(16, 256, generator=g) + 0.3 * torch.randn(2048, 256, generator=g)
    x = x * torch.linspace(0.2, 3.0, 256)  # channels of unequal size, as activations have: act_order matters
    w = torch.randn(64, 256, generator=g) * 0.05
    x = x.double()
    return w, 2.0 * x.T @ x / x.shape[0]


def _output_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    d = (w - q).double()
    return float(((d @ h) * d).sum())


@pytest.mark.parametrize(("preset", "grid"), [("W4A16", IntGrid.FULL), ("W4A16_ASYM", IntGrid.ASYMMETRIC)])
def test_gptq_matches_llmcompressor(preset, grid):
    ref = torch.load(FIXTURE, weights_only=True)[preset]
    scale, zp = (t.float().repeat_interleave(128, dim=1) for t in (ref["scale"], ref["zero_point"]))
    q_llmc = (ref["codes"].float() - zp) * scale
    w, h = weight_and_hessian()
    q, _, how = gptq_quantize(w, h, IntQuantizer(Format.INT4, Granularity.BLOCKWISE_1D, block_size=128, grid=grid), GPTQ())
    assert how == "gptq"
    same = ((q - q_llmc).abs() <= 1e-6 * w.abs().max()).float().mean().item()
    err, err_llmc = _output_error(w, q, h), _output_error(w, q_llmc, h)
    # Measured (torch 2.13 CPU): every weight equal, the same output error. The margin is for float32
    # (llmcompressor) against float64 (tq) Hessian arithmetic deciding a near-tie the other way. Another
    # algorithm is far outside it: act_order=False 46% equal and 10.7x the error; dampening 0.1 or
    # 0.001 87% or 84% equal and 1.94x or 0.85x the error.
    assert same >= 0.99, same
    assert abs(err / err_llmc - 1) <= 0.005, (err, err_llmc)
