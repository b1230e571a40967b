"""Delayed scaling (`fp8_delayed`) compiled with `fullgraph=True`: activation checkpointing inside
the compiled graph, and train/eval switches (the eager rules are in tests/test_delayed_scaling.py).

Measured (torch 2.13, aot_eager): a checkpointed block compiles into one graph with zero breaks;
before the histories rolled in backward, AOTAutograd's recompute read the already-rolled history
and the weight gradients differed from the uncheckpointed run from step 2. Switching a compiled
model between train() and eval(): the usual validation pass (eval under no_grad) costs the one
recompile that leaving grad mode costs any model (a plain nn.Linear model too); eval() with
gradients compiles one more graph, since Dynamo guards on `module.training` for delayed-scaling
layers; after that, switching back and forth recompiles nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

import tqcompile as tq
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal

SCALES = (4.0, 1.0, 0.25, 2.0)  # input scale per step: the window max changes as step 0's amax ages out


class Block(nn.Module):
    def __init__(self, checkpointing: str | None = None) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.checkpointing = checkpointing

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing is None:
            return self._inner(x)
        return checkpoint.checkpoint(self._inner, x, use_reentrant=self.checkpointing == "reentrant")


def _block(checkpointing: str | None = None) -> Block:
    torch.manual_seed(0)
    block = Block(checkpointing)
    tq.convert(block, tq.recipes.fp8_delayed(2))
    return block


def _histories(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers() if "amax_history" in k}


def _train(model: nn.Module, run) -> list:
    g = torch.Generator().manual_seed(1)
    record = []
    for scale in SCALES:
        x = (torch.randn(16, 32, generator=g) * scale).requires_grad_()
        loss = run(x).square().mean()
        loss.backward()
        record.append((loss.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}, _histories(model)))
        model.zero_grad()
    return record


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_checkpointed_compiled_block_equals_the_uncheckpointed_one(mode):
    eager = _block()
    expected = _train(eager, eager)
    plain = _block()
    assert_bitwise_equal(_train(plain, torch.compile(plain, backend="aot_eager", fullgraph=True)), expected, "compiled")
    torch.compiler.reset()  # the same forward code, compiled afresh: counts below are this block's alone
    checkpointed = _block(mode)
    counter = CompileCounter("aot_eager")
    actual = _train(checkpointed, torch.compile(checkpointed, backend=counter, fullgraph=True))
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert_bitwise_equal(a, e, f"compiled, {mode} checkpointing, step {step}")
    assert (counter.frame_count, counter.recompiles, counter.graph_breaks) == (1, 0, 0), (counter, counter.break_reasons)


def test_train_eval_switches():
    model = _block()
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(2)
    counts = []
    for _ in range(2):
        model.train()
        compiled(torch.randn(16, 32, generator=g) * 3).square().mean().backward()
        before = _histories(model)
        model.eval()
        x = torch.randn(16, 32, generator=g) * 50  # a validation batch far outside the training range
        with torch.no_grad():
            y = compiled(x)
            assert_bitwise_equal(_histories(model), before, "a validation pass leaves the histories")
            assert_bitwise_equal(y, model(x), "compiled eval equals eager eval")
        counts.append(counter.frame_count)
        # eval() with gradients: scales from the histories, and its backward rolls nothing either.
        compiled(torch.randn(16, 32, generator=g, requires_grad=True)).sum().backward()
        assert_bitwise_equal(_histories(model), before, "eval with backward leaves the histories")
        counts.append(counter.frame_count)
    # train, then eval under no_grad: 2 graphs; eval with grad: 3; the second round: none new.
    assert counts == [2, 3, 3, 3], counts
    assert counter.graph_breaks == 0, counter.break_reasons
