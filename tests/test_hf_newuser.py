"""Hugging Face models as a new user brings them (built from tiny configs, no download), and what
they hit first (eager; the compiled side is in `compile_tests/test_hf_newuser_compile.py`):

- PTQ presets keep the classification heads in high precision: `classifier` (BERT, ViT; RoBERTa's
  whole head module) and `score` (decoder models' `*ForSequenceClassification`), as they do `lm_head`;
- a training recipe's token-count error names the converted layer (BERT's pooler sees one token
  per sample) and shows the `filter_fn` that keeps it in high precision;
- inference under `torch.no_grad()` takes any token count (a ViT's 65 tokens per image).
"""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
    ViTConfig,
    ViTForImageClassification,
)

import tqcompile as tq
from tqcompile.calibration import modules as fq_modules

# A ViT on 32x32 images in 4x4 patches: 64 patches + the CLS token = 65 tokens per image.
VIT_TOKENS = 65


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


# Feature sizes every block recipe can serve (fp8_blockwise's 128x128 weight tiles need 128).
HIDDEN = {"mxfp8": 32, "nvfp4": 32, "fp8_blockwise": 128}


def tiny_llama_classifier() -> nn.Module:
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    return LlamaForSequenceClassification(cfg)


def tiny_roberta() -> nn.Module:
    cfg = RobertaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=40, num_labels=3, pad_token_id=1,
    )  # fmt: skip
    return RobertaForSequenceClassification(cfg)


MODELS = {
    # name: (build, the classification head's linear layers, one batch of inputs)
    "bert": (tiny_bert, ("classifier",), lambda: {"input_ids": torch.randint(2, 64, (2, 16))}),
    "vit": (tiny_vit, ("classifier",), lambda: {"pixel_values": torch.randn(2, 3, 32, 32)}),
    "llama": (tiny_llama_classifier, ("score",), lambda: {"input_ids": torch.randint(2, 64, (2, 16))}),
    # RobertaClassificationHead: classifier.dense -> tanh -> classifier.out_proj
    "roberta": (tiny_roberta, ("classifier.dense", "classifier.out_proj"), lambda: {"input_ids": torch.randint(2, 64, (2, 16))}),
}


# --------------------------------------------------------------------------------------------
# PTQ presets: the classification head stays in high precision
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["int8", "fp8"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_ptq_presets_keep_the_classification_head_in_high_precision(kind, preset):
    build, heads, inputs = MODELS[kind]
    torch.manual_seed(0)
    model = build().eval()
    batch = inputs()
    with torch.no_grad():
        reference = model(**batch).logits
    tq.calibrate(model, getattr(tq.configs, preset)(), lambda m: m(**batch), progress=False)

    rows = {r.name: r for r in tq.summary(model).rows}
    assert all((rows[h].input, rows[h].weight, rows[h].output) == ("off", "off", "off") for h in heads)
    # Every other GEMM layer is quantized (the patch embedding of the ViT, a Conv2d, included).
    gemms = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d)) and n not in heads]
    assert gemms and all(rows[n].weight != "off" and rows[n].input != "off" for n in gemms), {n: rows[n] for n in gemms}
    # The head computes in high precision: its fake-quantizers are off, so each layer is an exact nn.Linear.
    seen = {}
    hooks = []
    for h in heads:
        module = model.get_submodule(h)
        assert isinstance(module, fq_modules.FakeQuantModule) and not any(q.enabled for q in module.quantizers().values())
        hooks.append(module.register_forward_hook(lambda m, args, out, h=h: seen.update({h: (m, args[0], out)})))
    with torch.no_grad():
        quantized = model(**batch).logits
    for hook in hooks:
        hook.remove()
    assert sorted(seen) == sorted(heads)
    for module, head_in, head_out in seen.values():
        assert torch.equal(head_out, F.linear(head_in, module.weight, module.bias))
    assert quantized.shape == reference.shape and torch.isfinite(quantized).all()
    assert not torch.equal(quantized, reference)  # the rest of the model does run quantized


