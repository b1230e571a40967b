"""The query quantizer of an attention (issue 29: "and optionally the query"): the query after RoPE,
calibrated like the keys and values, fake-quantized where the attention computes with it (Hugging
Face attention through tq's query tap in transformers' AttentionInterface; nn.MultiheadAttention),
saved, restored, exported as ``<attention>.q_scale`` in both formats (one fp32 scalar a layer, as
vLLM reads it) and loaded back. Tiny models built from configs."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from test_kv_cache import PER_HEAD, PER_TENSOR, batches, loop, tiny
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import tqcompile as tq
from tqcompile.calibration import ConfigError, QuantConfig, QuantRule, fake_quantize
from tqcompile.export.units import ExportError
from tqcompile.kernels.reference import tensor_scale_inv
from tqcompile.testing.compile import assert_no_graph_breaks

WITH_QUERY = QuantConfig((tq.configs.fp8_kv_cache(query=True),))
SEEN: dict[int, list[torch.Tensor]] = {}


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention implementation that records the query it is given, then computes as sdpa."""
    SEEN.setdefault(module.layer_idx, []).append(query.detach().clone())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("test_recording", _recording_attention)


def recorded_queries(model: nn.Module, layer: int) -> torch.Tensor:
    """The queries layer `layer`'s attention function receives over the calibration batches."""
    SEEN.clear()
    with torch.no_grad():
        loop(model)
    return torch.cat(SEEN[layer])


# GPT-OSS has no sdpa implementation in transformers (its attention sinks): eager only.
@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("qwen3", "eager"), ("mixtral", "sdpa"), ("gpt_oss", "eager")])
def test_query_amax_is_the_post_rope_query_max_and_the_attention_computes_with_it_quantized(kind, attn):
    model = tiny(kind, attn)
    model.set_attn_implementation("test_recording")
    float_queries = recorded_queries(model, 0)
    model.set_attn_implementation(attn)
    x = batches()[0]
    with torch.no_grad():
        kv_only = tiny(kind, attn)
        tq.calibrate(kv_only, QuantConfig((tq.configs.fp8_kv_cache(),)), loop, progress=False)
        kv_only_logits = kv_only(input_ids=x).logits
    tq.calibrate(model, WITH_QUERY, loop, progress=False)
    attention = model.model.layers[0].self_attn
    assert torch.equal(attention.query_quantizer.amax, float_queries.abs().amax())  # after RoPE (and q_norm): what attention reads
    assert model.config._attn_implementation == attn and attention.__dict__["config"] is model.config.get_text_config()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    assert not torch.equal(logits, kv_only_logits)  # the query quantization changes what the model computes
    # Whatever implementation the model's config names runs, given the fake-quantized query.
    model.set_attn_implementation("test_recording")
    queries = recorded_queries(model, 0)
    assert torch.equal(queries, fake_quantize(float_queries, PER_TENSOR, attention.query_quantizer.amax))


def test_multihead_attention_quantizes_its_query():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    xs = [torch.randn(2, 5, 32) for _ in range(2)]
    with torch.no_grad():
        w_q, b_q = mha.in_proj_weight.chunk(3)[0], mha.in_proj_bias.chunk(3)[0]
        queries = torch.cat([torch.nn.functional.linear(x, w_q, b_q) for x in xs])
    tq.calibrate(mha, WITH_QUERY, lambda m: [m(x, x, x) for x in xs], progress=False)
    assert torch.equal(mha.query_quantizer.amax, queries.abs().amax())
    with torch.no_grad():
        with_query = mha(xs[0], xs[0], xs[0])[0]
        mha.query_quantizer.quantizer = None
        without = mha(xs[0], xs[0], xs[0])[0]
    assert 0 < (with_query - without).abs().max() < 0.05


def test_qat_gradient_reaches_the_query_projection():
    model = tiny("llama")
    tq.calibrate(model, WITH_QUERY, loop, progress=False)
    model.train()
    x = batches()[0]
    model(input_ids=x, labels=x).loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and bool(torch.isfinite(grad).all()) and grad.abs().sum() > 0


def test_a_query_quantizer_is_fp8_per_layer_and_comes_with_the_kv_cache():
    with pytest.raises(ConfigError, match=r"query=.*not allowed as a query quantizer.*TENSORWISE.*one FP8 q_scale per attention"):
        QuantRule(query=PER_HEAD)
    with pytest.raises(ConfigError, match=r"query=.*not allowed as a query quantizer"):
        QuantRule(query=tq.IntQuantizer())
    model = tiny("llama")
    with pytest.raises(ConfigError, match=r"quantizes the query of 'model.layers.0.self_attn' but not its keys and values"):
        tq.calibrate(model, QuantConfig((QuantRule(query=PER_TENSOR),)), loop, progress=False)
    assert type(model.model.layers[0].self_attn) is transformers.models.llama.modeling_llama.LlamaAttention


