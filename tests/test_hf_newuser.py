"""Hugging Face models as a new user brings them (built from tiny configs, no download), and what
they hit first:

- PTQ presets keep the classification heads in high precision: `classifier` (BERT, ViT) and
  `score` (decoder models' `*ForSequenceClassification`), as they do `lm_head`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    ViTConfig,
    ViTForImageClassification,
)

import tqcompile as tq
from tqcompile.calibration import modules as fq_modules


def tiny_bert(num_labels: int = 3, hidden: int = 32) -> nn.Module:
    cfg = BertConfig(
        vocab_size=64,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=32,
        num_labels=num_labels,
    )
    return BertForSequenceClassification(cfg)


def tiny_vit(hidden: int = 32) -> nn.Module:
    cfg = ViTConfig(
        image_size=32, patch_size=4, num_channels=3, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=2 * hidden, num_labels=3,
    )  # fmt: skip
    return ViTForImageClassification(cfg)


def tiny_llama_classifier() -> nn.Module:
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    return LlamaForSequenceClassification(cfg)


MODELS = {
    # name: (build, the classification head's name, one batch of inputs)
    "bert": (tiny_bert, "classifier", lambda: {"input_ids": torch.randint(1, 64, (2, 16))}),
    "vit": (tiny_vit, "classifier", lambda: {"pixel_values": torch.randn(2, 3, 32, 32)}),
    "llama": (tiny_llama_classifier, "score", lambda: {"input_ids": torch.randint(1, 64, (2, 16))}),
}


# --------------------------------------------------------------------------------------------
# PTQ presets: the classification head stays in high precision
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["int8", "fp8"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_ptq_presets_keep_the_classification_head_in_high_precision(kind, preset):
    build, head, inputs = MODELS[kind]
    torch.manual_seed(0)
    model = build().eval()
    batch = inputs()
    with torch.no_grad():
        reference = model(**batch).logits
    tq.calibrate(model, getattr(tq.configs, preset)(), lambda m: m(**batch), progress=False)

    rows = {r.name: r for r in tq.summary(model).rows}
    assert (rows[head].input, rows[head].weight, rows[head].output) == ("off", "off", "off")
    # Every other GEMM layer is quantized (the patch embedding of the ViT, a Conv2d, included).
    gemms = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d)) and n != head]
    assert gemms and all(rows[n].weight != "off" and rows[n].input != "off" for n in gemms), {n: rows[n] for n in gemms}
    # The head computes in high precision: its fake-quantizers are off, so it is an exact nn.Linear.
    head_module = model.get_submodule(head)
    assert isinstance(head_module, fq_modules.FakeQuantModule) and not any(q.enabled for q in head_module.quantizers().values())
    seen = []
    hook = head_module.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        quantized = model(**batch).logits
    hook.remove()
    ((head_in, head_out),) = seen
    assert torch.equal(head_out, F.linear(head_in, head_module.weight, head_module.bias))
    assert quantized.shape == reference.shape and torch.isfinite(quantized).all()
    assert not torch.equal(quantized, reference)  # the rest of the model does run quantized


def test_the_head_rules_match_names_ending_in_classifier_or_score_only():
    """`classifier` and `score` as whole name parts: `pre_classifier`/`scores` are not heads."""
    model = nn.ModuleDict(
        {
            "classifier": nn.Linear(32, 4),
            "pre_classifier": nn.Linear(32, 32),
            "blocks": nn.ModuleDict({"score": nn.Linear(32, 4), "scores": nn.Linear(32, 32)}),
        }
    )
    rules = tq.configs.int8().rules
    enabled = {
        name: [r for r in rules if r.matches(name, m) and r.weight is not None][-1].weight is not False
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }
    assert enabled == {"classifier": False, "pre_classifier": True, "blocks.score": False, "blocks.scores": True}
