"""KV-cache quantization (issue 29): the keys after RoPE and the values, as they enter the cache, of
Hugging Face attention (Llama, Qwen3, Mixtral, GPT-OSS; sdpa and eager) and nn.MultiheadAttention,
calibrated per layer and per KV head, fake-quantized in forward (QAT trains through them), saved,
restored, exported in both formats and loaded back. Tiny models built from configs."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import transformers
from moe_models import tiny_hf_moe
from safetensors import safe_open
from torch import nn

import tqcompile as tq
from tqcompile.calibration import ConfigError, QuantRule, fake_quantize
from tqcompile.calibration.pipeline import CalibrationWarning
from tqcompile.export.units import ExportError
from tqcompile.kernels.reference import tensor_scale_inv
from tqcompile.testing.compile import assert_no_graph_breaks

PER_TENSOR = tq.Float8Quantizer()
PER_HEAD = tq.Float8Quantizer(granularity=tq.Granularity.ROWWISE)
FAMILIES = ("llama", "qwen3", "mixtral", "gpt_oss")


def tiny(kind: str, attn: str = "sdpa", seed: int = 0) -> nn.Module:
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if kind in ("mixtral", "gpt_oss"):
        model = tiny_hf_moe(kind, seed=seed)
        model.set_attn_implementation(attn)
        return model
    cfg = (transformers.LlamaConfig if kind == "llama" else transformers.Qwen3Config)(head_dim=16, **common)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def batches(n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 10), generator=g) for _ in range(n)]


def loop(model):
    for x in batches():
        model(input_ids=x)


def float_kv(model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values the float model stores in its cache for `layer` over the calibration
    batches (post-RoPE keys, as transformers' DynamicCache holds them), concatenated on the batch dim."""
    ks, vs = [], []
    with torch.no_grad():
        for x in batches():
            cache = model(input_ids=x, use_cache=True).past_key_values
            ks.append(cache.layers[layer].keys)
            vs.append(cache.layers[layer].values)
    return torch.cat(ks), torch.cat(vs)


def per_head_amax(t: torch.Tensor) -> torch.Tensor:
    return t.abs().amax(dim=(0, 2, 3)).unsqueeze(-1)


# GPT-OSS has no sdpa implementation in transformers (its attention sinks): eager only.
@pytest.mark.parametrize("kind,attn", [(k, a) for k in FAMILIES for a in ("sdpa", "eager") if (k, a) != ("gpt_oss", "sdpa")])
def test_calibrated_amax_is_the_cache_entries_max_and_the_cache_stores_them_quantized(kind, attn):
    model = tiny(kind, attn)
    keys, values = float_kv(model, 1)
    cfg = tq.configs.int8().with_rules(QuantRule(key=PER_HEAD, value=PER_TENSOR))
    tq.calibrate(model, cfg, loop, kv_scale_search="max", progress=False)
    attention = model.model.layers[1].self_attn
    assert tq.calibration.modules.kind_of(attention)[0] == "Attention"
    assert torch.equal(attention.key_quantizer.amax, per_head_amax(keys))  # one per KV head: (2, 1)
    assert torch.equal(attention.value_quantizer.amax, values.abs().amax())
    # Fake-quantized in forward: what the cache receives is fake_quantize of the float model's entry.
    x = batches()[0]
    with torch.no_grad():
        cache = model(input_ids=x, use_cache=True).past_key_values
    layer0 = model.model.layers[0].self_attn
    assert torch.equal(cache.layers[0].values, fake_quantize(cache.layers[0].values, PER_TENSOR, layer0.value_quantizer.amax))
    stored = cache.layers[0].keys
    rows = stored.transpose(0, 1).reshape(2, -1)
    assert torch.equal(rows, fake_quantize(rows, PER_HEAD, layer0.key_quantizer.amax))


