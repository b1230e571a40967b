"""tq.load_exported: a compressed-tensors or ModelOpt checkpoint back into a tq calibrated model.

The round trip tq.export -> tq.load_exported gives fake-quant logits equal bit for bit to the
calibrated model's (whose scales the checkpoint holds), and exporting the loaded model again writes
the same bytes; QAT continues from it; a checkpoint compressed-tensors' own code quantized (as
llmcompressor does, scales ``amax / 127.5``) loads with its weights as its decompressor rebuilds
them; transformers' own loader (dequantize=True) computes the tq model's logits with activations
in float, bit for bit; bad input gets a clear error."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.calibration import CalibrationWarning
from tqcompile.export import ExportError

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
from test_export import _calibrated, _configs, _decompress, _read, tiny_llama  # noqa: E402

IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(5))


def _logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _fake_quant_units(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "weight_quantizer") and m.weight_quantizer.enabled}


def _check_amax(loaded, original, where, fmt: str = "compressed-tensors") -> None:
    """A loaded static amax against the calibrated one, by what they do. The scale tq writes
    (``1 / (qmax / amax)``; NVFP4: ``2688 / amax``) must be the same bits. The multiplier tq
    quantizes with (``qmax / amax``) cannot always be recovered from that scale (fp32 reciprocals
    of neighbouring multipliers can round to the same scale): it may be one ulp away, which moves an
    element only if it lies within 2**-23 (relative) of a rounding tie, by one quantization step.
    (Weights are unaffected: their codes come back exactly whichever multiplier.) NVFP4's global
    scale is the multiplier itself in compressed-tensors (exact), its reciprocal in ModelOpt."""
    fmax = 2688.0 if isinstance(loaded.quantizer, tq.NVFP4Quantizer) else loaded.quantizer.scale_max()
    a, b = torch.div(fmax, loaded.amax), torch.div(fmax, original.amax.reshape(loaded.amax.shape))
    exact_multiplier = isinstance(loaded.quantizer, tq.NVFP4Quantizer) and fmt == "compressed-tensors"
    assert torch.equal(a, b) if exact_multiplier else torch.equal(1.0 / a, 1.0 / b), where
    assert bool((torch.nextafter(a, b) == b).all() | (a == b).all()), where


# Every compressed-tensors scheme tq exports (INT4 groups once: g128 differs from g32 only in
# size); ModelOpt's per-tensor, per-channel and NVFP4 scales (its blocks and MXFP8 are
# compressed-tensors' tensors under other names).
def _assert_logits_round_trip(model: nn.Module, loaded: nn.Module, ids: torch.Tensor = IDS) -> None:
    """Bit for bit where every activation fake-quantizes as in the original; the bound otherwise:
    an input multiplier one ulp off (see _check_amax) moves only elements on a rounding tie, by
    exactly one quantization step. Checked on each quantized layer's input in the original model."""
    inputs, hooks = {}, []
    for n, m in _fake_quant_units(model).items():
        hooks.append(m.register_forward_pre_hook(lambda mod, args, n=n: inputs.__setitem__(n, args[0].detach())))
    want = _logits(model, ids)
    for h in hooks:
        h.remove()
    moved = 0
    with torch.no_grad():
        for n, m in _fake_quant_units(loaded).items():
            if n not in inputs or not m.input_quantizer.enabled or m.input_quantizer.amax is None:
                continue
            a, b = _fake_quant_units(model)[n].input_quantizer(inputs[n]), m.input_quantizer(inputs[n])
            differ = a != b
            if differ.any():
                assert differ.float().mean() < 1e-3, n  # only elements on a tie
                q = m.input_quantizer.quantizer
                if isinstance(q, tq.IntQuantizer):  # by one step (FP8, NVFP4: to the neighbouring value)
                    step = 1.0 / torch.div(q.scale_max(), m.input_quantizer.amax)
                    assert torch.allclose((a - b).abs()[differ], step.expand_as(a)[differ], rtol=2**-20), n
            moved += int(differ.sum())
    if moved == 0:
        assert torch.equal(_logits(loaded, ids), want)


