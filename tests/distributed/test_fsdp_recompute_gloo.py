"""Activation checkpointing x FSDP2 quantized all-gather, two CPU processes over gloo, one spawn.

For weight quantizers whose usages are not transposes (mxfp8, fp8_rowwise) and a unit FSDP2
reshards after forward, the backward re-gather brings only dgrad's columnwise usage, unless the
forward is known to be recomputed in backward (tqcompile.distributed.recompute); fp8_tensorwise
(transposable: one usage serves both passes) is the control. The model: two residual MLP blocks,
one with ReLU (which turned a NaN-poisoned recompute into silent zero gradients) and one with GELU.

Checks, per recipe, each against the one-process run and the FSDP2 run without checkpointing,
losses and every gradient over 3 AdamW steps, bit for bit:
(a) checkpoint_wrapper, and composable checkpoint, inside the FSDP2 unit;
(b) torch.utils.checkpoint.checkpoint inside the forward with tq.distributed.recompute_in_backward;
    without it: our ValueError (eager, and a compiled MLP called again by that checkpoint);
(c) a checkpoint_wrapper around FSDP2 units (outside them);
(d) blocks compiled (aot_eager, fullgraph) in the torchtitan order checkpoint_wrapper -> compile ->
    fully_shard: equal, no graph break, no graph after the first step;
(e) the bytes FSDP2 all-gathers per step with checkpointing, against bf16 and without checkpointing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

import tqcompile as tq
from tqcompile.testing.comm import count_collective_bytes
from tqcompile.testing.compile import CompileCounter
from tqcompile.testing.distributed import run_checks, run_ranks

RECIPES = ("mxfp8", "fp8_rowwise", "fp8_tensorwise")
D, HIDDEN, STEPS = 64, 128, 3


class MLP(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, HIDDEN, bias=False), act, nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.mlp = MLP(act)
        # torch.utils.checkpoint.checkpoint inside forward (invisible to structure): None, "reentrant" or "non_reentrant".
        self.checkpoint_mlp: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_mlp is None:
            return x + self.mlp(x)
        return x + checkpoint(self.mlp, x, use_reentrant=self.checkpoint_mlp == "reentrant")


def _model(recipe: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(Block(nn.ReLU()), Block(nn.GELU()))
    return tq.convert(model, tq.recipes.get(recipe), fsdp_quantized_all_gather=True)


def _shard(model: nn.Sequential, **kwargs) -> nn.Sequential:
    for block in model:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _train(model: nn.Module, steps: int = STEPS, after_step=None, grads: bool = True) -> list:
    """(loss, [full gradients]) per AdamW step, the same batch on every rank; `after_step(step)` after
    each. grads=False: no gradient (gathering sharded gradients whole is a collective too)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, D, generator=g).requires_grad_(), torch.randn(32, D, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, foreach=False)
    out = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        full = (
            [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in model.parameters()]
            if grads
            else []
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss.item(), full))
        if after_step is not None:
            after_step(len(out))
    return out


def _assert_equal(got: list, expected: list, what: str) -> None:
    for step, ((loss, grads), (loss_e, grads_e)) in enumerate(zip(got, expected, strict=True)):
        assert loss == loss_e, (what, step, loss, loss_e)
        for i, (g, e) in enumerate(zip(grads, grads_e, strict=True)):
            assert torch.equal(g, e), (what, step, i, (g - e).abs().max().item())


def _check_parity(rank: int, results: dict) -> None:
    for recipe in RECIPES:
        single = _train(_model(recipe))  # one process: nothing sharded
        _assert_equal(_train(_shard(_model(recipe))), single, f"{recipe} FSDP2 without checkpointing")

        # (a) inside the FSDP2 unit: the wrapper, and the composable API on a submodule.
        model = _model(recipe)
        for i, block in enumerate(model):
            model[i] = checkpoint_wrapper(block)
        _assert_equal(_train(_shard(model)), single, f"{recipe} checkpoint_wrapper inside the unit")
        model = _model(recipe)
        for block in model:
            composable_checkpoint(block.mlp)
        _assert_equal(_train(_shard(model)), single, f"{recipe} composable checkpoint inside the unit")

        # (b) function-level checkpoint inside the forward (reentrant in one block, not in the other):
        # the switch makes it right ...
        model = _model(recipe)
        model[0].checkpoint_mlp, model[1].checkpoint_mlp = "reentrant", "non_reentrant"
        assert tq.distributed.recompute_in_backward(model) == 4
        _assert_equal(_train(_shard(model)), single, f"{recipe} torch.utils.checkpoint with recompute_in_backward")
        # ... and without it the recomputed forward raises (transposable recipes need nothing).
        model = _model(recipe)
        model[0].checkpoint_mlp, model[1].checkpoint_mlp = "reentrant", "non_reentrant"
        if recipe == "fp8_tensorwise":
            _assert_equal(_train(_shard(model)), single, f"{recipe} torch.utils.checkpoint")
        else:
            with pytest.raises(ValueError, match=r"layer '1.mlp.fc1': its forward ran during backward .*recompute_in_backward"):
                _train(_shard(model), steps=1)
            # Declared too late (FSDP2 fixed the buffer sizes at the first gather): a clear error, not a no-op.
            with pytest.raises(ValueError, match=r"layer '0.mlp.fc1' was already all-gathered by FSDP2"):
                tq.distributed.recompute_in_backward(model)

        # (c) outside the FSDP2 units: each linear layer its own unit, the checkpoint around the block.
        model = _model(recipe)
        for i, block in enumerate(model):
            fully_shard(block.mlp.fc1)
            fully_shard(block.mlp.fc2)
            model[i] = checkpoint_wrapper(block)
        _assert_equal(_train(fully_shard(model)), single, f"{recipe} checkpoint_wrapper outside the units")
        results[f"parity_{recipe}"] = single[-1][0]


