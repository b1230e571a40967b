"""NVFP4 weights that serving engines fuse into one GEMM (q/k/v, gate/up) share one global scale
there; tq gives them one weight amax, the max of theirs, in the model itself, so the checkpoint
`tq.export` writes is what the model computed with, bit for bit, on every path (issue 25, item 6:
before, export re-rounded k_proj, v_proj and up_proj under the shared scale, SQNR ~21 dB against
the calibrated model's weights).

Checked the way a user checks: transformers' compressed-tensors loader (``dequantize=True``, which
runs compressed-tensors' own decompressors) against the tq model with its input quantizers off
(transformers ignores input scales). Both in bfloat16, so they compute with the same numbers and
the logits are equal too."""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.calibration import CalibrationWarning
from tqcompile.export import ExportWarning
from tqcompile.testing import sqnr

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
PARENTS = {"q_proj": "model.layers.0.self_attn", "gate_proj": "model.layers.0.mlp"}
IDS = [torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _loop(model: nn.Module) -> None:
    for ids in IDS:
        model(ids)


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS[0]).logits


def _units(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if getattr(m, "weight_quantizer", None) is not None and m.weight_quantizer.enabled}


def _siblings(model: nn.Module) -> list[list[str]]:
    return [[f"{PARENTS[fam[0]]}.{leaf}" for leaf in fam] for fam in FUSED]


@contextlib.contextmanager
def _weight_only(model: nn.Module):
    """The model with its input quantizers off: what transformers' dequantizing loader computes."""
    saved = {n: m.input_quantizer.quantizer for n, m in _units(model).items()}
    for m in _units(model).values():
        m.input_quantizer.quantizer = None
    try:
        yield model
    finally:
        for n, m in _units(model).items():
            m.input_quantizer.quantizer = saved[n]


def _served(path: str) -> nn.Module:
    from transformers.utils.quantization_config import CompressedTensorsConfig

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You passed `quantization_config`")  # dequantize=True is what we pass
        return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()


def assert_served_as_computed(model: nn.Module, path: str) -> None:
    """The fused siblings hold one amax; `tq.export`'s checkpoint, loaded by transformers, holds
    the weights the model fake-quantizes with, bit for bit, and computes its weight-only logits."""
    for names in _siblings(model):
        amaxes = [model.get_submodule(n).weight_quantizer.amax for n in names]
        assert all(torch.equal(a, amaxes[0]) for a in amaxes), f"{names}: {[float(a) for a in amaxes]}"
    tq.export(model, path)
    served = _served(path)
    units = _units(model)
    assert len(units) == 7
    for n, m in units.items():
        with torch.no_grad():
            want = m.weight_quantizer(m.weight)
        got = served.get_submodule(n).weight
        assert got.dtype == want.dtype == torch.bfloat16, n
        assert torch.equal(got, want), f"{n}: served weight vs computed SQNR {float(sqnr(want.float(), got.float())):.1f} dB"
    with _weight_only(model):
        assert torch.equal(_logits(served), _logits(model))


# AWQ with coarse grids (its scale and clipping searches both run, in a third of the time).
ALGORITHMS = {"max": "max", "percentile": "percentile", "mse": "mse", "awq": tq.AWQ(grid=5, clip_grid=5), "smoothquant": "smoothquant", "gptq": "gptq"}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS.values()), ids=list(ALGORITHMS))
def test_calibrated_fused_nvfp4_weights_are_served_as_computed(tmp_path, algorithm):
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)  # GPTQ / AWQ on a 48-token calibration set
        tq.calibrate(model, tq.configs.nvfp4(), _loop, algorithm=algorithm, progress=False)
    assert_served_as_computed(model, str(tmp_path / "ckpt"))


def _own_amax_state(model: nn.Module) -> dict:
    """`tq.quant_state(model)` as a tq that kept each fused sibling's own weight amax saved it."""
    state = copy.deepcopy(tq.quant_state(model))
    for names in _siblings(model):
        for n in names:
            m = model.get_submodule(n)
            state["modules"][n]["weight"]["amax"] = tq.ops.amax(m.weight.detach(), m.weight_quantizer.quantizer)
    return state


