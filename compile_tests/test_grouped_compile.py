"""`tq.nn.GroupedLinear` with tensor `m_splits` under `torch.compile(fullgraph=True)`.

A token-choice MoE trained for 8 steps: each step routes the same number of tokens with a new
random top-1 choice (two steps leave an expert with no tokens), counts them per expert on the
device (an int64 tensor, never a Python list) and passes the counts as `m_splits`. Zero graph
breaks, one graph, no recompile, and every step's loss and gradients equal the same step run
eagerly, bit for bit (aot_eager). A changing token count recompiles once. (`amax_group` over two
gloo ranks, per-expert amaxes reduced over the group: tests/distributed/test_amax_group_gloo.py.)

Cost on a 2-core CPU: one aot_eager compile per recipe (forward and backward) of a 2-layer MoE.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter

E, D, H, T = 4, 64, 128, 96
STEPS = 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Small tensors: one thread is as fast on an idle 2-core machine, and far faster on a busy one
    # (as in test_training_compile.py).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class TokenChoiceMoE(nn.Module):
    """Top-1 token-choice MoE MLP: tokens sorted by expert, per-expert counts as a tensor."""

    def __init__(self, recipe: tq.Recipe) -> None:
        super().__init__()
        self.w_in = tq.nn.GroupedLinear(E, D, H, recipe=recipe)
        self.w_out = tq.nn.GroupedLinear(E, H, D, recipe=recipe)

    def forward(self, x: torch.Tensor, expert: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(expert, stable=True)
        counts = F.one_hot(expert, E).sum(0)  # (E,) int64, static shape (bincount's is data dependent)
        h = self.w_out(F.gelu(self.w_in(x[order], counts)), counts)
        out = torch.zeros_like(x).index_copy_(0, order, h)
        return out * gate.unsqueeze(-1)


def _routings() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    routings = [torch.randint(0, E, (T,), generator=g) for _ in range(STEPS)]
    routings[3] = torch.randint(0, E - 1, (T,), generator=g)  # the last expert gets no tokens
    routings[5] = torch.where(routings[5] == 1, 0, routings[5])  # expert 1 gets none
    return routings


def _step(model, opt, x, expert, gate, seed):
    torch.manual_seed(seed)  # nvfp4's stochastic rounding draws its seeds from torch's generator
    loss = model(x, expert, gate).pow(2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_token_choice_moe_compiles_once_for_every_routing(name):
    torch.manual_seed(0)
    eager = TokenChoiceMoE(tq.recipes.get(name))
    counter = CompileCounter("aot_eager")
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True)
    opt_c, opt_e = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (compiled_model, eager))
    g = torch.Generator().manual_seed(1)
    routings = _routings()
    assert (F.one_hot(routings[3], E).sum(0) == 0).any() and (F.one_hot(routings[5], E).sum(0) == 0).any()
    for i, expert in enumerate(routings):
        x, gate = torch.randn(T, D, generator=g), torch.rand(T, generator=g)
        c_loss, c_grads = _step(compiled, opt_c, x, expert, gate, seed=i)
        e_loss, e_grads = _step(eager, opt_e, x, expert, gate, seed=i)
        assert torch.equal(c_loss, e_loss), f"step {i}: compiled loss {c_loss} != eager {e_loss}"
        assert all(torch.equal(a, b) for a, b in zip(c_grads, e_grads)), f"step {i}: gradients differ"
        if i == 0:
            assert counter.frame_count == 1
    assert counter.graph_breaks == 0, counter.break_reasons
    assert counter.recompiles == 0 and counter.frame_count == 1, counter  # the brief allowed one; measured none
    print(f"{name}: {STEPS} routings, {counter}")


def test_changing_token_count_recompiles_once():
    """Token dropping or a last short batch changes T: Dynamo recompiles once with T symbolic
    (the padded wgrad length is a SymInt expression of T), then never again."""
    torch.manual_seed(0)
    layer = tq.nn.GroupedLinear(E, D, D, recipe=tq.recipes.mxfp8())
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for t in (40, 56, 72, 90):
        x, counts = torch.randn(t, D, requires_grad=True), torch.tensor([t - 30, 10, 0, 20])
        y = compiled(x, counts)
        y.sum().backward()
        assert torch.equal(y.detach(), layer(x.detach(), counts)), f"T={t}"
    assert counter.graph_breaks == 0 and counter.frame_count == 2 and counter.recompiles == 1, counter