ROUND_TRIPS = [(name, "compressed-tensors") for name in _configs() if name != "int4_g128"] + [
    ("fp8_tensor", "modelopt"),
    ("fp8_channel_token", "modelopt"),
    ("nvfp4", "modelopt"),
]


@pytest.mark.parametrize("name,fmt", ROUND_TRIPS, ids=[f"{n}-{f}" for n, f in ROUND_TRIPS])
def test_round_trip_logits_bit_for_bit_and_reexport_same_bytes(tmp_path, name, fmt):
    model = _calibrated(name)
    tq.export(model, str(tmp_path / "a"), format=fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)  # tq's own scales map back exactly: nothing to warn
        loaded = tq.load_exported(str(tmp_path / "a"))
    original, back = _fake_quant_units(model), _fake_quant_units(loaded)
    assert original.keys() == back.keys() and len(back) == 7
    for n, m in back.items():
        o = original[n]
        for slot in ("weight", "input"):
            a, b = getattr(o, f"{slot}_quantizer"), getattr(m, f"{slot}_quantizer")
            assert a.quantizer == b.quantizer, (n, slot)
            assert (a.amax is None) == (b.amax is None), (n, slot)
            if b.amax is not None:
                _check_amax(b, a, (n, slot), fmt)
    # ModelOpt stores NVFP4's global scale as its reciprocal (weight_scale_2): where two fp32
    # multipliers share that reciprocal, the loaded one can be an ulp off, and the weights with it
    # (2**-23 relative; compressed-tensors stores the multiplier itself: exact).
    exact = not (fmt == "modelopt" and name == "nvfp4")
    with torch.no_grad():
        for n, m in back.items():  # the fake-quantized weights
            got, want = m.weight_quantizer(m.weight), original[n].weight_quantizer(original[n].weight)
            assert torch.equal(got, want) if exact else torch.allclose(got, want, rtol=2**-22, atol=0), n
    if exact:
        _assert_logits_round_trip(model, loaded)
    else:  # a 2**-23 relative weight change through the model, on logits of magnitude ~1 (measured here: 0)
        assert torch.allclose(_logits(loaded), _logits(model), rtol=0, atol=1e-5)
    tq.export(loaded, str(tmp_path / "b"), format=fmt)
    first, again = _read(str(tmp_path / "a")), _read(str(tmp_path / "b"))
    assert first.keys() == again.keys()
    for k in first:
        assert first[k].dtype == again[k].dtype and torch.equal(first[k].reshape(-1).view(torch.uint8), again[k].reshape(-1).view(torch.uint8)), k
    for f in ("config.json", "hf_quant_config.json"):
        if os.path.exists(tmp_path / "a" / f):
            a, b = (json.load(open(tmp_path / d / f)) for d in ("a", "b"))
            assert a.get("quantization_config", a) == b.get("quantization_config", b), f


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "mxfp8"])
def test_training_recipe_export_loads_back_to_the_trained_models_logits(tmp_path, recipe):
    """A `tq.convert`ed model exports its recipe's weights with dynamic activations; loaded back,
    the fake-quant model computes exactly what the converted model's forward computes. The scale
    rules a checkpoint does not record come from its scales: power-of-two FP8 scales (fp8_rowwise),
    MX blocks only RCEIL gives (mxfp8)."""
    model = tq.convert(tiny_llama(), tq.recipes.get(recipe), filter_fn=lambda m, fqn: fqn != "lm_head")
    tq.export(model, str(tmp_path / "a"))
    loaded = tq.load_exported(str(tmp_path / "a"))
    q_proj = loaded.get_submodule("model.layers.0.self_attn.q_proj")
    wanted = tq.recipes.get(recipe)
    assert (q_proj.weight_quantizer.quantizer, q_proj.input_quantizer.quantizer) == (wanted.fprop_weight, wanted.fprop_input)
    assert q_proj.input_quantizer.amax is None  # dynamic, as trained and as the engines run it
    assert torch.equal(_logits(loaded), _logits(model))


