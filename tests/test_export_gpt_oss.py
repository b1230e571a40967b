"""GPT-OSS's own MXFP4 checkpoint format: `tq.export(model, path, format="mxfp4")` and `tq.load_exported`.

A GPT-OSS model whose experts tq quantized to MXFP4 (`tq.configs.mxfp4_weight_only(experts_only=True)`)
is written as OpenAI released gpt-oss-20b / 120b: ``<experts>.gate_up_proj_blocks`` /
``_scales`` per experts GEMM in the GEMM view, everything else as stored, ``quant_method: "mxfp4"``.
Checked against transformers' own loader (its `Mxfp4Config(dequantize=True)` path, the one that runs
on a CPU): the experts it builds equal tq's bit for bit. tq's loader reads the format back (the
weights bit for bit, logits equal), also when the scales are not the ones tq would choose (a
checkpoint another tool quantized). What the format cannot hold is refused before anything is written.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import tqcompile as tq
from tqcompile.export import ExportError

transformers = pytest.importorskip("transformers")
from moe_models import tiny_hf_moe  # noqa: E402

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _quantized_gpt_oss(**kw):
    model = tiny_hf_moe("gpt_oss", **kw)
    tq.calibrate(model, tq.configs.mxfp4_weight_only(experts_only=True), None, progress=False)
    return model


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _fake_quantized_experts(model, layer: int, gemm: str) -> torch.Tensor:
    """The weight tq's model computes with: the experts GEMM fake-quantized, in the stored (E, in, out) view."""
    experts = model.model.layers[layer].mlp.experts
    unit = getattr(experts, f"{gemm}_gemm")
    w = getattr(experts, gemm).detach()
    return torch.stack([unit.weight_quantizer(w[e].t()).t() for e in range(w.shape[0])])


