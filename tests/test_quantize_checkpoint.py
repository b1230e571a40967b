"""`tq.quantize_checkpoint`: a float safetensors checkpoint quantized into a serving checkpoint
without loading the model (a meta-device skeleton; one tensor in memory at a time).

Its output must be, byte for byte, what ``tq.calibrate(model, config, None)`` and ``tq.export``
write for the loaded model: dense, tied embeddings, MoE experts that transformers saves per expert,
every data-free scheme; and what it cannot do without data is refused before anything is written."""

from __future__ import annotations

import filecmp
import os
import warnings

import pytest
import torch

import tqcompile as tq
from tqcompile.export import ExportError

transformers = pytest.importorskip("transformers")
from moe_models import tiny_hf_moe  # noqa: E402


def _llama(tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


def _same_files(a: str, b: str) -> list[str]:
    """The checkpoint files of `a` that differ from `b`'s (or that `b` lacks)."""
    names = sorted(f for f in os.listdir(a) if not f.startswith("."))
    assert names and sorted(f for f in os.listdir(b) if not f.startswith(".")) == names
    return [f for f in names if not filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False)]


def _calibrated_export(src: str, out: str, config) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers a preset leaves in high precision
        tq.calibrate(model, config, None, progress=False)
    tq.export(model, out)


CONFIGS = {
    "int4_g32": lambda: tq.configs.int4_weight_only(32),
    "int4_asymmetric": lambda: tq.configs.int4_weight_only(32, grid=tq.IntGrid.ASYMMETRIC),
    "int3_channel": lambda: tq.configs.int_weight_only(3, None),
    "w8a8_dynamic": tq.configs.int8_dynamic,
    "mxfp8": tq.configs.mxfp8,
    "nvfp4_weights": lambda: tq.configs.nvfp4().with_rules(tq.calibration.QuantRule(module_types=(torch.nn.Linear,), input=False, must_match=False)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_checkpoint_is_what_calibrate_and_export_write(tmp_path, name):
    src = str(tmp_path / "float")
    _llama().save_pretrained(src)
    report = tq.quantize_checkpoint(src, str(tmp_path / "streamed"), CONFIGS[name]())
    assert len(report.rows) == 14
    _calibrated_export(src, str(tmp_path / "loaded"), CONFIGS[name]())
    assert _same_files(str(tmp_path / "streamed"), str(tmp_path / "loaded")) == []


@pytest.mark.parametrize("kind", ["tied", "qwen3_moe"])
def test_tied_heads_and_experts_saved_per_expert(tmp_path, kind):
    """A head tied to the embedding is absent from the file; transformers saves fused 3-D experts
    as one tensor per expert and projection, which the reader puts back together."""
    src = str(tmp_path / "float")
    (_llama(tied=True) if kind == "tied" else tiny_hf_moe(kind)).save_pretrained(src)
    tq.quantize_checkpoint(src, str(tmp_path / "streamed"), tq.configs.int4_weight_only(32))
    _calibrated_export(src, str(tmp_path / "loaded"), tq.configs.int4_weight_only(32))
    assert _same_files(str(tmp_path / "streamed"), str(tmp_path / "loaded")) == []


def test_it_never_materializes_the_model(tmp_path, monkeypatch):
    """Every quantized weight is read once for its amax and once for the export, nothing else of
    the model is ever real: the skeleton's parameters stay on the meta device throughout."""
    src = str(tmp_path / "float")
    _llama().save_pretrained(src)
    from tqcompile.export import streaming

    built = []
    real_meta_model = streaming._meta_model
    monkeypatch.setattr(streaming, "_meta_model", lambda path: built.append(real_meta_model(path)) or built[-1])
    tq.quantize_checkpoint(src, str(tmp_path / "out"), tq.configs.int4_weight_only(32))
    (model,) = built
    assert all(p.is_meta for p in model.parameters())
    loaded = tq.load_exported(str(tmp_path / "out"))
    assert loaded.model.layers[1].mlp.down_proj.weight_quantizer.amax.shape == (128, 8)


def test_what_needs_data_is_refused_before_writing(tmp_path):
    src = str(tmp_path / "float")
    _llama().save_pretrained(src)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"tq.quantize_checkpoint \(data-free\) cannot calibrate the static activation amaxes of 'model.layers.0"):
        tq.quantize_checkpoint(src, str(out), tq.configs.int8())
    assert not out.exists()
    with pytest.raises(ExportError, match="has no config.json to build the model from"):
        tq.quantize_checkpoint(str(tmp_path), str(out), tq.configs.int4_weight_only())
    with pytest.raises(TypeError, match="config must be a tq QuantConfig"):
        tq.quantize_checkpoint(src, str(out), "int4")
