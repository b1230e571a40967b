"""`tq.convert`: convert a model's layers (`tqcompile.nn`'s registry), then set up FSDP2's quantized
all-gather of their weights (`tqcompile.distributed`).

It sits above both packages, so that `tqcompile.nn` never imports `tqcompile.distributed` (which
imports `tqcompile.nn` for its tensor-parallel styles)."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from tqcompile.distributed.fsdp import enable_converted_layers
from tqcompile.nn.convert import convert_layers
from tqcompile.recipes import Recipe

__all__ = ["convert"]


def convert(
    model: nn.Module,
    recipe: Recipe,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    fsdp_quantized_all_gather: bool | None = None,
) -> nn.Module:
    """Convert, in place, every layer of `model` that has a registered converter and passes
    `filter_fn(module, fqn)`, and return `model`. `fqn` is the layer's canonical name: a wrapper's
    components (DDP's ``module``, torch.compile's ``_orig_mod``, ...) are not part of it
    (`tqcompile.surgery.names`).

    Layers whose shapes `recipe` cannot serve (or that override forward without declaring
    Linear semantics) are left alone and reported in one `ConversionWarning`, as are layers whose
    parent reads their weight directly and is not converted itself (see `tqcompile.nn.convert`).
    Converting again with the same recipe changes nothing; with another recipe it raises.

    `fsdp_quantized_all_gather`: make the converted weights `tq.distributed.QuantizedWeight`s, which
    FSDP2's `fully_shard` all-gathers quantized (docs/distributed.md). None (default): when a
    default process group is initialized; False: never (weights are gathered in high precision).

    Example:
        >>> model = tq.convert(model, tq.recipes.mxfp8(), filter_fn=lambda m, fqn: "lm_head" not in fqn)
    """
    plan = convert_layers(model, recipe, filter_fn=filter_fn)
    if fsdp_quantized_all_gather is None:
        fsdp_quantized_all_gather = dist.is_available() and dist.is_initialized()
    if fsdp_quantized_all_gather:
        enable_converted_layers(model, [p.name for p in plan if p.action == "convert"])
    return model
