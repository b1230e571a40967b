"""tq.export to compressed-tensors: compressed-tensors' own decompressors rebuild every exported
weight bit for bit equal to the weight the tq model computes with, for every format, from PTQ and
from training recipes, dense and MoE; bad input gets a clear error."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.calibration import QuantRule
from tqcompile.configs import GEMM_LAYERS, default_disabled
from tqcompile.export import ExportError, ExportWarning
from tqcompile.export.safetensors_io import load_tensor, read_safetensors_header
from tqcompile.formats import Format
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, MXQuantizer

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme  # noqa: E402

HIDDEN, INTER = 128, 256  # multiples of 128: FP8 128x128 blocks and INT4 groups of 128 fit


def tiny_llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _config(weight, inputs) -> tq.calibration.QuantConfig:
    return tq.calibration.QuantConfig((QuantRule(module_types=GEMM_LAYERS, input=inputs, weight=weight, must_match=False), *default_disabled()))


def _configs() -> dict:
    fp8_row = Float8Quantizer(granularity=Granularity.ROWWISE)
    return {
        "int8_static": tq.configs.int8(),
        "int8_dynamic_token": _config(IntQuantizer(Format.INT8, Granularity.ROWWISE), IntQuantizer(Format.INT8, Granularity.ROWWISE)),
        "int4_g32": tq.configs.int4_weight_only(32),
        "int4_g128": tq.configs.int4_weight_only(128),
        "int4_symmetric_g32": tq.configs.int4_weight_only(32, grid=tq.IntGrid.SYMMETRIC),
        "int3_g32": tq.configs.int_weight_only(3, 32),
        "int2_channel": tq.configs.int_weight_only(2, None),
        "fp8_tensor": tq.configs.fp8(),
        "fp8_channel_token": _config(fp8_row, fp8_row),
        "fp8_block": _config(Float8Quantizer(granularity=Granularity.BLOCKWISE_2D), Float8Quantizer(granularity=Granularity.BLOCKWISE_1D)),
        "mxfp8": tq.configs.mxfp8(),
        "mxfp4": _config(MXQuantizer(Format.E2M1), MXQuantizer(Format.E2M1)),
        "nvfp4": tq.configs.nvfp4(),
    }


def _calibrated(name: str, model: nn.Module | None = None) -> nn.Module:
    model = tiny_llama() if model is None else model
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    tq.calibrate(model, _configs()[name], lambda m: m(ids), progress=False)
    return model


def _read(path: str) -> dict[str, torch.Tensor]:
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    out = {}
    for f in files:
        header, start = read_safetensors_header(os.path.join(path, f))
        out.update({k: load_tensor(os.path.join(path, f), e, start) for k, e in header.items()})
    return out


def _decompress(path: str, tensors: dict, prefix: str) -> torch.Tensor:
    """compressed-tensors' decompressor for the layer `prefix`, from the written config."""
    qc = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    QuantizationConfig.model_validate(qc)  # every field one compressed-tensors knows (its models forbid extra fields)
    (group,) = [g for g in qc["config_groups"].values() if g["targets"] == ["Linear"] or prefix in g["targets"]]
    scheme = QuantizationScheme.model_validate(group)
    local = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".") and "." not in k[len(prefix) + 1 :]}
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    return compressor.decompress(local, scheme)["weight"]


def _assert_bits(got: torch.Tensor, want_fp32: torch.Tensor, where: str) -> None:
    want = want_fp32.to(got.dtype)
    assert got.shape == want.shape, where
    assert torch.equal(got.view(torch.int16 if got.element_size() == 2 else torch.int32), want.view(torch.int16 if got.element_size() == 2 else torch.int32)), where


def _shared_nvfp4_amax(model: nn.Module, name: str, amax_of) -> torch.Tensor | None:
    """The max `amax_of(layer)` over the layers an engine fuses with `name` (q/k/v, gate/up); None
    for others. For `tq.convert`ed models: training quantized each weight with its own amax, the
    checkpoint holds one global scale per fused group."""
    parent, _, leaf = name.rpartition(".")
    for fam in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        if leaf in fam:
            return torch.stack([amax_of(model.get_submodule(f"{parent}.{s}")) for s in fam]).amax()
    return None


