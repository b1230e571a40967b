"""Checkpoints llmcompressor itself wrote (tests/data/llmcompressor, made by make_fixtures.py: a tiny
bfloat16 Llama quantized with its W8A8, W4A16 and FP8_DYNAMIC presets) load with `tq.load_exported`
as tq calibrated models, whose weights are the checkpoint's and which fine-tune (QAT).

What differs from the checkpoint, and by how much, is stated and tested: llmcompressor's scales
are ``amax / 127.5`` (INT8), ``amax / 7.5`` (INT4), ``amax / 448`` (FP8), in bfloat16; about a
quarter of them have no fp32 amax that tq turns into exactly that scale (one fp32 ulp away
instead). Its integer codes reach -128 / -8: they load on tq's FULL grid (`tq.IntGrid`), which
computes them as themselves, as the engines do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.calibration import CalibrationWarning
from tqcompile.formats import Format
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
from test_export import _decompress, _read  # noqa: E402
from test_export_load import assert_qat_lowers_the_loss  # noqa: E402

FIXTURES = Path(__file__).parent / "data" / "llmcompressor"
FULL = tq.IntGrid.FULL
ROW_INT8, ROW_FP8 = IntQuantizer(Format.INT8, Granularity.ROWWISE), Float8Quantizer(granularity=Granularity.ROWWISE)
SCHEMES = {  # llmcompressor preset: (tq weight quantizer, tq input quantizer: dynamic per token, as vLLM's amax / 127)
    "W8A8": (IntQuantizer(Format.INT8, Granularity.ROWWISE, grid=FULL), ROW_INT8),
    "W4A16": (IntQuantizer(Format.INT4, Granularity.BLOCKWISE_1D, block_size=128, grid=FULL), None),
    "FP8_DYNAMIC": (ROW_FP8, ROW_FP8),
}
IDS = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(5))


def _units(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "weight_quantizer") and m.weight_quantizer.enabled}


def _load(path: str, **kwargs) -> tuple[nn.Module, str]:
    with pytest.warns(CalibrationWarning, match="scales have no tq amax") as caught:
        model = tq.load_exported(path, **kwargs)
    return model, "\n".join(str(w.message) for w in caught)


def _step_of(m: nn.Module) -> torch.Tensor:
    """The scale tq dequantizes the unit's weight with, per element."""
    q = m.weight_quantizer.quantizer
    scale = 1.0 / torch.div(q.scale_max(), m.weight_quantizer.amax)
    return scale.repeat_interleave(m.weight.shape[1] // scale.shape[1], 1)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_llmcompressor_checkpoint_loads_with_its_weights(scheme):
    path = str(FIXTURES / scheme)
    loaded, _ = _load(path)
    integer = scheme != "FP8_DYNAMIC"
    tensors = _read(path)
    exact = {k: v.float() if k.endswith("_scale") else v for k, v in tensors.items()}  # code * scale exactly, in fp32
    units = _units(loaded)
    assert len(units) == 7
    for n, m in units.items():
        assert (m.weight_quantizer.quantizer, m.input_quantizer.quantizer) == SCHEMES[scheme], n
        assert m.input_quantizer.amax is None  # dynamic per token, as in the checkpoint
        want = _decompress(path, exact, n)  # compressed-tensors' own decompressor
        # The float weight: the checkpoint's, within 2**-22 relative (a scale with no exact tq amax
        # is one fp32 ulp, 2**-23, away; each side rounds code * scale once, 2**-24).
        assert torch.allclose(m.weight, want, rtol=2**-22, atol=0), n
        with torch.no_grad():
            fq = m.weight_quantizer(m.weight)
        # Fake quantization reproduces it, the bottom codes -128 / -8 included (the FULL grid).
        assert torch.equal(fq, m.weight), n
        if integer:
            bottom = m.weight_quantizer.quantizer.code_range()[0]
            assert bool((torch.round(m.weight / _step_of(m)) == bottom).any()), n  # the codes a SYMMETRIC grid lacks are there


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # transformers: dequantize=True is what we pass
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_transformers_and_tq_compute_with_the_same_weights(scheme):
    """Both in the checkpoint's bfloat16: transformers (dequantize=True) computes code * scale in
    bfloat16; the tq model's fake-quantized weights equal those, except a product that is a
    bfloat16 tie, where tq's scale is an fp32 ulp from the checkpoint's (no exact amax): one
    bfloat16 ulp."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    path = str(FIXTURES / scheme)
    hf = AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    loaded, _ = _load(path, dtype=torch.bfloat16)
    assert hf.dtype == torch.bfloat16 and loaded.dtype == torch.bfloat16
    for n, m in _units(loaded).items():
        with torch.no_grad():
            fq = m.weight_quantizer(m.weight)
        theirs = hf.get_submodule(n).weight
        one_ulp = torch.nextafter(theirs, fq) == fq
        assert bool(((fq == theirs) | one_ulp).all()), n
        assert (fq != theirs).float().mean() < 0.03, n  # measured 0.5-1.7 %


def test_qat_continues_from_an_llmcompressor_checkpoint(tmp_path):
    model, _ = _load(str(FIXTURES / "W4A16"))
    assert_qat_lowers_the_loss(model, 64, 3)
    # ... and exports back to a compressed-tensors checkpoint of the same scheme.
    report = tq.export(model, str(tmp_path / "tuned"))
    assert {r.scheme for r in report.rows} == {"pack-quantized W4 int group 128, activations 16-bit"}
