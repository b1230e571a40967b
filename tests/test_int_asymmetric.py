"""Asymmetric integer weights (`tq.IntGrid.ASYMMETRIC`): a zero point per channel or group.

The numerics are compressed-tensors' asymmetric observer (scale (max - min) / (2**b - 1), zero
point round(-2**(b-1) - min / scale), codes round(clamp(x / scale + zp))), checked against its
own functions; calibration (max, mse, GPTQ, AWQ), export as compressed-tensors writes it (its
decompressor rebuilds every weight bit for bit, dense and MoE), `tq.load_exported` back (logits
bit-equal, re-export byte-equal, and a checkpoint its own compressor wrote), and `tq.compress`
(the CPU INT4 kernel takes the zero points as its zeros)."""

from __future__ import annotations

import copy
import filecmp
import os

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.calibration.config import ConfigError
from tqcompile.calibration.fake_quant import fake_quantize, round_to_nearest
from tqcompile.calibration.gptq import gptq_quantize, hessian
from tqcompile.kernels import reference
from tqcompile.quantizers import Granularity

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from moe_models import tiny_hf_moe  # noqa: E402
from test_export import _assert_bits, _decompress, _read, tiny_llama  # noqa: E402

ASYM = tq.IntGrid.ASYMMETRIC
FORMATS = {8: tq.Format.INT8, 4: tq.Format.INT4, 3: tq.Format.INT3, 2: tq.Format.INT2}
IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


