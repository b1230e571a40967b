"""Compile a `torch.optim` optimizer's step with `fullgraph=True`.

`torch.optim.Optimizer.step` is wrapped (`_use_grad_for_differentiable`) in code that calls
`torch._dynamo.graph_break()` on purpose (pytorch/pytorch#104053: so AOTAutograd sees an
inference graph), so a stock optimizer step can never compile with `fullgraph=True`. Here the
undecorated step (`inspect.unwrap`) runs under `torch.no_grad()`, which is what that wrapper does
without the breaks. Checked on torch 2.13 (AdamW, SGD). Where the wrapper matters
(`differentiable=True`), this refuses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compile_optimizer_step"]


def compile_optimizer_step(optimizer: torch.optim.Optimizer, **compile_kwargs: Any) -> Callable[[], None]:
    """A compiled `optimizer.step()` (no closure) with no graph break.

    Pass a tensor learning rate (`lr=torch.tensor(1e-3)`) when a scheduler changes it: a float lr
    is guarded as a constant, so every change would recompile.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
        >>> step = tq.optim.compile_optimizer_step(opt, fullgraph=True)
        >>> loss.backward(); step(); opt.zero_grad()
    """
    if optimizer.defaults.get("differentiable", False):
        raise ValueError("compile_optimizer_step: differentiable=True optimizers need torch's grad-mode wrapper; compile optimizer.step instead")
    body = inspect.unwrap(type(optimizer).step)

    def step() -> None:
        with torch.no_grad():
            body(optimizer)

    return torch.compile(step, **compile_kwargs)
