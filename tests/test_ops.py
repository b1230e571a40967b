"""`torch.library.opcheck` on the tqcompile custom ops, for every quantizer family and layout, with
the shapes of both usages (rowwise: x; columnwise: the non-contiguous transpose of x as (-1, K))."""

from __future__ import annotations

import pytest
import torch

from tqcompile import Float8Quantizer, Format, Granularity, IntQuantizer, MXQuantizer, NVFP4Quantizer, ScaleRounding

G = Granularity
qops = torch.ops.tqcompile

QUANTIZERS = {
    "fp8-tensor": Float8Quantizer(),
    "fp8-row-e5m2": Float8Quantizer(format=Format.E5M2, granularity=G.ROWWISE),
    "fp8-1x32-pow2": Float8Quantizer(granularity=G.BLOCKWISE_1D, block_size=32, power_of_two_scale=True),
    "fp8-32x32": Float8Quantizer(granularity=G.BLOCKWISE_2D, block_size=32),
    "mxfp8-e5m2": MXQuantizer(format=Format.E5M2),
    "mxfp4-rceil": MXQuantizer(format=Format.E2M1, scale_rounding=ScaleRounding.RCEIL),
    "nvfp4": NVFP4Quantizer(),
    "nvfp4-2d": NVFP4Quantizer(block_2d=True),
    "nvfp4-sr-hadamard": NVFP4Quantizer(stochastic_rounding=True, hadamard=True, hadamard_seed=5),
    "int8-channel": IntQuantizer(granularity=G.ROWWISE),
    "int4-1x32": IntQuantizer(format=Format.INT4, granularity=G.BLOCKWISE_1D, block_size=32),
}
# float8 payloads and scales: see the fixture in conftest.py.
pytestmark = pytest.mark.usefixtures("float8_comparable")
ALL = pytest.mark.parametrize("q", list(QUANTIZERS.values()), ids=list(QUANTIZERS))
USAGES = pytest.mark.parametrize("usage", ["rowwise", "columnwise"])


def _input(usage: str, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    return x if usage == "rowwise" else x.reshape(-1, x.shape[-1]).t()


def _op_inputs(q, x):
    amax = qops.amax(x, q) if q.uses_tensor_amax() else None
    seed = torch.tensor([3, 7], dtype=torch.int64) if q.needs_seed() else None
    return amax, seed


def _flat_scale(q, usage: str) -> bool:
    """What `tq.quantize` asks of the op: a columnwise usage keeps 1-D block scales flat."""
    return usage == "columnwise" and q.flat_columnwise_scale()


@ALL
@USAGES
def test_opcheck_amax(q, usage):
    torch.library.opcheck(qops.amax, (_input(usage), q))


@ALL
@USAGES
def test_opcheck_quantize(q, usage):
    # A bf16 input for the columnwise usage: both input dtypes, and both strides, get checked.
    x = _input(usage, torch.float32 if usage == "rowwise" else torch.bfloat16)
    torch.library.opcheck(qops.quantize, (x, q, *_op_inputs(q, x), _flat_scale(q, usage)))


@ALL
@USAGES
def test_opcheck_dequantize(q, usage):
    x = _input(usage)
    amax, seed = _op_inputs(q, x)
    data, scale_inv = qops.quantize(x, q, amax, seed, _flat_scale(q, usage))
    out_dtype = torch.bfloat16 if usage == "rowwise" else torch.float32
    torch.library.opcheck(qops.dequantize, (data, scale_inv, amax, q, out_dtype))


@ALL
@USAGES
def test_fake_kernels_match_real_shapes(q, usage):
    """opcheck compares fake and real outputs; this states the shape contract directly."""
    x = _input(usage)
    amax, seed = _op_inputs(q, x)
    data, scale_inv = qops.quantize(x, q, amax, seed, _flat_scale(q, usage))
    assert tuple(data.shape) == q.payload_shape(x.shape) and data.dtype == q.element_format().storage_dtype
    want = q.columnwise_scale_shape(x.shape) if usage == "columnwise" else q.scale_shape(x.shape)
    assert tuple(scale_inv.shape) == want and scale_inv.dtype == q.scale_dtype()
    assert data.is_contiguous() and scale_inv.is_contiguous()
    out = qops.dequantize(data, scale_inv, amax, q, torch.bfloat16)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert qops.amax(x, q).shape == () and qops.amax(x, q).dtype == torch.float32
