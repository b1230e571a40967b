"""The quantized GEMM op `tqcompile::gemm_tn`, the delayed-scaling op `tqcompile::amax_history_update`,
and the three GEMMs of each recipe's linear layer.

- `opcheck` (schema, fake kernel, autograd registration, AOT dispatch) for every operand family;
- on CPU `gemm_tn` computes FP8 tensorwise/rowwise pairs as CPU `torch._scaled_mm` does, in plain
  torch (`fp8_gemm_cpu`, which inductor can fuse): bit for bit equal to `torch._scaled_mm`, and to
  the dequantize-to-fp32-and-matmul emulation where fp32 arithmetic is exact;
- for each named recipe, the layer's y / dx / dW equal, bit for bit, the GEMMs of the operands each
  recipe names (quantized by `tq.quantize` with the right quantizer and usage, then dequantized):
  this pins which quantizer each operand gets and which usage (rowwise/columnwise) each GEMM reads.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tqcompile as tq
from tqcompile.testing.compile import assert_bitwise_equal

G, F = tq.Granularity, tq.Format
gemm_tn = torch.ops.tqcompile.gemm_tn.default
dequantize_op = torch.ops.tqcompile.dequantize.default

# opcheck on float8 operands uses the `float8_comparable` fixture from tests/conftest.py.


def _operand(q: tq.Quantizer, rows: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # Rows spread over a few binades so rowwise/block scales differ from the tensor scale.
    x = torch.randn(rows, k, generator=g) * torch.logspace(-1, 1, rows).unsqueeze(1)
    return tq.quantize(x, q, seed=torch.tensor([seed, 0])).usage(False)


def _emulated(a, qa, b, qb, out_dtype):
    """The emulation `gemm_tn` defines: dequantize both operands to fp32, matmul, cast."""
    a32 = dequantize_op(*a[:2], a[2], qa, torch.float32)
    b32 = dequantize_op(*b[:2], b[2], qb, torch.float32)
    return (a32 @ b32.t()).to(out_dtype)


GEMM_OPERANDS = {
    "fp8_tensorwise": (tq.Float8Quantizer(), tq.Float8Quantizer()),
    "fp8_rowwise": (
        tq.Float8Quantizer(granularity=G.ROWWISE),
        tq.Float8Quantizer(granularity=G.ROWWISE, power_of_two_scale=True),
    ),
    "fp8_e5m2_x_e4m3": (tq.Float8Quantizer(format=F.E5M2), tq.Float8Quantizer()),
    "mxfp8": (tq.MXQuantizer(), tq.MXQuantizer(scale_rounding=tq.ScaleRounding.RCEIL)),
    "mxfp4": (tq.MXQuantizer(format=F.E2M1), tq.MXQuantizer(format=F.E2M1)),
    "nvfp4": (tq.NVFP4Quantizer(stochastic_rounding=True), tq.NVFP4Quantizer(block_2d=True)),
    "nvfp4_hadamard": (tq.NVFP4Quantizer(hadamard=True, hadamard_seed=5), tq.NVFP4Quantizer(hadamard=True, hadamard_seed=5)),
    "fp8_blockwise": (
        tq.Float8Quantizer(granularity=G.BLOCKWISE_1D, power_of_two_scale=True),
        tq.Float8Quantizer(granularity=G.BLOCKWISE_2D, power_of_two_scale=True),
    ),
}


@pytest.mark.usefixtures("float8_comparable")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(GEMM_OPERANDS))
def test_gemm_tn_opcheck(name, out_dtype):
    qa, qb = GEMM_OPERANDS[name]
    a, b = _operand(qa, 128, 128, 0), _operand(qb, 256, 128, 1)
    torch.library.opcheck(gemm_tn, (*a, qa, *b, qb, out_dtype))


@pytest.mark.parametrize("name", list(GEMM_OPERANDS))
def test_gemm_tn_equals_emulation(name):
    """Every family: the op is the emulation (bitwise; the scaled_mm ones are checked more below)."""
    qa, qb = GEMM_OPERANDS[name]
    a, b = _operand(qa, 128, 256, 2), _operand(qb, 128, 256, 3)
    out = gemm_tn(*a, qa, *b, qb, torch.float32)
    assert out.shape == (128, 128)
    assert_bitwise_equal(out, _emulated(a, qa, b, qb, torch.float32))


def test_amax_history_update_opcheck():
    history = torch.tensor([0.0, 3.0, 5.0, 1.0])
    torch.library.opcheck(torch.ops.tqcompile.amax_history_update.default, (history, torch.tensor(2.0)))


def test_amax_history_update_semantics():
    update = torch.ops.tqcompile.amax_history_update
    history = torch.zeros(3)
    # First step: the history is all zeros, so the current amax is used.
    assert update(history, torch.tensor(4.0)).item() == 4.0
    assert history.tolist() == [4.0, 0.0, 0.0]
    # Later steps: the window's max *before* this step's amax enters, then roll and write at 0.
    assert update(history, torch.tensor(1.0)).item() == 4.0
    assert history.tolist() == [1.0, 4.0, 0.0]
    assert update(history, torch.tensor(2.0)).item() == 4.0
    assert history.tolist() == [2.0, 1.0, 4.0]
    # The 4.0 leaves the window once it has rolled past the end.
    assert update(history, torch.tensor(0.5)).item() == 4.0
    assert history.tolist() == [0.5, 2.0, 1.0]
    assert update(history, torch.tensor(0.5)).item() == 2.0


_SCALED_MM_QUANTIZERS = st.sampled_from(
    [
        tq.Float8Quantizer(format=fmt, granularity=gran, power_of_two_scale=p2)
        for fmt in (F.E4M3, F.E5M2)
        for gran in (G.TENSORWISE, G.ROWWISE)
        for p2 in (False, True)
    ]
)
_OUT_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def _scaled_mm_operands(qa, qb, m, n, k, seed, exact: bool):
    """Quantized operands for the scaled_mm path; the second takes the first's granularity
    (scaled_mm takes tensorwise or rowwise scales, not one of each)."""
    qb = tq.Float8Quantizer(format=qb.format, granularity=qa.granularity, power_of_two_scale=qb.power_of_two_scale)
    if not exact:
        return qb, _operand(qa, m, k, seed), _operand(qb, n, k, seed + 1)
    g = torch.Generator().manual_seed(seed)
    operands = []
    for q, rows in ((qa, m), (qb, n)):
        # Integers of at most 3 significant bits (exact in E4M3 and E5M2), each row times 2^e.
        # Every row and the tensor have amax 7·2^e, so every scale (fmt_max / amax, with or
        # without power-of-two rounding) is a power of two and quantization is exact. A dot
        # product of two rows is then 2^(e_a + e_b) times a sum of integers below 49·K < 2^24:
        # exact in fp32 in any order, so any correct GEMM gives the same bits.
        ints = torch.randint(-7, 8, (rows, k), generator=g).float()
        ints[:, 0] = 7.0
        exps = torch.randint(-3, 4, (rows, 1), generator=g).float()
        operands.append(tq.quantize(ints * 2.0**exps, q).usage(False))
    return qb, *operands


def _spy_scaled_mm(mp, calls):
    scaled_mm = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return scaled_mm(*args, **kwargs)

    mp.setattr(torch, "_scaled_mm", spy)


def _fp8_pair_cases(test):
    """The hypothesis cases of the FP8 tensorwise/rowwise GEMM tests: shapes, quantizers, output dtype, seed."""
    return settings(max_examples=40, deadline=None)(
        given(
            m=st.integers(1, 48),
            n=st.integers(1, 48),
            k=st.integers(1, 96),
            qa=_SCALED_MM_QUANTIZERS,
            qb=_SCALED_MM_QUANTIZERS,
            out_dtype=_OUT_DTYPES,
            seed=st.integers(0, 2**16),
        )(test)
    )


def _cpu_scaled_mm_takes_rowwise() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes per-row scales (2.13 does; 2.11 asserts
    "only supports per-tensor scaling for CPU backend")."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


_CPU_SCALED_MM_ROWWISE = _cpu_scaled_mm_takes_rowwise()


@_fp8_pair_cases
def test_scaled_mm_path_equals_emulation_when_arithmetic_is_exact(m, n, k, qa, qb, out_dtype, seed):
    """Where fp32 arithmetic is exact, the CPU FP8 path equals the emulation bit for bit: the
    scales (tensorwise, per row, transposed for b) are applied exactly as the emulation applies them."""
    qb, a, b = _scaled_mm_operands(qa, qb, m, n, k, seed, exact=True)
    out = gemm_tn(*a, qa, *b, qb, out_dtype)
    assert_bitwise_equal(out, _emulated(a, qa, b, qb, out_dtype))


@_fp8_pair_cases
def test_cpu_fp8_path_equals_torch_scaled_mm(m, n, k, qa, qb, out_dtype, seed):
    """On CPU, FP8 tensorwise/rowwise pairs are computed by `fp8_gemm_cpu` (plain torch, so inductor
    can fuse it), not by calling `torch._scaled_mm`: it must equal CPU `torch._scaled_mm` bit for
    bit on general operands (same products, same BLAS call on a contiguous (K, N) operand)."""
    qb, a, b = _scaled_mm_operands(qa, qb, m, n, k, seed, exact=False)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        _spy_scaled_mm(mp, calls)
        out = gemm_tn(*a, qa, *b, qb, out_dtype)
    assert not calls, "the CPU FP8 path must not call the opaque torch._scaled_mm"
    if G.ROWWISE in (qa.granularity, qb.granularity) and not _CPU_SCALED_MM_ROWWISE:
        return  # torch < 2.13: CPU _scaled_mm has no rowwise scales to compare with
    expected = torch._scaled_mm(a[0], b[0].t(), scale_a=a[1], scale_b=b[1].t(), out_dtype=out_dtype)
    assert_bitwise_equal(out, expected)


def _dot_error_bound(a64: torch.Tensor, b64: torch.Tensor, out_dtype: torch.dtype, roundings: int) -> torch.Tensor:
    """Worst-case |computed - exact| of ``a @ b.T`` accumulated in fp32 in any order, then cast.

    Higham's bound: a dot product of length K whose every term passes through at most n fp32
    roundings (here: dequantizing each operand, the product, and the K-1 additions) is within
    γ_n·Σ|a_k·b_k| of exact, γ_n = n·u / (1 - n·u), u = 2^-24. The cast to `out_dtype` adds
    u_out·|value| (RNE, u_out = eps/2) plus half a subnormal step."""
    u = 2.0**-24
    gamma = roundings * u / (1 - roundings * u)
    bound = gamma * (a64.abs() @ b64.abs().t())
    if out_dtype != torch.float32:
        fi = torch.finfo(out_dtype)
        bound = bound * (1 + fi.eps / 2) + fi.eps / 2 * (a64 @ b64.t()).abs() + fi.smallest_normal * fi.eps / 2
    return bound


@_fp8_pair_cases
def test_scaled_mm_path_within_fp32_accumulation_of_exact(m, n, k, qa, qb, out_dtype, seed):
    """With general operands, `torch._scaled_mm` and the emulation are NOT always bitwise equal on
    CPU (torch 2.13): for some shapes the BLAS kernel it picks sums in another order (1-ulp
    differences, e.g. m=1, n=2, k=2). Both must lie within the fp32 accumulation bound of the exact
    product of the dequantized operands (payload x scale_inv, in fp64)."""
    qb, a, b = _scaled_mm_operands(qa, qb, m, n, k, seed, exact=False)
    a64, b64 = (t[0].double() * t[1].double() for t in (a, b))
    exact = a64 @ b64.t()
    bound = _dot_error_bound(a64, b64, out_dtype, roundings=k + 2)
    for name, out in (("scaled_mm", gemm_tn(*a, qa, *b, qb, out_dtype)), ("emulation", _emulated(a, qa, b, qb, out_dtype))):
        err = (out.double() - exact).abs()
        assert (err <= bound).all(), (
            f"{name}: error {err.max().item():.3g} above the bound at {(err > bound).nonzero()[0].tolist()}"
        )
    # The bound is far below the signal: a scale off by any factor, even 2, would break it.
    assert (exact.abs() > bound).any()


# ---------------------------------------------------------------------------------------------
# The three GEMMs of each recipe, against the operands the recipe names
# ---------------------------------------------------------------------------------------------
def _deq_usage(qt: tq.QuantizedTensor, columnwise: bool) -> torch.Tensor:
    data, scale_inv, amax = qt.usage(columnwise)
    return dequantize_op(data, scale_inv, amax, qt.quantizer, torch.float32)


def _recipe_operands(recipe: tq.Recipe, x2, w, dy2, sr_seed: int):
    """The operands of each GEMM, from the recipe's description alone (`tqcompile.recipes`):

        fprop  y  = x  · Wᵀ : x rowwise with fprop_input,    W rowwise with fprop_weight
        dgrad  dx = dy · W  : dy rowwise with dgrad_grad,    W columnwise with dgrad_weight
        wgrad  dW = dyᵀ · x : dy columnwise with wgrad_grad, x columnwise with wgrad_input

    as (a, a_columnwise, b, b_columnwise) per GEMM; wgrad is None when it runs in high precision.
    Stochastic-rounding seeds come from torch's generator in backward, dgrad's operand first
    (the layer's order); `sr_seed` re-seeds it as the test did before backward."""
    fprop = (tq.quantize(x2, recipe.fprop_input), False, tq.quantize(w, recipe.fprop_weight), False)
    torch.manual_seed(sr_seed)
    dgrad = (
        tq.quantize(dy2, recipe.dgrad_grad),
        False,
        tq.quantize(w, recipe.dgrad_weight, rowwise=False, columnwise=True),
        True,
    )
    wgrad = None
    if recipe.wgrad_grad is not None:
        qdy_t = tq.quantize(dy2, recipe.wgrad_grad, rowwise=False, columnwise=True)
        wgrad = (qdy_t, True, tq.quantize(x2, recipe.wgrad_input, rowwise=False, columnwise=True), True)
    return fprop, dgrad, wgrad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(tq.recipes.RECIPES))
