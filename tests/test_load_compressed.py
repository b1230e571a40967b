"""`tq.load_exported(path, compress=True)`: a checkpoint read straight into its deployment form.

The model is built with its parameters on the meta device; every quantized layer's weight is read,
put in its converted module and packed (`tq.compress`'s packing) before the next one is read, so
no two quantized layers are ever held in float at once. The result equals
``tq.compress(tq.load_exported(path))``: the same kernels, packed tensors and logits, bit for bit.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import pytest
import torch
from moe_models import tiny_hf_moe
from torch import nn

import tqcompile as tq
from tqcompile.deploy import modules as deploy_modules

transformers = pytest.importorskip("transformers")
load_module = importlib.import_module("tqcompile.export.load")
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _llama(tied: bool) -> nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


CASES = {
    "llama int4_weight_only (tied)": (lambda: _llama(True), lambda: tq.configs.int4_weight_only(), "compressed-tensors"),
    "llama int8": (lambda: _llama(False), lambda: tq.configs.int8(), "compressed-tensors"),
    "llama fp8 + FP8 KV": (lambda: _llama(False), lambda: tq.configs.fp8().with_rules(tq.configs.fp8_kv_cache()), "compressed-tensors"),
    "llama nvfp4": (lambda: _llama(False), lambda: tq.configs.nvfp4(), "compressed-tensors"),
    "mixtral int4_weight_only": (lambda: tiny_hf_moe("mixtral", num_experts=4, hidden=128, intermediate=128), lambda: tq.configs.int4_weight_only(), "compressed-tensors"),
    "gpt_oss mxfp4 experts": (lambda: tiny_hf_moe("gpt_oss", num_experts=4), lambda: tq.configs.mxfp4_weight_only(experts_only=True), "mxfp4"),
}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the state_dict, packed ones as their inner tensors."""
    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, tq.QuantizedTensor):
            out.update({f"{k}:{name}": t for name, t in v._inner().items()})
            out[f"{k}:class"] = type(v).__name__
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_load_equals_load_then_compress(case, tmp_path, monkeypatch):
    build, config, fmt = CASES[case]
    model = build()
    tq.calibrate(model, config(), lambda m: m(IDS), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.export(model, str(tmp_path), format=fmt)
        ref = tq.compress(tq.load_exported(str(tmp_path), dtype=torch.bfloat16))

        # While each module is packed, every other quantized layer is still unread (meta) or
        # packed already: never two layers' float weights at once.
        built, seen = [], []
        build_model, pack = load_module._build_model, deploy_modules.pack_module

        def keep(*a, **kw):
            built.append(build_model(*a, **kw))
            return built[-1]

        def pack_checked(name, module, fallback="packed"):
            floats = [
                n for n, p in built[0].named_parameters()
                if not p.is_meta and not isinstance(p, tq.QuantizedTensor) and _quantized(built[0], n) and not n.startswith(name + ".")
            ]
            assert floats == [], (name, floats)
            seen.append(name)
            pack(name, module, fallback)

        monkeypatch.setattr(load_module, "_build_model", keep)
        monkeypatch.setattr(deploy_modules, "pack_module", pack_checked)
        got = tq.load_exported(str(tmp_path), dtype=torch.bfloat16, compress=True)
    assert seen and len(seen) == len({r.name.rpartition(".")[0] if r.name.endswith("_gemm") else r.name for r in tq.deploy.deployed_layers(got) if r.kernel != "fp8 kv cache"})
    assert not [n for n, t in (*got.named_parameters(), *got.named_buffers()) if t.is_meta]
    assert [(r.name, r.kernel, r.weight_bytes) for r in tq.deploy.deployed_layers(got)] == [
        (r.name, r.kernel, r.weight_bytes) for r in tq.deploy.deployed_layers(ref)
    ]
    a, b = _state(ref), _state(got)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k] if isinstance(a[k], str) else (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])), k
    with torch.no_grad():
        assert torch.equal(got(IDS).logits, ref(IDS).logits)
    if "tied" in case:
        assert got.lm_head.weight is got.model.embed_tokens.weight