def test_the_head_rules_match_names_ending_in_classifier_or_score_only():
    """`classifier` and `score` as whole name parts: `pre_classifier`/`scores`/`classifiers` are not heads."""
    model = nn.ModuleDict(
        {
            "classifier": nn.Linear(32, 4),
            "pre_classifier": nn.Linear(32, 32),
            "blocks": nn.ModuleDict({"score": nn.Linear(32, 4), "scores": nn.Linear(32, 32)}),
            "head": nn.ModuleDict({"classifier": nn.ModuleDict({"dense": nn.Linear(32, 32)})}),
            "classifiers": nn.ModuleDict({"dense": nn.Linear(32, 32)}),
        }
    )
    rules = tq.configs.int8().rules
    enabled = {
        name: [r for r in rules if r.matches(name, m) and r.weight is not None][-1].weight is not False
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }
    assert enabled == {
        "classifier": False,
        "pre_classifier": True,
        "blocks.score": False,
        "blocks.scores": True,
        "head.classifier.dense": False,  # a layer of a head module named classifier
        "classifiers.dense": True,
    }


# --------------------------------------------------------------------------------------------
# Training recipes: the token-count error names the converted layer and the filter_fn fix
# --------------------------------------------------------------------------------------------
def _filter_fix(fqn: str) -> str:
    return f"tq.convert(model, recipe, filter_fn=lambda m, fqn: fqn != {fqn!r})"


@pytest.mark.parametrize(("recipe", "block"), [("mxfp8", 32), ("nvfp4", 16)])
def test_token_count_error_names_the_pooler_and_the_filter_fn_fix(recipe, block):
    torch.manual_seed(0)
    # 32 labels: the classifier is converted too (3 would be skipped by convert, its width not a block multiple).
    model = tq.convert(tiny_bert(num_labels=32), tq.recipes.get(recipe))
    assert model.bert.pooler.dense.tq_fqn == "bert.pooler.dense" and model.classifier.tq_fqn == "classifier"
    ids = torch.randint(1, 64, (2, 16))  # 32 tokens for the encoder; the pooler sees one per sample: 2
    with pytest.raises(ValueError) as info:
        model(input_ids=ids).logits.sum().backward()
    message = str(info.value)
    assert message.startswith(f"linear 'bert.pooler.dense': recipe '{recipe}' cannot serve this call: ")
    assert "(2 tokens = batch x sequence)" in message and f"pad it with {block - 2} zeros to {block}" in message
    assert message.endswith(_filter_fix("bert.pooler.dense")), message

    # The fix the message shows works: the model trains with the pooler in high precision.
    torch.manual_seed(0)
    model = tq.convert(tiny_bert(num_labels=32), tq.recipes.get(recipe), filter_fn=lambda m, fqn: fqn != "bert.pooler.dense")
    assert not tq.nn.is_converted(model.bert.pooler.dense) and tq.nn.is_converted(model.bert.encoder.layer[0].output.dense)
    with pytest.raises(ValueError, match=re.escape(_filter_fix("classifier"))):  # the classifier sees 2 tokens as well
        model(input_ids=ids).logits.sum().backward()
    model = tq.convert(tiny_bert(num_labels=32), tq.recipes.get(recipe), filter_fn=lambda m, fqn: fqn.startswith("bert.encoder"))
    model(input_ids=ids).logits.sum().backward()
    assert model.bert.encoder.layer[0].output.dense.weight.grad.abs().sum() > 0


def test_token_count_error_of_a_vit_names_the_layer():
    """65 tokens per image: the first converted layer names itself; padding, not filter_fn, is the fix there."""
    torch.manual_seed(0)
    with pytest.warns(tq.nn.ConversionWarning, match=r"patch_embeddings.projection \(Conv2d\): a convolution"):
        model = tq.convert(tiny_vit(hidden=128), tq.recipes.fp8_blockwise(), filter_fn=lambda m, fqn: fqn != "classifier")
    with pytest.raises(ValueError) as info:
        model(pixel_values=torch.randn(1, 3, 32, 32)).logits.sum().backward()
    message = str(info.value)
    assert message.startswith("linear 'vit.layers.0.attention.q_proj': recipe 'fp8_blockwise' cannot serve this call: ")
    assert f"({VIT_TOKENS} tokens = batch x sequence)" in message and "pad it with 63 zeros to 128" in message
    assert "make batch x sequence a multiple of the block" in message