def test_recipe_gemms_against_their_operands(name, dtype):
    """y, dx, dW of the layer: bit for bit the GEMMs of the operands the recipe names, and within
    the fp32 accumulation bound of the exact product of those operands dequantized."""
    recipe = tq.recipes.get(name)
    g = torch.Generator().manual_seed(7)
    # (2, 64) tokens: 128 rows, a whole 128-block along M for fp8_blockwise's wgrad operands.
    x = torch.randn(2, 64, 256, generator=g).to(dtype)
    w = (torch.randn(128, 256, generator=g) * 0.05).to(dtype)
    b = torch.randn(128, generator=g).to(dtype)
    dy = torch.randn(2, 64, 128, generator=g).to(dtype)
    x2, dy2 = x.reshape(-1, 256), dy.reshape(-1, 128)

    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    # A delayed-scaling recipe on its first step (zero histories) scales with the current amax.
    hists = tuple(torch.zeros(recipe.amax_history_len) for _ in range(3)) if recipe.amax_history_len else None
    y = tq.nn.linear(xr, wr, br, recipe, amax_histories=hists)
    torch.manual_seed(11)
    y.backward(dy)

    operands = dict(zip(("fprop", "dgrad", "wgrad"), _recipe_operands(recipe, x2, w, dy2, sr_seed=11)))
    fprop = tq.nn.qgemm(*operands["fprop"], dtype)
    assert_bitwise_equal(y.detach(), (fprop + b).reshape(2, 64, 128), "y")
    assert_bitwise_equal(br.grad, dy2.sum(0), "db")
    results = {"fprop": fprop, "dgrad": xr.grad.reshape(-1, 256), "wgrad": wr.grad}
    for gemm, ops in operands.items():
        out = results[gemm]
        if ops is None:  # high-precision wgrad: the plain matmul of dy and x
            assert_bitwise_equal(out, (dy2.t() @ x2).to(w.dtype), gemm)
            continue
        if gemm != "fprop":  # y was checked above, with its bias
            assert_bitwise_equal(out, tq.nn.qgemm(*ops, dtype), gemm)
        a64, b64 = _deq_usage(ops[0], ops[1]).double(), _deq_usage(ops[2], ops[3]).double()
        bound = _dot_error_bound(a64, b64, dtype, roundings=a64.shape[1] + 2)
        err = (out.double() - a64 @ b64.t()).abs()
        assert (err <= bound).all(), f"{gemm}: {err.max().item():.3g} above the accumulation bound"


