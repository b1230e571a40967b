"""Delayed scaling (`tq.recipes.fp8_delayed`): the amax histories as module state.

The rules tested here (docs/training.md, "Delayed scaling"):

- a training step's amaxes enter the histories once, in the layer's backward: the recompute of an
  activation checkpoint reuses the forward's scales and rolls nothing, so a checkpointed run equals
  an uncheckpointed one bit for bit;
- `eval()` (and a forward with no backward) scales from the histories without rolling them;
- histories are fp32 always (model casts keep them fp32; `tq.quantize` rejects any other dtype);
- they are never uninitialised memory: `to_empty` from the meta device and `reset_parameters`
  zero them (zeros are the first-step state);
- they are persistent `state_dict` entries, and an `nn.Linear` checkpoint without them still loads
  strictly, with zero histories.

The compiled counterparts (checkpointing, train/eval switches) are in
compile_tests/test_delayed_scaling_compile.py.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

import tqcompile as tq
from tqcompile.testing.compile import assert_bitwise_equal

HISTORIES = ("amax_history_input", "amax_history_weight", "amax_history_grad")
HIST_LEN = 2  # short, so that a window that forgets shows up within a few steps
# Per-step input scales: a big step, then smaller ones whose window max changes as the big one ages out.
SCALES = (4.0, 1.0, 0.25, 2.0)


class Block(nn.Module):
    """Two linears ("mlp"), or torch's encoder layer, whose converted attention owns histories too
    ("encoder"), optionally run under activation checkpointing."""

    def __init__(self, checkpointing: str | None = None, kind: str = "mlp") -> None:
        super().__init__()
        if kind == "mlp":
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        else:
            self.encoder = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.checkpointing = checkpointing  # None, "reentrant" or "non-reentrant"

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "encoder"):
            return self.encoder(x.view(2, -1, 32)).view(x.shape)
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing is None:
            return self._inner(x)
        return checkpoint.checkpoint(self._inner, x, use_reentrant=self.checkpointing == "reentrant")


def delayed_block(checkpointing: str | None = None, hist_len: int = HIST_LEN, kind: str = "mlp") -> Block:
    torch.manual_seed(0)
    block = Block(checkpointing, kind)
    tq.convert(block, tq.recipes.fp8_delayed(hist_len))
    return block


def histories(model: nn.Module) -> dict[str, torch.Tensor]:
    found = {k: v.clone() for k, v in model.named_buffers() if "amax_history" in k}
    assert found, "no delayed-scaling histories"
    return found


def train_steps(model: nn.Module, run=None, steps: int = len(SCALES)) -> list:
    """Losses, gradients and histories after each of `steps` training steps (no optimizer: the
    histories are what changes between steps)."""
    run = run or model
    g = torch.Generator().manual_seed(1)
    record = []
    for step in range(steps):
        x = (torch.randn(16, 32, generator=g) * SCALES[step]).requires_grad_()
        loss = run(x).square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        record.append((loss.detach(), x.grad, grads, histories(model)))
        model.zero_grad()
    return record


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mlp", "encoder"])
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_activation_checkpointing_equals_no_checkpointing(mode, kind):
    expected = train_steps(delayed_block(kind=kind))
    actual = train_steps(delayed_block(mode, kind=kind))
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert_bitwise_equal(a, e, f"{mode} step {step}")


def test_a_layer_called_twice_before_its_backward():
    """A shared layer (or microbatches in flight): both calls scale from the same window, and each
    call's input amax enters the history in its own backward (before: an in-place-modification error)."""
    layer = tq.nn.Linear(32, 32, recipe=tq.recipes.fp8_delayed(4))
    a = torch.randn(8, 32) * 3
    y1 = layer(a)
    layer(y1).sum().backward()
    hist = layer.amax_history_input.tolist()
    assert sorted(hist[:2]) == sorted([a.abs().max().item(), y1.detach().abs().max().item()]) and hist[2:] == [0, 0]


# ---------------------------------------------------------------------------------------------
# eval() and forwards without backward
# ---------------------------------------------------------------------------------------------
def _first_step(model: nn.Module) -> None:
    model(torch.randn(16, 32) * 8).square().mean().backward()
    model.zero_grad()