def test_state_restore_and_summary_keep_the_query():
    model = tiny("qwen3")
    tq.calibrate(model, tq.configs.int8().with_rules(tq.configs.fp8_kv_cache(per_head=True, query=True)), loop, progress=False)
    state = tq.quant_state(model)
    assert state["modules"]["model.layers.0.self_attn"]["query"]["amax"].shape == ()
    fresh = tq.restore(tiny("qwen3", seed=1), state)
    fresh.load_state_dict(model.state_dict())
    x = batches()[0]
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=x).logits, model(input_ids=x).logits)
    table = str(tq.summary(fresh))
    assert table.splitlines()[0].split()[-1] == "query" and "E4M3 tensor" in table.splitlines()[-2].split("  ")[-1]


def test_a_state_saved_before_the_query_slot_restores_without_a_query():
    model = tiny("llama")
    tq.calibrate(model, QuantConfig((tq.configs.fp8_kv_cache(),)), loop, progress=False)
    state = tq.quant_state(model)
    for entry in state["modules"].values():
        entry.pop("query", None)
    for rule in state["config"]["rules"]:
        rule.pop("query")
    fresh = tq.restore(tiny("llama"), state)
    assert not fresh.model.layers[0].self_attn.query_quantizer.enabled
    x = batches()[0]
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=x).logits, model(input_ids=x).logits)


@pytest.mark.parametrize("fmt,shape", [("compressed-tensors", (1,)), ("modelopt", ())])
def test_export_writes_one_q_scale_per_layer_and_load_exported_reads_it(tmp_path, fmt, shape):
    model = tiny("llama")
    tq.calibrate(model, tq.configs.fp8().with_rules(tq.configs.fp8_kv_cache(query=True)), loop, progress=False)
    tq.export(model, tmp_path, format=fmt)
    attention = model.model.layers[1].self_attn
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        t = f.get_tensor("model.layers.1.self_attn.q_scale")
    assert t.dtype == torch.float32 and tuple(t.shape) == shape
    assert torch.equal(t.reshape(()), tensor_scale_inv(attention.query_quantizer.amax, PER_TENSOR))  # amax / 448
    back = tq.load_exported(str(tmp_path))
    assert torch.equal(back.model.layers[1].self_attn.query_quantizer.amax, attention.query_quantizer.amax)
    x = batches()[0]
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, model(input_ids=x).logits)


def test_load_exported_refuses_a_q_scale_in_some_attentions_only(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny("llama")
    tq.calibrate(model, tq.configs.fp8().with_rules(tq.configs.fp8_kv_cache(query=True)), loop, progress=False)
    tq.export(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"'model.layers.0.self_attn' has a q_scale and 'model.layers.1.self_attn' has none"):
        tq.load_exported(str(tmp_path))


def test_export_refuses_a_query_quantized_in_some_attentions_only(tmp_path):
    model = tiny("llama")
    config = QuantConfig((tq.configs.fp8_kv_cache(), QuantRule(name="model.layers.0.self_attn", query=PER_TENSOR)))
    tq.calibrate(model, tq.configs.fp8().with_rules(*config.rules), loop, progress=False)
    with pytest.raises(ExportError, match=r"'model.layers.0.self_attn' quantizes its query and 'model.layers.1.self_attn' does not"):
        tq.export(model, tmp_path)
    assert json.dumps({}) and not (tmp_path / "model.safetensors").exists()


def test_compiled_attention_with_a_quantized_query_has_no_graph_break():
    model = tiny("llama")
    tq.calibrate(model, tq.configs.int8().with_rules(tq.configs.fp8_kv_cache(query=True)), loop, progress=False)
    x = batches()[0]
    with torch.no_grad():
        eager = model(input_ids=x, use_cache=False).logits
        compiled = assert_no_graph_breaks(lambda ids: model(input_ids=ids, use_cache=False).logits, x)
    torch.testing.assert_close(compiled, eager)


def test_compressed_model_with_a_quantized_query_generates_the_calibrated_models_tokens():
    x = batches()[0]
    outs = []
    for compress in (False, True):
        model = tiny("llama")
        tq.calibrate(model, QuantConfig((tq.configs.fp8_kv_cache(per_head=True, query=True),)), loop, progress=False)
        if compress:
            tq.compress(model)
        with torch.no_grad():
            outs.append(model.generate(x, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].logits, outs[1].logits, strict=True))
    assert type(outs[1].past_key_values.layers[0]).__name__ == "FP8DynamicLayer"
