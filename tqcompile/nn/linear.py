"""`tq.nn.Linear` and `tq.nn.GroupedLinear`: quantized drop-ins for training."""

from __future__ import annotations

import math

import torch
from torch import nn

from tqcompile.distributed.groups import group_name_of
from tqcompile.nn.functional import linear
from tqcompile.nn.histories import _AmaxHistoryOwner
from tqcompile.recipes import Recipe

__all__ = ["Linear", "GroupedLinear", "grouped_unsupported_reason"]

_HISTORIES = ("amax_history_input", "amax_history_weight", "amax_history_grad")


def _check_recipe(recipe: Recipe, in_features: int, out_features: int, what: str) -> None:
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{what}: recipe must be a tq.Recipe (e.g. tq.recipes.mxfp8()), got {type(recipe).__name__}")
    reason = recipe.unsupported_reason(in_features, out_features)
    if reason:
        raise ValueError(f"{what}: recipe {recipe.name!r} cannot serve in_features={in_features}, out_features={out_features}: {reason}")


def grouped_unsupported_reason(recipe: Recipe, in_features: int, out_features: int) -> str | None:
    """Why `recipe` cannot serve a GroupedLinear of these sizes (None if it can)."""
    if recipe.amax_history_len:
        return "it uses delayed scaling, whose one amax history per layer per-expert scales cannot use; use a current-scaling recipe"
    return recipe.unsupported_reason(in_features, out_features)


class _Quantized(_AmaxHistoryOwner):
    """What every quantized linear module has: a recipe, an amax group, delayed-scaling histories
    (fp32, initialised, persistent: see `tqcompile.nn.histories`)."""

    recipe: Recipe
    amax_group_name: str | None

    def _init_quantized(self, recipe: Recipe, amax_group=None) -> None:
        self.recipe = recipe
        self.amax_group_name = group_name_of(amax_group)
        for name in _HISTORIES:
            self._register_amax_history(name, recipe.amax_history_len, self.weight.device)

    def _histories(self):
        return tuple(getattr(self, n) for n in _HISTORIES) if self.recipe.amax_history_len else None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


class Linear(_Quantized, nn.Linear):
    """Drop-in for `nn.Linear` whose GEMMs run quantized as `recipe` says.

    Same parameters and `state_dict` keys as `nn.Linear`, plus, for delayed-scaling recipes, the
    fp32 buffers `amax_history_input`, `amax_history_weight` and `amax_history_grad`. An `nn.Linear`
    checkpoint loads as is (strictly; missing histories load as zeros, the first-step state).

    Example:
        >>> layer = tq.nn.Linear(256, 512, recipe=tq.recipes.mxfp8())
        >>> y = layer(torch.randn(64, 256))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *, recipe: Recipe, amax_group=None):
        _check_recipe(recipe, in_features, out_features, "tq.nn.Linear")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_quantized(recipe, amax_group)

    def reset_parameters(self) -> None:
        """Re-initialise weight and bias as `nn.Linear` does, and zero the delayed-scaling histories."""
        super().reset_parameters()
        self.reset_amax_histories()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Histories roll in training mode only (in the backward of each step; see `tq.nn.functional.linear`).
        # Read `training` only where it matters, so Dynamo guards on it only for delayed-scaling recipes.
        update = self.training if self.recipe.amax_history_len else True
        return linear(
            x,
            self.weight,
            self.bias,
            self.recipe,
            amax_group=self.amax_group_name,
            amax_histories=self._histories(),
            update_amax_histories=update,
        )


class GroupedLinear(_Quantized, nn.Module):
    """MoE experts: one (out_features, in_features) weight per expert, each with its own scales.

    `forward(x)` takes tokens grouped by expert, either as a dense (num_experts, tokens, in)
    tensor (static shapes, what compiled MoE dispatch with a fixed capacity produces) or as
    (total_tokens, in) with `m_splits`, a list of per-expert token counts (Python ints).

    Example:
        >>> experts = tq.nn.GroupedLinear(4, 64, 128, recipe=tq.recipes.fp8_rowwise())
        >>> y = experts(torch.randn(4, 32, 64))          # (4, 32, 128)
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None, *, recipe: Recipe, amax_group=None):
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"GroupedLinear: num_experts={num_experts!r}; allowed: an int >= 1")
        _check_recipe(recipe, in_features, out_features, "tq.nn.GroupedLinear")
        reason = grouped_unsupported_reason(recipe, in_features, out_features)
        if reason:
            raise ValueError(f"tq.nn.GroupedLinear: recipe {recipe.name!r} cannot serve {num_experts} experts {in_features} -> {out_features}: {reason}")
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()
        self._init_quantized(recipe, amax_group)

    def reset_parameters(self) -> None:
        for e in range(self.num_experts):
            nn.init.kaiming_uniform_(self.weight[e], a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(self.in_features), 1 / math.sqrt(self.in_features))

    def forward(self, x: torch.Tensor, m_splits: list[int] | None = None) -> torch.Tensor:
        if m_splits is None:
            if x.dim() != 3 or x.shape[0] != self.num_experts:
                raise ValueError(f"GroupedLinear: expected x of shape ({self.num_experts}, tokens, {self.in_features}) or m_splits, got {tuple(x.shape)}")
            chunks = x.unbind(0)
        else:
            if len(m_splits) != self.num_experts or sum(m_splits) != x.shape[0]:
                raise ValueError(f"GroupedLinear: m_splits={m_splits} must have {self.num_experts} entries summing to x.shape[0]={x.shape[0]}")
            chunks = x.split(m_splits, 0)
        # One quantized linear per expert: every expert's weight and tokens get their own scales.
        outs = [
            linear(chunk, self.weight[e], None if self.bias is None else self.bias[e], self.recipe, amax_group=self.amax_group_name)
            for e, chunk in enumerate(chunks)
        ]
        return torch.stack(outs) if m_splits is None else torch.cat(outs)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe.name}"
