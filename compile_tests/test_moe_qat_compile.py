"""QAT of fused MoE experts compiles: fullgraph, 0 graph breaks, one graph for every routing
(empty experts included), and equal to eager bit for bit (the compiled side of tests/test_moe_ptq.py).
Also `tq.nn.GroupedLinear` fake-quantized with a tensor of counts, which used to split by Python ints."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tqcompile as tq
from tqcompile.calibration import CalibrationWarning
from tqcompile.testing import CompileCounter, assert_bitwise_equal

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from moe_models import TitanMoEModel, tiny_hf_moe  # noqa: E402

pytest.importorskip("transformers")


def _build(kind: str) -> torch.nn.Module:
    return TitanMoEModel(seed=0) if kind == "titan" else tiny_hf_moe(kind, use_cache=False)


def _inputs(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "titan":
        return torch.randn(2, 8, 64, generator=g)
    return torch.randint(0, 128, (2, 8), generator=g)


def _loss(kind: str, model, x) -> torch.Tensor:
    out = model(x)
    return out.pow(2).mean() if kind == "titan" else F.cross_entropy(out.logits.flatten(0, 1), x.flatten())


def _route_away_from_expert_3(kind: str, model, starve: torch.Tensor, seen: list | None):
    """A hook on the first MoE layer that keeps expert 3 without tokens while `starve` (a 0-dim
    bool tensor: changing it is data, not a recompile) is True, and appends each forward's
    per-expert token counts to `seen` (eager only: a compiled hook appending to a list guards on
    its length)."""

    def count(ids):
        if seen is not None:
            seen.append(torch.zeros(4, dtype=torch.int64).index_add_(0, ids.flatten(), torch.ones_like(ids.flatten())))

    if kind == "titan":

        def hook(mod, args, out):
            out = torch.where(starve, out.index_fill(-1, torch.tensor([3]), -1e4), out)
            count(out.topk(2, dim=-1).indices)
            return out

        return model.blocks[0].router.register_forward_hook(hook)
    experts = next(e for n, e in model.named_modules() if n.endswith("layers.0.mlp.experts"))

    def pre_hook(mod, args):
        ids = torch.where(starve, args[1].clamp(max=2), args[1])
        count(ids)
        return (args[0], ids, args[2])

    return experts.register_forward_pre_hook(pre_hook)


# GPT-OSS covers what the HF families add to the shared routing: transposed weights, biases, its own gate.
@pytest.mark.parametrize("kind,config", [("titan", "fp8"), ("gpt_oss", "nvfp4")])
def test_compiled_qat_of_fused_experts_is_one_graph_for_every_routing_and_equals_eager(kind, config):
    model = _build(kind)
    cal = [_inputs(kind, s) for s in (1, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)  # GPT-OSS leaves an expert unrouted (tests/test_moe_ptq.py)
        tq.calibrate(model, getattr(tq.configs, config)(), lambda m: [m(x) for x in cal], progress=False)
    eager = _build(kind)
    tq.restore(eager, tq.quant_state(model))
    eager.load_state_dict(model.state_dict())
    model.train()
    eager.train()
    starve = torch.tensor(False)
    seen: list[torch.Tensor] = []
    hooks = [_route_away_from_expert_3(kind, model, starve, None), _route_away_from_expert_3(kind, eager, starve, seen)]

    torch.compiler.reset()
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    expert_grads = []
    for step in range(3):
        starve.fill_(step == 2)  # the third step routes no token to expert 3 of the first MoE layer
        x = _inputs(kind, 10 + step)
        loss_c = _loss(kind, compiled, x)
        loss_e = _loss(kind, eager, x)
        loss_c.backward()
        loss_e.backward()
        assert_bitwise_equal(loss_c.detach(), loss_e.detach())
        for (name, p), pe in zip(model.named_parameters(), eager.parameters()):
            assert_bitwise_equal(p.grad, pe.grad, name)
        expert_grads += [float(p.grad.abs().sum()) for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "w1"))]
        with torch.no_grad():
            for p, pe in zip(model.parameters(), eager.parameters()):
                if p.grad is not None:
                    p -= 0.01 * p.grad
                    pe -= 0.01 * pe.grad
                p.grad = pe.grad = None
    for h in hooks:
        h.remove()
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0), counter.break_reasons
    # The routings differed from step to step, the last one left expert 3 empty, and the experts
    # trained: their gradients came through the fake quantizers.
    assert not torch.equal(seen[0], seen[1]) and int(seen[2][3]) == 0 and int(seen[0][3]) > 0
    assert all(g > 0 for g in expert_grads)


def test_fake_quant_grouped_linear_with_count_tensors_compiles_without_recompiles():
    torch.manual_seed(0)
    layer = tq.nn.GroupedLinear(4, 32, 48, recipe=tq.recipes.fp8_tensorwise())
    x = torch.randn(24, 32)
    tq.calibrate(layer, tq.configs.fp8(), lambda m: m(x, torch.tensor([6, 6, 6, 6])), progress=False)
    torch.compiler.reset()
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for counts in ([6, 6, 6, 6], [20, 0, 3, 1], [0, 0, 24, 0]):
        m_splits = torch.tensor(counts)
        xi = x.clone().requires_grad_()
        xe = x.clone().requires_grad_()
        yc, ye = compiled(xi, m_splits), layer(xe, m_splits)
        assert_bitwise_equal(yc, ye)
        yc.sum().backward()
        ye.sum().backward()
        assert_bitwise_equal(xi.grad, xe.grad)
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0), counter.break_reasons


def test_fake_quant_grouped_linear_with_bincount_counts_compiles():
    """Counts from `torch.bincount(ids, minlength=E)` (a data-dependent length under compile) serve
    the fake-quantized layer as they serve the float one: one graph, equal to eager."""
    torch.manual_seed(0)
    layer = tq.nn.GroupedLinear(4, 32, 48, recipe=tq.recipes.fp8_tensorwise())
    x = torch.randn(24, 32)
    tq.calibrate(layer, tq.configs.fp8(), lambda m: m(x, torch.tensor([6, 6, 6, 6])), progress=False)
    torch.compiler.reset()

    def forward(x, ids):
        return layer(x, torch.bincount(ids, minlength=4))

    counter = CompileCounter("aot_eager")
    compiled = torch.compile(forward, backend=counter, fullgraph=True)
    for counts in ([6, 6, 6, 6], [20, 0, 3, 1]):
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
        assert_bitwise_equal(compiled(x, ids), forward(x, ids))
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0), counter.break_reasons
