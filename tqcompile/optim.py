"""Compile a `torch.optim` optimizer's step with `fullgraph=True`.

`torch.optim.Optimizer.step` is wrapped (`_use_grad_for_differentiable`) in code that calls
`torch._dynamo.graph_break()` on purpose (pytorch/pytorch#104053: so AOTAutograd sees an
inference graph), so a stock optimizer step can never compile with `fullgraph=True`. Here the
undecorated step (`inspect.unwrap`) runs under `torch.no_grad()`, which is what that wrapper does
without the breaks. Checked on torch 2.13 (AdamW, SGD). Where the wrapper matters
(`differentiable=True`), this refuses.

Unwrapping also skips what `optimizer.step()` does around the update, so the returned step does
that itself, eagerly, outside the compiled graph: the optimizer's step pre- and post-hooks, the
profiler's `Optimizer.step#...` range, and the mark that an LR scheduler checks to know the
optimizer stepped before it (without it every scheduler warns "Detected call of
`lr_scheduler.step()` before `optimizer.step()`").
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

__all__ = ["compile_optimizer_step"]


def _mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    # What `torch.optim.lr_scheduler.LRScheduler` patches `optimizer.step` to do (it sets this flag
    # and reads it back in `scheduler.step()`): there is no public way to tell a scheduler that the
    # optimizer stepped. Checked on torch 2.13.
    optimizer._opt_called = True  # type: ignore[attr-defined]


def compile_optimizer_step(optimizer: torch.optim.Optimizer, **compile_kwargs: Any) -> Callable[[], None]:
    """A compiled `optimizer.step()` (no closure) with no graph break.

    The parameter update is one `torch.compile`d graph; around it, eagerly, the step runs the
    optimizer's step hooks and tells LR schedulers that the optimizer stepped, as
    `optimizer.step()` does, so `scheduler.step()` after it neither warns nor skips a value.

    Pass a tensor learning rate (`lr=torch.tensor(1e-3)`) when a scheduler changes it: a float lr
    is guarded as a constant, so every change would recompile.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
        >>> step = tq.optim.compile_optimizer_step(opt, fullgraph=True)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        >>> loss.backward(); step(); sched.step(); opt.zero_grad()
    """
    if optimizer.defaults.get("differentiable", False):
        raise ValueError(
            "compile_optimizer_step: differentiable=True optimizers need torch's grad-mode wrapper; compile optimizer.step instead"
        )
    body = inspect.unwrap(type(optimizer).step)

    def update() -> None:
        with torch.no_grad():
            body(optimizer)

    # Dynamo keeps its compiled graphs on the code object, and every `update` made here shares one:
    # each new optimizer in a process would be one more cache entry of the same frame, and the 9th
    # would hit the recompile limit (FailOnRecompileLimitHit under fullgraph=True; checked on torch
    # 2.13). A copy of the code object gives each compiled step a cache of its own.
    update = types.FunctionType(update.__code__.replace(), update.__globals__, update.__name__, None, update.__closure__)
    compiled_update = torch.compile(update, **compile_kwargs)
    profile_name = f"Optimizer.step#{type(optimizer).__name__}.step"

    def step() -> None:
        args: tuple[Any, ...] = (optimizer,)
        with torch.autograd.profiler.record_function(profile_name):
            for pre_hook in chain(_global_optimizer_pre_hooks.values(), optimizer._optimizer_step_pre_hooks.values()):
                if pre_hook(optimizer, args, {}) is not None:
                    raise ValueError(
                        f"compile_optimizer_step: the step pre-hook {pre_hook!r} returned new arguments; the compiled step "
                        "takes none, so allowed: pre-hooks that return None"
                    )
            compiled_update()
            _mark_stepped(optimizer)
            for post_hook in chain(optimizer._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
                post_hook(optimizer, args, {})

    return step