def _quantized(model: nn.Module, param_name: str) -> bool:
    """Whether `param_name` is the weight of a layer the checkpoint quantized (a fake-quantized
    linear layer or experts module of the loaded model)."""
    from tqcompile.calibration.modules import is_fake_quant_experts, slots_of

    owner_name, _, local = param_name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if is_fake_quant_experts(owner) or isinstance(owner, deploy_modules._ExpertsPacked):
        return local in {g.weight for g in owner.tq_experts_layout.gemms}  # not the biases
    if isinstance(owner, deploy_modules.PackedModule):
        return local == "weight"
    slots = slots_of(owner)
    return slots is not None and "weight" in slots and slots["weight"].enabled and param_name.endswith(".weight")


def test_a_given_model_is_loaded_then_compressed(tmp_path):
    """A model passed in (its float weights allocated by its maker) is filled in place, then packed."""
    model = _llama(False)
    tq.calibrate(model, tq.configs.int8_weight_only(), lambda m: m(IDS), progress=False)
    tq.export(model, str(tmp_path))
    ref = tq.compress(tq.load_exported(str(tmp_path), _llama(False)))
    got = tq.load_exported(str(tmp_path), _llama(False), compress=True)
    assert {r.kernel for r in tq.deploy.deployed_layers(got)} == {"int8pack_mm"}
    with torch.no_grad():
        assert torch.equal(got(IDS).logits, ref(IDS).logits)


def test_bad_fallback_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"fallback='dense'.*allowed: \('packed', 'dequantized'\)"):
        tq.load_exported(str(tmp_path), compress=True, fallback="dense")


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16", "FP8_DYNAMIC"])
def test_checkpoints_llmcompressor_wrote_load_compressed(scheme):
    """Checkpoints llmcompressor 0.14 itself wrote (tests/data/llmcompressor: a bfloat16 Llama with
    its W8A8, W4A16 and FP8_DYNAMIC presets): read straight into the deployment form, the
    same as a load then `tq.compress`, bit for bit (their bfloat16 scales load to the nearest tq
    amax either way)."""
    path = str(Path(__file__).parent / "data" / "llmcompressor" / scheme)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scales-without-an-exact-amax note (test_export_llmcompressor.py)
        ref = tq.compress(tq.load_exported(path, dtype=torch.bfloat16))
        got = tq.load_exported(path, dtype=torch.bfloat16, compress=True)
    assert [(r.name, r.kernel) for r in tq.deploy.deployed_layers(got)] == [(r.name, r.kernel) for r in tq.deploy.deployed_layers(ref)]
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


def test_device_goes_with_a_compressed_load_of_a_built_model(tmp_path):
    """`device=` names where a compressed load makes and packs the model (the CPU here, explicitly:
    the same result); elsewhere it is refused with what to do instead. On a GPU:
    tests/test_cuda.py::test_compressed_load_onto_the_gpu."""
    model = _llama(False)
    tq.calibrate(model, tq.configs.int8_dynamic(), lambda m: m(IDS), progress=False)
    tq.export(model, str(tmp_path))
    ref = tq.load_exported(str(tmp_path), dtype=torch.bfloat16, compress=True)
    got = tq.load_exported(str(tmp_path), dtype=torch.bfloat16, compress=True, device="cpu")
    with torch.no_grad():
        assert torch.equal(got(IDS).logits, ref(IDS).logits)
    with pytest.raises(ValueError, match=r"device='cpu' goes with compress=True and a model it builds.*model.to\(device\)"):
        tq.load_exported(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match=r"device='cpu' goes with compress=True and a model it builds"):
        tq.load_exported(str(tmp_path), _llama(False), compress=True, device="cpu")
