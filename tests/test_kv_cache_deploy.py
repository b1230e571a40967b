"""The deployment form of a quantized KV cache (issue 29 item 4): after `tq.compress`, a model
calibrated with a KV rule stores FP8 codes (one byte) plus its calibrated scales in Hugging Face's
dynamic and static caches, and computes bit for bit what the calibrated model computes; the
decode step with the static FP8 cache compiles into one graph. Tiny models built from configs."""

from __future__ import annotations

import pytest
import torch
from test_kv_cache import batches, loop, tiny
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer

import tqcompile as tq
from tqcompile.calibration import QuantConfig
from tqcompile.export import ExportError
from tqcompile.testing.compile import CompileCounter

NEW = 6


def calibrated(per_head: bool, dtype: torch.dtype = torch.float32, kind: str = "llama", attn: str = "sdpa", weights=None):
    """A tiny model calibrated with an FP8 KV rule (and `weights`' preset, else the KV cache only):
    the same model and amaxes on every call."""
    model = tiny(kind, attn).to(dtype)
    rule = tq.configs.fp8_kv_cache(per_head=per_head)
    config = QuantConfig((rule,)) if weights is None else weights.with_rules(rule)
    tq.calibrate(model, config, loop, progress=False)
    return model


def generate(model, cache_implementation=None, **kw):
    with torch.no_grad():
        return model.generate(
            batches()[0], max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
            cache_implementation=cache_implementation, **kw,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("per_head", [False, True], ids=["tensor", "head"])
@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("qwen3", "eager")])
def test_generate_stores_fp8_codes_and_computes_what_the_calibrated_model_computes(kind, attn, cache, per_head, dtype):
    ref = generate(calibrated(per_head, dtype, kind, attn), cache)
    model = tq.compress(calibrated(per_head, dtype, kind, attn))
    out = generate(model, cache)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits, strict=True):
        assert torch.equal(a, b)  # bit for bit: the same codes, the same dequantize op
    layers = out.past_key_values.layers
    expected = tq.deploy.FP8StaticLayer if cache == "static" else tq.deploy.FP8DynamicLayer
    assert [type(layer) for layer in layers] == [expected] * 2
    assert all(layer.keys.dtype == layer.values.dtype == torch.float8_e4m3fn for layer in layers)


def test_cache_bytes_per_token_are_half_of_bf16():
    """Exact byte counts: 2 layers x (keys + values) x 2 KV heads x head_dim 16 per token."""
    ids = batches()[0][:1]
    per_token_bf16 = 2 * 2 * 2 * 16 * 2
    float_model = tiny("llama").to(torch.bfloat16)
    model = tq.compress(calibrated(per_head=True, dtype=torch.bfloat16))
    sizes = {}
    for name, m in (("bf16", float_model), ("fp8", model)):
        for tokens in (ids.shape[1], ids.shape[1] + 5):
            cache = DynamicCache(config=m.config)
            with torch.no_grad():
                m(input_ids=torch.cat([ids, ids[:, : tokens - ids.shape[1]]], 1), past_key_values=cache, use_cache=True)
            sizes[name, tokens] = tq.deploy.kv_cache_bytes(cache)
    assert sizes["bf16", 10] == 10 * per_token_bf16 and sizes["bf16", 15] == 15 * per_token_bf16
    assert sizes["fp8", 10] == 10 * per_token_bf16 // 2 and sizes["fp8", 15] == 15 * per_token_bf16 // 2
    static = tq.deploy.quantized_kv_cache(model, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=static, use_cache=True)
    assert tq.deploy.kv_cache_bytes(static) == 32 * per_token_bf16 // 2  # preallocated for 32 tokens


def test_a_cache_built_ahead_passes_to_generate():
    ref = generate(calibrated(per_head=False), "static")
    model = tq.compress(calibrated(per_head=False))
    # generate's own static cache holds every token but the last: the same length, the same sums.
    cache = tq.deploy.quantized_kv_cache(model, max_cache_len=batches()[0].shape[1] + NEW - 1)
    assert isinstance(cache, StaticCache) and isinstance(cache.layers[1], tq.deploy.FP8StaticLayer)
    out = generate(model, past_key_values=cache)
    assert out.past_key_values is cache
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))


