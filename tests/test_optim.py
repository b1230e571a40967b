"""`tq.optim.compile_optimizer_step`: the compiled step behaves like `optimizer.step()` for what
sits around the update (LR schedulers, step hooks), not only for the update itself."""

from __future__ import annotations

import warnings

import pytest
import torch

import tqcompile as tq
from tqcompile.testing import CompileCounter


def _model_and_grads(seed: int = 0) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    grads = [torch.randn(5, *p.shape) for p in model.parameters()]  # one gradient per step
    return model, grads


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.5 ** max(0, step - 2)


def _train(compiled: bool, steps: int = 5) -> tuple[list[float], list[torch.Tensor], list[str]]:
    model, grads = _model_and_grads()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.1))
    step = tq.optim.compile_optimizer_step(opt, backend="eager", fullgraph=True) if compiled else opt.step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            for p, g in zip(model.parameters(), grads):
                p.grad = g[i].clone()
            lrs.append(float(opt.param_groups[0]["lr"]))
            step()
            sched.step()
    return lrs, [p.detach().clone() for p in model.parameters()], [str(w.message) for w in caught]


def test_scheduler_after_compiled_step_does_not_warn_and_follows_the_schedule() -> None:
    lrs, params, messages = _train(compiled=True)
    assert not [m for m in messages if "lr_scheduler.step()" in m], messages
    # The schedule's own values, step by step: none skipped, none repeated.
    assert lrs == pytest.approx([0.1 * _warmup(s) for s in range(5)], rel=1e-6)
    ref_lrs, ref_params, _ = _train(compiled=False)
    assert lrs == pytest.approx(ref_lrs, rel=1e-6)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r)


def test_compiled_step_runs_the_step_hooks() -> None:
    model, grads = _model_and_grads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre") if o is opt else None)
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post") if o is opt else None)
    step = tq.optim.compile_optimizer_step(opt, backend="eager", fullgraph=True)
    for p, g in zip(model.parameters(), grads):
        p.grad = g[0].clone()
    step()
    step()
    assert calls == ["pre", "post", "pre", "post"]


def test_a_pre_hook_that_returns_arguments_is_refused() -> None:
    model, _ = _model_and_grads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda o, args, kwargs: (args, kwargs))
    step = tq.optim.compile_optimizer_step(opt, backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match="allowed: pre-hooks that return None"):
        step()


def test_differentiable_optimizer_is_refused() -> None:
    model, _ = _model_and_grads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True)
    with pytest.raises(ValueError, match="differentiable=True"):
        tq.optim.compile_optimizer_step(opt)


def test_each_optimizer_gets_its_own_compiled_step() -> None:
    # Every compiled step used to share one code object, hence one Dynamo cache: each new optimizer
    # in the process was a recompile of it, and the one past the recompile limit failed under
    # fullgraph=True (FailOnRecompileLimitHit; a sweep in one process reaches 9 optimizers quickly).
    counter = CompileCounter("eager")
    with torch._dynamo.config.patch(recompile_limit=2):
        for seed in range(4):
            model, grads = _model_and_grads(seed)
            opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
            step = tq.optim.compile_optimizer_step(opt, backend=counter, fullgraph=True)
            for p, g in zip(model.parameters(), grads):
                p.grad = g[0].clone()
            before = [p.detach().clone() for p in model.parameters()]
            step()
            for p, b, g in zip(model.parameters(), before, grads):
                torch.testing.assert_close(p.detach(), b - 0.1 * g[0])
    assert counter.frame_count == 4 and counter.recompiles == 0, counter