def _asym(bits: int, block: int | None = 32) -> tq.IntQuantizer:
    if block is None:
        return tq.IntQuantizer(FORMATS[bits], Granularity.ROWWISE, grid=ASYM)
    return tq.IntQuantizer(FORMATS[bits], Granularity.BLOCKWISE_1D, block_size=block, grid=ASYM)


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("block", [32, None])
def test_numerics_are_compressed_tensors_asymmetric_observer(bits, block):
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(bits)) + 0.3  # off-centre rows
    q = _asym(bits, block)
    data, scale_inv = reference.quantize(w, q, None, None)
    assert scale_inv.shape == q.scale_shape(w.shape) == (48, 4 if block else 1, 2)
    strategy = {"strategy": "group", "group_size": 32} if block else {"strategy": "channel"}
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=False, **strategy)
    units = w.unflatten(-1, (-1, 32)) if block else w.unsqueeze(1)
    scale, zp = calculate_qparams(units.amin(-1), units.amax(-1), args)
    scale, zp = scale.reshape(scale_inv.shape[:-1]), zp.reshape(scale_inv.shape[:-1])
    assert torch.allclose(scale_inv[..., 0], scale, rtol=2**-22, atol=0)  # (max - min) / (2^b - 1) to an fp32 ulp
    assert torch.equal(scale_inv[..., 1], zp.float())
    theirs = ct_quantize(w, scale.reshape(48, -1), zp.reshape(48, -1), args, dtype=torch.int8)
    ours = reference.int_values(data, q)
    assert (ours != theirs).float().mean() < 1e-3  # only values on a rounding tie, tq multiplying by 1 / their scale
    lo, hi = q.code_range()
    assert int(ours.min()) == lo and int(ours.max()) == hi  # every unit spans the whole grid
    back = reference.dequantize(data, scale_inv, None, q, torch.float32)
    assert bool(((back - w).abs() <= scale_inv[..., 0].repeat_interleave(128 // scale_inv.shape[1], 1) / 2 * (1 + 1e-5)).all())


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="grid=IntGrid.ASYMMETRIC with granularity=Granularity.TENSORWISE is not allowed"):
        tq.IntQuantizer(grid=ASYM)
    with pytest.raises(ConfigError, match="input=IntQuantizer.*zero points .* are for weights"):
        tq.calibration.QuantRule(input=_asym(8, None))
    with pytest.raises(ValueError, match="fprop_input=IntQuantizer.*zero points"):
        tq.Recipe("r", **{f: _asym(8, None) for f in ("fprop_input", "fprop_weight", "dgrad_grad", "dgrad_weight")})


def test_clipped_ste_passes_the_gradient_inside_each_units_range():
    q = _asym(4, None)
    w = torch.tensor([[-1.0, 0.5, 2.0, 3.0]], requires_grad=True)
    amax = torch.tensor([[[0.5, 2.5]]])  # the unit's range [-0.5, 2.5]: -1 and 3 saturate
    fake_quantize(w, q, amax).sum().backward()
    assert w.grad.tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_gptq_and_the_scale_searches_round_asymmetric_weights():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g) * torch.linspace(0.2, 3, 128)
    w = torch.randn(32, 128, generator=g) * 0.05 + 0.02
    q, h = _asym(4), hessian(x)
    rounded, amax, how = gptq_quantize(w, h, q)
    assert how == "gptq" and amax.shape == (32, 4, 2)
    assert torch.equal(fake_quantize(rounded, q, amax), rounded)  # on the grid the stored extents give
    err = lambda v: float(((x @ (v - w).t()) ** 2).sum())  # noqa: E731
    assert err(rounded) < err(round_to_nearest(w, q))  # measured 94 against 113
    # On the same model, each algorithm gives (-min, max) per unit, and the asymmetric grid's error
    # is below the symmetric one's for round to nearest (rows off centre).
    assert err(round_to_nearest(w, q)) < err(round_to_nearest(w, tq.IntQuantizer(tq.Format.INT4, Granularity.BLOCKWISE_1D, block_size=32)))
    for algorithm in ("mse", "awq"):
        m = tiny_llama()
        tq.calibrate(m, tq.configs.int4_weight_only(32, grid=ASYM), lambda mm: mm(IDS), algorithm=algorithm, progress=False)
        t = m.model.layers[0].mlp.up_proj.weight_quantizer
        assert t.amax.shape == (*t.quantizer.scale_shape(m.model.layers[0].mlp.up_proj.weight.shape),) and bool((t.amax >= 0).all())


def test_awq_clips_each_side_of_a_unit():
    from tqcompile.calibration.awq import awq_clip

    g = torch.Generator().manual_seed(3)
    w = torch.rand(16, 64, generator=g)  # every unit non-negative: min 0, nothing below to clip
    w[:, ::7] *= 4  # outliers above
    out = awq_clip(w, _asym(4), hessian(torch.randn(256, 64, generator=g)))
    assert bool((out >= 0).all()) and float(out.max()) < float(w.max())


def _export(model, tmp_path, name="ckpt") -> str:
    path = str(tmp_path / name)
    tq.export(model, path)
    return path


@pytest.mark.parametrize(
    "config",
    [
        tq.configs.int4_weight_only(32, grid=ASYM),
        tq.configs.int_weight_only(3, 32, grid=ASYM),
        tq.configs.int8_weight_only(grid=ASYM),
        tq.configs.int8_dynamic(grid=ASYM),
    ],
    ids=["w4g32", "w3g32", "w8-channel", "w8a8-dynamic"],
)
def test_export_decompresses_and_loads_back_bit_for_bit(tmp_path, config):
    model = tiny_llama()
    tq.calibrate(model, config, lambda m: m(IDS), progress=False)
    path = _export(model, tmp_path)
    tensors = _read(path)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    for n, m in linears:
        assert f"{n}.weight_zero_point" in tensors, n
        with torch.no_grad():
            want = m.weight_quantizer(m.weight)
        _assert_bits(_decompress(path, tensors, n), want, n)  # compressed-tensors' own decompressor
    loaded = tq.load_exported(path)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    again = _export(loaded, tmp_path, "again")
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            assert filecmp.cmp(os.path.join(path, f), os.path.join(again, f), shallow=False), f


def test_moe_experts_export_and_load(tmp_path):
    model = tiny_hf_moe("qwen3_moe")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    tq.calibrate(model, tq.configs.int4_weight_only(32, grid=ASYM), lambda m: m(ids), algorithm="gptq", progress=False)
    path = _export(model, tmp_path)
    tensors = _read(path)
    zp = tensors["model.layers.0.mlp.experts.1.down_proj.weight_zero_point"]
    assert zp.dtype == torch.int32 and zp.shape == (-(-64 * 4 // 32), 2)  # packed along the rows
    unit = model.get_submodule("model.layers.0.mlp.experts.down_proj_gemm")  # the GEMM view: (experts, out, in)
    with torch.no_grad():
        want = unit.weight_quantizer(unit.weight)[1]
    got = _decompress(path, tensors, "model.layers.0.mlp.experts.1.down_proj")
    assert torch.equal(got.float(), want.float())
    loaded = tq.load_exported(path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_compressed_tensors_asymmetric_checkpoint_loads(tmp_path):
    """W4A16_ASYM written by compressed-tensors' own calculate_qparams and compressor."""
    from test_export_load import _ct_quantized_checkpoint

    path = str(tmp_path / "ct")
    _ct_quantized_checkpoint(path, "W4A16_ASYM", group_size=32)
    loaded = tq.load_exported(path)
    tensors = _read(path)
    exact = {k: v.float() if k.endswith("_scale") else v for k, v in tensors.items()}
    units = {n: m for n, m in loaded.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    for n, m in units.items():
        assert m.weight_quantizer.quantizer == _asym(4), n
        assert torch.allclose(m.weight, _decompress(path, exact, n), rtol=2**-22, atol=2**-30), n
        with torch.no_grad():
            assert torch.equal(m.weight_quantizer(m.weight), m.weight), n


def test_compress_runs_the_int4_kernel_with_zero_points():
    model = tiny_llama()
    tq.calibrate(model, tq.configs.int4_weight_only(32, grid=ASYM), lambda m: m(IDS), progress=False)
    packed = tq.compress(copy.deepcopy(model))
    rows = tq.deploy.deployed_layers(packed)
    assert {r.kernel for r in rows} == {"int4pack_mm"}
    seen = {}
    hooks = [model.get_submodule(r.name).register_forward_hook(lambda mod, a, o, n=r.name: seen.__setitem__(n, (a[0], o))) for r in rows]
    with torch.no_grad():
        model(IDS)
        for h in hooks:
            h.remove()
        for n, (x, y) in seen.items():
            layer = packed.get_submodule(n)
            assert float((layer(x) - y).norm() / y.norm()) < 1e-5, n  # float32: summation order only
            assert torch.allclose(layer.weight.dequantize(), model.get_submodule(n).weight_quantizer(model.get_submodule(n).weight), rtol=1e-6, atol=1e-7)
    int8 = tiny_llama()
    tq.calibrate(int8, tq.configs.int8_weight_only(grid=ASYM), lambda m: m(IDS), progress=False)
    assert {r.kernel for r in tq.deploy.deployed_layers(tq.compress(int8))} == {"dequantize"}  # the INT8 kernels take no zero point