def test_other_errors_of_a_converted_layer_name_it_too():
    model = tq.convert(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), tq.recipes.fp8_tensorwise())
    with pytest.raises(TypeError, match=re.escape("linear '0': input dtype torch.float64 is not supported")):
        model(torch.randn(4, 64, dtype=torch.float64))
    # Only a token-count error shows the filter_fn fix; a layer built directly has no name to give.
    layer = tq.nn.Linear(64, 64, recipe=tq.recipes.mxfp8())
    assert layer.tq_fqn is None
    with pytest.raises(ValueError) as info:
        layer(torch.randn(33, 64, requires_grad=True))
    assert str(info.value).startswith("linear: recipe 'mxfp8'") and "filter_fn" not in str(info.value)


def test_the_name_survives_pickling():
    model = tq.convert(tiny_bert(num_labels=32), tq.recipes.mxfp8())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    assert restored.bert.pooler.dense.tq_fqn == "bert.pooler.dense"


# --------------------------------------------------------------------------------------------
# Inference under no_grad: no operand is blocked along the tokens
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8_blockwise"])
def test_inference_under_no_grad_takes_any_token_count(recipe):
    """Under no_grad only fprop runs, blocked along the features: a ViT's 65 tokens per image, and
    BERT's pooler (2 tokens), run. With grad mode on, the same forward asks for the wgrad operands."""
    torch.manual_seed(0)
    hidden = HIDDEN[recipe]
    # The patch-embedding convolution stays in high precision (reported; not what this test is about).
    keep = lambda m, fqn: fqn != "classifier" and not fqn.endswith("patch_embeddings.projection")  # noqa: E731
    vit = tq.convert(tiny_vit(hidden), tq.recipes.get(recipe), filter_fn=keep).eval()
    bert = tq.convert(tiny_bert(num_labels=hidden, hidden=hidden), tq.recipes.get(recipe)).eval()
    assert tq.nn.is_converted(vit.vit.layers[0].mlp.fc1) and tq.nn.is_converted(bert.bert.pooler.dense)
    images, ids = torch.randn(1, 3, 32, 32), torch.randint(1, 64, (2, 16))
    with torch.no_grad():
        logits = vit(pixel_values=images).logits
        assert logits.shape == (1, 3) and torch.isfinite(logits).all()
        assert torch.isfinite(bert(input_ids=ids).logits).all()
    with torch.inference_mode():
        assert torch.equal(vit(pixel_values=images).logits, logits)
    with pytest.raises(ValueError, match=rf"\({VIT_TOKENS} tokens = batch x sequence\)"):
        vit(pixel_values=images)  # eval() alone keeps grad mode on: backward could follow


# --------------------------------------------------------------------------------------------
# Modules tq cannot fake-quantize from outside are left as they are, and said so
# --------------------------------------------------------------------------------------------
def tiny_causal_lm(model_type: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32)
    extra = {
        "gemma": dict(intermediate_size=64, num_key_value_heads=2, head_dim=16),
        "opt": dict(ffn_dim=64, word_embed_proj_dim=32),
        "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
        "olmo2": dict(intermediate_size=64, num_key_value_heads=2),
    }
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes, **extra[model_type])).eval()