def test_mixed_schemes_by_exact_names_and_by_regex_targets(tmp_path):
    from tqcompile.calibration import QuantRule

    model = tiny_llama()
    cfg = tq.configs.int8().with_rules(
        QuantRule(name="*.mlp.*", input=False, weight=tq.IntQuantizer(tq.Format.INT4, tq.Granularity.BLOCKWISE_1D, block_size=32)),
        QuantRule(name="*.o_proj", input=tq.Float8Quantizer(), weight=tq.Float8Quantizer()),
    )
    tq.calibrate(model, cfg, lambda m: m(IDS), progress=False)
    path = tmp_path / "a"
    tq.export(model, str(path))
    config = json.load(open(path / "config.json"))
    groups = config["quantization_config"]["config_groups"]
    assert len(groups) == 3  # one per scheme, each naming its layers
    loaded = tq.load_exported(str(path))
    assert torch.equal(_logits(loaded), _logits(model))
    # The same groups targeted as llmcompressor users write them: "re:" patterns, "Linear" last.
    patterns = {"int-quantized": r"re:.*self_attn\.[qkv]_proj$", "float-quantized": "re:.*o_proj", "pack-quantized": "Linear"}
    for g in groups.values():
        g["targets"] = [patterns[g["format"]]]
    json.dump(config, open(path / "config.json", "w"))
    again = tq.load_exported(str(path))
    for n, m in _fake_quant_units(again).items():
        assert m.weight_quantizer.quantizer == _fake_quant_units(model)[n].weight_quantizer.quantizer, n
    assert torch.equal(_logits(again), _logits(model))