@pytest.mark.parametrize("name", list(tq.recipes.RECIPES))
def test_linear_with_no_tokens(name):
    """An MoE expert can receive no tokens: empty y and dx, a zero dW."""
    recipe = tq.recipes.get(name)
    hists = tuple(torch.zeros(recipe.amax_history_len) for _ in range(3)) if recipe.amax_history_len else None
    x = torch.randn(0, 128, requires_grad=True)
    w = torch.randn(128, 128, requires_grad=True)
    y = tq.nn.linear(x, w, None, recipe, amax_histories=hists)
    y.backward(torch.randn(0, 128))
    assert y.shape == (0, 128) and x.grad.shape == (0, 128)
    assert_bitwise_equal(w.grad, torch.zeros(128, 128))


@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.ROWWISE])
def test_gemm_of_fp32_max_operand_is_finite(granularity):
    """Regression (item 5): an operand holding fp32's max quantizes (power-of-two scale 2**120)
    to the e4m3 grid point 256, and 256 * 2**120 overflows fp32. CPU `_scaled_mm` forms that
    product and returns Inf for a finite float product; gemm_tn's CPU path saturates instead, and
    equals `_scaled_mm` bit for bit on ordinary operands."""
    q = tq.Float8Quantizer(granularity=granularity, power_of_two_scale=True)
    x = torch.zeros(16, 16)
    x[0, 0] = torch.finfo(torch.float32).max
    x[1:] = torch.randn(15, 16)
    w = torch.zeros(16, 16)
    w[0, 0] = 0.5
    a, b = tq.quantize(x, q).usage(False), tq.quantize(w, q).usage(False)
    assert (_emulated(a, q, b, q, torch.float32)[0, 0] > 1e38).item()  # fp32max / 2, finite
    out = gemm_tn(*a, q, *b, q, torch.float32)
    assert torch.isfinite(out).all()
    assert_bitwise_equal(out, _emulated(a, q, b, q, torch.float32))
    if granularity is G.ROWWISE and not _CPU_SCALED_MM_ROWWISE:
        return  # torch < 2.13: CPU _scaled_mm has no rowwise scales to compare with
    # CPU _scaled_mm itself overflows there (what the saturating CPU path avoids) ...
    assert torch.isinf(torch._scaled_mm(a[0], b[0].t(), scale_a=a[1], scale_b=b[1].t(), out_dtype=torch.float32)).any()
    # ... and equals it bit for bit on ordinary operands.
    x[0, 0] = 1.0
    a = tq.quantize(x, q).usage(False)
    expected = torch._scaled_mm(a[0], b[0].t(), scale_a=a[1], scale_b=b[1].t(), out_dtype=torch.float32)
    assert_bitwise_equal(gemm_tn(*a, q, *b, q, torch.float32), expected)


