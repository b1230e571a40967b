"""Numerics of `tq.nn.Linear` for every recipe: y, dx and dW against the exact (fp64) computation,
with an SQNR threshold per recipe derived from its formats, and the delayed-scaling histories
(compiled == eager bit for bit: compile_tests/test_linear_numerics_compile.py).

How the thresholds are derived
==============================

SQNR = 10·log10(Σ ref² / Σ (out − ref)²), in dB, with ref computed in fp64 from the very inputs
the layer sees (already rounded to its dtype), so only the layer's own rounding counts.

One FP operand, RNE, m mantissa bits, amax scaled into the normal range: an element in the binade
[2^e, 2^(e+1)) has step 2^(e−m) and an error uniform in ±step/2 (variance step²/12). Hence

    SQNR_op = 10·log10(E[x²] / E[step²/12]) = 6.02·m + 10.79 + c,   c = 10·log10(E[x²] / E[4^⌊log2|x|⌋])

For Gaussian x, c = 2.67 dB (computed numerically; it varies by ±0.02 dB with where the scale puts
the binade edges). Written as the usual rule of thumb this is 6.02·(m+1) + 7.44 dB. Saturation does
not occur (amax maps to the format max) and subnormals hold a negligible share of a Gaussian's power,
and since a float's relative precision does not depend on the scale, the FP8 scale granularity
(tensor, row, 1x128, 128x128, MX 32-block) leaves this unchanged:

    E4M3 (m=3): 31.52 dB          E5M2 (m=2): 25.50 dB

E2M1 has too few binades for that formula (values 0, .5, 1, 1.5, 2, 3, 4, 6: a block's small
values sit on the 0.5 grid). NVFP4 scales each block so its amax maps to 6; the error is then
Σ over the grid's intervals of P(interval)·gap²/12, for a Gaussian whose block amax is its expected
value, 2.08σ for 16 elements (1x16 blocks) and 3.04σ for 256 (16x16 weight tiles: a larger amax
pushes the other elements down the grid). That gives 20.2 dB (1x16) and 18.9 dB (16x16).
Stochastic rounding of a value a fraction p along a gap g has error variance g²·p(1−p); averaged over
p that is g²/6, twice RNE's g²/12: −3.0 dB, 17.2 dB. The random Hadamard transform maps a Gaussian
block to a Gaussian block: no change for these inputs.

MXFP6's E2M3 (m = 3, but only 2 exponent bits) has E4M3's steps on its normal values and a
subnormal grid of 1/8 below 1, which a Gaussian block reaches: with the block amax at its expected
value for 32 elements (2.35σ), RCEIL's scale is 2^-1 (2.35 / 7.5 rounds up to 2^-1), so |x| < σ/2
falls on the 1/16σ grid. Integrating gap²/12 over the Gaussian gives 30.9 dB (measured on a
4096 x 4096 tensor: 30.95 dB), against 31.5 dB for the same block in E4M3.

A GEMM output y = Σ_k a_k·b_k with independent relative errors on a and b: E[δy²] = K·(σ_δa²σ_b² +
σ_a²σ_δb²), E[y²] = K·σ_a²σ_b², so the noise-to-signal ratios add, 1/SQNR_y = 1/SQNR_a + 1/SQNR_b
(two E4M3 operands: 31.52 − 3.01 = 28.51 dB). K cancels. The result's own rounding adds one more
term: for bf16/fp16 results (CPU matmuls accumulate in fp32 and round once) the formula above with
m = 7 / 10, 55.6 / 73.7 dB; for fp32 results the accumulation dominates: recursive summation of
n = 256 products rounds each partial sum S_j with variance ≈ (2^-24·S_j)²/3, Σ_j E[S_j²] ≈ n²σ²/2
against a signal nσ², so SQNR ≈ 10·log10(6 / (n·2^-48)) = 128.2 dB (blocked summation does better).
That term only shows in fp8_rowwise_hp_wgrad's dW, whose operands are not quantized.

Margin: the measured SQNRs (CPU, torch 2.13, these shapes) agree with the prediction to within
0.3 dB (except fp32 high-precision wgrad, 2.7 dB above its recursive-summation estimate, which is
a worst case) and vary by < 0.2 dB between seeds; the thresholds sit 1.5 dB below the prediction, which
absorbs that and the approximations above (block amax fixed at its mean, block scales' own E4M3
rounding ignored), and is still a quarter of what one lost mantissa bit (6 dB) would cost.

Measured (dB, y / dx / dW, fp32): fp8_tensorwise and fp8_delayed 28.5/24.6/24.6; fp8_rowwise,
fp8_blockwise, mxfp8 28.5/28.5/28.5; fp8_rowwise_hp_wgrad 28.5/28.5/130.9 (bf16 dW 55.6, fp16 73.7); nvfp4 16.7/15.0/15.6.
"""

