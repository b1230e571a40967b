"""MXFP6 (OCP MX with E2M3 / E3M2 elements), end to end: the element codes against the OCP
definition, the payload layout against compressed-tensors' own packer, GPTQ's MX invariant, the
training recipe compiled, and PTQ/QAT with GPTQ and AWQ on a Hugging Face model.

MXFP6 was added as two `Format` names and one codec module (tqcompile/formats/fp6.py); the MX
family, GPTQ, AWQ, FSDP2's gather, the summary and the config files took it without a change. The
generic property tests (tests/test_properties.py: scales against the spec, error bounds,
idempotence, slicing) and the FSDP2 spawn (every recipe) cover it through the shared strategies
and `tq.recipes.RECIPES`."""

from __future__ import annotations

import math

import pytest
import torch

import tqcompile as tq
from tqcompile.calibration.fake_quant import fake_quantize
from tqcompile.calibration.gptq import gptq_quantize, hessian
from tqcompile.formats import Format
from tqcompile.formats.codec import pack_codes, unpack_codes
from tqcompile.testing.compile import CompileCounter

FP6 = {Format.E2M3: (2, 3), Format.E3M2: (3, 2)}  # (exponent bits, mantissa bits)


def _ocp_value(code: int, ebits: int, mbits: int) -> float:
    """The OCP MX v1.0 value of a 6-bit code, from its bit fields (no codec involved)."""
    sign = -1.0 if code >> 5 else 1.0
    e, m = (code >> mbits) & (2**ebits - 1), code & (2**mbits - 1)
    bias = 2 ** (ebits - 1) - 1
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - mbits)
    return sign * (1 + m / 2**mbits) * 2.0 ** (e - bias)


@pytest.mark.parametrize("fmt", list(FP6))
def test_codes_are_the_ocp_values(fmt):
    ebits, mbits = FP6[fmt]
    codes = torch.arange(64, dtype=torch.uint8)
    want = torch.tensor([_ocp_value(c, ebits, mbits) for c in range(64)])
    got = fmt.codec.decode(codes)
    assert torch.equal(got, want)
    assert torch.equal(fmt.codec.encode(got), codes)  # every code round-trips, -0 included
    assert fmt.max_value == want.max() == {Format.E2M3: 7.5, Format.E3M2: 28.0}[fmt]
    assert fmt.emax == math.floor(math.log2(fmt.max_value)) and fmt.bits == 6
    assert (fmt.pack_elements, fmt.pack_bytes) == (4, 3)


@pytest.mark.parametrize("fmt", [Format.E2M1, *FP6])
def test_compiled_decode_is_the_table_bit_for_bit(fmt):
    """Under compile (inductor tracing a dequantize decomposition) the small floats decode by
    arithmetic, not by the table: every code's value and sign bit (-0 included) are the table's."""
    codes = torch.arange(2**fmt.bits, dtype=torch.uint8)
    table, arithmetic = fmt.codec.decode(codes), fmt.codec._decode_arithmetic(codes)
    assert torch.equal(arithmetic, table) and torch.equal(torch.signbit(arithmetic), torch.signbit(table))
    torch._dynamo.reset()
    compiled = torch.compile(fmt.codec.decode, fullgraph=True, backend="inductor")(codes)
    assert torch.equal(compiled, table) and torch.equal(torch.signbit(compiled), torch.signbit(table))


@pytest.mark.parametrize("fmt", list(FP6))
def test_rounding_ties_to_even_saturates_and_has_no_nan(fmt):
    grid = sorted({abs(v) for v in fmt.codec.decode(torch.arange(32, dtype=torch.uint8)).tolist()})
    mids = torch.tensor([(a + b) / 2 for a, b in zip(grid, grid[1:])])
    got = fmt.codec.decode(fmt.codec.encode(mids))
    lo, hi = torch.tensor(grid[:-1]), torch.tensor(grid[1:])
    lo_code = fmt.codec.encode(lo)
    want = torch.where(lo_code % 2 == 0, lo, hi)  # the even code (the even mantissa) of the two
    assert torch.equal(got, want)
    top = fmt.max_value
    special = torch.tensor([top * 1.01, -top * 4, math.inf, -math.inf, math.nan, -0.0])
    assert fmt.codec.decode(fmt.codec.encode(special)).tolist() == [top, -top, top, -top, 0.0, -0.0]
    assert fmt.codec.encode(torch.tensor([-0.0])).item() == 0x20  # the sign of a zero is kept


def test_payload_is_compressed_tensors_mxfp6_layout():
    """Four codes in three bytes, little-endian: compressed-tensors' `pack_fp6_to_uint8` (E2M3) writes
    the same bytes, and its unpacker reads tq's payload back to the same values."""
    helpers = pytest.importorskip("compressed_tensors.compressors.mxfp6.helpers")
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 64, (8, 64), generator=g, dtype=torch.uint8)
    values = Format.E2M3.codec.decode(codes)
    packed = pack_codes(codes, 6)
    assert packed.shape == (8, 48) and torch.equal(packed, helpers.pack_fp6_to_uint8(values))
    assert torch.equal(helpers.unpack_fp6_from_uint8(packed, 8, 64, dtype=torch.float32), values)
    assert torch.equal(unpack_codes(packed, 6), codes)
    # A quantized tensor's payload is that layout too.
    x = torch.randn(4, 64, generator=g)
    qx = tq.quantize(x, tq.MXQuantizer(Format.E2M3))
    scale = qx._scale_inv.float().repeat_interleave(32, -1)
    assert torch.equal(helpers.unpack_fp6_from_uint8(qx._data, 4, 64, dtype=torch.float32) * scale, qx.dequantize())