@pytest.mark.parametrize("granularity", [G.TENSORWISE, G.ROWWISE, "e5m2"])
@pytest.mark.parametrize("m", [1, 5, 16, 17])
def test_scaled_mm_with_rows_padded_to_16_equals_the_unpadded_product(m, granularity):
    """CUDA's `_scaled_mm` wants M % 16 == 0: `_scaled_mm_padded` adds zero rows (scale 1) and
    drops their outputs. Checked with CPU `_scaled_mm`, which takes any M: every row equals the
    unpadded call's, bit for bit (a row's output depends on its own row only)."""
    from tqcompile.ops.gemm import _scaled_mm_padded

    if granularity is G.ROWWISE and not _CPU_SCALED_MM_ROWWISE:
        pytest.skip("torch < 2.13: CPU _scaled_mm takes per-tensor scales only")
    q = tq.Float8Quantizer(granularity=granularity) if granularity != "e5m2" else tq.Float8Quantizer(tq.Format.E5M2)
    torch.manual_seed(m)
    a = tq.quantize(torch.randn(m, 64), q).usage(False)
    b = tq.quantize(torch.randn(32, 64), q if granularity != "e5m2" else tq.Float8Quantizer()).usage(False)
    got = _scaled_mm_padded(a[0], a[1], b[0], b[1], torch.bfloat16)
    want = torch._scaled_mm(a[0], b[0].t(), scale_a=a[1], scale_b=b[1].t(), out_dtype=torch.bfloat16)
    assert got.shape == (m, 32)
    assert_bitwise_equal(got, want)