def test_summary_and_quant_state_of_the_loaded_model(tmp_path):
    model = _calibrated("int8_static")
    tq.export(model, str(tmp_path / "a"))
    loaded = tq.load_exported(str(tmp_path / "a"))
    rows = {r.name: r for r in tq.summary(loaded).rows}
    assert rows["model.layers.0.self_attn.q_proj"].weight.startswith("INT8 per-channel full amax")
    assert rows["lm_head"].weight == "off" and rows["model.embed_tokens"].weight == "off"
    # A calibrated model like any: its state restores into a fresh float model.
    fresh = tq.restore(tiny_llama(seed=3), tq.quant_state(loaded))
    fresh.load_state_dict(loaded.state_dict())
    assert torch.equal(_logits(fresh), _logits(model))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_per_expert_names_back_into_fused_experts(tmp_path, kind):
    from moe_models import tiny_hf_moe

    model = tiny_hf_moe(kind, hidden=64, intermediate=64, layers=1, num_experts=4).eval()
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))
    tq.calibrate(model, tq.configs.int8(), lambda m: m(ids), progress=False)
    tq.export(model, str(tmp_path / "a"))
    loaded = tq.load_exported(str(tmp_path / "a"))
    experts = next(m for n, m in loaded.named_modules() if n.endswith("experts"))
    original = next(m for n, m in model.named_modules() if n.endswith("experts"))
    for g in ("gate_up_proj_gemm", "down_proj_gemm"):
        a, b = getattr(original, g), getattr(loaded.get_submodule(next(n for n, m in loaded.named_modules() if m is experts)), g)
        assert b.weight_quantizer.amax.shape == a.weight_quantizer.amax.shape == (4, a.weight.shape[1], 1)  # per expert, channel
        assert b.input_quantizer.amax.shape == (4,)  # per expert
        for slot in ("weight", "input"):
            _check_amax(getattr(b, f"{slot}_quantizer"), getattr(a, f"{slot}_quantizer"), (g, slot))
    _assert_logits_round_trip(model, loaded, ids)
    tq.export(loaded, str(tmp_path / "b"))
    first, again = _read(str(tmp_path / "a")), _read(str(tmp_path / "b"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def assert_qat_lowers_the_loss(model: nn.Module, vocab: int, steps: int) -> None:
    """A few QAT steps (AdamW, fake quantization in the forward): the loss stays finite and falls."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, vocab, (4, 24), generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.05, losses


def test_qat_continues_from_a_loaded_checkpoint(tmp_path):
    tq.export(_calibrated("int8_static"), str(tmp_path / "a"))
    model = tq.load_exported(str(tmp_path / "a"))
    assert_qat_lowers_the_loss(model, 96, 4)
    q_proj = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert q_proj.weight.grad is not None and q_proj.weight_quantizer.enabled  # trained through fake quantization


def _ct_quantized_checkpoint(path: str, scheme_name: str, **weights) -> nn.Module:
    """A checkpoint that compressed-tensors' own code quantizes, as llmcompressor does: its
    `calculate_qparams` scales (symmetric INT: ``amax / 127.5``, codes down to -128) and its
    compressor's packing, from a float model; returns that float model. `weights`: fields of the
    preset's weight arguments to change (num_bits=3, group_size=32)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from tqcompile.export.safetensors_io import ShardedWriter

    model = tiny_llama(seed=4)
    fmt = "pack-quantized"  # both presets quantize weights in groups of 128, stored packed
    preset = preset_name_to_scheme(scheme_name, ["Linear"]).model_dump()
    preset["weights"].update(weights)
    scheme = QuantizationScheme(**{**preset, "format": fmt})
    compressor = BaseCompressor.get_value_from_registry(fmt)
    os.makedirs(path)
    writer = ShardedWriter(path, 2**30)
    for key, value in model.state_dict().items():
        prefix = key.rsplit(".", 1)[0]
        if not (key.endswith(".weight") and isinstance(model.get_submodule(prefix), nn.Linear) and prefix != "lm_head"):
            writer.add(key, value)
            continue
        w, args = value.detach(), scheme.weights
        if args.strategy == "group":
            g = w.unflatten(-1, (-1, args.group_size))
            lo, hi = g.amin(-1), g.amax(-1)
        else:
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale, zp = calculate_qparams(lo.clamp(max=0), hi.clamp(min=0), args)
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
        for local, t in compressor.compress(state, scheme).items():
            writer.add(f"{prefix}.{local}", t)
    writer.finish()
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"], quantization_status="compressed")
    model.config.quantization_config = config.model_dump()
    model.config.save_pretrained(path)
    return model


@pytest.mark.parametrize("scheme_name", ["W4A16", "W8A16"])
def test_checkpoint_quantized_by_compressed_tensors_loads_and_fine_tunes(tmp_path, scheme_name):
    path = str(tmp_path / "ct")
    _ct_quantized_checkpoint(path, scheme_name)
    with pytest.warns(CalibrationWarning, match="scales have no tq amax") as caught:
        loaded = tq.load_exported(path)
    tensors = _read(path)
    inexact = [int(m) for w in caught for m in __import__("re").findall(r"(\d+) scales have no tq amax", str(w.message))]
    n_scales = bottom = 0
    for n, m in _fake_quant_units(loaded).items():
        want = _decompress(path, tensors, n)  # compressed-tensors' own decompressor
        n_scales += tensors[f"{n}.weight_scale"].numel()
        # The float weight is the checkpoint's; where its scale has no exact tq amax, within 2**-22
        # relative: the scale's ulp (2**-23) plus each side's rounding of code * scale (2**-24 each).
        assert torch.allclose(m.weight, want, rtol=2**-22, atol=0), n
        with torch.no_grad():
            fq = m.weight_quantizer(m.weight)
        # Loaded on the FULL grid, tq computes every code the checkpoint holds, -128 / -8 included.
        q = m.weight_quantizer.quantizer
        assert q.grid is tq.IntGrid.FULL, n
        group = m.weight.shape[1] // m.weight_quantizer.amax.shape[1]
        codes = torch.round(want / tensors[f"{n}.weight_scale"].float().repeat_interleave(group, 1))
        bottom += int((codes == q.code_range()[0]).sum())
        assert torch.equal(fq, m.weight), n
    assert bottom > 0  # compressed-tensors' observer uses the bottom code, which a SYMMETRIC grid lacks
    assert sum(inexact) < n_scales  # most scales map back exactly; the warning counts the others
    assert_qat_lowers_the_loss(loaded, 96, 3)


TRANSFORMERS_SCHEMES = ["int8_static", "int4_g32", "fp8_tensor", "fp8_channel_token"]


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # transformers: dequantize=True is what we pass
@pytest.mark.parametrize("name", TRANSFORMERS_SCHEMES)
def test_transformers_dequantize_loader_gives_the_tq_logits_with_float_activations(tmp_path, name):
    """transformers 5.23's compressed-tensors loader with dequantize=True dequantizes every weight
    with compressed-tensors' decompressors at load time and leaves the model dense: it ignores the
    input scales (activations run in float). Its logits are therefore the calibrated tq model's with
    its input quantizers off (`tq.calibration.weight_only`), bit for bit; the rest of the difference is activation quantization."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = _calibrated(name)
    tq.export(model, str(tmp_path / "a"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"), quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    got, with_activations = _logits(hf), _logits(model)
    with tq.calibration.weight_only(model):
        assert torch.equal(got, _logits(model))
    if name == "int4_g32":  # weight-only: nothing else differs
        assert torch.equal(got, with_activations)
    else:  # W8A8: the activation part, measured 0.7-2.9 % relative L2 on this model (docs/serving.md)
        assert not torch.equal(got, with_activations)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_transformers_input_scales_and_the_dtype_caveat(tmp_path):
    """What docs/serving.md says about transformers 5.23 reading a static W8A8 export.
    dequantize=True keeps the model dense, so each static `input_scale` has no parameter to load into:
    transformers reports exactly those keys as unexpected (and runs activations in float). Its
    default load gives each Linear an `input_scale` and quantizes activations with it. An export with
    `dtype=torch.bfloat16` is not the tq model bit for bit: config.json says bfloat16, so transformers
    builds the model in bf16; loaded in float32 it is the tq model whose high-precision tensors
    (embeddings, norms, head) went through bf16, bit for bit."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = _calibrated("int8_static")
    tq.export(model, str(tmp_path / "a"))
    dequantize = CompressedTensorsConfig(dequantize=True)
    dense, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"), quantization_config=dequantize, output_loading_info=True)
    assert sorted(info["unexpected_keys"]) == sorted(f"{n}.input_scale" for n in _fake_quant_units(model))
    quantizing, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"), output_loading_info=True)
    assert not info["unexpected_keys"] and hasattr(quantizing.model.layers[0].mlp.up_proj, "input_scale")
    with tq.calibration.weight_only(model):
        weight_only = _logits(model)
    assert torch.equal(_logits(dense.eval()), weight_only)
    # compressed-tensors quantizes activations with the same scales (rounding x / scale into [-128, 127]
    # where tq multiplies by the reciprocal into [-127, 127]): measured 0.1 % from tq's logits, 1.6 % from float activations.
    assert _rel(_logits(quantizing.eval()), _logits(model)) < 0.2 * _rel(weight_only, _logits(model))

    tq.export(model, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    in_bf16 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), quantization_config=dequantize).eval()
    in_fp32 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), quantization_config=dequantize, dtype=torch.float32).eval()
    assert in_bf16.dtype == torch.bfloat16 and not torch.equal(_logits(in_bf16).float(), weight_only)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.rpartition(".")[0] not in _fake_quant_units(model):  # what dtype= rounds: every tensor kept in high precision
                p.copy_(p.to(torch.bfloat16))
    with tq.calibration.weight_only(model):
        assert torch.equal(_logits(in_fp32), _logits(model))


