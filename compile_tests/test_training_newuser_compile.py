"""Compiled training of models the other tests never saw, as a new user would write them.

- `test_compiled_training_equals_eager`: a ViT-style encoder (`nn.TransformerEncoder`, sequence
  first, i.e. `batch_first=False`) with a patch projection whose input needs no grad, and an MLP
  block under activation checkpointing; `torch.compile(fullgraph=True, backend="aot_eager")`: zero
  graph breaks, one graph and no recompile over the steps, and the same losses and weights as
  eager bit for bit. Before the fix, nvfp4 diverged from step 2: the first layer's backward
  quantized dy for a dgrad it does not run, stochastically rounded, so eager drew one more seed
  from torch's generator than the compiled backward (which drops the dead op), and every later
  layer's gradient was rounded with another seed.
- `test_grouped_linear_errors_under_fullgraph` (and `..._attention_...` for a converted
  `nn.MultiheadAttention`): a bad call of `tq.nn.GroupedLinear` (wrong m_splits
  length or dtype, wrong feature count, a 3-D input with m_splits) raised Dynamo's "Observed
  exception" / "Failed to convert args/kwargs to proxy" under fullgraph; now our message.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal

D = 128


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(D, D)
        layer = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=False, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h)))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # (batch, patches, D)
        h = self.encoder(self.patch(patches).transpose(0, 1)).transpose(0, 1)
        return h + checkpoint.checkpoint(self._mlp, h, use_reentrant=False)


def _train(model: nn.Module, forward, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(2, 64, D, generator=g), torch.randn(2, 64, D, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)  # nvfp4's stochastic rounding draws its seeds from torch's generator
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(forward(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


# nvfp4 only: the stochastic rounding made the difference; fp8_delayed compiled == eager is in
# test_delayed_scaling_compile.py.
@pytest.mark.parametrize("name", ["nvfp4"])
def test_compiled_training_equals_eager(name):
    torch.manual_seed(0)
    eager = tq.convert(ViT(), tq.recipes.get(name))
    torch.manual_seed(0)
    compiled_model = tq.convert(ViT(), tq.recipes.get(name))
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(compiled_model, fullgraph=True, backend=counter)

    expected = _train(eager, eager)
    actual = _train(compiled_model, compiled)
    assert counter.graph_breaks == 0 and counter.frame_count == 1 and counter.recompiles == 0, counter
    assert_bitwise_equal(actual, expected)
    assert_bitwise_equal(compiled_model.state_dict(), eager.state_dict())
    assert expected[-1] < expected[0]


def test_grouped_linear_errors_under_fullgraph():
    experts = tq.nn.GroupedLinear(4, D, D, recipe=tq.recipes.mxfp8())
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    x = torch.randn(10, D)
    assert compiled(x, torch.tensor([2, 3, 4, 1])).shape == (10, D)
    cases = [
        (x, torch.tensor([5, 5]), ValueError, r"m_splits tensor has shape \(2,\); expected \(4,\), one count per expert"),
        (x, torch.tensor([2.0, 3.0, 4.0, 1.0]), TypeError, "m_splits tensor has dtype torch.float32; allowed: torch.int64"),
        (torch.randn(10, 64), torch.tensor([2, 3, 4, 1]), ValueError, r"expected x of shape \(tokens, 128\), got \(10, 64\)"),
        (torch.randn(2, 5, D), torch.tensor([2, 3, 4, 1]), ValueError, r"expected x of shape \(tokens, 128\), got \(2, 5, 128\)"),
        (torch.randn(3, 5, D), None, ValueError, r"expected x of shape \(4, tokens, 128\) or m_splits, got \(3, 5, 128\)"),
        (x, [5, 5], ValueError, r"m_splits=\[5, 5\] must have 4 entries summing to x.shape\[0\]=10"),
    ]
    for bad_x, m_splits, error, message in cases:
        with pytest.raises(error, match=message):
            compiled(bad_x) if m_splits is None else compiled(bad_x, m_splits)
    # Good calls still run after the bad ones.
    assert compiled(torch.randn(12, D), torch.tensor([2, 3, 4, 3])).shape == (12, D)


def test_converted_attention_errors_under_fullgraph():
    """A converted nn.MultiheadAttention's own checks raised while Dynamo traced: "Observed exception"."""
    mha = tq.convert(nn.MultiheadAttention(D, 4, batch_first=True), tq.recipes.mxfp8())
    compiled = torch.compile(mha, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 16, D)
    small = torch.randn(2, 16, 64)
    with pytest.raises(ValueError, match=r"query \(2, 16, 64\), key \(2, 16, 64\) and value \(2, 16, 64\)"):
        compiled(small, small, small)
    with pytest.raises(ValueError, match=r"key_padding_mask of shape \(2, 7\); expected \(2, 16\)"):
        compiled(x, x, x, key_padding_mask=torch.zeros(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 3\); allowed: \(16, 16\)"):
        compiled(x, x, x, attn_mask=torch.zeros(3, 3, dtype=torch.bool))
    assert compiled(x, x, x)[0].shape == (2, 16, D)
