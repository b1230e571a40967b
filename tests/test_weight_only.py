"""tq.calibration.weight_only: inside the block a calibrated model computes as the same model
calibrated with its input and output quantizers disabled (activations in float, weights
fake-quantized), on Linear units and on each GEMM of MoE experts; on exit, and on an error, every
quantizer is the object it was. The compiled side: compile_tests/test_weight_only_compile.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.calibration import QuantRule, TensorQuantizer

transformers = pytest.importorskip("transformers")
from moe_models import tiny_hf_moe  # noqa: E402

IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))


def _build(kind: str) -> nn.Module:
    if kind == "mixtral":
        return tiny_hf_moe("mixtral", layers=1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _config() -> tq.calibration.QuantConfig:
    # FP8 inputs and weights everywhere the preset quantizes, plus output quantizers on the decoder's Linears.
    out = tq.Float8Quantizer()
    return tq.configs.fp8().with_rules(QuantRule(name="*layers.*", module_types=(nn.Linear,), output=out))


def _calibrated(kind: str, config: tq.calibration.QuantConfig) -> nn.Module:
    model = _build(kind)
    tq.calibrate(model, config, lambda m: m(IDS), progress=False)
    return model


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _activation_slots(model: nn.Module) -> dict[str, object]:
    return {n: m.quantizer for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.role != "weight"}


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_weight_only_is_the_model_calibrated_without_activation_quantizers(kind):
    model = _calibrated(kind, _config())
    # The reference: the same float model, calibrated with every input and output quantizer disabled
    # (weights are calibrated from the weights alone, so their amaxes are the same).
    reference = _calibrated(kind, _config().with_rules(QuantRule(input=False, output=False, must_match=False)))
    slots = _activation_slots(model)
    gemm_units = [n for n, q in slots.items() if n.endswith("_gemm.input_quantizer") and q is not None]
    assert (len(gemm_units) == 2) == (kind == "mixtral")  # Mixtral's experts: gate_up and down GEMMs
    assert sum(q is not None for n, q in slots.items() if n.endswith("output_quantizer")) > 0
    fake_quant = _logits(model)

    with tq.calibration.weight_only(model) as inside:
        assert inside is model
        assert torch.equal(_logits(model), _logits(reference))
        assert all(r.input == "off" and r.output == "off" for r in tq.summary(model).rows)

    assert not torch.equal(fake_quant, _logits(reference))  # the activations' part was there, and is again
    assert torch.equal(_logits(model), fake_quant)
    assert all(m.quantizer is slots[n] for n, m in model.named_modules() if n in slots)


def test_weight_only_restores_the_quantizers_after_an_error():
    model = _calibrated("llama", tq.configs.int8())
    slots = _activation_slots(model)
    with pytest.raises(RuntimeError, match="inside"):
        with tq.calibration.weight_only(model):
            raise RuntimeError("inside")
    assert all(m.quantizer is slots[n] for n, m in model.named_modules() if n in slots)
    assert any(q is not None for q in slots.values())


def test_weight_only_bad_input():
    with pytest.raises(ValueError, match=r"Sequential holds no fake-quantized module.*tq.calibrate"):
        with tq.calibration.weight_only(nn.Sequential(nn.Linear(8, 8))):
            pass
    converted = tq.convert(nn.Sequential(nn.Linear(32, 32)), tq.recipes.fp8_tensorwise())
    with pytest.raises(ValueError, match="holds no fake-quantized module.*tq.convert"):
        with tq.calibration.weight_only(converted):
            pass

    def forward_loop(m):
        with tq.calibration.weight_only(m):
            m(IDS)

    with pytest.raises(ValueError, match=r"the model is being calibrated \(module 'model\.embed_tokens'"):
        tq.calibrate(_build("llama"), tq.configs.int8(), forward_loop, progress=False)