def _decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's MXFP4 decode, written from the format's definition: code 2i in the low nibble,
    value FP4[code] * 2^(scale - 127), (E, out, in) transposed to the model's (E, in, out)."""
    lo, hi = FP4_VALUES[(blocks & 0xF).long()], FP4_VALUES[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return vals.reshape(*scales.shape[:2], -1).transpose(1, 2)


def test_export_writes_gpt_oss_layout_that_decodes_to_the_model_weights(tmp_path):
    model = _quantized_gpt_oss()
    report = tq.export(model, str(tmp_path / "m"), format="mxfp4")
    assert len(report.rows) == 4 and {r.layer.rsplit(".", 1)[1] for r in report.rows} == {"gate_up_proj_gemm", "down_proj_gemm"}
    qc = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4"
    # Everything but the experts is listed as kept (transformers and vLLM build it in 16 bits).
    assert "lm_head" in qc["modules_to_not_convert"] and "model.layers.0.self_attn.q_proj" in qc["modules_to_not_convert"]
    assert not any("experts" in n for n in qc["modules_to_not_convert"])
    t = _tensors(tmp_path / "m")
    assert not any(k.endswith(("gate_up_proj", "down_proj")) for k in t)  # no float copy of a quantized GEMM
    for layer in (0, 1):
        pre = f"model.layers.{layer}.mlp.experts"
        assert t[f"{pre}.gate_up_proj_blocks"].shape == (4, 128, 2, 16) and t[f"{pre}.gate_up_proj_blocks"].dtype == torch.uint8
        assert t[f"{pre}.gate_up_proj_scales"].shape == (4, 128, 2) and t[f"{pre}.gate_up_proj_scales"].dtype == torch.uint8
        assert t[f"{pre}.down_proj_blocks"].shape == (4, 64, 2, 16)
        assert torch.equal(t[f"{pre}.gate_up_proj_bias"], model.model.layers[layer].mlp.experts.gate_up_proj_bias.detach())
        for gemm in ("gate_up_proj", "down_proj"):
            got = _decode(t[f"{pre}.{gemm}_blocks"], t[f"{pre}.{gemm}_scales"])
            assert torch.equal(got, _fake_quantized_experts(model, layer, gemm)), (layer, gemm)


def test_transformers_loads_the_experts_tq_computed_with(tmp_path):
    """transformers' GPT-OSS MXFP4 loader (dequantize=True: bf16 kernels, as on a CPU) builds the
    experts tq's model computes with, bit for bit; the logits then differ only by the order the
    two implementations sum in (fp32)."""
    model = _quantized_gpt_oss()
    tq.export(model, str(tmp_path / "m"), format="mxfp4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "m"), dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
        ).eval()
    # transformers 5.17 dequantizes the experts to bf16 whatever dtype is asked (5.23 keeps it): MXFP4
    # values are exact in bf16, so casting back loses nothing.
    hf = hf.float()
    for layer in (0, 1):
        for gemm in ("gate_up_proj", "down_proj"):
            got = getattr(hf.model.layers[layer].mlp.experts, gemm).detach()
            assert torch.equal(got, _fake_quantized_experts(model, layer, gemm)), (layer, gemm)
    torch.testing.assert_close(_logits(hf), _logits(model), rtol=0, atol=1e-5)  # measured 1.8e-7


def test_load_exported_reads_it_back_and_exports_the_same_bytes(tmp_path):
    model = _quantized_gpt_oss()
    tq.export(model, str(tmp_path / "a"), format="mxfp4")
    loaded = tq.load_exported(str(tmp_path / "a"))
    assert torch.equal(_logits(loaded), _logits(model))
    for layer in (0, 1):
        for gemm in ("gate_up_proj", "down_proj"):
            assert torch.equal(_fake_quantized_experts(loaded, layer, gemm), _fake_quantized_experts(model, layer, gemm))
    tq.export(loaded, str(tmp_path / "b"), format="mxfp4")
    a, b = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_with_other_scales_loads_to_its_own_weights(tmp_path):
    """A checkpoint another tool quantized: blocks whose largest code is 3.0, under the scales tq's
    export wrote. tq's own rule would store those values with the scale one step down and the codes
    doubled, so no tq export writes these bytes; tq loads the values the checkpoint holds, and its
    export of the loaded model holds the same values (in its own bytes)."""
    from safetensors.torch import save_file

    model = _quantized_gpt_oss()
    tq.export(model, str(tmp_path / "m"), format="mxfp4")
    t = _tensors(tmp_path / "m")
    g = torch.Generator().manual_seed(7)
    for k in [k for k in t if k.endswith("_blocks")]:
        codes = torch.randint(0, 6, (*t[k].shape, 2), generator=g, dtype=torch.uint8)  # 0 .. 3.0
        codes |= torch.randint(0, 2, codes.shape, generator=g, dtype=torch.uint8) << 3  # signs
        t[k] = codes[..., 0] | (codes[..., 1] << 4)
    save_file(t, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    loaded = tq.load_exported(str(tmp_path / "m"))
    tq.export(loaded, str(tmp_path / "again"), format="mxfp4")
    again = _tensors(tmp_path / "again")
    for layer in (0, 1):
        for gemm in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{gemm}"
            want = _decode(t[f"{name}_blocks"], t[f"{name}_scales"])
            assert torch.equal(getattr(loaded.model.layers[layer].mlp.experts, gemm).detach(), want)
            assert torch.equal(_fake_quantized_experts(loaded, layer, gemm), want)
            assert torch.equal(_decode(again[f"{name}_blocks"], again[f"{name}_scales"]), want)
            assert not torch.equal(again[f"{name}_scales"], t[f"{name}_scales"])  # tq's rule: other bytes


def test_what_the_format_cannot_hold_is_refused_before_writing(tmp_path):
    # Attention quantized too (the preset without experts_only): vLLM builds it in 16 bits.
    model = tiny_hf_moe("gpt_oss")
    tq.calibrate(model, tq.configs.mxfp4_weight_only(), None, progress=False)
    with pytest.raises(ExportError, match=r"self_attn.q_proj' is quantized, but GPT-OSS's mxfp4 format quantizes only the MoE experts"):
        tq.export(model, str(tmp_path / "a"), format="mxfp4")
    # One layer's experts kept in 16 bits: vLLM's loader quantizes every experts module.
    model = tiny_hf_moe("gpt_oss")
    cfg = tq.configs.mxfp4_weight_only(experts_only=True).with_rules(tq.calibration.QuantRule.disable("model.layers.1.mlp.experts.*"))
    tq.calibrate(model, cfg, None, progress=False)
    with pytest.raises(ExportError, match=r"experts GEMM model.layers.1.mlp.experts.gate_up_proj is kept in high precision"):
        tq.export(model, str(tmp_path / "a"), format="mxfp4")
    # Another element format.
    model = tiny_hf_moe("gpt_oss")
    tq.calibrate(model, tq.configs.mxfp8().with_rules(tq.calibration.QuantRule.disable(module_types=(torch.nn.Linear,))), None, progress=False)
    with pytest.raises(ExportError, match=r"has no GPT-OSS mxfp4 form"):
        tq.export(model, str(tmp_path / "a"), format="mxfp4")
    # A quantized KV cache: vLLM's GPT-OSS MXFP4 config reads no KV scales.
    model = tiny_hf_moe("gpt_oss")
    cfg = tq.configs.mxfp4_weight_only(experts_only=True).with_rules(tq.configs.fp8_kv_cache())
    tq.calibrate(model, cfg, lambda m: m(IDS), progress=False)
    with pytest.raises(ExportError, match=r"GPT-OSS's mxfp4 format holds no KV-cache scales"):
        tq.export(model, str(tmp_path / "a"), format="mxfp4")
    # Not a GPT-OSS model.
    mixtral = tiny_hf_moe("mixtral")
    tq.calibrate(mixtral, tq.configs.mxfp4_weight_only(experts_only=True), None, progress=False)
    with pytest.raises(ExportError, match=r"model_type 'gpt_oss' only; this model is 'mixtral'"):
        tq.export(mixtral, str(tmp_path / "a"), format="mxfp4")
    # The other formats name this one for GPT-OSS's transposed experts.
    with pytest.raises(ExportError, match=r"stores its weight transposed.*format='mxfp4'"):
        tq.export(_quantized_gpt_oss(), str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match=r"experts_only='yes' is not allowed"):
        tq.configs.mxfp4_weight_only(experts_only="yes")


def test_experts_only_preset_quantizes_the_experts_of_any_moe():
    """The preset's experts_only keeps every nn.Linear (attention, router, head) in high precision
    and quantizes each experts GEMM, on models that store experts either way."""
    for kind in ("gpt_oss", "mixtral"):
        model = tiny_hf_moe(kind)
        tq.calibrate(model, tq.configs.mxfp4_weight_only(experts_only=True), None, progress=False)
        on = {n for n, m in model.named_modules() if getattr(getattr(m, "weight_quantizer", None), "enabled", False)}
        assert on == {f"model.layers.{i}.mlp.experts.{g}_gemm" for i in (0, 1) for g in ("gate_up_proj", "down_proj")}, (kind, on)


def test_a_loaded_gpt_oss_checkpoint_compresses_and_compiles(tmp_path):
    """The path from a released GPT-OSS checkpoint to a deployed tq model: load the mxfp4 files,
    `tq.compress` (the experts packed, half a byte a weight), compile fullgraph; logits as loaded."""
    tq.export(_quantized_gpt_oss(), str(tmp_path / "m"), format="mxfp4")
    model = tq.load_exported(str(tmp_path / "m"))
    ref = _logits(model)
    tq.compress(model)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, tq.QuantizedTensor)
    assert experts.gate_up_proj._data.numel() == experts.gate_up_proj.shape.numel() // 2
    assert torch.equal(_logits(model), ref)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(IDS).logits, ref)


