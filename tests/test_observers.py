"""Calibration records through observers (tqcompile.calibration.observers); a `TensorQuantizer`
holds only what the calibrated model runs with, during and after `tq.calibrate`, also when it fails,
and in pickles made before observers existed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.calibration import TensorQuantizer, fake_quantize
from tqcompile.calibration.record import CalibrationRecord

DATA = Path(__file__).parent / "data"

# What a TensorQuantizer holds besides nn.Module's own state: its runtime state, the slot an
# observer is attached to while calibrating, and how its weight was made (a result).
RUNTIME = {"quantizer", "role", "owner", "num_experts", "ste", "observer", "method"}


def _fields(t: TensorQuantizer) -> set[str]:
    return {k for k in vars(t) if not k.startswith("_") and k != "training"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).eval()


BATCHES = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _loop(m):
    for x in BATCHES:
        m(x)


@pytest.mark.parametrize("algorithm", ["percentile", "gptq"])
def test_calibrated_quantizers_hold_only_runtime_state(algorithm):
    model = tq.calibrate(_model(), tq.configs.int8(), _loop, algorithm=algorithm, progress=False)
    tqs = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
    assert len(tqs) == 6
    for t in tqs:
        assert _fields(t) == RUNTIME, t.owner
        assert set(t._buffers) == {"amax"} and t.observer is None
    assert model[0].weight_quantizer.method == algorithm


def test_a_failing_calibrate_leaves_no_observer_attached():
    """A forward_loop that fails in the weight transforms' pass (GPTQ's statistics attached beside
    the amax observers): every quantizer it saw quantizes again, holding nothing of calibration."""
    seen: list[TensorQuantizer] = []

    def loop(m):
        seen.extend(t for t in m.modules() if isinstance(t, TensorQuantizer))
        m(BATCHES[0])
        raise KeyError("data loader broke")

    model = _model()
    with pytest.raises(KeyError, match="data loader broke"):
        tq.calibrate(model, tq.configs.int8(), loop, algorithm="gptq", progress=False)
    assert not any(isinstance(m, TensorQuantizer) for m in model.modules())  # the conversion was undone
    assert len(seen) == 6
    x = BATCHES[1]
    for t in seen:
        assert _fields(t) == RUNTIME and t.observer is None
        if t.enabled:  # quantizes (no static amax: from x), not records
            assert torch.equal(t(x), fake_quantize(x, t.quantizer))


class _Seen:
    def __init__(self):
        self.inputs = []

    def record(self, x, ends):
        self.inputs.append((x, ends))


def test_an_attached_observer_sees_the_scaling_units_and_the_input_passes_unchanged():
    t = TensorQuantizer(tq.IntQuantizer(granularity=tq.Granularity.ROWWISE), "input", "conv")
    t.observer = seen = _Seen()
    x = torch.randn(2, 3, 4, 4)
    assert t(x, channel_dim=1) is x
    (got, ends), = seen.inputs
    assert torch.equal(got, x.movedim(1, -1)) and ends is None
    t.observer = None
    assert not torch.equal(t(x, channel_dim=1), x)


def test_a_model_pickled_before_observers_loads_and_computes_as_it_did():
    """tests/data/calibrated_model_before_observers.pt: `torch.save` of a GPTQ-calibrated model by tq
    before calibration moved to observers (its TensorQuantizers held calibrating, stat_max, hist,
    ...; its record named tqcompile.calibration.pipeline.CalibrationRecord)."""
    saved = torch.load(DATA / "calibrated_model_before_observers.pt", weights_only=False)
    model = saved["model"]
    for t in (m for m in model.modules() if isinstance(m, TensorQuantizer)):
        assert _fields(t) == RUNTIME and t.observer is None
    with torch.no_grad():
        assert torch.equal(model(saved["x"]), saved["y"])
    assert str(tq.summary(model)) == saved["summary"]
    assert isinstance(model.tq_calibration, CalibrationRecord)  # found under its old module's name
    assert tq.quant_state(model)["algorithm"].startswith("GPTQ(")


def test_quant_state_does_not_import_the_pipeline():
    from test_import_graph import import_graph

    assert "tqcompile.calibration.pipeline" not in import_graph()["tqcompile.calibration.state"]


def test_shared_gram_is_reused_only_for_the_same_unchanged_input():
    from tqcompile.calibration.layer_stats import SharedGram

    gram, x = SharedGram(), torch.randn(8, 4)
    first = gram(x, x)
    assert torch.equal(first, x.T @ x)
    assert gram(x, x) is first  # the same tensor, unchanged: no second product
    x.mul_(2.0)  # changed in place: its version counter moved
    assert torch.equal(gram(x, x), x.T @ x)
    y = x.clone()  # equal values, another tensor
    assert gram(y, y) is not gram(x, x)
    with torch.inference_mode():
        z = torch.randn(8, 4)
        assert gram(z, z) is not gram(z, z)  # no version counter: never shared


def test_projections_reading_one_input_share_its_gram_and_calibrate_as_before(monkeypatch):
    """q/k/v read one tensor: its xᵀx is computed once a batch, and GPTQ's result is what separate
    products give (the same float32 products summed in float64)."""
    from tqcompile.calibration import layer_stats

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

        def forward(self, x):
            return self.o(self.q(x) * self.k(x) + self.v(x))

    def run(share: bool):
        torch.manual_seed(0)
        m = nn.Sequential(Block(), Block()).eval()
        asked, products = [0], [0]
        real = layer_stats.SharedGram.__call__

        def counted(self, source, x):
            asked[0] += 1
            before = self._gram
            out = real(self, source, x) if share else x.T @ x
            products[0] += out is not before
            return out

        monkeypatch.setattr(layer_stats.SharedGram, "__call__", counted)
        tq.calibrate(m, tq.configs.int4_weight_only(16), _loop, algorithm="gptq", progress=False)
        monkeypatch.undo()
        return m, asked[0], products[0]

    shared, asked, products = run(True)
    separate, _, separate_products = run(False)
    assert asked == separate_products == 2 * 4 * len(BATCHES)  # every layer asks, every batch
    assert products == 2 * 2 * len(BATCHES)  # q's product serves k and v; o's input is its own
    for a, b in zip(shared.state_dict().values(), separate.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("algorithm", [tq.GPTQ(act_order=True), tq.GPTQ(act_order=False), tq.AWQ(loss="output")])
def test_calibrating_under_inference_mode_gives_what_it_gives_without(algorithm):
    """Inference tensors have no version counter: the statistics and GPTQ's rounding must not rely on
    one (a loop written under torch.inference_mode() failed with GPTQ once they did)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    data = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    got = []
    for inference in (False, True):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.inference_mode(inference):
            tq.calibrate(model, tq.configs.int4_weight_only(32), lambda m: [m(x) for x in data], algorithm=algorithm, progress=False)
        got.append(model.state_dict())
    for (k, a), b in zip(got[0].items(), got[1].values()):
        assert torch.equal(a, b), k