def test_with_quantized_weights_the_tokens_are_the_calibrated_models():
    """W8 weight-only layers run torch's INT8 kernel after compress (its own, documented rounding):
    greedy tokens equal, logits within the kernel's bound (docs/deploy.md)."""
    weights = tq.configs.int8_weight_only()
    ref = generate(calibrated(True, weights=weights))
    out = generate(tq.compress(calibrated(True, weights=weights)))
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert isinstance(out.past_key_values.layers[0], tq.deploy.FP8DynamicLayer)


def test_a_layer_already_holding_float_entries_keeps_them_and_gets_fake_quantized_values():
    model = tq.compress(calibrated(per_head=False))
    ref = calibrated(per_head=False)
    ids = batches()[0]
    caches = []
    for m in (ref, model):
        cache = DynamicCache(config=m.config)
        for layer in cache.layers:  # one float entry already in
            layer.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16))
        with torch.no_grad():
            logits = m(input_ids=ids, past_key_values=cache, use_cache=True).logits
        caches.append((cache, logits))
    (ref_cache, ref_logits), (cache, logits) = caches
    assert [type(layer) for layer in cache.layers] == [DynamicLayer] * 2
    assert torch.equal(cache.layers[1].keys, ref_cache.layers[1].keys)
    assert torch.equal(logits, ref_logits)


def test_compiled_decode_step_with_the_static_fp8_cache_is_one_graph_without_recompiles():
    model = tq.compress(calibrated(per_head=True))
    ref = calibrated(per_head=True)
    ids = batches()[0][:1]
    n = ids.shape[1]

    def run(m, step):
        cache = StaticCache(config=m.config, max_cache_len=n + 4)
        with torch.no_grad():
            logits = m(input_ids=ids, past_key_values=cache, cache_position=torch.arange(n), use_cache=True).logits[:, -1]
            out = []
            for i in range(3):
                nxt = logits.argmax(-1, keepdim=True)
                logits = step(m, nxt, cache, torch.tensor([n + i]))
                out.append(logits)
        return out, cache

    def step(m, nxt, cache, pos):
        return m(input_ids=nxt, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1]

    counter = CompileCounter("aot_eager")
    got, cache = run(model, torch.compile(step, backend=counter, fullgraph=True))
    assert isinstance(cache.layers[0], tq.deploy.FP8StaticLayer)
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0)
    # The calibrated model compiled the same way: bit for bit. (Compiled and eager differ by up to
    # 6e-8 in these logits for the calibrated model too: aot_eager's decompositions, not the cache.)
    want, _ = run(ref, torch.compile(step, backend="aot_eager", fullgraph=True))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_quantized_kv_cache_needs_a_compressed_kv_model():
    model = calibrated(per_head=False)  # calibrated, not compressed
    with pytest.raises(ValueError, match="no compressed attention with a quantized KV cache.*tq.compress"):
        tq.deploy.quantized_kv_cache(model)


def test_compress_leaves_the_model_as_it_was_when_a_kv_amax_is_missing():
    model = calibrated(per_head=False, weights=tq.configs.int8_weight_only())
    model.model.layers[1].self_attn.value_quantizer.set_amax(None)
    before = type(model.model.layers[0].self_attn)
    with pytest.raises(RuntimeError, match="value quantizer of 'model.layers.1.self_attn'.*calibrated"):
        tq.compress(model)
    assert type(model.model.layers[0].self_attn) is before
    assert not isinstance(model.model.layers[0].self_attn.q_proj.weight, tq.QuantizedTensor)


def test_deployed_layers_lists_the_fp8_cache_of_each_compressed_attention():
    model = tq.compress(calibrated(per_head=True, weights=tq.configs.int8_dynamic()))
    rows = {row.name: row for row in tq.deploy.deployed_layers(model)}
    attentions = [f"model.layers.{i}.self_attn" for i in range(2)]
    for name in attentions:
        assert rows[name].kernel == "fp8 kv cache" and rows[name].weight_bytes == 0
        assert f"{name}.q_proj" in rows  # its projections keep their own rows
    kv_only = tq.deploy.deployed_layers(tq.compress(calibrated(per_head=False)))
    assert [(row.name, row.kernel) for row in kv_only] == [(name, "fp8 kv cache") for name in attentions]


def test_export_refuses_a_compressed_model_that_quantizes_only_its_kv_cache(tmp_path):
    # The rule of every compressed model: export the calibrated one (its FP8 cache is tq's runtime form).
    model = tq.compress(calibrated(per_head=False))
    with pytest.raises(ExportError, match=r"the model is compressed \(tq.compress; layer 'model.layers.0.self_attn' runs its fp8 kv cache"):
        tq.export(model, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