from __future__ import annotations

import math

import pytest
import torch

import tqcompile as tq
from tqcompile.testing.compile import assert_bitwise_equal
from tqcompile.testing.numerics import sqnr

MARGIN_DB = 1.5

# Operand SQNRs (dB) from the derivation above.
E4M3 = 6.02 * 3 + 10.79 + 2.67
E5M2 = 6.02 * 2 + 10.79 + 2.67
NVFP4_1D = 20.2
NVFP4_2D = 18.9
NVFP4_1D_SR = NVFP4_1D - 3.0
MXFP6_E2M3 = 30.9
HIGH_PRECISION = math.inf  # an operand used as is

# The result's own rounding (see the derivation): fp32 accumulation over n = 256 products; bf16/fp16
# one rounding, the FP formula with m = 7 / 10 (c = 2.67 dB for Gaussian data).
OUTPUT_ROUNDING = {
    torch.float32: 10 * math.log10(6 / (256 * 2.0**-48)),
    torch.bfloat16: 6.02 * 7 + 10.79 + 2.67,
    torch.float16: 6.02 * 10 + 10.79 + 2.67,
}

# recipe -> ((a, b) operand SQNRs of fprop, dgrad, wgrad), per the operand table in tqcompile.recipes.
OPERANDS = {
    "fp8_tensorwise": ((E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)),
    "fp8_delayed": ((E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)),
    "fp8_rowwise": ((E4M3, E4M3), (E4M3, E4M3), (E4M3, E4M3)),
    "fp8_rowwise_hp_wgrad": ((E4M3, E4M3), (E4M3, E4M3), (HIGH_PRECISION, HIGH_PRECISION)),
    "fp8_blockwise": ((E4M3, E4M3), (E4M3, E4M3), (E4M3, E4M3)),
    "mxfp8": ((E4M3, E4M3), (E4M3, E4M3), (E4M3, E4M3)),
    "nvfp4": ((NVFP4_1D, NVFP4_2D), (NVFP4_1D_SR, NVFP4_2D), (NVFP4_1D_SR, NVFP4_1D)),
    "mxfp6": ((MXFP6_E2M3, MXFP6_E2M3), (E4M3, MXFP6_E2M3), (E4M3, E4M3)),
}


def _combine(*sqnrs_db: float) -> float:
    """Independent errors: noise-to-signal ratios add."""
    return -10 * math.log10(sum(10 ** (-s / 10) for s in sqnrs_db))


def expected_sqnr(recipe_name: str, dtype: torch.dtype) -> tuple[float, float, float]:
    """Predicted SQNR (dB) of y, dx, dW."""
    return tuple(_combine(a, b, OUTPUT_ROUNDING[dtype]) for a, b in OPERANDS[recipe_name])


def test_recipe_table_covers_every_recipe():
    assert set(OPERANDS) == set(tq.recipes.RECIPES)


def _data(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # (2, 128) tokens: 256 rows, whole 128-blocks along M for fp8_blockwise's wgrad operands.
    x = torch.randn(2, 128, 256, generator=g).to(dtype)
    w = (torch.randn(128, 256, generator=g) * 0.05).to(dtype)
    dy = torch.randn(2, 128, 128, generator=g).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(tq.recipes.RECIPES))