@pytest.mark.parametrize("model_type", ["gemma", "opt"])
def test_embedding_subclasses_with_their_own_forward_keep_it(model_type):
    """Gemma scales its embedding in its own forward (GemmaTextScaledWordEmbedding) and OPT's learned
    positions take position_ids; tq.calibrate gave every nn.Embedding the fake-quant forward, which
    calls F.embedding: Gemma's logits were silently wrong with the embedding's quantizers all off
    (cosine 0.86 to the float model under tq.configs.fp8()), OPT's calibration raised a TypeError."""
    torch.manual_seed(0)
    model, ids = tiny_causal_lm(model_type), torch.randint(2, 64, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    tq.calibrate(model, tq.configs.int8_weight_only(), None, progress=False)
    own_forward = [
        m for m in model.modules() if isinstance(m, nn.Embedding) and fq_modules.base_class(m).forward is not nn.Embedding.forward
    ]
    assert own_forward and not any(fq_modules.holds_quantizers(m) for m in own_forward)  # left as they were
    assert any(fq_modules.holds_quantizers(m) for m in model.modules())  # the linear layers are quantized
    with torch.no_grad():
        out = model(ids).logits
    assert F.cosine_similarity(out.flatten(), ref.flatten(), 0) > 0.999


def test_a_rule_for_gemmas_embedding_is_refused_by_name_and_old_states_restore():
    model = tiny_causal_lm("gemma")
    rule = tq.configs.QuantRule(name="model.embed_tokens", weight=tq.IntQuantizer())
    with pytest.warns(
        tq.calibration.CalibrationWarning, match=r"model.embed_tokens \(GemmaTextScaledWordEmbedding\): .*overrides forward"
    ):
        tq.calibrate(model, tq.configs.int8_weight_only().with_rules(rule), None, progress=False)
    state = tq.quant_state(model)
    assert "model.embed_tokens" not in state["modules"]
    # A state saved before lists the embedding with every quantizer off: it restores.
    off = {"kind": "Embedding", **{s: {"quantizer": None, "amax": None} for s in ("input", "weight", "output")}}
    old = {**state, "modules": {"model.embed_tokens": off, **state["modules"]}}
    fresh = tq.restore(tiny_causal_lm("gemma"), old)
    fresh.load_state_dict(model.state_dict())
    ids = torch.randint(2, 64, (2, 12))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_nothing_to_quantize_is_said_naming_the_weights_tq_does_not_know():
    """GPT-2's attention and MLP are transformers' Conv1D (a (in, out) weight and addmm), no nn.Linear:
    tq.calibrate quantized nothing and said nothing, and tq.export then refused the model."""
    from transformers.pytorch_utils import Conv1D

    model = nn.Sequential(Conv1D(32, 16), nn.ReLU(), Conv1D(16, 32))
    with pytest.warns(tq.calibration.CalibrationWarning, match=r"enables no quantizer.*: 0 \(Conv1D\), 2 \(Conv1D\)"):
        tq.calibrate(model, tq.configs.int8(), lambda m: m(torch.randn(4, 16)), progress=False)


def test_falcons_linear_layers_are_quantized():
    """Every linear layer of a Falcon is transformers' FalconLinear, an nn.Linear subclass whose own
    forward computes ``x @ W.T + b``: tq.calibrate skipped them all as overriding forward (nothing
    quantized; tq.export then refused the model). That forward is F.linear's computation, so the
    fake-quant forward stands in for it."""
    torch.manual_seed(0)
    model, ids = tiny_causal_lm("falcon"), torch.randint(2, 64, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    linears = [n for n, m in model.named_modules() if type(m).__name__ == "FalconLinear" and n != "lm_head"]
    tq.calibrate(model, tq.configs.int8(), lambda m: m(ids), progress=False)
    quantized = {r.name for r in tq.summary(model).rows if r.weight.startswith("INT8")}
    assert linears and set(linears) <= quantized
    with torch.no_grad():
        out = model(ids).logits
    assert F.cosine_similarity(out.flatten(), ref.flatten(), 0) > 0.999
    assert {r.kernel for r in tq.deploy.deployed_layers(tq.compress(model))} == {"int_mm"}


def test_smoothquant_that_smooths_nothing_says_so():
    """OLMo 2 normalises after attention and MLP: no norm produces any layer's input, so SmoothQuant
    (which folds into norms only, by default) returned the naive W8A8 model and said nothing."""
    torch.manual_seed(0)
    batches = [torch.randint(2, 64, (2, 16)) for _ in range(2)]
    loop = lambda m: [m(b) for b in batches]  # noqa: E731
    model = tiny_causal_lm("olmo2")
    with pytest.warns(tq.calibration.CalibrationWarning, match=r"SmoothQuant smoothed no layer.*linear_folds=True"):
        tq.calibrate(model, tq.configs.int8(), loop, algorithm="smoothquant", progress=False)
    model = tiny_causal_lm("olmo2")
    tq.calibrate(model, tq.configs.int8(), loop, algorithm=tq.calibration.SmoothQuant(linear_folds=True), progress=False)
    assert "smoothquant" in tq.summary(model).rows[-2].method  # the last down_proj, folded into up_proj


# --------------------------------------------------------------------------------------------
# Multimodal models: the language model is quantized, the vision encoder and projector are not
# --------------------------------------------------------------------------------------------
def tiny_llava() -> nn.Module:
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)  # fmt: skip
    cfg = AutoConfig.for_model("llava", text_config=text, vision_config=vision, image_token_index=250)
    return AutoModelForImageTextToText.from_config(cfg).eval()


def test_a_vlm_quantizes_its_language_model_and_loads_back(tmp_path):
    """The presets quantized a VLM's vision tower and projector too (llmcompressor's and ModelOpt's
    VLM recipes keep them in high precision, as vLLM serves them), and tq.load_exported built every
    checkpoint with AutoModelForCausalLM, which refuses Llava, Qwen2.5-VL and Mistral3 configs."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    model, ids = tiny_llava(), torch.randint(1, 240, (2, 12))
    tq.calibrate(model, tq.configs.int8_weight_only(), None, progress=False)
    quantized = {r.name for r in tq.summary(model).rows if r.weight != "off"}
    assert quantized and all(n.startswith("model.language_model.") for n in quantized)
    assert any(n.startswith("model.vision_tower.") for n in (r.name for r in tq.summary(model).rows))  # converted, off
    tq.export(model, str(tmp_path / "m"))
    loaded = tq.load_exported(str(tmp_path / "m"))
    assert type(loaded).__name__ == "LlavaForConditionalGeneration"
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    # A vision model on its own (its layers under a top-level `vision_model`) is the model: quantized.
    clip_cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    clip = CLIPVisionModel(clip_cfg)
    tq.calibrate(clip, tq.configs.int8_weight_only(), None, progress=False)
    assert {r.weight != "off" for r in tq.summary(clip).rows if r.name.endswith(("_proj", "fc1", "fc2"))} == {True}


def test_encoder_decoder_models_export_and_load_back(tmp_path):
    """T5 and Whisper: tq.load_exported built every checkpoint with AutoModelForCausalLM (which
    refuses them), and the presets quantized Whisper's output head `proj_out`, tied to the decoder's
    embedding, so tq.export refused the model. (Whisper's convolution stem: kept in high precision
    by a rule, as export's error says: serving formats quantize linear layers only.)"""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    from tqcompile.calibration import QuantRule

    sizes = dict(vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128)  # fmt: skip
    whisper_cfg = AutoConfig.for_model(
        "whisper", **sizes, num_mel_bins=16, max_source_positions=16, max_target_positions=16, decoder_start_token_id=1, pad_token_id=0
    )
    t5_cfg = AutoConfig.for_model("t5", vocab_size=128, d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16, decoder_start_token_id=0)
    decoder_ids = torch.randint(3, 120, (2, 6))
    cases = {
        "whisper": (AutoModelForSpeechSeq2Seq.from_config(whisper_cfg), {"input_features": torch.randn(2, 16, 32)}),
        "t5": (AutoModelForSeq2SeqLM.from_config(t5_cfg), {"input_ids": torch.randint(3, 120, (2, 10))}),
    }
    keep_convs = QuantRule.disable(module_types=(nn.Conv1d,), must_match=False)
    for name, (model, inputs) in cases.items():
        model.eval()
        inputs = {**inputs, "decoder_input_ids": decoder_ids}
        tq.calibrate(model, tq.configs.int8_dynamic().with_rules(keep_convs), lambda m, x=inputs: m(**x), progress=False)
        quantized = {r.name for r in tq.summary(model).rows if r.weight != "off"}
        assert quantized and "proj_out" not in quantized, name
        tq.export(model, str(tmp_path / name))
        loaded = tq.load_exported(str(tmp_path / name))
        assert type(loaded) is type(model), name
        with torch.no_grad():
            assert torch.equal(loaded(**inputs).logits, model(**inputs).logits), name