def _checkpoint_file(path: str) -> str:
    (name,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return os.path.join(path, name)


def test_qat_restore_and_load_exported_keep_one_fused_amax(tmp_path):
    model = tiny_llama()
    tq.calibrate(model, tq.configs.nvfp4(), _loop, progress=False)
    old_state = _own_amax_state(model)
    k_proj = model.get_submodule("model.layers.0.self_attn.k_proj")
    assert not torch.equal(old_state["modules"]["model.layers.0.self_attn.k_proj"]["weight"]["amax"], k_proj.weight_quantizer.amax)

    # QAT trains under the calibrated (shared) amaxes: the trained weights are served as trained.
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = k_proj.weight.detach().clone()
    for ids in IDS:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    assert not torch.equal(before, k_proj.weight)
    assert_served_as_computed(model, str(tmp_path / "qat"))

    # A state whose siblings hold their own amaxes (saved before tq shared them) restores shared.
    with pytest.warns(CalibrationWarning, match=r"k_proj.*one amax, the max of theirs"):
        restored = tq.restore(tiny_llama(), old_state)
    restored.load_state_dict(model.state_dict())
    for n, m in _units(model).items():
        assert torch.equal(restored.get_submodule(n).weight_quantizer.amax, m.weight_quantizer.amax), n
    assert_served_as_computed(restored, str(tmp_path / "restored"))

    # load_exported, then export: the same bytes.
    loaded = tq.load_exported(str(tmp_path / "qat"), dtype=torch.bfloat16)
    assert_served_as_computed(loaded, str(tmp_path / "reexported"))
    a, b = (safetensors_torch.load_file(_checkpoint_file(str(tmp_path / d))) for d in ("qat", "reexported"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # A checkpoint (another tool's) whose fused siblings hold different global scales loads with one amax.
    key = "model.layers.0.self_attn.k_proj.weight_global_scale"
    a[key] = a[key] * 2
    safetensors_torch.save_file(a, _checkpoint_file(str(tmp_path / "qat")), metadata={"format": "pt"})
    with pytest.warns(CalibrationWarning, match=r"k_proj.*one amax, the max of theirs"):
        foreign = tq.load_exported(str(tmp_path / "qat"), dtype=torch.bfloat16)
    assert_served_as_computed(foreign, str(tmp_path / "foreign"))

    # An amax set by hand, outside those paths: the export says its checkpoint differs from the model.
    k_amax = foreign.get_submodule("model.layers.0.self_attn.k_proj").weight_quantizer
    k_amax.set_amax(k_amax.amax / 2)
    with pytest.warns(ExportWarning, match=r"k_proj.*differ from the model's.*tq.restore"):
        tq.export(foreign, str(tmp_path / "by_hand"))


def test_gptq_fallback_rounds_fused_siblings_under_their_shared_amax():
    """GPTQ does not support NVFP4 with the Hadamard transform and rounds to nearest instead: under
    the fused group's amax, the one the layer computes with, so its weight stays on that grid."""
    from tqcompile.calibration import QuantConfig, QuantRule
    from tqcompile.configs import GEMM_LAYERS, default_disabled

    model = tiny_llama().float()
    rule = QuantRule(module_types=GEMM_LAYERS, input=False, weight=tq.NVFP4Quantizer(hadamard=True), must_match=False)
    with pytest.warns(CalibrationWarning, match="round to nearest"):
        tq.calibrate(model, QuantConfig((rule, *default_disabled())), _loop, algorithm="gptq", progress=False)
    for names in _siblings(model):
        for n in names:
            m = model.get_submodule(n)
            assert torch.equal(m.weight_quantizer.amax, model.get_submodule(names[0]).weight_quantizer.amax), n
            with torch.no_grad():
                assert torch.equal(m.weight_quantizer(m.weight), m.weight), f"{n}: rounded under another amax than it computes with"