def test_linear_sqnr(name, dtype):
    x, w, dy = _data(dtype)
    layer = tq.nn.Linear(256, 128, bias=False, recipe=tq.recipes.get(name), dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    xq = x.clone().requires_grad_()
    y = layer(xq)
    y.backward(dy)
    assert y.dtype == dtype and xq.grad.dtype == dtype and layer.weight.grad.dtype == dtype

    x64, w64, dy64 = (t.double() for t in (x, w, dy))
    y_ref = x64 @ w64.t()
    dx_ref = dy64 @ w64
    dw_ref = dy64.reshape(-1, 128).t() @ x64.reshape(-1, 256)

    measured = (sqnr(y_ref, y), sqnr(dx_ref, xq.grad), sqnr(dw_ref, layer.weight.grad))
    predicted = expected_sqnr(name, dtype)
    for what, got, want in zip(("y", "dx", "dW"), measured, predicted):
        assert got >= want - MARGIN_DB, f"{name} {dtype} {what}: SQNR {got:.2f} dB < predicted {want:.2f} dB - {MARGIN_DB} dB"


def test_quantization_is_not_a_no_op():
    """The SQNR test bounds error from below only; check the FP8 layer really rounds (an upper bound too)."""
    x, w, dy = _data(torch.float32)
    layer = tq.nn.Linear(256, 128, bias=False, recipe=tq.recipes.fp8_tensorwise())
    with torch.no_grad():
        layer.weight.copy_(w)
    y = layer(x)
    assert sqnr(x.double() @ w.double().t(), y) < expected_sqnr("fp8_tensorwise", torch.float32)[0] + MARGIN_DB


# ---------------------------------------------------------------------------------------------
# Compiled == eager, bit for bit
# ---------------------------------------------------------------------------------------------
def _train_step(layer, x, dy, rng_seed: int):
    # nvfp4 draws its stochastic-rounding seeds from torch's generator: seed it the same for both runs.
    torch.manual_seed(rng_seed)
    xr = x.clone().requires_grad_()
    y = layer(xr)
    y.backward(dy)
    grads = (xr.grad, layer.weight.grad.clone(), layer.bias.grad.clone())
    layer.zero_grad()
    return (y.detach(), *grads)


def test_stochastic_rounding_depends_on_the_seed():
    """Makes the seeded bitwise comparison above meaningful for nvfp4: its gradients do vary with torch's RNG."""
    layer = tq.nn.Linear(128, 128, recipe=tq.recipes.nvfp4())
    x, dy = torch.randn(128, 128), torch.randn(128, 128)
    a, b, c = (_train_step(layer, x, dy, s) for s in (0, 0, 1))
    assert_bitwise_equal(a, b)
    assert not torch.equal(a[1], c[1]) and not torch.equal(a[2], c[2])
    assert torch.equal(a[0], c[0]), "forward has no stochastic rounding"


# ---------------------------------------------------------------------------------------------
# Delayed scaling
# ---------------------------------------------------------------------------------------------
def _finite_amax(t: torch.Tensor) -> float:
    return t.float().abs().max().item()


def test_delayed_scaling_uses_the_history_max():
    """Step 2's input is 8x smaller than step 1's: its scale must come from step 1's amax, not its own."""
    q = tq.Float8Quantizer()
    layer = tq.nn.Linear(64, 32, bias=False, recipe=tq.recipes.fp8_delayed(4))
    g = torch.Generator().manual_seed(0)
    big, small = torch.randn(16, 64, generator=g) * 8, torch.randn(16, 64, generator=g)
    layer(big).sum().backward()  # a training step: its amaxes enter the histories in its backward
    with torch.no_grad():
        y = layer(small)
    window = torch.tensor(_finite_amax(big))
    x_q = torch.ops.tqcompile.dequantize(*torch.ops.tqcompile.quantize(small, q, window, None), window, q, torch.float32)
    w_amax = torch.tensor(_finite_amax(layer.weight))
    w_q = torch.ops.tqcompile.dequantize(*torch.ops.tqcompile.quantize(layer.weight, q, w_amax, None), w_amax, q, torch.float32)
    assert_bitwise_equal(y, x_q @ w_q.t())
    # The small input quantized with its own (current) scale would differ: the test can tell.
    current = tq.quantize(small, q).dequantize()
    assert not torch.equal(current, x_q)


def test_2d_input_returns_no_view():
    """A 2-D input's output is the GEMM result itself, not a view of it: FSDP2 warns on every forward
    ("returned a view tensor ... skip the all-gather") when a layer that is its own unit returns a view."""
    layer = tq.nn.Linear(64, 32, recipe=tq.recipes.mxfp8())
    x = torch.randn(32, 64, requires_grad=True)
    y = layer(x)
    assert y._base is None and not y._is_view(), "a 2-D input's output must not be a view"
    y.sum().backward()
    assert x.grad.shape == x.shape
    y3 = layer(x.detach().view(2, 16, 64))
    assert y3.shape == (2, 16, 32)
    torch.testing.assert_close(y3.reshape(32, 32), y.detach(), rtol=0, atol=0)
