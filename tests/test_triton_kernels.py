"""The Triton quantize kernels against the reference, bit for bit (payload bytes and scales).

On CPU the kernels run through Triton's interpreter, on CPU tensors. The interpreter must be
chosen before `triton.language` is imported (its own `@triton.jit` helpers such as `tl.max` are
decorated at import, for the interpreter or the compiler; measured on triton 3.9: an interpreted
kernel calling a compiled-mode `tl.max` fails with "Cannot call @triton.jit'd outside of the
scope of a kernel"). So `test_interpreter_suite` reruns this file in a child process started
with TRITON_INTERPRET=1; the tests that take the `kernels` fixture run only there. Nothing in the
library reads the variable, and the parent process (other tests, the op's CUDA kernel, the CUDA
tests at the bottom) keeps compiled Triton.

The interpreter's own float8 cast is wrong (`test_interpreter_float8_cast_is_wrong` records what
was measured); the kernels never use it: they build FP8 codes with integer bit operations (see
`tqcompile.kernels.triton._numerics`). `test_ptx_*` compile the kernels for sm_90 without a GPU
and check that the PTX uses only operations whose rounding is fixed (IEEE fp64 division,
`mul.rn.f32`, no flush-to-zero, no fused multiply-add).

Every comparison is exact: no tolerance applies anywhere in this file.
"""

from __future__ import annotations

import importlib
import math
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from tqcompile.formats import Format  # noqa: E402
from tqcompile.kernels import reference  # noqa: E402
from tqcompile.quantizers import (  # noqa: E402
    Float8Quantizer,
    Granularity,
    IntQuantizer,
    MXQuantizer,
    NVFP4Quantizer,
    ScaleRounding,
)
from tqcompile.testing.strategies import (  # noqa: E402
    float8_quantizers,
    float_tensors,
    mx_quantizers,
    nvfp4_quantizers,
    quantizer_inputs,
    seeds,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# numpy, running the interpreted kernels, warns when a lane that a select discards divides by
# zero or computes inf * 0; the GPU computes those lanes silently too.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
compiled = pytest.mark.skipif(INTERPRETED, reason="needs Triton's compiler, not its interpreter")


@compiled
def test_interpreter_suite():
    """Run this file's interpreter tests (those taking the `kernels` fixture) in a child process
    started with TRITON_INTERPRET=1; its failures show in this test's message."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", str(pathlib.Path(__file__).resolve()), "-q", "-p", "no:cacheprovider", "-rfE"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    report = proc.stdout[-12000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    # Guards against a child that skipped everything (e.g. the variable did not reach it).
    assert passed and int(passed.group(1)) >= 20, report


def _cast_to_float8(x_ptr, y_ptr, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    """Triton's own fp32 -> float8 cast (the defect test runs it interpreted)."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    y = x.to(tl.float8e5) if E5M2 else x.to(tl.float8e4nv)
    tl.store(y_ptr + offs, y.to(tl.uint8, bitcast=True), mask=offs < n)


@pytest.fixture(scope="module")
def kernels():
    """The quantize kernel module, interpreted, and Triton's own cast kernel. Every test that
    takes this fixture runs only in the child process."""
    if not INTERPRETED:
        pytest.skip("runs in the TRITON_INTERPRET=1 child process of test_interpreter_suite")
    from tqcompile.kernels.triton import quantize

    assert type(quantize._fp8_rows_kernel).__name__ == "InterpretedFunction"
    from tqcompile.kernels.triton import int8_mm

    return types.SimpleNamespace(quantize=quantize, int8_mm=int8_mm, cast=triton.jit(_cast_to_float8))


# ---------------------------------------------------------------------------------------------
# Comparison and inputs
# ---------------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(name: str, got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    assert (got.dtype, got.shape) == (want.dtype, want.shape), (
        f"{name}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
    )
    differ = _bits(got) != _bits(want)
    if differ.any():
        i = tuple(differ.nonzero()[0].tolist())
        raise AssertionError(
            f"{name}: {int(differ.sum())} of {got.numel()} differ; first at {i}: "
            f"kernel bits {_bits(got)[i].item():#x} ({got[i].float().item()!r}), "
            f"reference bits {_bits(want)[i].item():#x} ({want[i].float().item()!r}); input {x.dtype}{list(x.shape)}"
        )


