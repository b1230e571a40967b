"""`tq.nn.GroupedLinear` with tensor `m_splits` under `torch.compile(fullgraph=True)`.

A token-choice MoE trained for 8 steps: each step routes the same number of tokens with a new
random top-1 choice (two steps leave an expert with no tokens), counts them per expert on the
device (an int64 tensor, never a Python list) and passes the counts as `m_splits`. Zero graph
breaks, one graph, no recompile, and every step's loss and gradients equal the same step run
eagerly, bit for bit (aot_eager). A changing token count recompiles once. Then `amax_group` over two gloo ranks: per-expert amaxes reduced
over the group, compiled.

Cost on a 2-core CPU: one aot_eager compile per recipe (forward and backward) of a 2-layer MoE,
and one spawn of two ranks that each compile two forward-only layers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tqcompile as tq
from tqcompile.testing import run_ranks
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


# --- amax_group: per-expert amaxes all-reduced over the group, two gloo ranks ------------------
WORLD_SIZE = 2


def _rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    counts = torch.tensor([16, 0, 48, 32]) if rank == 0 else torch.tensor([32, 16, 0, 48])
    # Rank 1's tokens are larger, so every expert it serves has a larger amax there.
    return torch.randn(int(counts.sum()), D, generator=g) * (1.0 + 3.0 * rank), counts


def _rank_checks(rank: int, out_dir: str) -> None:
    from tqcompile.ops import grouped_gemm as gops

    group = dist.group.WORLD
    x, counts = _rank_data(rank)
    results = {}
    for name in ("fp8_tensorwise", "nvfp4"):
        torch.manual_seed(0)
        layer = tq.nn.GroupedLinear(E, D, H, recipe=tq.recipes.get(name), amax_group=group)
        counter = CompileCounter("aot_eager")
        compiled = torch.compile(layer, backend=counter, fullgraph=True)
        y = compiled(x, counts)
        assert counter.graph_breaks == 0 and counter.frame_count == 1, counter
        # The same GEMM with the amax reduced by hand: what the layer must have used.
        q = layer.recipe.fprop_input
        ends = counts.cumsum(0)
        local = gops.grouped_amax(x, q, ends, False)
        reduced = local.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        qx = gops.grouped_quantize(x, q, ends, reduced, None, False)
        w = layer.weight.detach().reshape(E * H, D)
        w_ends = torch.arange(1, E + 1) * H
        w_amax = gops.grouped_amax(w, layer.recipe.fprop_weight, w_ends, False)
        qw = gops.grouped_quantize(w, layer.recipe.fprop_weight, w_ends, w_amax, None, False)
        amax_or_none = reduced if name == "nvfp4" else None
        w_amax_or_none = w_amax if name == "nvfp4" else None
        expected = gops.grouped_gemm_tn(
            *qx, amax_or_none, q, *qw, w_amax_or_none, layer.recipe.fprop_weight, ends, False, x.dtype
        )
        assert torch.equal(y, expected), f"{name}: y differs from the GEMM with the group-reduced amax"
        results[name] = {"local": local, "reduced": reduced}
    torch.save(results, f"{out_dir}/rank{rank}.pt")




def test_amax_group_reduces_per_expert_amaxes(tmp_path):
    """With `amax_group`, each expert's activation amax is the max over the ranks of that expert's
    tokens (an (E,) MAX all-reduce, traced under fullgraph=True), and the layer's output is the
    grouped GEMM quantized with it, bit for bit."""
    ranks = run_ranks(_rank_checks, WORLD_SIZE, tmp_path)
    for name in ("fp8_tensorwise", "nvfp4"):
        local = [r[name]["local"] for r in ranks]
        want = torch.maximum(*local)
        for r in ranks:
            assert torch.equal(r[name]["reduced"], want)
        # Every expert with tokens on rank 0 gets a larger amax from rank 1 (experts 0 and 3).
        assert (want[[0, 3]] > local[0][[0, 3]]).all() and local[0][1] == 0 and want[1] > 0