def test_flex_attention_calibrates_and_stores_the_cache_as_sdpa_does():
    """FlexAttention (transformers' "flex_attention", compiled by transformers itself) reaches the
    same cache tap and query tap: the amaxes equal sdpa's up to the float rounding that separates
    the two kernels' outputs, and the cache stores quantized entries. Without gradients: torch 2.13
    has no FlexAttention backward on CPU (QAT through it needs a GPU)."""
    cfg = tq.configs.int8().with_rules(QuantRule(key=PER_HEAD, value=PER_TENSOR, query=PER_TENSOR))
    got = {}
    with torch.no_grad():
        for attn in ("sdpa", "flex_attention"):
            model = tiny("llama", attn)
            tq.calibrate(model, cfg, loop, kv_scale_search="max", progress=False)
            got[attn] = model
    for layer in (0, 1):
        a, b = (got[k].model.layers[layer].self_attn for k in ("sdpa", "flex_attention"))
        for slot in ("query_quantizer", "key_quantizer", "value_quantizer"):
            # Layer 0 sees identical inputs; layer 1 the two kernels' outputs, ~1e-7 apart (measured 2e-7 relative).
            torch.testing.assert_close(getattr(b, slot).amax, getattr(a, slot).amax, rtol=1e-5 if layer else 0, atol=0)
    flex = got["flex_attention"]
    with torch.no_grad():
        cache = flex(input_ids=batches()[0], use_cache=True).past_key_values
    amax = flex.model.layers[0].self_attn.value_quantizer.amax
    assert torch.equal(cache.layers[0].values, fake_quantize(cache.layers[0].values, PER_TENSOR, amax))
    assert not torch.equal(cache.layers[0].values, float_kv(tiny("llama", "flex_attention"), 0)[1][:2])


def test_per_layer_kv_amax_is_the_error_search_by_default_and_the_rest_follows_the_algorithm():
    """By default a per-layer KV amax is the histogram "mse" search, not the largest |k|: one FP8
    scale covers a layer's rare outlier keys (docs/ptq.md measured a lower KL); a per-head KV amax,
    the weights and the other activations keep `algorithm`'s ("max"); `kv_scale_search` names one
    search for every KV amax."""
    keys, values = float_kv(tiny("llama"), 0)

    def calibrated(kv_rule, **kwargs):
        model = tiny("llama")
        tq.calibrate(model, tq.configs.int8().with_rules(kv_rule), loop, progress=False, **kwargs)
        return model

    by_default = calibrated(tq.configs.fp8_kv_cache())
    searched = calibrated(tq.configs.fp8_kv_cache(), algorithm="mse")
    maxed = calibrated(tq.configs.fp8_kv_cache(), kv_scale_search="max")
    attention = by_default.model.layers[0].self_attn
    for slot in ("key", "value"):
        amax = getattr(attention, f"{slot}_quantizer").amax
        assert torch.equal(amax, getattr(searched.model.layers[0].self_attn, f"{slot}_quantizer").amax)
    assert float(attention.key_quantizer.amax) < float(keys.abs().amax())  # this model's keys: the search clips
    assert torch.equal(maxed.model.layers[0].self_attn.key_quantizer.amax, keys.abs().amax())
    assert torch.equal(maxed.model.layers[0].self_attn.value_quantizer.amax, values.abs().amax())
    for (name, m), (_, ref) in zip(by_default.named_modules(), maxed.named_modules(), strict=True):
        if hasattr(m, "input_quantizer"):  # int8's static input amaxes and its weights: "max", as before
            for slot in ("input", "weight"):
                a, b = getattr(m, f"{slot}_quantizer").amax, getattr(ref, f"{slot}_quantizer").amax
                assert (a is None and b is None) or torch.equal(a, b), (name, slot)
    assert tq.quant_state(by_default)["algorithm"] == "max (KV cache: mse)"
    per_head = calibrated(tq.configs.fp8_kv_cache(per_head=True))
    assert torch.equal(per_head.model.layers[0].self_attn.key_quantizer.amax, per_head_amax(keys))
    clipped = calibrated(tq.configs.fp8_kv_cache(per_head=True), kv_scale_search="percentile", percentile=99.0)
    assert bool((clipped.model.layers[0].self_attn.key_quantizer.amax < per_head_amax(keys)).any())
    with pytest.raises(ValueError, match=r"kv_scale_search='minmax' is not allowed; allowed: None .* 'max', 'percentile', 'mse'"):
        tq.calibrate(tiny("llama"), tq.configs.int8().with_rules(tq.configs.fp8_kv_cache()), loop, kv_scale_search="minmax")