def test_scaled_mm_gets_16_byte_aligned_scales(monkeypatch):
    """cuBLAS refused an FP8 GEMM whose scale was an expert's element of an (E,) tensor (an 8-byte
    offset: CUBLAS_STATUS_NOT_SUPPORTED on an H200, fp8_tensorwise experts' dgrad): `_scaled_mm_padded`
    hands `torch._scaled_mm` scales at 16-byte aligned addresses, the values unchanged."""
    from tqcompile.ops.gemm import _scaled_mm_padded

    real, seen = torch._scaled_mm, []

    def checked(a, b, scale_a, scale_b, **kw):
        seen.append((scale_a.data_ptr() % 16, scale_b.data_ptr() % 16))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    q = tq.Float8Quantizer()
    a, b = tq.quantize(torch.randn(16, 64), q).usage(False), tq.quantize(torch.randn(32, 64), q).usage(False)
    scales = torch.tensor([1.0, 2.0, a[1].item(), b[1].item()])  # per-expert scales; experts 2 and 3 at offsets 8, 12
    got = _scaled_mm_padded(a[0], scales[2], b[0], scales[3], torch.bfloat16)
    assert seen == [(0, 0)]
    assert_bitwise_equal(got, real(a[0], b[0].t(), scale_a=a[1], scale_b=b[1], out_dtype=torch.bfloat16))