@pytest.mark.parametrize("fmt", list(FP6))
@pytest.mark.parametrize("rounding", list(tq.ScaleRounding))
def test_gptq_mx_block_whose_max_shrank_stays_on_grid(fmt, rounding):
    """GPTQ rounds an MX block with the exponent of its starting max and keeps it only if the block
    requantizes to itself (tests/test_gptq.py states why for MXFP8/MXFP4). For both FP6 grids every
    largest code qualifies: neither has a top-binade gap like E4M3's missing 480."""
    q = tq.MXQuantizer(fmt, scale_rounding=rounding)
    grid = torch.tensor(sorted({abs(v) for v in fmt.codec.decode(torch.arange(32, dtype=torch.uint8)).tolist()}))
    e, g = 2.0**-3, torch.Generator().manual_seed(0)
    for top in grid[grid > 0]:
        below = grid[grid <= top]
        codes = below[torch.randint(len(below), (31,), generator=g)]
        signs = torch.where(torch.rand(32, generator=g) < 0.5, -1.0, 1.0)
        block = (torch.cat((top.reshape(1), codes)) * signs * e).reshape(1, 32)
        assert torch.equal(fake_quantize(block, q), block), float(top)


def _output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float(((x @ (w - q).T) ** 2).sum())


@pytest.mark.parametrize("fmt", list(FP6))
def test_gptq_beats_round_to_nearest(fmt):
    q, hows = tq.MXQuantizer(fmt), []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(256, 8, generator=g) @ torch.randn(8, 64, generator=g) + 0.1 * torch.randn(256, 64, generator=g)
        w = torch.randn(48, 64, generator=g)
        rounded, amax, how = gptq_quantize(w, hessian(x), q)
        assert _output_error(x, w, rounded) <= _output_error(x, w, fake_quantize(w, q))
        assert torch.equal(fake_quantize(rounded, q), rounded) and amax is None  # MX scales come from the blocks
        hows.append(how)
    assert "gptq" in hows, hows


def test_training_recipe_compiles_without_breaks_and_equals_eager():
    recipe = tq.recipes.mxfp6()
    assert recipe.fprop_weight == tq.MXQuantizer(Format.E2M3, tq.ScaleRounding.RCEIL)
    torch.manual_seed(0)
    layer = tq.nn.Linear(128, 64, recipe=recipe)
    x, dy = torch.randn(64, 128), torch.randn(64, 64)

    def step(fn):
        xr = x.clone().requires_grad_()
        y = fn(xr)
        y.backward(dy)
        out = (y.detach(), xr.grad, layer.weight.grad.clone())
        layer.zero_grad()
        return out

    eager = step(layer)
    counter = CompileCounter("aot_eager")
    compiled = step(torch.compile(layer, backend=counter, fullgraph=True))
    assert counter.graph_breaks == 0 and counter.recompiles == 0
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("algorithm", ["max", "gptq", "awq"])
def test_ptq_on_a_hugging_face_model(algorithm):
    ids = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    float_model = _tiny_llama()
    with torch.no_grad():
        ref = float_model(ids).logits
    model = _tiny_llama()
    tq.calibrate(model, tq.configs.mxfp6(), lambda m: m(ids), algorithm=algorithm, progress=False)
    rows = {r.name: r for r in tq.summary(model).rows}
    q_proj = rows["model.layers.0.self_attn.q_proj"]
    assert "MX E2M3" in q_proj.weight and "MX E4M3" in q_proj.input, q_proj
    with torch.no_grad():
        out = model(ids).logits
    assert tq.testing.sqnr(ref.double(), out) > 23  # measured: max 26.5, gptq 28.6, awq 27.3 dB (MXFP8 preset: 26.5)
    # The state saves and restores (bit for bit), and QAT trains through it.
    state = tq.quant_state(model)
    again = _tiny_llama()
    tq.restore(again, state)
    again.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(again(ids).logits, out)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_export_e2m3_is_compressed_tensors_mxfp6_and_e3m2_is_refused(tmp_path):
    """E2M3 exports as compressed-tensors' `mxfp6-pack-quantized` (one `register_mx_element` call beside
    MXFP8's and MXFP4's), whose own decompressor rebuilds every weight the model computes with, bit for
    bit; tq.load_exported reads it back to the same logits. E3M2 has no compressed-tensors scheme."""
    pytest.importorskip("compressed_tensors")
    from test_export import _decompress, _read

    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    model = _tiny_llama()
    tq.calibrate(model, tq.configs.mxfp6(), lambda m: m(ids), progress=False)
    path = str(tmp_path / "mxfp6")
    report = tq.export(model, path)
    assert {r.scheme.split()[0] for r in report.rows} == {"mxfp6-pack-quantized"}
    tensors = _read(path)
    for name, module in model.named_modules():
        if getattr(module, "weight_quantizer", None) is not None and module.weight_quantizer.enabled:
            assert tensors[f"{name}.weight_packed"].shape == (module.weight.shape[0], module.weight.shape[1] * 3 // 4)
            with torch.no_grad():
                want = module.weight_quantizer(module.weight)
            assert torch.equal(_decompress(path, tensors, name).float(), want), name
    with torch.no_grad():
        assert torch.equal(tq.load_exported(path)(ids).logits, model(ids).logits)

    e3m2 = _tiny_llama()
    config = tq.calibration.QuantConfig(
        (tq.calibration.QuantRule(module_types=tq.configs.GEMM_LAYERS, input=False, weight=tq.MXQuantizer(Format.E3M2)),
         *tq.configs.default_disabled())
    )  # fmt: skip
    tq.calibrate(e3m2, config, lambda m: m(ids), progress=False)
    with pytest.raises(tq.export.ExportError, match=r"MXQuantizer\(format=Format.E3M2.*has no compressed-tensors form; .*E2M3"):
        tq.export(e3m2, str(tmp_path / "e3m2"))
