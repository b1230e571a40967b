"""Integer grids (`tq.IntGrid`) and the narrow integer formats (INT3, INT2).

FULL is compressed-tensors' symmetric observer (codes -2**(b-1)..2**(b-1)-1, scale
amax / ((2**b - 1) / 2)); SYMMETRIC (-qmax..qmax, amax / qmax) stays the class default, and
quantizers saved before grids existed load as SYMMETRIC. INT3 / INT2 pack as compressed-tensors
0.19+ packs them (dense int32 words), checked against its own packer and decompressor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tqcompile as tq
from tqcompile.export.families import pack_int32_words, unpack_int32_words
from tqcompile.kernels import reference
from tqcompile.quantizers import Granularity

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

DATA = Path(__file__).parent / "data"
FORMATS = {8: tq.Format.INT8, 4: tq.Format.INT4, 3: tq.Format.INT3, 2: tq.Format.INT2}


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_full_grid_is_compressed_tensors_observer(bits):
    """Per group of 32, fp32: tq's FULL codes are compressed-tensors' (its scale amax / 7.5, codes
    by x / scale) except where x / scale lies within fp32 rounding of a .5 tie (tq multiplies by
    7.5 / amax): a group's negative extreme, which either tool rounds to the bottom code or one
    above as its last ulp falls. Its scale is tq's scale_inv to an fp32 ulp."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(bits))
    q = tq.IntQuantizer(FORMATS[bits], Granularity.BLOCKWISE_1D, block_size=32, grid=tq.IntGrid.FULL)
    data, scale_inv = reference.quantize(w, q, None, None)
    ours = reference.int_values(data, q).to(torch.int32)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=32)
    g = w.unflatten(-1, (-1, 32))
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    theirs = ct_quantize(w, scale, zp, args, dtype=torch.int8).to(torch.int32)
    assert torch.allclose(scale_inv, scale, rtol=2**-23, atol=0)
    lo, hi = q.code_range()
    assert int(ours.min()) == lo == int(theirs.min()) and int(ours.max()) == hi
    v = w / scale.repeat_interleave(32, -1)
    tie = ((v - v.floor()) - 0.5).abs() < 1e-5
    assert torch.equal(ours[~tie], theirs[~tie])
    # The ties are the groups' negative extremes, -amax / scale = -(qmax + 0.5) to an ulp: at most one a group.
    assert int((ours != theirs).unflatten(-1, (-1, 32)).sum(-1).max()) <= 1


def test_symmetric_grid_is_the_default_and_keeps_its_numerics():
    q = tq.IntQuantizer(tq.Format.INT4, Granularity.BLOCKWISE_1D, block_size=32)
    assert q.grid is tq.IntGrid.SYMMETRIC and q.code_range() == (-7, 7) and q.scale_max() == 7.0
    full = tq.IntQuantizer(tq.Format.INT4, Granularity.BLOCKWISE_1D, block_size=32, grid=tq.IntGrid.FULL)
    assert full.code_range() == (-8, 7) and full.scale_max() == 7.5 and full != q and hash(full) != hash(q)
    w = torch.tensor([[-1.0, 0.5] + [0.0] * 30])
    assert reference.int_values(reference.quantize(w, q, None, None)[0], q)[0, 0] == -7
    assert reference.int_values(reference.quantize(w, full, None, None)[0], full)[0, 0] == -8
    with pytest.raises(ValueError, match="grid='full' is not allowed; allowed: IntGrid.SYMMETRIC, IntGrid.FULL"):
        tq.IntQuantizer(grid="full")