def _check(kernels, x, q, amax=None, seed=None) -> None:
    assert kernels.quantize.supports(x, q, amax, seed), f"{q!r} on {x.dtype}{list(x.shape)} should be covered"
    want_data, want_scale = reference.quantize(x, q, amax, seed)
    got_data, got_scale = kernels.quantize.quantize(x, q, amax, seed)
    _assert_same("payload", got_data, want_data, x)
    _assert_same("scale_inv", got_scale, want_scale, x)


def _from_bits(bits) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


# fp32 values the shared strategies do not reach: the largest finite value (its amax gives a
# subnormal reciprocal), NaNs with the sign bit set or a payload, the smallest subnormal.
_EXTREMES = _from_bits([0x7F7FFFFF, 0xFF7FFFFF, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x00000001, 0x80000001, 0x00400000])


@st.composite
def _with_raw_bits(draw, x: torch.Tensor) -> torch.Tensor:
    """`x` with up to 8 elements replaced by arbitrary bit patterns of its dtype or by `_EXTREMES`."""
    x = x.clone()
    flat = _bits(x).view(-1)
    width = 8 * x.element_size()
    raw = st.integers(-(2 ** (width - 1)), 2 ** (width - 1) - 1)
    if x.dtype == torch.float32:
        raw = st.one_of(raw, st.sampled_from(_bits(_EXTREMES).tolist()))
    for i, b in draw(st.lists(st.tuples(st.integers(0, flat.numel() - 1), raw), max_size=min(8, flat.numel()))):
        flat[i] = b
    return x


@st.composite
def _cases(draw, quantizer_strategy, max_numel: int = 2048):
    q, x = draw(quantizer_inputs(quantizer_strategy, max_numel=max_numel))
    if draw(st.booleans()):
        x = draw(_with_raw_bits(x))
    if draw(st.booleans()):
        # A non-contiguous input: the kernels read a contiguous copy, as the reference does.
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() >= 2 else x
    return q, x


# ---------------------------------------------------------------------------------------------
# The interpreter defect the kernels work around
# ---------------------------------------------------------------------------------------------
def test_interpreter_float8_cast_is_wrong(kernels):
    """Documents the measured defect (triton 3.9): the interpreter's fp32 -> float8 cast drops the
    mantissa carry into the exponent (1.96 -> 1.0, not 2.0), rounds ties up (1.0625 -> 1.125, not
    1.0) and misplaces subnormals. If this test fails, Triton fixed its cast; the kernels still
    build codes from bits, which stays correct."""
    probes = {
        torch.float8_e4m3fn: torch.tensor([1.96, 1.9375, 1.0625, 0.0146484375, 0.003]),  # torch: 2, 2, 1, 2**-6, 2**-8
        torch.float8_e5m2: torch.tensor([1.96, 1.875, 1.125]),  # torch: 2, 2, 1
    }
    for dtype, x in probes.items():
        y = torch.empty(x.shape, dtype=torch.uint8)
        kernels.cast[(1,)](x, y, x.numel(), E5M2=dtype == torch.float8_e5m2, BLOCK=8)
        want = x.to(dtype).view(torch.uint8)
        assert bool((y != want).all()), f"{dtype}: interpreter {y.tolist()} torch {want.tolist()}"
        # Through the kernels (tensorwise, amax = the format's max, so the scale is exactly 1) they are right.
        _check(
            kernels,
            x,
            Float8Quantizer(Format.E4M3 if dtype == torch.float8_e4m3fn else Format.E5M2),
            amax=torch.tensor(torch.finfo(dtype).max),
        )


# ---------------------------------------------------------------------------------------------
# Exhaustive element encodings (scale exactly 1: amax = the format's max)
# ---------------------------------------------------------------------------------------------
def _tiny_epsilon(fmt: Format) -> float:
    """About the smallest amax_epsilon the quantizer accepts: scales up to 2**127.5, so that
    scale_inv can be subnormal."""
    return fmt.max_value * 2.0**-127.5


