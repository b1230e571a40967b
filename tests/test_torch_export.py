"""torch.export of quantized models: export -> `tq.lift_quantizers` -> torch.export.save -> load.

The loaded program's outputs equal the eager model's bit for bit (CPU) for PTQ, QAT and converted
(training-recipe) models, a small MLP and a tiny Hugging Face Llama, with a dynamic batch dim; the
graph keeps our ops with the quantizers as constants. Why the pass is needed: tqcompile/torch_export.py.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from moe_models import tiny_hf_moe
from torch import nn
from torch.export import Dim

import tqcompile as tq
from tqcompile import torch_export
from tqcompile.quantizers import Quantizer

PTQ_CONFIGS = {
    "int8": tq.configs.int8,
    "fp8": tq.configs.fp8,
    "int4_weight_only_32": lambda: tq.configs.int4_weight_only(32),
    "mxfp8": tq.configs.mxfp8,
    "nvfp4": tq.configs.nvfp4,
}
RECIPES = ("fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4")
# torch.export.save stores opaque constants from torch 2.13 (tqcompile/torch_export.py); on an older
# torch (2.11 on the GPU machines) lift_quantizers refuses, which the last test checks there too.
needs_archive = pytest.mark.skipif(
    not torch_export._archive_stores_opaque_objects(), reason=f"torch {torch.__version__}: torch.export.save stores no opaque constants"
)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 32)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Logits(nn.Module):
    """A Hugging Face causal LM as export takes it: token ids in, logits out (no cache object)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


def _calibrated(config) -> MLP:
    model = _mlp()
    batches = [torch.randn(16, 64) for _ in range(2)]
    return tq.calibrate(model, config, lambda m: [m(b) for b in batches], progress=False)


def _save_load(program, tmp_path):
    path = tmp_path / "model.pt2"
    torch.export.save(tq.lift_quantizers(program), path)
    return torch.export.load(path)


def _assert_same_outputs(model, loaded, inputs):
    with torch.no_grad():
        for x in inputs:
            expected, got = model(x), loaded.module()(x)
            assert torch.equal(got, expected), f"input {tuple(x.shape)}: max |diff| {(got - expected).abs().max().item()}"


def _tq_ops(program) -> set[str]:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function" and str(n.target).startswith("tqcompile.")}


@needs_archive
@pytest.mark.parametrize("name", PTQ_CONFIGS)
def test_calibrated_model_round_trips_with_a_dynamic_batch(name, tmp_path):
    model = _calibrated(PTQ_CONFIGS[name]())
    batch = Dim("batch", min=1, max=64)
    program = torch.export.export(model, (torch.randn(8, 64),), dynamic_shapes=({0: batch},))
    loaded = _save_load(program, tmp_path)
    _assert_same_outputs(model, loaded, [torch.randn(n, 64) for n in (8, 3, 17)])
    assert {"tqcompile.quantize.default", "tqcompile.dequantize.default"} <= _tq_ops(loaded)


@needs_archive
def test_qat_model_round_trips(tmp_path):
    model = _calibrated(tq.configs.int8()).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(16, 64)
        F.mse_loss(model(x), torch.zeros(16, 32)).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    loaded = _save_load(torch.export.export(model, (torch.randn(8, 64),)), tmp_path)
    _assert_same_outputs(model, loaded, [torch.randn(8, 64)])


@needs_archive
@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_model_round_trips_in_eval_no_grad(recipe, tmp_path):
    model = tq.convert(_mlp(), tq.recipes.get(recipe))
    x = torch.randn(32, 64)
    with torch.no_grad():
        program = torch.export.export(model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=1024)},))
    loaded = _save_load(program, tmp_path)
    _assert_same_outputs(model, loaded, [x, torch.randn(7, 64)])  # any token count: forward blocks run along K
    assert "tqcompile.gemm_tn.default" in _tq_ops(loaded)


@needs_archive
def test_converted_model_in_training_mode_round_trips(tmp_path):
    # With grad enabled the export holds the training forward (columnwise usages for backward);
    # it still computes the same output.
    model = tq.convert(_mlp(), tq.recipes.fp8_tensorwise()).train()
    x = torch.randn(32, 64)
    loaded = _save_load(torch.export.export(model, (x,)), tmp_path)
    _assert_same_outputs(model, loaded, [x])


@needs_archive
def test_quantized_weight_parameters_are_saved_as_the_high_precision_tensor(tmp_path):
    # tq.convert(..., fsdp_quantized_all_gather=True) makes QuantizedWeight parameters, which
    # ExportedProgram refuses as parameters; the graph reads them as the tensor they hold.
    model = tq.convert(_mlp(), tq.recipes.fp8_rowwise(), fsdp_quantized_all_gather=True)
    assert isinstance(model.fc1.weight, tq.distributed.QuantizedWeight)
    x = torch.randn(32, 64)
    with torch.no_grad():
        program = torch.export.export(model, (x,))
    loaded = _save_load(program, tmp_path)
    assert type(loaded.state_dict["fc1.weight"]) is nn.Parameter
    assert torch.equal(loaded.state_dict["fc1.weight"], model.fc1.weight.detach())
    _assert_same_outputs(model, loaded, [x])