def test_quantizers_saved_before_grids_load_as_symmetric():
    """tests/data/int_quantizers_before_grid.pt was written by tq before `grid` existed (a
    quantizer's pickle then held one field fewer)."""
    saved = torch.load(DATA / "int_quantizers_before_grid.pt", weights_only=True)
    want = tq.IntQuantizer(tq.Format.INT4, Granularity.BLOCKWISE_1D, block_size=32)
    assert saved["int4_g32"] == want and saved["int4_g32"].grid is tq.IntGrid.SYMMETRIC
    assert saved["int8_rows"] == tq.IntQuantizer(tq.Format.INT8, Granularity.ROWWISE)
    assert torch.equal(saved["tensor"].dequantize(), tq.quantize(saved["x"], want).dequantize())


def test_grid_survives_config_files(tmp_path):
    cfg = tq.configs.int_weight_only(3, 64)
    back = tq.calibration.QuantConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back.rules[0].weight == cfg.rules[0].weight and back.rules[0].weight.grid is tq.IntGrid.FULL


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("cols", [32, 100, 256])
def test_int32_words_are_compressed_tensors_packing(bits, cols):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    v = torch.randint(lo, hi + 1, (6, cols), generator=torch.Generator().manual_seed(cols), dtype=torch.int8)
    words = pack_int32_words(v, bits)
    assert torch.equal(words, pack_to_int32(v, bits))
    assert torch.equal(unpack_int32_words(words, bits, cols), v)
    assert torch.equal(unpack_from_int32(words, bits, torch.Size(v.shape)), v)


def test_int_weight_only_presets_refuse_other_widths():
    with pytest.raises(ValueError, match=r"bits=5 is not allowed; allowed: \[2, 3, 4, 8\]"):
        tq.configs.int_weight_only(5)


def test_int3_checkpoint_from_compressed_tensors_loads_with_its_bottom_codes(tmp_path):
    """An INT3 g32 checkpoint compressed-tensors' own compressor wrote (its -4 codes included)
    loads on the FULL grid and computes its weights exactly."""
    from test_export import _decompress, _read
    from test_export_load import _ct_quantized_checkpoint

    path = str(tmp_path / "ct")
    _ct_quantized_checkpoint(path, "W4A16", num_bits=3, group_size=32)
    loaded = tq.load_exported(path)
    tensors = _read(path)
    units = {n: m for n, m in loaded.named_modules() if hasattr(m, "weight_quantizer") and m.weight_quantizer.enabled}
    assert len(units) == 7
    for n, m in units.items():
        q = m.weight_quantizer.quantizer
        assert (q.format, q.grid, q.layout()) == (tq.Format.INT3, tq.IntGrid.FULL, (Granularity.BLOCKWISE_1D, -1, 32)), n
        exact = {k: v.float() if k.endswith("_scale") else v for k, v in tensors.items()}
        assert torch.allclose(m.weight, _decompress(path, exact, n), rtol=2**-22, atol=0), n
        with torch.no_grad():
            assert torch.equal(m.weight_quantizer(m.weight), m.weight), n


@pytest.mark.parametrize("bits", [3, 2])
def test_gptq_rounds_narrow_integers(bits):
    """GPTQ's per-column rounding of INT3 / INT2 (codes narrower than their packing group) lands on
    the grid its stored amax gives, below round to nearest's output error on its data."""
    from tqcompile.calibration.fake_quant import fake_quantize, round_to_nearest
    from tqcompile.calibration.gptq import gptq_quantize, hessian

    g = torch.Generator().manual_seed(bits)
    x = torch.randn(512, 128, generator=g) * torch.linspace(0.2, 3, 128)
    w = torch.randn(32, 128, generator=g) * 0.05
    q = tq.IntQuantizer(FORMATS[bits], Granularity.BLOCKWISE_1D, block_size=32, grid=tq.IntGrid.FULL)
    rounded, amax, how = gptq_quantize(w, hessian(x), q)
    assert how == "gptq" and torch.equal(fake_quantize(rounded, q, amax), rounded)
    err = lambda v: float(((x @ (v - w).t()) ** 2).sum())  # noqa: E731
    assert err(rounded) < err(round_to_nearest(w, q))
