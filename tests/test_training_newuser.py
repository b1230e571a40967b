"""Training a model the other tests never saw, as a new user would, with every recipe (eager).

The model is a small GPT written the way people write one with torch's own modules: tied
embedding / LM-head weights, `nn.MultiheadAttention` with a causal mask and a key padding mask, and
a user subclass of `nn.Linear` whose forward computes through `super().forward`. For each recipe:
`tq.convert`, a few SGD steps whose loss goes down, an `eval()` + `no_grad` pass that changes no
parameter or buffer, `torch.save` of the model and of its state_dict (`weights_only=True`), and
meta-device initialisation. The compiled side is in `compile_tests/test_training_newuser_compile.py`.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tqcompile as tq

D, V, S, B = 128, 128, 64, 2  # 128 tokens a step: every recipe's blocks divide it


class ScaledLinear(nn.Linear):
    """A user's subclass that overrides forward and says it computes through super().forward."""

    tq_linear_semantics = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.ln = nn.LayerNorm(D)
        self.fc = ScaledLinear(D, 2 * D)
        self.proj = nn.Linear(2 * D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        causal = torch.triu(torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool), 1)
        h = h + self.attn(h, h, h, key_padding_mask=key_padding_mask, attn_mask=causal, need_weights=False)[0]
        h = h + self.proj(F.gelu(self.fc(self.ln(h))))
        return self.lm_head(h)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (B, S + 1), generator=g)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, S - 8 :] = True  # the second sequence is 8 tokens shorter
    return tokens[:, :-1], tokens[:, 1:], pad


def _loss(model: nn.Module, idx, target, pad) -> torch.Tensor:
    return F.cross_entropy(model(idx, pad).float().reshape(-1, V), target.reshape(-1))


@pytest.mark.parametrize("name", sorted(tq.recipes.RECIPES))
def test_new_user_trains_saves_and_validates(name):
    recipe = tq.recipes.get(name)
    torch.manual_seed(0)
    model = tq.convert(TinyGPT(), recipe)
    quantized = {n for n, m in model.named_modules() if isinstance(m, tq.nn.Linear)}
    # The tied head is converted too (its weight is the embedding's, read as the head's parameter).
    assert quantized == {"attn.out_proj", "fc", "proj", "lm_head"}
    assert isinstance(model.fc, ScaledLinear) and model.lm_head.weight is model.emb.weight
    idx, target, pad = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)
    losses = []
    for _ in range(3):
        loss = _loss(model, idx, target, pad)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses

    # Validation changes nothing: no parameter, no buffer (delayed-scaling histories included).
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        val = _loss(model, idx, target, pad)
    assert torch.isfinite(val)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k

    # The whole model pickles (the user subclass included); the state_dict loads with weights_only.
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = tq.convert(TinyGPT(), recipe)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.lm_head.weight is fresh.emb.weight  # loading keeps the tie
    with torch.no_grad():
        for other in (restored.eval(), fresh.eval()):
            torch.manual_seed(3)
            expected = model(idx, pad)
            torch.manual_seed(3)
            assert torch.equal(other(idx, pad), expected)


def test_meta_device_init_then_train():
    """Built on the meta device, converted, materialised with to_empty, initialised by the user:
    training then runs on initialised state only (histories zeros, no NaN/Inf anywhere)."""
    with torch.device("meta"):
        model = TinyGPT()
    tq.convert(model, tq.recipes.fp8_delayed())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        # nn.MultiheadAttention names its initialiser `_reset_parameters` (torch's choice).
        for init in ("reset_parameters", "_reset_parameters"):
            if hasattr(m, init):
                getattr(m, init)()
                break
    assert not model.attn.amax_history_in_proj_input.any() and not model.fc.amax_history_input.any()
    idx, target, pad = _batch()
    loss = _loss(model, idx, target, pad)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


class _CountRandom(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.draws = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.randint, torch.ops.aten.random_):
            self.draws += 1
        return func(*args, **(kwargs or {}))


def test_stochastic_rounding_draws_only_for_gemms_that_run():
    """A first layer's input needs no grad, so its backward runs no dgrad GEMM. Its dy used to be
    quantized for dgrad anyway (stochastically rounded for nvfp4: one draw from torch's generator),
    a draw a compiled backward drops as dead code: every later draw, hence every later gradient,
    then differed between eager and compiled training (the compiled check is in compile_tests)."""
    layer = tq.nn.Linear(64, 64, recipe=tq.recipes.nvfp4())
    y = layer(torch.randn(32, 64))  # no requires_grad on the input
    with _CountRandom() as counter:
        y.sum().backward()
    assert counter.draws == 1  # wgrad's dy only
    x = torch.randn(32, 64, requires_grad=True)
    y = layer(x)
    with _CountRandom() as counter:
        y.sum().backward()
    assert counter.draws == 2  # dgrad's dy and wgrad's dy


def test_convert_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match="tq.convert: model must be a torch.nn.Module, got Tensor"):
        tq.convert(torch.randn(3), tq.recipes.mxfp8())
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        tq.nn.conversion_plan(lambda x: x, tq.recipes.mxfp8())
