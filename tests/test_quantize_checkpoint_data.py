"""`tq.quantize_checkpoint(..., data=...)`: calibration with data of a model whose weights stay on
disk, one decoder layer in memory at a time (`tqcompile.export.layerwise`).

The checkpoint it writes must be, byte for byte, what `tq.calibrate` of the loaded model on the
same batches and `tq.export` write, for every algorithm (GPTQ, AWQ, SmoothQuant, the scale searches,
KV-cache scales) on dense and MoE models; only one decoder layer's weights are ever real; each
layer runs a constant number of times per batch; the cached inputs obey their memory bound and
their files are removed; what it cannot do is refused by name before anything is written."""

from __future__ import annotations

import filecmp
import os
import warnings

import pytest
import torch

import tqcompile as tq
from tqcompile.export import layerwise, streaming

transformers = pytest.importorskip("transformers")
from moe_models import tiny_hf_moe  # noqa: E402


def _llama(layers: int = 3, dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def _batches(vocab: int, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, 12), generator=g) for _ in range(n)]


def _differ(a: str, b: str) -> list[str]:
    names = sorted(f for f in os.listdir(a) if not f.startswith("."))
    assert names and sorted(f for f in os.listdir(b) if not f.startswith(".")) == names
    return [f for f in names if not filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False)]


def _calibrated_export(src: str, out: str, config, batches, algorithm) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers a preset leaves in high precision
        tq.calibrate(model, config, lambda m: [m(b) for b in batches], algorithm=algorithm, progress=False)
    tq.export(model, out)