def test_bad_input(tmp_path):
    model = _calibrated("int8_static")
    tq.export(model, str(tmp_path / "a"))
    # No quantization_config: a float checkpoint.
    tiny_llama().save_pretrained(str(tmp_path / "float"))
    with pytest.raises(ExportError, match="has no quantization_config"):
        tq.load_exported(str(tmp_path / "float"))
    # A scheme tq cannot express: the layer and the scheme named.
    qc_path = tmp_path / "a" / "config.json"
    cfg = json.load(open(qc_path))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 5
    json.dump(cfg, open(qc_path, "w"))
    with pytest.raises(ExportError, match=r"layer 'model.layers.0.\w+.\w+_proj'.*num_bits=5.*has no tq quantizer"):
        tq.load_exported(str(tmp_path / "a"))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8, symmetric=False)
    json.dump(cfg, open(qc_path, "w"))
    with pytest.raises(ExportError, match=r"q_proj.*lacks its weight_zero_point \(its config says symmetric: false\)"):
        tq.load_exported(str(tmp_path / "a"))  # the config says asymmetric, the tensors have no zero points
    # ModelOpt: hf_quant_config.json stands in for config.json's quantization_config; an algo tq has no quantizer for.
    fp8 = _calibrated("fp8_tensor")
    tq.export(fp8, str(tmp_path / "mo"), format="modelopt")
    cfg = json.load(open(tmp_path / "mo" / "config.json"))
    del cfg["quantization_config"]
    json.dump(cfg, open(tmp_path / "mo" / "config.json", "w"))
    assert torch.equal(_logits(tq.load_exported(str(tmp_path / "mo"))), _logits(fp8))
    hf_quant = json.load(open(tmp_path / "mo" / "hf_quant_config.json"))
    hf_quant["quantization"]["quant_algo"] = "W4A16_AWQ"
    json.dump(hf_quant, open(tmp_path / "mo" / "hf_quant_config.json", "w"))
    with pytest.raises(ExportError, match="quant_algo 'W4A16_AWQ' has no tq quantizer"):
        tq.load_exported(str(tmp_path / "mo"))
    # A model already quantized.
    with pytest.raises(ExportError, match="already quantized"):
        tq.load_exported(str(tmp_path / "mo"), model=fp8)
    # A model of another architecture: the tensors that differ are named.
    tq.export(model, str(tmp_path / "b"))
    other = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    )
    with pytest.raises(ExportError, match=r"does not match.*lacks: model.layers.1.self_attn.q_proj.weight"):
        tq.load_exported(str(tmp_path / "b"), model=other)
    assert not any(hasattr(m, "weight_quantizer") for m in other.modules())  # refused before anything changed
    # A plain module's checkpoint names no architecture: the model must be given.
    seq = nn.Sequential(nn.Linear(32, 32))
    tq.calibrate(seq, tq.configs.int8(), lambda m: m(torch.randn(4, 32)), progress=False)
    tq.export(seq, str(tmp_path / "c"))
    with pytest.raises(ExportError, match="names no model_type"):
        tq.load_exported(str(tmp_path / "c"))
    back = tq.load_exported(str(tmp_path / "c"), model=nn.Sequential(nn.Linear(32, 32)))
    x = torch.randn(3, 32)
    assert torch.equal(back(x), seq(x))