def test_generate_with_a_quantized_cache_equals_full_recomputation():
    """The cache holds quantized entries, so cached decoding computes what recomputing the whole
    sequence with fake-quantized k/v computes (every key/value is quantized once, as in an FP8 cache)."""
    model = tiny("llama")
    tq.calibrate(model, tq.configs.int8_weight_only().with_rules(tq.configs.fp8_kv_cache()), loop, progress=False)
    x = batches()[0][:1]
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=4, do_sample=False, use_cache=True)
        logits_cached = model(input_ids=out[:, :-1], use_cache=False).logits[:, -1]
    nxt = logits_cached.argmax(-1)
    assert torch.equal(nxt, out[:, -1])


def test_multihead_attention():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    xs = [torch.randn(2, 5, 32) for _ in range(2)]
    with torch.no_grad():
        ref = mha(xs[0], xs[0], xs[0])[0]
        w_k, b_k = mha.in_proj_weight.chunk(3)[1], mha.in_proj_bias.chunk(3)[1]
        keys = torch.cat([torch.nn.functional.linear(x, w_k, b_k) for x in xs]).unflatten(-1, (4, 8)).transpose(1, 2)
    with warnings.catch_warnings():
        # A KV rule matches out_proj too, whose parent reads its weight: a Linear has no KV slots, nothing to report.
        warnings.simplefilter("error", CalibrationWarning)
        tq.calibrate(mha, QuantConfig_kv(PER_HEAD), lambda m: [m(x, x, x) for x in xs], progress=False)
    assert type(mha).__name__ == "FakeQuantMultiheadAttention"
    assert torch.equal(mha.key_quantizer.amax, per_head_amax(keys))  # (4 heads, 1)
    with torch.no_grad():
        out = mha(xs[0], xs[0], xs[0])[0]
    assert 0 < (out - ref).abs().max() < 0.05  # quantized, and close


def QuantConfig_kv(q) -> tq.calibration.QuantConfig:
    return tq.calibration.QuantConfig((QuantRule(key=q, value=q),))


@pytest.mark.parametrize("algorithm", ["percentile", "mse"])
@pytest.mark.parametrize("q", [PER_TENSOR, PER_HEAD], ids=["tensor", "head"])
def test_percentile_and_mse_clip_within_the_max(algorithm, q):
    model = tiny("llama")
    keys, _ = float_kv(model, 0)
    tq.calibrate(model, QuantConfig_kv(q), loop, algorithm=algorithm, percentile=99.0, progress=False)
    amax = model.model.layers[0].self_attn.key_quantizer.amax
    top = per_head_amax(keys) if q is PER_HEAD else keys.abs().amax()
    assert amax.shape == top.shape
    assert bool((amax <= top).all()) and bool((amax > 0).all())
    if algorithm == "percentile":
        assert bool((amax < top).any())


def test_qat_gradients_flow_through_the_kv_quantizers():
    model = tiny("qwen3")
    tq.calibrate(model, tq.configs.int8().with_rules(tq.configs.fp8_kv_cache(per_head=True)), loop, progress=False)
    model.train()
    x = batches()[0]
    model(input_ids=x, labels=x).loss.backward()
    attn = model.model.layers[0].self_attn
    for p in (attn.k_proj.weight, attn.v_proj.weight, attn.k_norm.weight):
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and p.grad.abs().sum() > 0