@pytest.mark.parametrize("name", list(_configs()))
def test_ptq_export_decompresses_bit_for_bit(tmp_path, name):
    model = _calibrated(name)
    report = tq.export(model, str(tmp_path / "ckpt"))
    path = str(tmp_path / "ckpt")
    tensors = _read(path)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    assert len(report.rows) == len(linears) == 7
    assert report.ignored == ["lm_head"] and not any(k.startswith("lm_head.") and k != "lm_head.weight" for k in tensors)
    for n, m in linears:
        with torch.no_grad():
            # The fake-quantized weight the calibrated model computes with (NVFP4 q/k/v and gate/up
            # included: they compute with the one global amax the engines fuse them under).
            want = m.weight_quantizer(m.weight)
        _assert_bits(_decompress(path, tensors, n), want, f"{name} {n}")
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(tensors[k], model.state_dict()[k]), k  # high-precision tensors as they are


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4"])
def test_training_recipe_export_decompresses_bit_for_bit(tmp_path, recipe):
    model = tq.convert(tiny_llama(), tq.recipes.get(recipe), filter_fn=lambda m, fqn: fqn != "lm_head")
    path = str(tmp_path / "ckpt")
    report = tq.export(model, path)
    tensors = _read(path)
    wq = tq.recipes.get(recipe).fprop_weight
    n_layers = 0
    for n, m in model.named_modules():
        if tq.nn.is_converted(m):
            n_layers += 1
            with torch.no_grad():
                # What training's forward GEMM uses; NVFP4's global amax shared by the weights an engine fuses.
                amax = _shared_nvfp4_amax(model, n, lambda s: tq.ops.amax(s.weight, wq)) if recipe == "nvfp4" else None
                want = tq.quantize(m.weight, wq, amax=amax).dequantize()
            _assert_bits(_decompress(path, tensors, n), want, f"{recipe} {n}")
    assert n_layers == len(report.rows) == 7
    if recipe == "nvfp4":  # NVFP4 activations need a calibrated global amax: weight-only, said in the report
        assert all("activations 16-bit" in r.scheme for r in report.rows)


@pytest.mark.parametrize("kind,mode", [("mixtral", "calibrate"), ("qwen3_moe", "calibrate"), ("mixtral", "convert")])
def test_moe_experts_export_per_expert_names_bit_for_bit(tmp_path, kind, mode):
    from moe_models import tiny_hf_moe

    model = tiny_hf_moe(kind, hidden=64, intermediate=64, layers=1, num_experts=4).eval()
    if mode == "calibrate":
        ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))
        tq.calibrate(model, tq.configs.int8(), lambda m: m(ids), progress=False)
    else:
        with pytest.warns(tq.nn.ConversionWarning, match="MoE router"):  # routers stay in high precision, said once
            tq.convert(model, tq.recipes.mxfp8(), filter_fn=lambda m, fqn: fqn != "lm_head")
    path = str(tmp_path / "ckpt")
    tq.export(model, path)
    tensors = _read(path)
    names = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}[kind]
    experts_name, experts = next((n, m) for n, m in model.named_modules() if n.endswith("experts"))
    disk = experts_name.replace(".mlp.", ".block_sparse_moe.") if kind == "mixtral" else experts_name
    with torch.no_grad():
        if mode == "calibrate":
            gate_up = experts.gate_up_proj_gemm.weight_quantizer(experts.gate_up_proj_gemm.weight)
            down = experts.down_proj_gemm.weight_quantizer(experts.down_proj_gemm.weight)
        else:  # each expert's weight as training's grouped GEMM quantizes it
            wq = tq.recipes.mxfp8().fprop_weight
            gate_up, down = (torch.stack([tq.quantize(w[e], wq).dequantize() for e in range(4)]) for w in (experts.gate_up_proj, experts.down_proj))
    inter = gate_up.shape[1] // 2
    for e in range(4):
        for leaf, want in zip(names, (gate_up[e, :inter], gate_up[e, inter:], down[e])):
            prefix = f"{disk}.{e}.{leaf}"
            _assert_bits(_decompress(path, tensors, prefix), want, prefix)
            assert (f"{prefix}.input_scale" in tensors) == (mode == "calibrate")
    assert not any(".gate_up_proj" in k for k in tensors)  # the fused name never reaches the checkpoint
    if mode == "calibrate":
        # Shared input scale for gate and up (one input): what vLLM's fused w13 requires.
        assert tensors[f"{disk}.0.{names[0]}.input_scale"].shape == (1,)
        assert torch.equal(tensors[f"{disk}.0.{names[0]}.input_scale"], tensors[f"{disk}.0.{names[1]}.input_scale"])


