"""Sequential weight transforms replay decoder layers on cached inputs (tqcompile.calibration.replay).

Each decoder layer runs a bounded number of times per batch whatever the depth, and the results
are bit for bit those of one `forward_loop` pass per layer (the path before replay, still taken
where the model does not hand each layer's output to the next one unchanged).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.calibration import transforms

transformers = pytest.importorskip("transformers")

BATCHES = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]


def loop(m):
    for b in BATCHES:
        m(b)


SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)


def _build(config) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def llama(layers: int) -> nn.Module:
    return _build(transformers.LlamaConfig(intermediate_size=128, num_hidden_layers=layers, **SMALL))


def gpt_oss() -> nn.Module:
    layer_types = ["sliding_attention", "full_attention"] * 2
    return _build(
        transformers.GptOssConfig(
            intermediate_size=64, num_hidden_layers=4, head_dim=16, sliding_window=4, layer_types=layer_types, **SMALL, **EXPERTS
        )
    )


def mixtral() -> nn.Module:
    return _build(transformers.MixtralConfig(intermediate_size=128, num_hidden_layers=3, **SMALL, **EXPERTS))


def calibrate_counting(model, layers, config, algorithm, replay: bool, monkeypatch) -> int:
    monkeypatch.setattr(transforms, "REPLAY", replay)
    calls = [0]
    for layer in layers(model):
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    tq.calibrate(model, config, loop, algorithm=algorithm, progress=False)
    return calls[0]


@pytest.mark.parametrize("depth", [2, 6])
def test_each_layer_runs_a_bounded_number_of_times(depth, monkeypatch):
    """One pass of forward_loop captures the inputs (and gives the first layer's statistics), then
    each later layer runs once for its statistics and each but the last once to hand its rounded
    outputs on: 3 calls a layer per batch (weight-only: no activation-amax pass), where a pass of
    forward_loop per layer makes it grow with the depth."""
    cfg = tq.configs.int4_weight_only(32)
    replayed = calibrate_counting(llama(depth), lambda m: m.model.layers, cfg, "gptq", True, monkeypatch)
    whole = calibrate_counting(llama(depth), lambda m: m.model.layers, cfg, "gptq", False, monkeypatch)
    b = len(BATCHES)
    assert replayed == (3 * depth - 2) * b
    assert whole == depth * (depth * b)  # one pass per layer
    if depth == 6:
        assert replayed < whole / 1.5


@pytest.mark.parametrize("preset, amax_pass", [("int8_dynamic", False), ("int8", True)])
def test_activation_amax_pass_only_for_static_activation_scales(preset, amax_pass, monkeypatch):
    """After the transforms, a pass of forward_loop calibrates static activation amaxes (`int8`);
    activations scaled at run time (`int8_dynamic`, per token) have nothing to record, and the
    transforms' own passes already showed every quantizer its input's shape: no extra pass."""
    depth, b = 3, len(BATCHES)
    calls = calibrate_counting(llama(depth), lambda m: m.model.layers, getattr(tq.configs, preset)(), "gptq", True, monkeypatch)
    assert calls == (3 * depth - 2) * b + (depth * b if amax_pass else 0)


@pytest.mark.parametrize("linear_folds, proofs", [(False, 2), (True, 4)])
def test_smoothquant_fold_runs_per_layer(linear_folds, proofs, monkeypatch):
    """SmoothQuant proves and checks its folds on the replayed layer's first cached batch: one
    baseline run, one run per candidate proved (a Llama layer: input_layernorm into q/k/v,
    post_attention_layernorm into gate/up; with linear folds also q_proj tried for o_proj and
    rejected, up_proj into down_proj), and one check of the folds made with the scales found."""
    depth, b = 3, len(BATCHES)
    algorithm = tq.SmoothQuant(linear_folds=linear_folds)
    calls = calibrate_counting(llama(depth), lambda m: m.model.layers, tq.configs.int8_dynamic(), algorithm, True, monkeypatch)
    assert calls == (3 * depth - 2) * b + (1 + proofs + 1) * depth


@pytest.mark.parametrize(
    "make, preset, algorithm",
    [
        (lambda: llama(3), "int4_weight_only", "gptq"),
        (lambda: llama(3), "int4_weight_only", "awq"),
        (lambda: llama(3), "int8", ("smoothquant", "gptq")),
        (mixtral, "int4_weight_only", "gptq"),
        (gpt_oss, "int4_weight_only", "awq"),  # sliding-window and full-attention layers: each keeps its mask
    ],
)
def test_replay_equals_a_pass_per_layer(make, preset, algorithm, monkeypatch):
    config = tq.configs.int4_weight_only(32) if preset == "int4_weight_only" else getattr(tq.configs, preset)()
    base = make()
    results = []
    for replay in (True, False):
        model = copy.deepcopy(base)
        monkeypatch.setattr(transforms, "REPLAY", replay)
        tq.calibrate(model, config, loop, algorithm=algorithm, progress=False)
        with torch.no_grad():
            results.append((model(BATCHES[0]).logits, model.state_dict(), tq.quant_state(model)))
    (a_logits, a_state, a_q), (b_logits, b_state, b_q) = results
    assert torch.equal(a_logits, b_logits)
    assert a_state.keys() == b_state.keys() and all(torch.equal(a_state[k], b_state[k]) for k in a_state)
    assert a_q.keys() == b_q.keys() and str(a_q) == str(b_q)


class _Scaled(nn.Module):
    """Layers in a ModuleList, but the model scales the stream between them: no direct hand-off."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * 0.5
        return x


def test_no_direct_hand_off_runs_a_pass_per_layer(monkeypatch):
    data = [torch.randn(4, 64) for _ in range(3)]
    results, counts = [], []
    for replay in (True, False):
        model = _Scaled()
        monkeypatch.setattr(transforms, "REPLAY", replay)
        calls = [0]
        for layer in model.layers:
            layer.register_forward_pre_hook(lambda *_, calls=calls: calls.__setitem__(0, calls[0] + 1))
        tq.calibrate(model, tq.configs.int8(), lambda m: [m(x) for x in data], algorithm="gptq", progress=False)
        results.append(model(data[0]))
        counts.append(calls[0])
    assert torch.equal(results[0], results[1])
    assert counts[0] == counts[1]  # the capture pass (the first group's) found no hand-off: a pass per group
