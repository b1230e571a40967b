"""AWQ's "output" loss (`tq.AWQ(loss="output")`): a candidate scale for layers that share an input
is scored by the mean squared error of their lowest common parent module's output (the attention
for q/k/v, the MLP for gate/up) over every calibration batch, as llmcompressor's `AWQModifier`
scores it, instead of the layers' own summed output errors from their Hessians.

`ParentCalls` records, while a group's statistics pass runs, every call of each module that is the
lowest common ancestor of two of the group's units (inside the replayed layer): its arguments (a
KV cache argument replaced as the replay replaces it) and its float output. `parent_loss` then
gives `tqcompile.calibration.awq.awq_search` a loss function: each consumer's weight replaced by
``RTN(W diag(s)) diag(1/s)`` in its own dtype (what the fold and `max` calibration make of it), the
parent run on the recorded calls, the weights put back exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tqcompile.calibration.fake_quant import round_to_nearest
from tqcompile.calibration.layer_stats import per_expert
from tqcompile.calibration.replay import _CACHE_ARGS

__all__ = ["ParentCalls", "lowest_common_parent"]


def _parents(scope: nn.Module) -> dict[int, nn.Module]:
    """{id(module): its parent} for the modules under `scope`."""
    up = {}
    for m in scope.modules():
        for c in m.children():
            up.setdefault(id(c), m)
    return up


def _ancestors(m: nn.Module, up: dict[int, nn.Module]) -> list[nn.Module]:
    chain = []
    while id(m) in up:
        m = up[id(m)]
        chain.append(m)
    return chain


def lowest_common_parent(units: list, scope: nn.Module, up: dict[int, nn.Module] | None = None) -> nn.Module | None:
    """The deepest module under `scope` (or `scope` itself) containing every one of `units` (None:
    fewer than two units, or one not under `scope`). `up`: `scope`'s parent map, when the caller
    asks for many sets under one scope."""
    if len(units) < 2:
        return None
    up = _parents(scope) if up is None else up
    chains = [_ancestors(u, up) for u in units]  # nearest first, ending at `scope`
    if any(not c for c in chains):
        return None
    common = set.intersection(*({id(m) for m in c} for c in chains))
    return next((m for m in chains[0] if id(m) in common), None)


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple | list) else out


class ParentCalls:
    """Hooks recording every call (arguments and float output) of the lowest common parent of each
    pair of `units` under `scope`, for as long as they are attached."""

    def __init__(self, units: list, scope: nn.Module):
        self.scope = scope
        self.calls: dict[int, list[tuple[tuple, dict, torch.Tensor]]] = {}
        parents, up = {}, _parents(scope)  # one map for every pair (a whole model's units without replay)
        for i, a in enumerate(units):
            for b in units[i + 1 :]:
                p = lowest_common_parent([a, b], scope, up)
                if p is not None:
                    parents[id(p)] = p
        self._handles = []
        for key, p in parents.items():
            self.calls[key] = []
            self._handles.append(p.register_forward_pre_hook(self._pre(key), with_kwargs=True))
            self._handles.append(p.register_forward_hook(self._post(key)))
        self._pending: dict[int, tuple[tuple, dict]] = {}

    def _pre(self, key: int):
        def hook(_m, args, kwargs):
            kept = {k: (_CACHE_ARGS[k] if k in _CACHE_ARGS else v) for k, v in kwargs.items()}
            self._pending[key] = (args, kept)

        return hook

    def _post(self, key: int):
        def hook(_m, _args, out):
            args, kwargs = self._pending.pop(key)
            self.calls[key].append((args, kwargs, _output(out).detach()))

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def of(self, parent: nn.Module | None) -> list | None:
        return None if parent is None else self.calls.get(id(parent)) or None


def parent_loss(fold, parent: nn.Module, calls: list, groups: tuple) -> Callable[[torch.Tensor], float]:
    """The loss of a candidate scale `s` for `fold`'s consumers: the mean squared error of
    `parent`'s output on its recorded `calls` with each consumer's weight as the fold and round to
    nearest make it, summed over the ranks of `groups` (every rank then picks the same scale)."""

    def loss(s: torch.Tensor) -> float:
        saved = []
        total = torch.zeros(2, dtype=torch.float64, device=calls[0][2].device)
        try:
            with torch.no_grad():
                for u in fold.consumers:
                    q = u.weight_quantizer.quantizer
                    if q is None:
                        continue
                    for _, w in per_expert(u):
                        saved.append((w, w.clone()))
                        scaled = (w.float() * s).to(w.dtype).float()
                        w.copy_((round_to_nearest(scaled, q) / s).to(w.dtype))
                for args, kwargs, ref in calls:
                    out = _output(parent(*args, **kwargs)).float()
                    total[0] += (out - ref.float()).pow(2).sum(dtype=torch.float64)
                    total[1] += ref.numel()
        finally:
            with torch.no_grad():
                for w, copy in saved:
                    w.copy_(copy)
        for g in groups:
            dist.all_reduce(total, group=g)
        return float(total[0] / total[1].clamp(min=1))

    return loss