CASES = {
    "int4_g32_gptq": ("llama", lambda: tq.configs.int4_weight_only(32), "gptq"),
    "int4_asym_awq": ("llama", lambda: tq.configs.int4_weight_only(32, grid=tq.IntGrid.ASYMMETRIC), "awq"),
    "int4_awq_output_loss": ("llama", lambda: tq.configs.int4_weight_only(32), tq.AWQ(loss="output")),
    "w8a8_static_smoothquant_gptq": ("llama", tq.configs.int8, ("smoothquant", "gptq")),
    "w8a8_static_mse": ("llama", tq.configs.int8, "mse"),
    "int4_gptq_fp8_kv": ("llama", lambda: tq.configs.int4_weight_only(32).with_rules(tq.configs.fp8_kv_cache()), "gptq"),
    "qwen3_moe_gptq": ("qwen3_moe", lambda: tq.configs.int4_weight_only(32), "gptq"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_checkpoint_is_what_calibrate_and_export_write(tmp_path, name):
    kind, config, algorithm = CASES[name]
    model = _llama() if kind == "llama" else tiny_hf_moe(kind)
    src = str(tmp_path / "float")
    model.save_pretrained(src)
    batches = _batches(model.config.vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.quantize_checkpoint(src, str(tmp_path / "layerwise"), config(), data=batches, algorithm=algorithm, progress=False)
    _calibrated_export(src, str(tmp_path / "loaded"), config(), batches, algorithm)
    assert _differ(str(tmp_path / "layerwise"), str(tmp_path / "loaded")) == []
    assert os.listdir(tmp_path) and not [f for f in os.listdir(tmp_path) if f.startswith("tq-scratch-")]  # scratch removed


def test_one_decoder_layer_is_real_at_a_time_and_runs_twice_a_batch(tmp_path, monkeypatch):
    src = str(tmp_path / "float")
    _llama(layers=4).save_pretrained(src)
    batches = _batches(96)
    built, real, calls = [], [], [0] * 4
    build = streaming._meta_model

    def build_and_watch(path, buffers=False):
        model = build(path, buffers)
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        built.append(model)
        return model

    load = layerwise._Weights.load

    def load_and_count(self, modules):
        load(self, modules)
        real.append(sum(any(not p.is_meta for p in layer.parameters()) for layer in built[0].model.layers))

    monkeypatch.setattr(streaming, "_meta_model", build_and_watch)
    monkeypatch.setattr(layerwise._Weights, "load", load_and_count)
    tq.quantize_checkpoint(src, str(tmp_path / "out"), tq.configs.int4_weight_only(32), data=batches, algorithm="gptq", progress=False)
    assert max(real) == 1 and len(real) >= 4  # never two decoder layers' weights at once
    # The capture runs stand-ins (one call a layer a batch); then each layer runs once for its GPTQ
    # statistics and once to hand its rounded outputs on: 3 calls a layer a batch, whatever the depth.
    assert calls == [3 * len(batches)] * 4
    assert all(p.is_meta for p in built[0].parameters())  # and everything went back to the meta device


def test_cached_inputs_spill_to_disk_within_the_bound(tmp_path, monkeypatch):
    src = str(tmp_path / "float")
    _llama().save_pretrained(src)
    batches = _batches(96)
    spilled, close = [], tq.calibration.replay.StreamCache.close

    def counting_close(self):
        spilled.append(self.spilled)
        close(self)

    monkeypatch.setattr(tq.calibration.replay.StreamCache, "close", counting_close)
    cache = tmp_path / "cache"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.quantize_checkpoint(src, str(tmp_path / "bounded"), tq.configs.int8(), data=batches, algorithm=("smoothquant", "gptq"),
                               cache_bytes=2 * 12 * 64 * 2, cache_dir=str(cache), progress=False)
    assert spilled == [len(batches) - 1]  # one bf16 batch (2 x 12 x 64) fits the bound, the rest went to files
    assert os.listdir(cache) == []  # the files and the scratch weights are removed
    _calibrated_export(src, str(tmp_path / "loaded"), tq.configs.int8(), batches, ("smoothquant", "gptq"))
    assert _differ(str(tmp_path / "bounded"), str(tmp_path / "loaded")) == []


def test_calibrate_with_a_bounded_cache_computes_the_same(tmp_path):
    model, batches = _llama(dtype=torch.float32), _batches(96)
    twin = _llama(dtype=torch.float32)
    loop = lambda m: [m(b) for b in batches]  # noqa: E731
    tq.calibrate(model, tq.configs.int4_weight_only(32), loop, algorithm="gptq", progress=False)
    tq.calibrate(twin, tq.configs.int4_weight_only(32), loop, algorithm="gptq", progress=False, cache_bytes=0, cache_dir=str(tmp_path))
    for (n, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), n
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=r"cache_bytes=-1 is not allowed"):
        tq.calibrate(_llama(), tq.configs.int4_weight_only(32), loop, algorithm="gptq", cache_bytes=-1)


def test_what_it_cannot_do_is_refused_before_writing(tmp_path):
    src = str(tmp_path / "float")
    _llama().save_pretrained(src)
    out, batches = tmp_path / "out", _batches(96)
    head = tq.configs.int4_weight_only(32).with_rules(tq.calibration.QuantRule(name="lm_head", weight=tq.IntQuantizer(tq.Format.INT4, tq.Granularity.ROWWISE)))
    with pytest.raises(ValueError, match=r"would transform 'lm_head', which lies outside the decoder layers \(model.layers\)"):
        tq.quantize_checkpoint(src, str(out), head, data=batches, algorithm="gptq", progress=False)
    with pytest.raises(TypeError, match=r"data must be a non-empty list of batches"):
        tq.quantize_checkpoint(src, str(out), tq.configs.int8(), data=batches[0])
    with pytest.raises(TypeError, match=r"data\[1\] is a str"):
        tq.quantize_checkpoint(src, str(out), tq.configs.int8(), data=[batches[0], "text"])
    with pytest.raises(ValueError, match=r"algorithm='GPTQ\(.*needs calibration data; pass data="):
        tq.quantize_checkpoint(src, str(out), tq.configs.int4_weight_only(32), algorithm="gptq")
    with pytest.raises(ValueError, match=r"percentile=20 is not allowed"):
        tq.quantize_checkpoint(src, str(out), tq.configs.int8(), data=batches, algorithm="percentile", percentile=20)
    with torch.device("meta"):
        skeleton = _llama()
    with pytest.raises(tq.export.ExportError, match=r"buffer 'model.rotary_emb.inv_freq' is on the meta device"):
        tq.quantize_checkpoint(src, str(out), tq.configs.int8(), data=batches, model=skeleton)
    assert not out.exists()


def test_a_quantized_head_with_static_activations_is_calibrated_on_the_layers_outputs(tmp_path):
    """What lies outside the decoder layers gets its activation amaxes from one more pass, with the
    layers stood in for by their cached outputs: the same amaxes as calibrating the loaded model."""
    src = str(tmp_path / "float")
    _llama().save_pretrained(src)
    batches = _batches(96)
    config = lambda: tq.configs.int8().with_rules(tq.calibration.QuantRule(name="lm_head", weight=tq.IntQuantizer(), input=tq.IntQuantizer()))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.quantize_checkpoint(src, str(tmp_path / "layerwise"), config(), data=batches, algorithm="percentile", progress=False)
    _calibrated_export(src, str(tmp_path / "loaded"), config(), batches, "percentile")
    assert _differ(str(tmp_path / "layerwise"), str(tmp_path / "loaded")) == []


def test_an_occupied_out_is_refused_before_calibrating(tmp_path, monkeypatch):
    """`out` is checked as the export will check it before the calibration (hours on a large model),
    and nothing is created where the call is refused."""
    src = str(tmp_path / "float")
    _llama(layers=2).save_pretrained(src)
    calls = []
    monkeypatch.setattr(streaming, "calibrate_layerwise", lambda *a, **kw: calls.append(1))
    with pytest.raises(tq.export.ExportError, match=r"directory '.*float' exists and is not empty .* overwrite=True"):
        tq.quantize_checkpoint(src, src, tq.configs.int4_weight_only(32), data=_batches(96), algorithm="gptq", progress=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(tq.export.ExportError, match=r"path '.*file' is a file; pass a directory"):
        tq.quantize_checkpoint(src, str(tmp_path / "file"), tq.configs.int4_weight_only(32), data=_batches(96), algorithm="gptq", progress=False)
    assert calls == []