@needs_archive
def test_quantized_tensor_weights_round_trip_as_real_payloads(tmp_path):
    class Stored(nn.Module):
        def __init__(self):
            super().__init__()
            w = torch.randn(32, 64)
            q = tq.IntQuantizer(granularity=tq.Granularity.ROWWISE)
            self.register_buffer("weight", tq.quantize(w, q))

        def forward(self, x):
            return F.linear(x, self.weight.dequantize())

    model = Stored()
    x = torch.randn(8, 64)
    loaded = _save_load(torch.export.export(model, (x,)), tmp_path)
    stored = loaded.state_dict["weight"]
    assert isinstance(stored, tq.QuantizedTensor) and stored._data.dtype == torch.int8
    _assert_same_outputs(model, loaded, [x])


@needs_archive
def test_graph_keeps_our_ops_with_the_quantizers_as_constants():
    model = _calibrated(tq.configs.int8())
    program = torch.export.export(model, (torch.randn(8, 64),))
    # Export bakes each quantizer into its op call, like an int...
    quantize = next(n for n in program.graph.nodes if str(n.target) == "tqcompile.quantize.default")
    assert quantize.args[1] == model.fc1.input_quantizer.quantizer
    # ...lifting makes each distinct one a custom-object constant that the op reads...
    lifted = tq.lift_quantizers(program)
    objs = {s.arg.name: s.target for s in lifted.graph_signature.input_specs if s.kind.name == "CUSTOM_OBJ"}
    quantize = next(n for n in lifted.graph.nodes if str(n.target) == "tqcompile.quantize.default")
    assert lifted.constants[objs[quantize.args[1].name]] == model.fc1.input_quantizer.quantizer
    quantizers = {v for v in lifted.constants.values() if isinstance(v, Quantizer)}
    assert len(objs) == len(quantizers) == 2  # int8 per-tensor inputs, per-channel weights: shared by both layers
    # ...and the default decompositions leave our ops whole (no fp32 rounding ops in their place).
    decomposed = lifted.run_decompositions()
    assert _tq_ops(decomposed) == _tq_ops(lifted) == {"tqcompile.quantize.default", "tqcompile.dequantize.default"}
    assert not any("round" in str(n.target) for n in decomposed.graph.nodes)


@needs_archive
def test_tiny_llama_round_trips_with_a_dynamic_batch(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 128, (2, 16))
    tq.calibrate(llama, tq.configs.nvfp4(), lambda m: m(ids), progress=False)
    model = Logits(llama)
    batch = Dim("batch", min=1, max=8)
    program = torch.export.export(model, (ids,), dynamic_shapes=({0: batch},))
    loaded = _save_load(program, tmp_path)
    _assert_same_outputs(model, loaded, [ids, torch.randint(0, 128, (3, 16))])


@needs_archive
def test_mixtral_with_quantized_experts_round_trips(tmp_path):
    pytest.importorskip("transformers")
    mixtral = tiny_hf_moe("mixtral", layers=1)
    ids = torch.randint(0, 128, (2, 16))
    tq.calibrate(mixtral, tq.configs.int8(), lambda m: m(ids), progress=False)
    model = Logits(mixtral)
    loaded = _save_load(torch.export.export(model, (ids,)), tmp_path)
    assert "tqcompile.grouped_quantize.default" in _tq_ops(loaded)
    _assert_same_outputs(model, loaded, [ids])


# --- bad input ----------------------------------------------------------------------------------


@needs_archive
def test_without_lifting_torch_export_load_fails(tmp_path):
    # The torch defect lift_quantizers works around. If this starts passing, torch.export.save
    # writes inline opaque values itself: revisit tqcompile/torch_export.py and the docs.
    program = torch.export.export(_calibrated(tq.configs.int8()), (torch.randn(8, 64),))
    torch.export.save(program, tmp_path / "model.pt2")
    with pytest.raises(RuntimeError, match="deserializing"):
        torch.export.load(tmp_path / "model.pt2")


def test_refuses_what_is_not_an_exported_program():
    with pytest.raises(TypeError, match="program is a MLP; allowed: a torch.export.ExportedProgram"):
        tq.lift_quantizers(_mlp())


@needs_archive
def test_refuses_a_quantizer_inside_a_subgraph():
    q = tq.IntQuantizer()

    class Branchy(nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x: tq.quantize(x, q).dequantize(), lambda x: x * 2, (x,))

    program = torch.export.export(Branchy(), (torch.randn(4, 8),))
    with pytest.raises(ValueError, match="subgraph 'true_graph_0' takes IntQuantizer"):
        tq.lift_quantizers(program)


@needs_archive
def test_a_grad_mode_subgraph_lifts_after_run_decompositions(tmp_path):
    # torch.no_grad() inside forward exports as a subgraph; run_decompositions inlines it.
    q = tq.IntQuantizer()

    class NoGradInside(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            with torch.no_grad():
                return y + tq.quantize(y, q).dequantize()

    model = NoGradInside()
    program = torch.export.export(model, (torch.randn(4, 8),))
    with pytest.raises(ValueError, match="run_decompositions"):
        tq.lift_quantizers(program)
    loaded = _save_load(program.run_decompositions(), tmp_path)
    _assert_same_outputs(model, loaded, [torch.randn(4, 8)])


def test_refuses_a_torch_whose_archive_cannot_store_opaque_objects(monkeypatch):
    monkeypatch.setattr(torch_export, "_archive_stores_opaque_objects", lambda: False)
    program = torch.export.export(_calibrated(tq.configs.int8()), (torch.randn(8, 64),))
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} stores only tensors and TorchScript objects")):
        tq.lift_quantizers(program)