def _fake_quantized(t: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    q = tq.Float8Quantizer()
    return torch.ops.tqcompile.dequantize(*torch.ops.tqcompile.quantize(t, q, amax, None), amax, q, torch.float32)


def test_eval_scales_from_the_history_without_rolling_it():
    layer = tq.nn.Linear(32, 16, bias=False, recipe=tq.recipes.fp8_delayed(4))
    layer(torch.randn(16, 32) * 8).sum().backward()
    before = histories(layer)
    layer.eval()
    small = torch.randn(16, 32) * 0.1
    with torch.no_grad():
        y = layer(small)
    assert_bitwise_equal(histories(layer), before, "eval + no_grad")
    # Scaled from the history (the training step's big amax), not from the small input's own amax.
    x_q = _fake_quantized(small, before["amax_history_input"].max())
    w_q = _fake_quantized(layer.weight.detach(), before["amax_history_weight"].max())
    assert_bitwise_equal(y, x_q @ w_q.t())
    assert not torch.equal(x_q, tq.quantize(small, tq.Float8Quantizer()).dequantize()), "the test can tell the two apart"


def test_eval_with_backward_does_not_roll():
    model = delayed_block(hist_len=4)
    _first_step(model)
    before = histories(model)
    model.eval()
    model(torch.randn(16, 32, requires_grad=True)).sum().backward()
    assert_bitwise_equal(histories(model), before)


def test_training_mode_forward_without_backward_does_not_roll():
    model = delayed_block(hist_len=4)
    _first_step(model)
    before = histories(model)
    with torch.no_grad():
        model(torch.randn(16, 32))
    model(torch.randn(16, 32))  # built for backward, never run
    assert_bitwise_equal(histories(model), before)


@pytest.mark.parametrize("kind", ["mlp", "encoder"])
def test_a_validation_pass_does_not_change_training(kind):
    plain, validated = delayed_block(kind=kind), delayed_block(kind=kind)
    expected = train_steps(plain)
    g = torch.Generator().manual_seed(1)
    for step in range(len(SCALES)):
        x = (torch.randn(16, 32, generator=g) * SCALES[step]).requires_grad_()
        validated(x).square().mean().backward()
        assert_bitwise_equal({n: p.grad for n, p in validated.named_parameters()}, expected[step][2], f"step {step}")
        validated.zero_grad()
        validated.eval()
        with torch.no_grad():
            validated(torch.randn(16, 32) * 100)  # a validation batch far outside the training range
        validated.train()
    assert_bitwise_equal(histories(validated), expected[-1][3])


# ---------------------------------------------------------------------------------------------
# dtypes: fp32 histories always
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_quantize_rejects_a_non_fp32_history(dtype):
    with pytest.raises(
        ValueError, match=rf"amax_history has dtype {dtype} and shape \(4,\); allowed: a non-empty 1-D torch.float32"
    ):
        tq.quantize(torch.randn(8, 8), tq.Float8Quantizer(), amax_history=torch.zeros(4, dtype=dtype))


@pytest.mark.parametrize("shape", [(0,), (2, 2), ()], ids=str)
def test_quantize_rejects_a_history_of_the_wrong_shape(shape):
    with pytest.raises(ValueError, match=r"allowed: a non-empty 1-D torch.float32 tensor"):
        tq.quantize(torch.randn(8, 8), tq.Float8Quantizer(), amax_history=torch.zeros(shape))
    with pytest.raises(TypeError, match=r"amax_history must be a 1-D torch.float32 tensor, got list"):
        tq.quantize(torch.randn(8, 8), tq.Float8Quantizer(), amax_history=[0.0])


@pytest.mark.parametrize("cast", ["to_bf16", "half", "double", "to_cpu_bf16"])
def test_model_casts_keep_histories_fp32(cast):
    model = delayed_block(hist_len=4)
    _first_step(model)
    before = histories(model)
    if cast == "to_bf16":
        model.to(torch.bfloat16)
    elif cast == "half":
        model.half()
    elif cast == "double":
        model.double()
    else:
        model.to("cpu", torch.bfloat16)
    assert_bitwise_equal(histories(model), before, cast)  # same fp32 values, not rounded through bf16
    dtype = model.up.weight.dtype
    assert dtype != torch.float32
    if dtype is not torch.float64:  # fp64 is not an input dtype the layers take
        x = torch.randn(16, 32, dtype=dtype, requires_grad=True)
        model(x).float().square().mean().backward()  # crashed before: bf16 scales given to _scaled_mm
        assert x.grad.dtype == dtype and model.up.weight.grad.abs().sum() > 0
        assert all(h.dtype == torch.float32 for h in histories(model).values())


# ---------------------------------------------------------------------------------------------
# Initialisation: meta device, to_empty, reset_parameters
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def uninitialised_is_nan():
    """Make `torch.empty` (and so `to_empty`) fill floats with NaN, so that uninitialised memory is
    seen whatever the allocator happens to return."""
    was = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def _meta_block() -> Block:
    with torch.device("meta"):
        model = Block()
    tq.convert(model, tq.recipes.fp8_delayed(HIST_LEN))
    assert model.up.amax_history_input.is_meta
    return model


@pytest.mark.parametrize("init", ["reset_parameters", "init_weights"])
def test_meta_init_gives_a_first_step_state(uninitialised_is_nan, init):
    reference = delayed_block()
    model = _meta_block()
    model.to_empty(device="cpu")
    # Materialised histories are zeros at once: the layer's own init, whatever the model's init does.
    assert all(torch.equal(h, torch.zeros(HIST_LEN)) for h in histories(model).values()), histories(model)
    if init == "reset_parameters":
        model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    # torchtitan's pattern: the model's own init_weights sets weights directly, never reset_parameters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reference.get_parameter(name))
    assert_bitwise_equal(train_steps(model), train_steps(reference))


def test_reset_parameters_zeroes_the_histories():
    model = delayed_block()
    _first_step(model)
    assert all(h.any() for h in histories(model).values())
    model.up.reset_parameters()
    assert not any(getattr(model.up, n).any() for n in HISTORIES)
    assert model.down.amax_history_input.any(), "only the reset layer"


# ---------------------------------------------------------------------------------------------
# state_dict: persistent histories, nn.Linear checkpoints still load
# ---------------------------------------------------------------------------------------------
def _save_load(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("kind", ["mlp", "encoder"])
def test_histories_are_saved_and_restored(kind):
    model = delayed_block(kind=kind)
    train_steps(model, steps=2)
    state = _save_load(model.state_dict())
    assert {k for k in state if "amax_history" in k} == set(histories(model))
    if kind == "mlp":
        assert set(histories(model)) == {f"{m}.{h}" for m in ("up", "down") for h in HISTORIES}
    resumed = delayed_block(kind=kind)
    resumed.load_state_dict(state)
    assert_bitwise_equal(histories(resumed), histories(model))
    # A resumed run continues exactly as the uninterrupted one.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 32, generator=g) * 0.1
    for m in (model, resumed):
        m(x).square().mean().backward()
    assert_bitwise_equal({n: p.grad for n, p in resumed.named_parameters()}, {n: p.grad for n, p in model.named_parameters()})
    assert_bitwise_equal(histories(resumed), histories(model))


@pytest.mark.parametrize("kind", ["mlp", "encoder"])
def test_an_unconverted_checkpoint_loads_strictly_with_zero_histories(kind):
    torch.manual_seed(0)
    plain = Block(kind=kind)
    state = _save_load(plain.state_dict())
    model = delayed_block(kind=kind)
    _first_step(model)  # histories non-zero: loading must reset them to the start value
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert len(histories(model)) == (6 if kind == "mlp" else 21)  # encoder: 4 linears, 3 self-attention in-projection
    assert all(torch.equal(h, torch.zeros(HIST_LEN)) for h in histories(model).values())
    assert_bitwise_equal({k: v for k, v in model.state_dict().items() if "amax_history" not in k}, plain.state_dict())
    # The same first step as a freshly converted copy of the plain model.
    fresh = copy.deepcopy(plain)
    tq.convert(fresh, tq.recipes.fp8_delayed(HIST_LEN))
    assert_bitwise_equal(train_steps(model, steps=2), train_steps(fresh, steps=2))


def test_a_checkpoint_missing_some_histories_reports_them():
    model = delayed_block()
    state = model.state_dict()
    del state["up.amax_history_grad"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"up.amax_history_grad\""):
        model.load_state_dict(state)


def test_a_history_of_another_length_is_a_clear_error():
    state = delayed_block(hist_len=8).state_dict()
    model = delayed_block(hist_len=4)
    with pytest.raises(
        RuntimeError,
        match=r"up.amax_history_input: the checkpoint holds an amax history of shape \(8,\); this layer's recipe 'fp8_delayed' keeps \(4,\)",
    ):
        model.load_state_dict(state)


@pytest.mark.parametrize("assign", [False, True])
def test_a_low_precision_history_in_a_checkpoint_loads_as_fp32(assign):
    model = delayed_block()
    _first_step(model)
    state = {k: (v.to(torch.bfloat16) if "amax_history" in k else v) for k, v in model.state_dict().items()}
    target = delayed_block()
    target.load_state_dict(state, assign=assign)
    assert len(histories(target)) == 6
    for k, v in histories(target).items():
        assert v.dtype == torch.float32 and torch.equal(v, state[k].float()), k
