"""`tq.nn.Linear`: the quantized drop-in for training. (`GroupedLinear` lives in `tqcompile.nn.grouped`.)"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tqcompile.groups import group_name_of
from tqcompile.nn.base import QuantizedModule
from tqcompile.nn.functional import layer_linear
from tqcompile.nn.histories import _AmaxHistoryOwner
from tqcompile.recipes import Recipe

__all__ = ["Linear"]

_HISTORIES = ("amax_history_input", "amax_history_weight", "amax_history_grad")


def _check_recipe(recipe: Recipe, in_features: int, out_features: int, what: str) -> None:
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{what}: recipe must be a tq.Recipe (e.g. tq.recipes.mxfp8()), got {type(recipe).__name__}")
    reason = recipe.unsupported_reason(in_features, out_features)
    if reason:
        raise ValueError(f"{what}: recipe {recipe.name!r} cannot serve in_features={in_features}, out_features={out_features}: {reason}")


class _Quantized(QuantizedModule, _AmaxHistoryOwner):
    """What every quantized linear module (`Linear`, `GroupedLinear`) has: a recipe, an amax group,
    delayed-scaling histories (fp32, initialised, persistent: see `tqcompile.nn.histories`)."""

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
        if isinstance(self.weight, DTensor):
            _refuse_dtensor_weight(self)
        return layer_linear(
            x,
            self.weight,
            self.bias,
            self.recipe,
            amax_group=self.amax_group_name,
            amax_histories=self._histories(),
            update_amax_histories=update,
            layer=self,
        )


def _refuse_dtensor_weight(layer: Linear) -> None:
    # Without this, torch's own TP styles on a converted layer failed deep in DTensor dispatch with
    # "Operator tqcompile.amax.default does not have a sharding strategy registered", naming neither
    # the layer nor the styles to use. tqcompile's styles swap in a forward that never gets here, and
    # FSDP2 hands a layer its unsharded (plain or quantized) weight, so only a misuse reaches this.
    w = layer.weight
    raise TypeError(
        f"tq.nn.Linear({layer.in_features}, {layer.out_features}, recipe {layer.recipe.name!r}): its weight is a DTensor placed "
        f"{tuple(w.placements)} on a mesh of {w.device_mesh.size()} ranks, which the quantized GEMMs cannot take (DTensor has "
        "no sharding rule for the tqcompile ops). If torch.distributed.tensor.parallel's ColwiseParallel/RowwiseParallel/"
        "SequenceParallel sharded it, use tq.distributed.ColwiseParallel/RowwiseParallel instead (docs/tensor_parallel.md); "
        "if fully_shard did, call the layer through the module fully_shard was applied to, which gathers the weight first"
    )