def test_a_model_with_a_4d_buffer_exports_and_loads_back(tmp_path):
    """MiniMax's linear-attention layers hold a (1, heads, block, block) `diagonal_decay` buffer in
    their state_dict: the export's name probe gave 4-D tensors one entry (one "row") and failed
    reshaping it ("shape '[1, 4, 256, 256]' is invalid for input of size 1")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "minimax", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert any(t.dim() == 4 for t in model.state_dict().values())
    tq.calibrate(model, tq.configs.int8_weight_only(), None, progress=False)
    tq.export(model, str(tmp_path / "m"))
    loaded = tq.load_exported(str(tmp_path / "m"))
    assert torch.equal(_logits(loaded), _logits(model))


def test_experts_saved_as_one_tensor_are_refused_with_the_rule_that_exports(tmp_path):
    """GraniteMoE's checkpoints hold every expert in one tensor (``input_linear.weight``): tq.export
    wrote them quantized that way, which its own loader refused ("holds all experts in one tensor")
    and vLLM cannot map (it renames only the float ``.weight``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tqcompile.calibration import QuantRule

    cfg = AutoConfig.for_model(
        "granitemoe", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    tq.calibrate(model, tq.configs.int8_weight_only(), None, progress=False)
    with pytest.raises(ExportError, match=r"one tensor of every expert: .*input_linear.weight.*QuantRule\(name='\*.experts.\*'"):
        tq.export(model, str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    rule = QuantRule(name="*.experts.*", input=False, weight=False)
    tq.calibrate(model, tq.configs.int8_weight_only().with_rules(rule), None, progress=False)
    tq.export(model, str(tmp_path / "b"))
    assert torch.equal(_logits(tq.load_exported(str(tmp_path / "b"))), _logits(model))