def test_sharded_files_and_index(tmp_path):
    model = _calibrated("int8_static")
    path = str(tmp_path / "ckpt")
    report = tq.export(model, path, max_shard_size="40KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert len(report.files) > 2 and set(index["weight_map"].values()) == set(report.files)
    one = str(tmp_path / "one")
    tq.export(model, one)
    a, b = _read(path), _read(one)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())


def test_bad_input(tmp_path):
    with pytest.raises(ExportError, match="nothing in the model is quantized"):
        tq.export(tiny_llama(), str(tmp_path / "a"))
    model = _calibrated("int8_static")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="exists and is not empty"):
        tq.export(model, str(tmp_path / "full"))
    with pytest.raises(ValueError, match="format='gguf' is not allowed"):
        tq.export(model, str(tmp_path / "b"), format="gguf")
    # INT8 has no ModelOpt form: the error names the layer and what works.
    with pytest.raises(ExportError, match=r"'model.layers.0.self_attn.q_proj'.*no ModelOpt form.*compressed-tensors"):
        tq.export(model, str(tmp_path / "c"), format="modelopt")
    assert not (tmp_path / "c").exists()  # refused before anything is written
    # A NaN amax (set by hand: calibration never makes one) never reaches a checkpoint.
    model.model.layers[0].mlp.up_proj.input_quantizer.amax = torch.tensor(float("nan"))
    with pytest.raises(ExportError, match=r"'model.layers.0.mlp.up_proj' has 1 non-finite input_scale"):
        tq.export(model, str(tmp_path / "nan"))
    e5m2 = _config(Float8Quantizer(Format.E5M2), None)
    m2 = tiny_llama()
    tq.calibrate(m2, e5m2, lambda m: m(torch.zeros(1, 4, dtype=torch.long)), progress=False)
    with pytest.raises(ExportError, match=r"q_proj.*E5M2.*no compressed-tensors form"):
        tq.export(m2, str(tmp_path / "d"))


def _modelopt_dequant(t: dict, prefix: str, algo: str) -> torch.Tensor:
    """A ModelOpt layer dequantized the way its loaders define: ``q * weight_scale`` (NVFP4: times
    ``weight_scale_2``), block scales repeated over their blocks."""
    w, s = t[f"{prefix}.weight"], t[f"{prefix}.weight_scale"]
    if algo == "MXFP8":
        return w.float() * torch.exp2(s.float() - 127).repeat_interleave(32, dim=-1)
    if algo == "NVFP4":
        vals = Format.E2M1.codec.decode(Format.E2M1.codec.unpack(w))
        return vals * (s.float().repeat_interleave(16, dim=-1) * t[f"{prefix}.weight_scale_2"])
    if algo == "FP8_PB_WO":
        return w.float() * s.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        # vLLM's ModelOpt loader declares this scale 1-D, (out,), and refuses (out, 1) (modelopt.py, KFp8StaticChannel).
        assert s.shape == (w.shape[0],), (prefix, tuple(s.shape))
        return w.float() * s.unsqueeze(-1)
    return w.float() * s


@pytest.mark.parametrize(
    "name,algo", [("fp8_tensor", "FP8"), ("fp8_channel_token", "FP8_PER_CHANNEL_PER_TOKEN"), ("mxfp8", "MXFP8"), ("nvfp4", "NVFP4")]
)
def test_modelopt_export(tmp_path, name, algo):
    model = _calibrated(name)
    path = str(tmp_path / "ckpt")
    tq.export(model, path, format="modelopt")
    hf_quant = json.load(open(os.path.join(path, "hf_quant_config.json")))
    assert hf_quant["quantization"]["quant_algo"] == algo and hf_quant["quantization"]["exclude_modules"] == ["lm_head"]
    qc = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quantization"] == hf_quant["quantization"]
    t = _read(path)
    for n, m in model.named_modules():
        if not isinstance(m, nn.Linear) or n == "lm_head":
            continue
        with torch.no_grad():
            want = m.weight_quantizer(m.weight)
        got = _modelopt_dequant(t, n, algo)
        if algo == "NVFP4":
            # weight_scale_2 is the fp32 reciprocal of tq's s_enc: one more rounding than tq's q * (s_blk / s_enc).
            torch.testing.assert_close(got, want, rtol=2**-22, atol=0)
        else:
            assert torch.equal(got, want), n
        assert (f"{n}.input_scale" in t) == (algo in ("FP8", "NVFP4"))