def test_kv_fake_quant_gradient_is_the_clipped_straight_through_estimator():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8)
    tq.calibrate(mha, QuantConfig_kv(PER_TENSOR), lambda m: m(x, x, x), progress=False)
    k = torch.randn(1, 2, 3, 4, requires_grad=True)
    mha.key_quantizer.set_amax(torch.tensor(1.0))
    mha.key_quantizer(k, unit_dim=1).sum().backward()
    assert torch.equal(k.grad, (k.detach().abs() <= 1.0).float())


def test_state_and_restore_round_trip():
    model = tiny("mixtral")
    tq.calibrate(model, tq.configs.int8().with_rules(tq.configs.fp8_kv_cache(per_head=True)), loop, progress=False)
    state = tq.quant_state(model)
    assert state["modules"]["model.layers.0.self_attn"]["kind"] == "Attention"
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kv_state_{os.getpid()}.pt")
    torch.save(state, path)
    fresh = tiny("mixtral", seed=1)
    tq.restore(fresh, torch.load(path, weights_only=True))
    os.remove(path)
    fresh.load_state_dict(model.state_dict())
    x = batches()[0]
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=x).logits, model(input_ids=x).logits)
    assert "E4M3 per-head" in str(tq.summary(fresh))


def test_a_state_without_kv_quantizers_restores_without_converting_attention():
    model = tiny("llama")
    tq.calibrate(model, tq.configs.int8(), loop, progress=False)
    fresh = tq.restore(tiny("llama"), tq.quant_state(model))
    assert type(fresh.model.layers[0].self_attn) is transformers.models.llama.modeling_llama.LlamaAttention


@pytest.mark.parametrize("per_head", [False, True])
def test_export_compressed_tensors(tmp_path, per_head):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    model = tiny("llama")
    tq.calibrate(model, tq.configs.int8().with_rules(tq.configs.fp8_kv_cache(per_head=per_head)), loop, progress=False)
    tq.export(model, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # compressed-tensors' own parser
    assert parsed.kv_cache_scheme.strategy == (QuantizationStrategy.ATTN_HEAD if per_head else QuantizationStrategy.TENSOR)
    assert parsed.kv_cache_scheme.num_bits == 8 and parsed.kv_cache_scheme.type == "float" and not parsed.kv_cache_scheme.dynamic
    attention = model.model.layers[1].self_attn
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        for slot, local in (("key", "k_scale"), ("value", "v_scale")):
            t = f.get_tensor(f"model.layers.1.self_attn.{local}")
            assert t.dtype == torch.float32 and tuple(t.shape) == ((2, 1, 1) if per_head else (1,))
            quantizer = getattr(attention, f"{slot}_quantizer")
            assert torch.equal(t.flatten(), tensor_scale_inv(quantizer.amax, quantizer.quantizer).flatten())  # amax / 448
    back = tq.load_exported(str(tmp_path))
    x = batches()[0]
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, model(input_ids=x).logits)
    q = back.model.layers[1].self_attn.key_quantizer
    assert torch.equal(tensor_scale_inv(q.amax, q.quantizer), tensor_scale_inv(attention.key_quantizer.amax, PER_TENSOR))


def test_export_modelopt(tmp_path):
    model = tiny("llama")
    fp8_rowwise = tq.Float8Quantizer(granularity=tq.Granularity.ROWWISE)
    cfg = tq.calibration.QuantConfig(
        (QuantRule(module_types=tq.configs.GEMM_LAYERS, input=fp8_rowwise, weight=fp8_rowwise), *tq.configs.default_disabled())
    )
    tq.calibrate(model, cfg.with_rules(tq.configs.fp8_kv_cache()), loop, progress=False)
    tq.export(model, tmp_path, format="modelopt")
    for name in ("config.json", "hf_quant_config.json"):
        content = json.loads((tmp_path / name).read_text())
        content = content.get("quantization_config", content)
        assert content["quantization"]["kv_cache_quant_algo"] == "FP8"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        t = f.get_tensor("model.layers.0.self_attn.v_scale")
    a = model.model.layers[0].self_attn.value_quantizer
    assert t.dtype == torch.float32 and t.shape == () and torch.equal(t, tensor_scale_inv(a.amax, a.quantizer))
    back = tq.load_exported(str(tmp_path))
    x = batches()[0]
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, model(input_ids=x).logits)