def _fp8_grid_probes(dtype: torch.dtype) -> torch.Tensor:
    """Every FP8 value, every midpoint between neighbours (ties), one fp32 ulp either side of
    each, values beyond the largest finite one, and the fp32 subnormal range."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    grid = codes[torch.isfinite(codes) & (codes >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    probes = torch.cat((grid, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(math.inf))))
    fmax = grid.max().item()
    beyond = torch.tensor([fmax * 1.0625, fmax * 1.125, fmax * 2, 3.0e38, math.inf])
    fp32_tiny = _from_bits([1, 2, 3, 0x7FFFFF, 0x800000, 0x800001])
    probes = torch.cat((probes, beyond, fp32_tiny, _EXTREMES, torch.tensor([math.nan])))
    return torch.cat((probes, -probes))


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
def test_fp8_encoding_exhaustive(kernels, fmt):
    x = _fp8_grid_probes(fmt.torch_dtype)
    _check(kernels, x, Float8Quantizer(fmt), amax=torch.tensor(fmt.max_value))
    # The same probes as 1-element rows (rowwise, the smallest epsilon the format allows): each
    # row's amax is its own |x|, so this runs the scale division on every probe, subnormal
    # quotients included.
    _check(kernels, x.unsqueeze(-1), Float8Quantizer(fmt, Granularity.ROWWISE, amax_epsilon=_tiny_epsilon(fmt)))


@pytest.mark.parametrize("power_of_two_scale", [False, True])
def test_fp8_scale_division_over_fp32_range(kernels, power_of_two_scale):
    """One row per amax, amaxes spread over every fp32 binade: scale = 448 / amax and
    scale_inv = 1 / scale are correctly rounded, including subnormal scale_inv (amax near fp32's max)."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(1, 0x7F800000, (4096,), generator=g, dtype=torch.int64)
    amaxes = torch.cat((bits.to(torch.int32).view(torch.float32), _from_bits([0x7F7FFFFF, 0x7F000000, 0x7E800000, 1])))
    x = torch.stack((amaxes, -amaxes / 3), dim=-1)
    q = Float8Quantizer(
        Format.E4M3, Granularity.ROWWISE, power_of_two_scale=power_of_two_scale, amax_epsilon=_tiny_epsilon(Format.E4M3)
    )
    _check(kernels, x, q)


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2, Format.E2M1])
@pytest.mark.parametrize("rounding", list(ScaleRounding))
def test_mx_scale_exponents_over_fp32_range(kernels, fmt, rounding):
    """One 32-block per amax over every fp32 binade and the subnormals, including the amaxes
    whose RCEIL quotient amax / elem_max is an exact tie at 2**-150 (rounds to 0: exponent 0)."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 0x7F800000, (1024,), generator=g, dtype=torch.int64)
    ties = [int(fmt.max_value) // 2, int(fmt.max_value) // 2 + 1, int(fmt.max_value), 3 * int(fmt.max_value) // 2]
    amax = torch.cat((bits.to(torch.int32).view(torch.float32), _from_bits(ties + [0x7F7FFFFF, 0x00800000, 0x007FFFFF])))
    frac = torch.rand(amax.numel(), 31, generator=g) * 2 - 1
    x = torch.cat((amax[:, None], amax[:, None] * frac), dim=-1)
    _check(kernels, x, MXQuantizer(fmt, rounding))


def test_e2m1_encoding_exhaustive(kernels):
    """All E2M1 values, ties and their fp32 neighbours, saturation and NaN through MXFP4 with a unit
    scale: each block starts with 4.0 and holds nothing of magnitude 8 or more, so its FLOOR exponent
    is floor(log2(amax)) - emax = 2 - 2 = 0."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = (grid[1:] + grid[:-1]) / 2
    probes = torch.cat(
        (
            grid,
            mids,
            torch.nextafter(mids, torch.tensor(0.0)),
            torch.nextafter(mids, torch.tensor(9.0)),
            torch.tensor([5.5, 7.0, 7.9]),
        )
    )
    probes = torch.cat((probes, -probes, torch.tensor([math.nan, -0.0, 1e-40, -1e-40])))
    probes = torch.cat((probes, torch.zeros(-probes.numel() % 31)))
    blocks = torch.cat((torch.full((probes.numel() // 31, 1), 4.0), probes.view(-1, 31)), dim=-1)
    _check(kernels, blocks.view(-1, 32), MXQuantizer(Format.E2M1, ScaleRounding.FLOOR))


# ---------------------------------------------------------------------------------------------
# Properties over the shared strategies (plus raw bit patterns)
# ---------------------------------------------------------------------------------------------
@settings(max_examples=40)
@given(case=_cases(float8_quantizers()), data=st.data())
def test_float8_matches_reference(kernels, case, data):
    q, x = case
    amax = None
    if q.uses_tensor_amax() and data.draw(st.booleans(), label="amax given"):
        amax = reference.tensor_amax(x, q)
        factor = data.draw(st.sampled_from([1.0, 0.75, 3.0, 0.0, math.inf, math.nan, 1e-39]), label="amax factor")
        amax = (amax * factor) if factor != 0.0 else torch.zeros(())
    _check(kernels, x, q, amax)


@settings(max_examples=30)
@given(case=_cases(mx_quantizers()))
def test_mx_matches_reference(kernels, case):
    q, x = case
    if q.format not in kernels.quantize._MX_KERNELS:  # MXFP6: no Triton kernel; CUDA runs the reference
        assert not kernels.quantize.supports(x, q, None, None), f"{q!r} has no kernel, yet the kernels claim it"
        return
    _check(kernels, x, q)


@settings(max_examples=30)
@given(case=_cases(nvfp4_quantizers(hadamard=False)), seed=seeds(), data=st.data())
def test_nvfp4_matches_reference(kernels, case, seed, data):
    q, x = case
    amax = reference.tensor_amax(x, q) * data.draw(st.sampled_from([1.0, 0.5, 2.0]), label="amax factor")
    _check(kernels, x, q, amax, seed if q.stochastic_rounding else None)


# ---------------------------------------------------------------------------------------------
# Layout corners the strategies reach rarely
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "q"),
    [
        ((3, 4100), Float8Quantizer(granularity=Granularity.ROWWISE)),  # rows longer than one program's chunk
        ((2, 4100, 3), Float8Quantizer(granularity=Granularity.ROWWISE, axis=1)),  # a long reduced middle axis
        ((257, 3), Float8Quantizer(Format.E5M2, Granularity.ROWWISE, axis=0, power_of_two_scale=True)),
        ((2, 128, 256), Float8Quantizer(granularity=Granularity.BLOCKWISE_2D, block_size=128)),
        ((5, 384), Float8Quantizer(granularity=Granularity.BLOCKWISE_1D, block_size=96)),  # block not a power of two
        ((24, 48), Float8Quantizer(granularity=Granularity.BLOCKWISE_2D, block_size=24, power_of_two_scale=True)),
        ((9000,), Float8Quantizer()),  # several programs share one tensorwise scale
        ((2, 32, 64), NVFP4Quantizer(block_2d=True)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_corners(kernels, shape, q, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())).to(dtype)
    x.view(-1)[:: max(1, x.numel() // 5)] = 0.0  # some all-zero or sparse units
    amax = reference.tensor_amax(x, q) if q.uses_tensor_amax() else None
    _check(kernels, x, q, amax)


def test_all_special_blocks(kernels):
    """Units that hold only zeros, only non-finite values, or subnormals."""
    rows = [[0.0] * 32, [math.nan] * 32, [math.inf, -math.inf] * 16, [1e-45, -3e-45] * 16, [-0.0] * 32, [1e-40, math.nan] * 16]
    x = torch.tensor(rows)
    for q in (
        Float8Quantizer(granularity=Granularity.ROWWISE),
        Float8Quantizer(granularity=Granularity.BLOCKWISE_1D, block_size=16, power_of_two_scale=True),
        MXQuantizer(Format.E4M3, ScaleRounding.RCEIL),
        MXQuantizer(Format.E5M2, ScaleRounding.FLOOR),
        MXQuantizer(Format.E2M1, ScaleRounding.RCEIL),
    ):
        _check(kernels, x, q)
    _check(kernels, x, NVFP4Quantizer(), torch.tensor(0.0))
    _check(kernels, x, NVFP4Quantizer(stochastic_rounding=True), torch.tensor(3.0), torch.tensor([5, 7]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_units_at_the_dtype_max(kernels, dtype):
    """Units whose amax is the dtype's largest finite value (or within a grid step of it): the
    kernels round the largest element up to the grid point the reference picks (256 * 2**120 for
    power-of-two FP8 and MX RCEIL from fp32's max), bit for bit, and the shared saturating
    dequantization turns every such payload into a finite value (docs/numerics: "Dequantization
    saturates"; the rule lives in dequantize, so the quantize kernels need no change for it)."""
    big = torch.finfo(dtype).max
    row = torch.linspace(-1.0, 1.0, 32, dtype=torch.float64)
    x = torch.stack([row * big, row.flip(0) * big * 0.999, torch.full((32,), big, dtype=torch.float64)]).to(dtype)
    for q in (
        Float8Quantizer(power_of_two_scale=True),
        Float8Quantizer(Format.E5M2, Granularity.ROWWISE, power_of_two_scale=True),
        Float8Quantizer(granularity=Granularity.BLOCKWISE_1D, block_size=16),
        MXQuantizer(Format.E4M3, ScaleRounding.RCEIL),
        MXQuantizer(Format.E5M2, ScaleRounding.RCEIL),
        MXQuantizer(Format.E2M1, ScaleRounding.RCEIL),
        MXQuantizer(Format.E4M3, ScaleRounding.FLOOR),
        NVFP4Quantizer(),
    ):
        amax = reference.tensor_amax(x, q) if q.uses_tensor_amax() else None
        _check(kernels, x, q, amax)
        data, scale_inv = kernels.quantize.quantize(x, q, amax, None)
        for out_dtype in (dtype, torch.float32):
            out = reference.dequantize(data, scale_inv, amax, q, out_dtype)
            assert torch.isfinite(out).all(), (q, out_dtype)


# ---------------------------------------------------------------------------------------------
# What the kernels cover, and how the op picks them
# ---------------------------------------------------------------------------------------------
def test_supports(kernels):
    supports = kernels.quantize.supports
    x = torch.randn(4, 32)
    amax = torch.tensor(1.0)
    assert supports(x, Float8Quantizer(), None, None)
    assert supports(x.half(), MXQuantizer(Format.E2M1), None, None)
    assert supports(x, NVFP4Quantizer(), amax, None)
    # The reference runs for these.
    assert not supports(x.double(), Float8Quantizer(), None, None)
    assert not supports(x[:0], Float8Quantizer(), None, None)
    assert not supports(x, IntQuantizer(), None, None)
    assert not supports(x, NVFP4Quantizer(hadamard=True), amax, None)
    assert not supports(x, Float8Quantizer(), amax.double(), None)
    assert not supports(x, Float8Quantizer(granularity=Granularity.ROWWISE), amax, None)  # the reference would use the given amax
    assert not supports(x, Float8Quantizer(granularity=Granularity.BLOCKWISE_1D), None, None)  # 32 % 128: the reference raises
    assert not supports(x, NVFP4Quantizer(), None, None)
    assert not supports(x, NVFP4Quantizer(stochastic_rounding=True), amax, None)


def test_op_selects_triton_only_for_cuda_tensors(monkeypatch, kernels):
    quantize_ops = importlib.import_module(
        "tqcompile.ops.codec"
    )  # the module (the op is `tqcompile.ops.quantize`)

    assert torch._C._dispatch_has_kernel_for_dispatch_key("tqcompile::quantize", "CUDA")
    ran = []

    def spy(x, q, amax, seed):
        ran.append(q)
        return kernels.quantize.quantize(x, q, amax, seed)

    # The op's CUDA kernel imports `tqcompile.kernels.triton.quantize` when it runs; hand it the
    # interpreted module with a spy on `quantize`.
    stand_in = types.SimpleNamespace(supports=kernels.quantize.supports, quantize=spy)
    monkeypatch.setattr(importlib.import_module("tqcompile.kernels.triton"), "quantize", stand_in, raising=False)
    x = torch.randn(8, 64)
    for q in (MXQuantizer(), IntQuantizer()):
        want_data, want_scale = reference.quantize(x, q, None, None)
        for name, (data, scale) in (
            ("op on CPU", torch.ops.tqcompile.quantize(x, q, None, None)),
            ("CUDA kernel on CPU tensors", quantize_ops._quantize_cuda(x, q, None, None)),
        ):
            _assert_same(f"{name} payload", data, want_data, x)
            _assert_same(f"{name} scale", scale, want_scale, x)
    assert ran == [MXQuantizer()]  # only the CUDA kernel, and only where Triton covers the quantizer


# ---------------------------------------------------------------------------------------------
# GPU code generation, checked without a GPU: compile to PTX for sm_90 (in the parent process)
# ---------------------------------------------------------------------------------------------
_ARG_TYPES = {
    "out_ptr": "*u8",
    "scale_ptr": "*u8",
    "scale_inv_ptr": "*fp32",
    "amax_ptr": "*fp32",
    "partial_ptr": "*fp32",
    "seed_ptr": "*i64",
    "eps": "fp32",
}
_FP8_E4M3 = dict(FMT_MAX=448.0, MBITS=3, BIAS=7)
_FP8_E5M2 = dict(FMT_MAX=57344.0, MBITS=2, BIAS=15)

# (kernel name, x pointer type, constexprs, divides): every kernel variant the host code launches.
_PTX_CASES = {
    "amax_partial": ("_amax_partial_kernel", "*fp32", dict(IN_BF16=False, BLOCK=4096), False),
    "fp8_tensorwise": ("_fp8_tensorwise_kernel", "*fp16", dict(IN_BF16=False, **_FP8_E4M3, POW2=False, BLOCK=4096), True),
    "fp8_rows": (
        "_fp8_rows_kernel",
        "*i16",
        dict(IN_BF16=True, **_FP8_E4M3, POW2=True, BLOCK_R=32, BLOCK_C=128, ONE_CHUNK=True),
        True,
    ),
    "fp8_long_rows": (
        "_fp8_rows_kernel",
        "*fp32",
        dict(IN_BF16=False, **_FP8_E5M2, POW2=False, BLOCK_R=1, BLOCK_C=4096, ONE_CHUNK=False),
        True,
    ),
    "fp8_cols": (
        "_fp8_cols_kernel",
        "*i16",
        dict(IN_BF16=True, **_FP8_E4M3, POW2=False, BLOCK_O=2, BLOCK_A=16, BLOCK_I=128),
        True,
    ),
    "fp8_small_tiles": (
        "_fp8_tiles_kernel",
        "*i16",
        dict(IN_BF16=True, **_FP8_E4M3, POW2=False, B=3, BLOCK_B=4, ROWS=4, TR=16, TC=16),
        True,
    ),
    "fp8_128_tiles": (
        "_fp8_tiles_kernel",
        "*i16",
        dict(IN_BF16=True, **_FP8_E4M3, POW2=True, B=128, BLOCK_B=128, ROWS=32, TR=1, TC=1),
        True,
    ),
    "mx_fp8_rceil": ("_mx_fp8_kernel", "*fp32", dict(IN_BF16=False, **_FP8_E5M2, EMAX=15, RCEIL=True, BLOCK_R=128), True),
    "mx_fp8_floor": ("_mx_fp8_kernel", "*i16", dict(IN_BF16=True, **_FP8_E4M3, EMAX=8, RCEIL=False, BLOCK_R=128), False),
    "mx_fp4_rceil": ("_mx_fp4_kernel", "*fp16", dict(IN_BF16=False, RCEIL=True, BLOCK_R=128), True),
    "nvfp4_rows_sr": ("_nvfp4_rows_kernel", "*i16", dict(IN_BF16=True, ENC=2688.0, STOCHASTIC=True, BLOCK_R=256), True),
    "nvfp4_tiles": ("_nvfp4_tiles_kernel", "*fp32", dict(IN_BF16=False, ENC=2688.0, STOCHASTIC=False, TR=1, TC=16), True),
}


def _sm90_ptx_ops(fn, signature: dict, constexprs: dict, options: dict | None = None) -> set[str]:
    """The PTX instructions of the Triton kernel `fn` compiled for sm_90 (no GPU needed); skips the
    test where this Triton build has no NVIDIA backend."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    try:
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options or {}).asm["ptx"]
    except Exception as e:
        if "backend" in str(e).lower():  # a Triton build without the NVIDIA backend
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise
    ops = set()
    for line in ptx.splitlines():
        words = line.split()
        if words and not words[0].startswith("//"):
            ops.add(words[1] if words[0].startswith("@") and len(words) > 1 else words[0])
    return ops


@compiled
@pytest.mark.slow  # a few seconds per kernel on a 2-core machine, until Triton's cache has it
@pytest.mark.parametrize("case", list(_PTX_CASES))
def test_ptx_compiles_with_exactly_rounded_float_ops(case):
    """Compile the kernel for sm_90 (no GPU needed) and read its PTX: no flush-to-zero, no
    approximate division or reciprocal, no fused or contractible multiply-add, no hardware float8
    conversion; divisions are IEEE fp64 (`div.rn.f64`)."""
    from tqcompile.kernels.triton import quantize as triton_quantize

    name, x_type, constexprs, divides = _PTX_CASES[case]
    fn = getattr(triton_quantize, name)
    signature = {
        a: "constexpr" if a in constexprs else _ARG_TYPES.get(a, x_type if a == "x_ptr" else "i32") for a in fn.arg_names
    }
    ops = _sm90_ptx_ops(fn, signature, constexprs, {"enable_fp_fusion": False})
    float_ops = {op for op in ops if ".f32" in op or ".f64" in op or op.startswith(("fma", "rcp", "div", "sqrt"))}
    assert not any(".ftz" in op for op in float_ops), float_ops  # subnormals must survive
    assert not any(op.startswith(("fma", "rcp", "div.full", "div.approx")) for op in float_ops), float_ops
    assert not any(op.startswith(("mul.f32", "add.f32", "sub.f32")) for op in float_ops), float_ops  # contractible forms
    assert not any("e4m3" in op or "e5m2" in op for op in float_ops), float_ops  # no hardware float8 cast
    assert ("div.rn.f64" in float_ops) == divides, float_ops


# ---------------------------------------------------------------------------------------------
# The INT8 weight-only GEMM (not bit-exact: a sum whose order is the kernel's; bounded instead)
# ---------------------------------------------------------------------------------------------
def int8_weight_only_bound(x, codes, scale, y):
    """|y - exact| and its bound for ``(x @ codesᵀ) * scale`` summed in fp32 in any order, scaled in
    fp32 and rounded to y's dtype: (K + 1) units of fp32 roundoff of sum |x||c| s, plus half an
    ulp of y's dtype of |exact| (and of that fp32 error)."""
    exact = (x.double() @ codes.double().t()) * scale.double()
    magnitude = (x.double().abs() @ codes.double().abs().t()) * scale.double()
    fp32 = (x.shape[1] + 1) * 2.0**-24 * magnitude
    half_ulp = torch.finfo(y.dtype).eps / 2
    return (y.double() - exact).abs(), fp32 * (1 + half_ulp) + half_ulp * exact.abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m, n, k", [(1, 128, 256), (5, 96, 200), (16, 64, 128), (17, 70, 300), (40, 64, 130)])
def test_int8_weight_only_kernel_is_within_fp32_summation_of_the_exact_product(kernels, m, n, k, dtype):
    """Tiles cut by M, N and K (masked lanes), one and several BLOCK_M tiles, every input dtype;
    every code of int8 (-128 included) and scales of different magnitudes."""
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    codes[0, :] = -128
    scale = torch.rand(n, generator=g) * torch.logspace(-4, 1, n)
    y = kernels.int8_mm.int8_weight_only_mm(x, codes, scale)
    assert y.dtype == dtype and y.shape == (m, n)
    err, bound = int8_weight_only_bound(x, codes, scale, y)
    assert bool((err <= bound).all()), float((err / bound).max())


@compiled
def test_int8_weight_only_kernel_runs_on_tensor_cores():
    """Compiled for sm_90 without a GPU: a bf16 layer's dot is TF32 tensor-core MMA (exact for
    bf16 values and int8 codes, the kernel's docstring)."""
    from tqcompile.kernels.triton import int8_mm

    fn = int8_mm._int8_weight_only_kernel
    constexprs = {"DTYPE": tl.bfloat16, "IN_BF16": True, "PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}
    pointers = {"x_ptr": "*i16", "w_ptr": "*i8", "s_ptr": "*fp32", "y_ptr": "*i16"}  # bf16 as its bits
    signature = {a: "constexpr" if a in constexprs else pointers.get(a, "i32") for a in fn.arg_names}
    ops = _sm90_ptx_ops(fn, signature, constexprs)
    assert any(op.startswith("mma.") and ".tf32" in op for op in ops), sorted(op for op in ops if "mma" in op)


@compiled
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_cuda_int8_weight_only_op_is_within_its_bound(m):
    import tqcompile.ops as tq_ops

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 4096, generator=g).to(torch.bfloat16)
    codes = torch.randint(-128, 128, (1024, 4096), generator=g, dtype=torch.int8)
    scale = torch.rand(1024, generator=g) * 0.01
    y = tq_ops.int8_weight_only_mm(x.cuda(), codes.cuda(), scale.cuda()).cpu()
    err, bound = int8_weight_only_bound(x, codes, scale, y)
    assert bool((err <= bound).all()), float((err / bound).max())


# ---------------------------------------------------------------------------------------------
# On a GPU: the compiled kernels through the op, against the reference on the CPU
# ---------------------------------------------------------------------------------------------
_GPU_QUANTIZERS = [
    Float8Quantizer(),
    Float8Quantizer(Format.E5M2, power_of_two_scale=True),
    Float8Quantizer(granularity=Granularity.ROWWISE),
    Float8Quantizer(granularity=Granularity.ROWWISE, axis=0),
    Float8Quantizer(granularity=Granularity.BLOCKWISE_1D, power_of_two_scale=True),
    Float8Quantizer(granularity=Granularity.BLOCKWISE_2D),
    MXQuantizer(Format.E4M3, ScaleRounding.FLOOR),
    MXQuantizer(Format.E4M3, ScaleRounding.RCEIL),
    MXQuantizer(Format.E5M2, ScaleRounding.RCEIL),
    MXQuantizer(Format.E2M1, ScaleRounding.FLOOR),
    NVFP4Quantizer(),
    NVFP4Quantizer(block_2d=True, stochastic_rounding=True),
]


@compiled
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("q", _GPU_QUANTIZERS, ids=repr)
@settings(max_examples=20)
@given(data=st.data())
def test_cuda_op_matches_cpu_reference(q, data):
    import tqcompile.ops  # noqa: F401

    x = data.draw(float_tensors(q, shape=(256, 512)))
    x = data.draw(_with_raw_bits(x))
    amax = reference.tensor_amax(x, q) if q.uses_tensor_amax() else None
    seed = torch.tensor([3, 11]) if q.needs_seed() else None
    want_data, want_scale = reference.quantize(x, q, amax, seed)
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    got_data, got_scale = torch.ops.tqcompile.quantize(x.cuda(), q, cuda(amax), cuda(seed))
    _assert_same("payload", got_data.cpu(), want_data, x)
    _assert_same("scale_inv", got_scale.cpu(), want_scale, x)