def test_qat_export_after_training_steps(tmp_path):
    """QAT moves the weights, not the calibrated amaxes: the export writes the weights the QAT model computes with."""
    model = _calibrated("int8_static").train()
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(before, model.model.layers[0].mlp.down_proj.weight)
    path = str(tmp_path / "ckpt")
    tq.export(model.eval(), path)
    t = _read(path)
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and n != "lm_head":
            with torch.no_grad():
                _assert_bits(_decompress(path, t, n), m.weight_quantizer(m.weight), n)


def test_export_from_dcp_checkpoint_on_meta_model(tmp_path):
    """A training checkpoint (DCP, as FSDP2 saves it) exports from one process without the model in
    memory: the model is built on the meta device for its structure, tensors are read one at a time."""
    recipe = tq.recipes.mxfp8()
    keep_head = lambda m, fqn: fqn != "lm_head"  # noqa: E731
    trained = tq.convert(tiny_llama(), recipe, filter_fn=keep_head)
    tq.distributed.checkpoint.save(trained, None, str(tmp_path / "dcp"))
    with torch.device("meta"):
        skeleton = tq.convert(tiny_llama(), recipe, filter_fn=keep_head)
    tq.export(skeleton, str(tmp_path / "from_dcp"), dtype=torch.bfloat16, checkpoint=str(tmp_path / "dcp"))
    tq.export(trained, str(tmp_path / "from_model"), dtype=torch.bfloat16)
    a, b = _read(str(tmp_path / "from_dcp")), _read(str(tmp_path / "from_model"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(tmp_path / "from_dcp" / "config.json")) == json.load(open(tmp_path / "from_model" / "config.json"))


def test_wrapped_model_exports_like_the_model(tmp_path):
    """torch.compile's wrapper (its `_orig_mod.` names) changes nothing in the checkpoint."""
    model = _calibrated("fp8_tensor")
    tq.export(model, str(tmp_path / "plain"))
    tq.export(torch.compile(model, backend="eager"), str(tmp_path / "compiled"))
    a, b = _read(str(tmp_path / "plain")), _read(str(tmp_path / "compiled"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(tmp_path / "plain" / "config.json")) == json.load(open(tmp_path / "compiled" / "config.json"))


LLMC = os.path.join(os.path.dirname(__file__), "data", "llmcompressor")


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16", "FP8_DYNAMIC"])
def test_same_layout_as_llmcompressor(tmp_path, scheme):
    """What tq.export writes for a scheme has the names, shapes, dtypes and scheme fields of what
    llmcompressor 0.14 writes for it (tests/data/llmcompressor: its own output on the same architecture)."""
    theirs_cfg = json.load(open(os.path.join(LLMC, scheme, "config.json")))
    qc_theirs = theirs_cfg.pop("quantization_config")
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**theirs_cfg)).to(torch.bfloat16).eval()
    fp8_row, int8_row = Float8Quantizer(granularity=Granularity.ROWWISE), IntQuantizer(Format.INT8, Granularity.ROWWISE)
    config = {"W8A8": _config(int8_row, int8_row), "W4A16": tq.configs.int4_weight_only(128), "FP8_DYNAMIC": _config(fp8_row, fp8_row)}[scheme]
    tq.calibrate(model, config, lambda m: m(torch.zeros(1, 8, dtype=torch.long)), progress=False)
    path = str(tmp_path / "ours")
    tq.export(model, path)
    ours, theirs = _read(path), _read(os.path.join(LLMC, scheme))
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    # Same dtypes, except scales: llmcompressor stores them in the model's dtype (bf16, rounded);
    # tq in fp32, the scales the weights were quantized with (the engines read either into fp32).
    for k, v in ours.items():
        want = torch.float32 if k.endswith("_scale") else theirs[k].dtype
        assert v.dtype == want and (not k.endswith("_scale") or theirs[k].dtype == torch.bfloat16), (k, v.dtype, theirs[k].dtype)
    qc_ours = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    fields = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic")
    for part in ("weights", "input_activations"):
        a, b = qc_ours["config_groups"]["group_0"][part], qc_theirs["config_groups"]["group_0"][part]
        assert (a is None) == (b is None), part
        if a is not None:
            assert {f: a.get(f) for f in fields} == {f: b.get(f) for f in fields}, part
    for key in ("format", "ignore", "quant_method", "quantization_status"):
        assert qc_ours[key] == qc_theirs[key], key