def test_modelopt_refuses_per_head_scales(tmp_path):
    model = tiny("llama")
    tq.calibrate(model, tq.configs.fp8().with_rules(tq.configs.fp8_kv_cache(per_head=True)), loop, progress=False)
    with pytest.raises(ExportError, match="per head.*compressed-tensors"):
        tq.export(model, tmp_path, format="modelopt")
    assert not (tmp_path / "model.safetensors").exists()


def test_load_exported_refuses_a_kv_scale_the_config_does_not_name(tmp_path):
    model = tiny("llama")
    tq.calibrate(model, tq.configs.int8().with_rules(tq.configs.fp8_kv_cache()), loop, progress=False)
    tq.export(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="names no KV-cache scheme"):
        tq.load_exported(str(tmp_path))


def test_compiled_fake_quant_attention_has_no_graph_break():
    model = tiny("llama")
    tq.calibrate(model, tq.configs.int8().with_rules(tq.configs.fp8_kv_cache(per_head=True)), loop, progress=False)
    x = batches()[0]
    with torch.no_grad():
        eager = model(input_ids=x, use_cache=False).logits
        compiled = assert_no_graph_breaks(lambda ids: model(input_ids=ids, use_cache=False).logits, x)
    torch.testing.assert_close(compiled, eager)


def test_bad_kv_quantizer_and_unmatched_kv_rule():
    with pytest.raises(ConfigError, match=r"key=.*MXQuantizer.*allowed: Float8Quantizer\(E4M3\)"):
        QuantRule(key=tq.MXQuantizer())
    model = nn.Sequential(nn.Linear(8, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tq.calibrate(model, tq.configs.int8().with_rules(tq.configs.fp8_kv_cache()), lambda m: m(torch.randn(2, 8)), progress=False)
    assert any(issubclass(w.category, CalibrationWarning) and "no attention module" in str(w.message) for w in caught)


def test_a_model_quantizing_only_its_kv_cache_exports_in_compressed_tensors(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    model = tiny("llama")
    tq.calibrate(model, QuantConfig_kv(PER_HEAD), loop, progress=False)
    tq.export(model, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert qc["config_groups"] == {} and qc["format"] == "dense" and parsed.kv_cache_scheme.strategy == "attn_head"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.self_attn.k_scale").shape == (2, 1, 1)
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight").dtype == torch.float32  # the float weights, as they are
    back = tq.load_exported(str(tmp_path))
    x = batches()[0]
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, model(input_ids=x).logits)


def test_modelopt_refuses_a_model_quantizing_only_its_kv_cache(tmp_path):
    model = tiny("llama")
    tq.calibrate(model, QuantConfig_kv(PER_TENSOR), loop, progress=False)
    with pytest.raises(ExportError, match="only its KV cache.*quant_algo.*compressed-tensors"):
        tq.export(model, tmp_path, format="modelopt")
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("q", [tq.IntQuantizer(), tq.IntQuantizer(granularity=tq.Granularity.ROWWISE), tq.Float8Quantizer(tq.Format.E5M2)])
def test_a_kv_quantizer_no_engine_loads_is_refused_in_the_config(q):
    # vLLM 0.32's compressed-tensors loader: "Currently supported kv cache quantization is num_bits=8, type=float"
    # (FP8 E4M3); it has no INT8 KV cache. Refused where it is written, not at export after calibration.
    with pytest.raises(ConfigError, match=r"value=.*is not allowed as a KV-cache quantizer.*Float8Quantizer\(E4M3\).*INT8"):
        QuantRule(value=q)
