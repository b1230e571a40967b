"""`tq.nn.GroupedLinear` (MoE experts): per-expert scales, dense and m_splits inputs, backward, compile."""

from __future__ import annotations

import copy

import pytest
import torch

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal
from tqcompile.testing.numerics import sqnr

E, K, N = 4, 128, 128
# Recipes whose scales could be shared across experts if the layer got it wrong: a tensor-level
# amax (fp8_tensorwise; nvfp4's global amax under its block scales) or per-row/per-block scales.
RECIPES = ["fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4"]


def _experts(name: str, bias: bool = False, seed: int = 0) -> tq.nn.GroupedLinear:
    torch.manual_seed(seed)
    return tq.nn.GroupedLinear(E, K, N, bias=bias, recipe=tq.recipes.get(name))


def _step(experts, x, dy, m_splits=None, rng_seed=0):
    torch.manual_seed(rng_seed)  # nvfp4's stochastic rounding seeds
    xr = x.clone().requires_grad_()
    y = experts(xr, m_splits) if m_splits is not None else experts(xr)
    y.backward(dy)
    out = (y.detach(), xr.grad, experts.weight.grad.clone())
    experts.zero_grad()
    return out


@pytest.mark.parametrize("name", RECIPES)
def test_per_expert_scales(name):
    """Expert 0's weights 1000x larger leave every other expert's results unchanged, bit for bit,
    and each expert's output keeps the SQNR of its recipe."""
    experts = _experts(name)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(E, 32, K, generator=g), torch.randn(E, 32, N, generator=g)
    before = _step(experts, x, dy)
    with torch.no_grad():
        experts.weight[0] *= 1000
    after = _step(experts, x, dy)
    for what, b, a in zip(("y", "dx", "dW"), before, after):
        assert_bitwise_equal(a[1:], b[1:], f"{what} of experts 1..{E - 1}")
    # Expert 0's own output and input gradient do change (its dW = dyᵀ·x does not involve W).
    assert not torch.equal(after[0][0], before[0][0]) and not torch.equal(after[1][0], before[1][0])
    # Per-expert output SQNR against fp64, including the scaled-up expert. Thresholds from
    # tests/test_linear_numerics.py (derived there from the formats): fprop with two E4M3 operands
    # 28.5 dB, nvfp4's 1x16 x 16x16 fprop 16.5 dB; minus the same 1.5 dB margin.
    threshold = {"nvfp4": 16.5 - 1.5}.get(name, 28.5 - 1.5)
    ref = torch.einsum("etk,enk->etn", x.double(), experts.weight.detach().double())
    for e in range(E):
        assert sqnr(ref[e], after[0][e]) >= threshold, f"expert {e}"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_blockwise", "nvfp4"])
def test_dense_and_m_splits_agree(name, bias):
    experts = _experts(name, bias=bias)
    tokens = 128  # a whole 128-block along the tokens for fp8_blockwise's wgrad operands
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(E, tokens, K, generator=g), torch.randn(E, tokens, N, generator=g)
    dense = _step(experts, x, dy)
    split = _step(experts, x.reshape(-1, K), dy.reshape(-1, N), m_splits=[tokens] * E)
    assert_bitwise_equal(split[0], dense[0].reshape(-1, N))
    assert_bitwise_equal(split[1], dense[1].reshape(-1, K))
    assert_bitwise_equal(split[2], dense[2])


def test_uneven_m_splits_equal_one_linear_per_expert():
    """Each expert's slice of tokens is exactly a tq.nn.linear with that expert's weight and bias."""
    experts = _experts("fp8_rowwise", bias=True)
    m_splits = [5, 0, 17, 10]
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(sum(m_splits), K, generator=g), torch.randn(sum(m_splits), N, generator=g)
    y, dx, dw = _step(experts, x, dy, m_splits=m_splits)
    assert y.shape == (32, N) and dx.shape == (32, K) and dw.shape == (E, N, K)
    start = 0
    for e, m in enumerate(m_splits):
        xe = x[start : start + m].clone().requires_grad_()
        we = experts.weight[e].detach().clone().requires_grad_()
        ye = tq.nn.linear(xe, we, experts.bias[e].detach(), experts.recipe)
        ye.backward(dy[start : start + m])
        assert_bitwise_equal(y[start : start + m], ye.detach(), f"y of expert {e}")
        assert_bitwise_equal(dx[start : start + m], xe.grad, f"dx of expert {e}")
        assert_bitwise_equal(dw[e], we.grad, f"dW of expert {e}")
        start += m
    assert not dw[1].any(), "an expert with no tokens gets a zero weight gradient"


def test_backward_reaches_every_parameter():
    experts = _experts("mxfp8", bias=True)
    x = torch.randn(E, 32, K, requires_grad=True)
    experts(x).pow(2).mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert experts.weight.grad.shape == (E, N, K) and all(experts.weight.grad[e].abs().sum() > 0 for e in range(E))
    assert experts.bias.grad.shape == (E, N)


@pytest.mark.parametrize("mode", ["dense", "m_splits"])
@pytest.mark.parametrize("name", ["fp8_tensorwise", "nvfp4"])
def test_compiled_fullgraph_no_graph_breaks(name, mode):
    torch.compiler.reset()
    experts = _experts(name)
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(copy.deepcopy(experts), backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(4)
    m_splits = [16, 48, 32, 32] if mode == "m_splits" else None
    shape = (128,) if mode == "m_splits" else (E, 32)
    x, dy = torch.randn(*shape, K, generator=g), torch.randn(*shape, N, generator=g)
    assert_bitwise_equal(_step(compiled, x, dy, m_splits), _step(experts, x, dy, m_splits))
    assert counter.frame_count == 1 and counter.graph_breaks == 0 and counter.recompiles == 0, counter
    torch.compiler.reset()