def test_fused_layers_quantized_differently_warn(tmp_path):
    """k_proj/v_proj left in high precision (64 rows do not fit 128x128 blocks) beside a quantized
    q_proj: vLLM refuses such a checkpoint, so the export says so, naming the layers."""
    model = tiny_llama()
    model.config.num_key_value_heads = 2
    model = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    block = _config(Float8Quantizer(granularity=Granularity.BLOCKWISE_2D), None)
    with pytest.warns(tq.calibration.CalibrationWarning):
        tq.calibrate(model, block, lambda m: m(torch.zeros(1, 4, dtype=torch.long)), progress=False)
    with pytest.warns(ExportWarning, match=r"self_attn.q_proj: naive-quantized .*self_attn.k_proj: high precision"):
        tq.export(model, str(tmp_path / "x"))


def _moe(kind: str = "qwen3_moe", layers: int = 2) -> nn.Module:
    from moe_models import tiny_hf_moe

    return tiny_hf_moe(kind, hidden=64, intermediate=64, layers=layers, num_experts=4).eval()


def _moe_ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))


def test_moe_w4a16_experts(tmp_path):
    """Packed INT4 experts: per expert `weight_shape` and payload, decompressed bit for bit."""
    model = _moe(layers=1)
    tq.calibrate(model, tq.configs.int4_weight_only(32), lambda m: m(_moe_ids()), progress=False)
    path = str(tmp_path / "ckpt")
    tq.export(model, path)
    t = _read(path)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        down = experts.down_proj_gemm.weight_quantizer(experts.down_proj_gemm.weight)
    for e in range(4):
        prefix = f"model.layers.0.mlp.experts.{e}.down_proj"
        assert t[f"{prefix}.weight_shape"].tolist() == [64, 64]
        _assert_bits(_decompress(path, t, prefix), down[e], prefix)