def test_modelopt_names_gpt_oss_experts_kept_in_16_bits_as_the_module(tmp_path):
    """ModelOpt's exclude_modules names experts kept in high precision by their module, which vLLM
    matches as a prefix of its MoE layer: for GPT-OSS (every expert in one tensor) that is
    ``<...>.mlp.experts``, not the tensors under it (which matched nothing)."""
    model = tiny_hf_moe("gpt_oss")
    cfg = tq.configs.fp8().with_rules(tq.calibration.QuantRule.disable("*.experts.*"))
    tq.calibrate(model, cfg, lambda m: m(IDS), progress=False)
    tq.export(model, str(tmp_path / "m"), format="modelopt")
    exclude = json.loads((tmp_path / "m" / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert "model.layers.0.mlp.experts" in exclude and "model.layers.1.mlp.experts" in exclude
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n in exclude), exclude
    assert torch.equal(_logits(tq.load_exported(str(tmp_path / "m"))), _logits(model))


def test_qat_then_export_to_the_released_format(tmp_path):
    """ModelOpt's GPT-OSS recipe (fine-tune with MXFP4 experts, deploy in the original format), in tq:
    a few QAT steps through the fake-quantized experts, then export; the checkpoint computes the
    trained model's logits."""
    model = _quantized_gpt_oss()
    before = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    assert not torch.equal(model.model.layers[0].mlp.experts.gate_up_proj.detach(), before)
    tq.export(model, str(tmp_path / "m"), format="mxfp4")
    assert torch.equal(_logits(tq.load_exported(str(tmp_path / "m"))), _logits(model))


def test_quantize_checkpoint_streams_a_float_gpt_oss_to_the_same_files(tmp_path):
    """`tq.quantize_checkpoint` (one tensor in memory at a time: a bf16 gpt-oss-120b is 240 GB)
    writes the bytes `tq.calibrate` + `tq.export` write."""
    from safetensors.torch import load_file

    model = tiny_hf_moe("gpt_oss")
    model.save_pretrained(str(tmp_path / "float"))
    config = tq.configs.mxfp4_weight_only(experts_only=True)
    tq.quantize_checkpoint(str(tmp_path / "float"), str(tmp_path / "q"), config, format="mxfp4", progress=False)
    tq.calibrate(model, config, None, progress=False)
    tq.export(model, str(tmp_path / "e"), format="mxfp4")
    a, b = load_file(str(tmp_path / "q" / "model.safetensors")), load_file(str(tmp_path / "e" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    qc = [json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in ("q", "e")]
    assert qc[0] == qc[1]


def test_loading_reads_each_stored_experts_tensor_once_a_pass(tmp_path, monkeypatch):
    """The loader reads a GEMM expert by expert, alternating between its blocks and scales; a stored
    tensor (a GB for one of gpt-oss-120b's GEMMs) is read once for the checks and once to fill the
    model, not once per expert."""
    from tqcompile.export import gpt_oss_mxfp4

    tq.export(_quantized_gpt_oss(num_experts=8), str(tmp_path / "m"), format="mxfp4")
    reads = []
    real = gpt_oss_mxfp4.load_tensor  # how the per-expert view reads a stored tensor
    monkeypatch.setattr(gpt_oss_mxfp4, "load_tensor", lambda path, entry, start: reads.append(tuple(entry["data_offsets"])) or real(path, entry, start))
    tq.load_exported(str(tmp_path / "m"))
    assert len(set(reads)) == 8 and all(reads.count(r) <= 2 for r in set(reads)), reads
