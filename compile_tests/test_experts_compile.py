"""MoE experts converted by `tq.convert` (tqcompile/nn/experts.py), compiled with fullgraph=True:
one graph, 0 graph breaks, 0 recompiles across routings (empty experts included), compiled ==
eager bit for bit (forward and all gradients); token counts recompile as for float layers.
The compiled side of tests/test_experts.py, on the MoE block of each model family."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from moe_models import HF_MOE_KINDS, TitanMoEModel, tiny_hf_moe

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal

MODELS = (*HF_MOE_KINDS, "torchtitan")
DIM = 64


def moe_block(kind: str, recipe: str) -> torch.nn.Module:
    """The first MoE block (router + experts) of a tiny model of `kind`, converted with `recipe`."""
    block = TitanMoEModel(dim=DIM).blocks[0] if kind == "torchtitan" else tiny_hf_moe(kind, hidden=DIM).model.layers[0].mlp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tq.nn.ConversionWarning)  # the router stays float, and says so
        return tq.convert(block.train(), tq.recipes.get(recipe))


def router_of(block: torch.nn.Module) -> torch.nn.Module:
    return next(m for n, m in block.named_children() if n in ("gate", "router"))


def only_experts_1_and_2(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Set the router so experts 0 and 3 receive no token for inputs like the returned one."""
    v = torch.nn.functional.normalize(torch.ones(DIM), dim=0)
    router = router_of(block)
    with torch.no_grad():
        router.weight.copy_(torch.stack([-10 * v, 10 * v, 9 * v, -10 * v]))
        if getattr(router, "bias", None) is not None:
            router.bias.zero_()
    return x + v * (x @ v).abs().unsqueeze(-1) + v  # every token has x . v > 0


def step(block: torch.nn.Module, x: torch.Tensor):
    torch.manual_seed(0)
    xr = x.clone().requires_grad_()
    y = block(xr)
    y = y[0] if isinstance(y, tuple) else y
    y.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in block.parameters() if p.grad is not None]
    block.zero_grad()
    return (y.detach(), xr.grad, *grads)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_rowwise"])
@pytest.mark.parametrize("kind", MODELS)
def test_one_graph_for_every_routing_equal_to_eager(kind, recipe):
    torch.compiler.reset()
    eager = moe_block(kind, recipe)
    counter = CompileCounter("aot_eager")
    compiled_block = copy.deepcopy(eager)
    compiled = torch.compile(compiled_block, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    shape = (2, 32, DIM)
    for i in range(3):
        x = torch.randn(*shape, generator=g)
        if i == 2:  # a routing that leaves experts 0 and 3 without tokens
            x = only_experts_1_and_2(eager, x)
            only_experts_1_and_2(compiled_block, x)
        assert_bitwise_equal(step(compiled, x), step(eager, x), path=f"input {i}")
    assert counter.frame_count == 1 and counter.graph_breaks == 0 and counter.recompiles == 0, counter
    torch.compiler.reset()


def _frames(block: torch.nn.Module, token_counts) -> int:
    torch.compiler.reset()
    counter = CompileCounter("aot_eager")
    f = torch.compile(block, backend=counter, fullgraph=True)
    for t in token_counts:
        step(f, torch.randn(1, t, DIM))
    assert counter.graph_breaks == 0
    torch.compiler.reset()
    return counter.frame_count


@pytest.mark.parametrize("kind", ["mixtral", "torchtitan"])
def test_token_counts_recompile_as_dense_layers_do(kind):
    """Graphs for T = 64, 96, 128, 160 tokens: the converted MoE block needs no more than a float
    dense MLP (nn.Linear: a static graph, then one dynamic one). (A float torchtitan block cannot
    be the reference: torch 2.13's `_grouped_mm` refuses fp32 under compile.)"""
    counts = (64, 96, 128, 160)
    dense = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.SiLU(), torch.nn.Linear(2 * DIM, DIM))
    assert _frames(moe_block(kind, "mxfp8"), counts) <= _frames(dense, counts) == 2


def test_delayed_scaling_histories_roll_alike_compiled_and_eager():
    torch.compiler.reset()
    eager = moe_block("torchtitan", "fp8_delayed")
    compiled_block = copy.deepcopy(eager)
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(compiled_block, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(5)
    for i in range(3):
        x = torch.randn(2, 32, DIM, generator=g)
        assert_bitwise_equal(step(compiled, x), step(eager, x), path=f"step {i}")
    assert_bitwise_equal(dict(compiled_block.named_buffers()), dict(eager.named_buffers()), path="histories")
    assert counter.frame_count == 1 and counter.graph_breaks == 0 and counter.recompiles == 0, counter
    torch.compiler.reset()


class _BincountMoE(torch.nn.Module):
    """A torchtitan-style MoE block that counts tokens per expert with `torch.bincount(...,
    minlength=E)`, as much MoE code does: the counts' length is data dependent (an unbacked size
    under compile), which the experts must accept as the float model does."""

    def __init__(self, num_experts: int = 4):
        super().__init__()
        block = TitanMoEModel(dim=DIM, num_experts=num_experts).blocks[0]
        self.router, self.experts, self.num_experts = block.router, block.experts, num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_w, top_i = self.router(x).softmax(-1).topk(2, dim=-1)
        flat = top_i.reshape(-1)
        perm = torch.sort(flat, stable=True)[1]
        counts = torch.bincount(flat, minlength=self.num_experts)
        out = self.experts(x[perm // 2], counts) * top_w.reshape(-1)[perm].unsqueeze(-1).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, perm // 2, out.to(x.dtype))


def test_bincount_counts_compile_after_convert():
    """The float block compiles with fullgraph=True (in bf16: torch's `_grouped_mm` refuses fp32
    under compile on CPU), and so must the converted one: one graph for every routing, equal to
    eager bit for bit."""
    block = _BincountMoE().to(torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, DIM, generator=g).bfloat16()
    float_counter = CompileCounter("aot_eager")
    torch.compile(block, backend=float_counter, fullgraph=True)(x)
    assert float_counter.frame_count == 1 and float_counter.graph_breaks == 0, float_counter
    torch.compiler.reset()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tq.nn.ConversionWarning)  # the router stays float, and says so
        eager = tq.convert(block.train(), tq.recipes.mxfp8())
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(copy.deepcopy(eager), backend=counter, fullgraph=True)
    for i in range(3):
        x = torch.randn(64, DIM, generator=g).bfloat16()
        assert_bitwise_equal(step(compiled, x), step(eager, x), path=f"input {i}")
    assert counter.frame_count == 1 and counter.graph_breaks == 0 and counter.recompiles == 0, counter