@pytest.mark.parametrize("format", ["compressed-tensors", "modelopt"])
def test_experts_and_routers_kept_in_high_precision_are_ignored_by_name(tmp_path, format):
    """Experts left in high precision and routers (not nn.Linear in transformers 5) are listed under
    the names the engines look up: compressed-tensors per expert, ModelOpt by experts module."""
    model = _moe(layers=2)
    cfg = tq.configs.fp8().with_rules(QuantRule.disable("*.experts"))
    tq.calibrate(model, cfg, lambda m: m(_moe_ids()), progress=False)
    path = str(tmp_path / "ckpt")
    report = tq.export(model, path, format=format)
    ignored = set(report.ignored)
    assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"} <= ignored
    if format == "modelopt":
        assert ignored == {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    else:
        per_expert = {f"model.layers.{layer}.mlp.experts.{e}.{p}" for layer in range(2) for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
        assert ignored == {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"} | per_expert


def test_experts_gemms_quantized_differently_refused(tmp_path):
    model = _moe(layers=1)
    cfg = tq.configs.fp8().with_rules(QuantRule.disable("*.experts.down_proj_gemm"))
    tq.calibrate(model, cfg, lambda m: m(_moe_ids()), progress=False)
    with pytest.raises(ExportError, match=r"experts module 'model.layers.0.mlp.experts' are quantized differently.*down_proj_gemm: high precision"):
        tq.export(model, str(tmp_path / "x"))


def test_quantized_lm_head_is_a_target(tmp_path):
    """vLLM builds lm_head as a ParallelLMHead, which the `Linear` target does not match: named."""
    model = tiny_llama()
    fp8_row = Float8Quantizer(granularity=Granularity.ROWWISE)
    cfg = tq.calibration.QuantConfig((QuantRule(module_types=GEMM_LAYERS, input=fp8_row, weight=fp8_row, must_match=False),))
    tq.calibrate(model, cfg, lambda m: m(torch.zeros(1, 4, dtype=torch.long)), progress=False)
    tq.export(model, str(tmp_path / "ct"))
    qc = json.load(open(tmp_path / "ct" / "config.json"))["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear", "lm_head"] and qc["ignore"] == []
    with pytest.raises(ExportError, match=r"\['lm_head'\] quantized: vLLM's ModelOpt loader keeps the LM head in high precision"):
        tq.export(model, str(tmp_path / "mo"), format="modelopt")


def test_presets_keep_qwen2_moe_shared_expert_gate_in_high_precision():
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.warns(tq.calibration.CalibrationWarning, match="received no tokens"):  # 4 tokens leave experts unrouted
        tq.calibrate(model, tq.configs.int8(), lambda m: m(torch.zeros(1, 4, dtype=torch.long)), progress=False)
    gate = model.model.layers[0].mlp.shared_expert_gate
    assert not gate.weight_quantizer.enabled and model.model.layers[0].mlp.shared_expert.up_proj.weight_quantizer.enabled


def test_deepseek_mla_nvfp4_shares_the_fused_global_scale(tmp_path):
    """vLLM fuses MLA's q_a_proj and kv_a_proj_with_mqa (fused_qkv_a_proj) under one NVFP4 global scale."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    tq.calibrate(model, tq.configs.nvfp4(), lambda m: m(torch.zeros(1, 4, dtype=torch.long)), progress=False)
    tq.export(model, str(tmp_path / "x"))
    t = _read(str(tmp_path / "x"))
    attn = "model.layers.0.self_attn"
    a, b = t[f"{attn}.q_a_proj.weight_global_scale"], t[f"{attn}.kv_a_proj_with_mqa.weight_global_scale"]
    assert torch.equal(a, b)
    # The model computes with that one global amax too (tests/test_fused_nvfp4.py: every path).
    own = [model.get_submodule(f"{attn}.{n}").weight_quantizer.amax for n in ("q_a_proj", "kv_a_proj_with_mqa")]
    weights = [model.get_submodule(f"{attn}.{n}").weight for n in ("q_a_proj", "kv_a_proj_with_mqa")]
    assert torch.equal(own[0], own[1]) and torch.equal(own[0], torch.stack([w.abs().amax() for w in weights]).amax())


def test_overwrite_keeps_the_previous_checkpoint_until_the_new_one_is_written(tmp_path):
    model = _calibrated("int8_static")
    path = str(tmp_path / "ckpt")
    tq.export(model, path, max_shard_size="40KB")
    before = _read(path)
    model.model.layers[0].mlp.up_proj.input_quantizer.amax = torch.tensor(float("nan"))
    with pytest.raises(ExportError, match="non-finite"):
        tq.export(model, path, overwrite=True)
    after = _read(path)  # the old shards, all of them, with their index
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    model.model.layers[0].mlp.up_proj.input_quantizer.amax = torch.tensor(1.0)
    tq.export(model, path, overwrite=True)  # one shard now: the old shards and index are gone
    assert sorted(f for f in os.listdir(path) if "safetensors" in f) == ["model.safetensors"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="cannot create the directory"):
        tq.export(model, str(tmp_path / "file" / "sub"))


def test_empty_tensor_in_an_hf_model(tmp_path):
    model = _calibrated("int8_static")
    model.model.register_buffer("empty", torch.zeros(0))
    tq.export(model, str(tmp_path / "x"))
    assert _read(str(tmp_path / "x"))["model.empty"].shape == (0,)


@pytest.mark.parametrize("pow2", [False, True])
def test_static_input_scale_is_the_scale_tq_quantizes_with(tmp_path, pow2):
    """`input_scale` is the scale_inv tq's fake quantization uses for that input, power-of-two
    rounding included (what the engines then multiply with)."""
    fp8 = Float8Quantizer(power_of_two_scale=pow2)
    model = tiny_llama()
    tq.calibrate(model, _config(fp8, fp8), lambda m: m(torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))), progress=False)
    tq.export(model, str(tmp_path / "x"))
    t = _read(str(tmp_path / "x"))
    for n in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        iq = model.get_submodule(n).input_quantizer
        want = tq.quantize(torch.zeros(4, HIDDEN if "q_proj" in n else INTER), fp8, amax=iq.amax)._scale_inv
        assert torch.equal(t[f"{n}.input_scale"], want.reshape(1)), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_config_json_is_what_save_pretrained_writes_plus_the_quantization_config(tmp_path, dtype):
    """A model built from a config (no `architectures`, no `dtype` in it yet) exports the config.json
    `save_pretrained` writes for it, plus the quantization_config: vLLM picks the model class by
    `architectures` and its dtype="auto" by `dtype`."""
    model = _calibrated("int4_g32", tiny_llama().to(dtype))
    tq.export(model, str(tmp_path / "ours"))
    model.save_pretrained(str(tmp_path / "hf"))  # after the export: save_pretrained writes into model.config
    ours = json.load(open(tmp_path / "ours" / "config.json"))
    hf = json.load(open(tmp_path / "hf" / "config.json"))
    assert ours.pop("quantization_config")["format"] == "pack-quantized"
    hf.pop("quantization_config", None)
    assert ours == hf and ours["architectures"] == ["LlamaForCausalLM"] and ours["dtype"] == str(dtype).removeprefix("torch.")