def _check_compile(rank: int, results: dict) -> None:
    for recipe in RECIPES[:2]:
        single = _train(_model(recipe))
        torch.compiler.reset()
        counter = CompileCounter("aot_eager")
        model = _model(recipe)
        # The torchtitan order: checkpoint_wrapper, compile the block, then shard it.
        for i, block in enumerate(model):
            model[i] = torch.compile(checkpoint_wrapper(block), backend=counter, fullgraph=True)
        graphs: list[int] = []
        got = _train(_shard(model), after_step=lambda step, graphs=graphs, counter=counter: graphs.append(counter.frame_count))
        _assert_equal(got, single, f"{recipe} compiled")
        assert counter.graph_breaks == 0, counter.break_reasons
        # One graph per block (the ReLU and GELU blocks share the wrapper's code: two graphs), none after step 1.
        assert graphs == [2] * STEPS, graphs
        results[f"graphs_{recipe}"] = (counter.frame_count, counter.graph_breaks)

    # A compiled MLP called again by a function-level checkpoint in an eager forward, not declared:
    # Dynamo guards on the gathered weight's record of the unfilled usage, recompiles and raises ours.
    torch.compiler.reset()
    model = _model("mxfp8")
    for block in model:
        block.checkpoint_mlp = "non_reentrant"
        block.mlp = torch.compile(block.mlp, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"layer '1.mlp.fc1': its forward ran during backward .*recompute_in_backward"):
        _train(_shard(model), steps=1)


def _check_bytes(rank: int, results: dict) -> None:
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    per_step = {}
    for recipe in ("mxfp8", "fp8_rowwise"):
        for name, quantized, wrap in (("bf16", False, False), ("no_ckpt", True, False), ("ckpt", True, True)):
            torch.manual_seed(0)
            model = nn.Sequential(Block(nn.ReLU()), Block(nn.GELU()))
            tq.convert(model, tq.recipes.get(recipe), fsdp_quantized_all_gather=quantized)
            if wrap:
                for i, block in enumerate(model):
                    model[i] = checkpoint_wrapper(block)
            for block in model:
                fully_shard(block, mp_policy=bf16)  # the root holds no parameter: only the blocks gather
            fully_shard(model, mp_policy=bf16)
            _train(model, steps=1)  # the first step sets FSDP2's buffers up; count the second
            with count_collective_bytes() as wire:
                _train(model, steps=1, grads=False)
            per_step[recipe, name] = wire.bytes["all_gather"]
        # Both usages in the backward gather, and the forward's buffer as long: about bf16's bytes.
        assert per_step[recipe, "no_ckpt"] < 0.55 * per_step[recipe, "bf16"], per_step
        assert per_step[recipe, "ckpt"] < 1.05 * per_step[recipe, "bf16"], per_step
    results["bytes"] = per_step


def _checks(rank: int, out_dir: str) -> None:
    results: dict = {}
    checks = [
        (check.__name__.removeprefix("_check_"), lambda c=check: c(rank, results))
        for check in (_check_parity, _check_compile, _check_bytes)
    ]
    results["seconds"] = {name: round(s, 1) for name, s in run_checks(rank, checks)["timings"].items()}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def test_activation_checkpointing_with_quantized_all_gather(tmp_path):
    ranks = run_ranks(_checks, 2, tmp_path, deadline_s=500)
    assert ranks[0]["bytes"] == ranks[1]["bytes"]
    for recipe in RECIPES:
        assert ranks[0][f"parity_{recipe}"] == ranks[1][f"parity_{recipe}"]
    print("seconds (rank 0):", ranks[0]["seconds"], "all-gather bytes per step:", ranks[0]["bytes"])
