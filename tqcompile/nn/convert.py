"""`tq.convert`: swap a model's layers for quantized ones, in place, through a registry.

A module is converted by the registered converter of the first class in its MRO that has one,
so subclasses of `nn.Linear` match too. A subclass is converted by giving the module a new class
that inherits from both its own class and `tq.nn.Linear` (attributes, extra methods and hooks are
kept). A subclass that overrides `forward` keeps Linear semantics only if that forward computes
through `super().forward(...)`; it cannot be checked, so such a class must say so with a class
attribute ``tq_linear_semantics = True`` (then its `super().forward` runs quantized), otherwise it
is skipped and reported.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

from torch import nn

from tqcompile.distributed import fsdp as distributed_fsdp
from tqcompile.nn.linear import Linear, _Quantized
from tqcompile.recipes import Recipe

__all__ = ["convert", "conversion_plan", "register_converter", "ConversionWarning", "PlannedConversion"]

Converter = Callable[[nn.Module, Recipe], None]
ReasonFn = Callable[[nn.Module, Recipe], "str | None"]
# class -> (converter, why it cannot serve a module; None: it always can)
_REGISTRY: dict[type, tuple[Converter, ReasonFn | None]] = {}
_SUBCLASS_CACHE: dict[type, type] = {}


class ConversionWarning(UserWarning):
    """Layers `tq.convert` left in high precision, with the reason."""


@dataclasses.dataclass(frozen=True)
class PlannedConversion:
    name: str
    module_type: str
    action: str  # "convert", "skip" or "already converted"
    reason: str = ""


def register_converter(cls: type, *, unsupported_reason: ReasonFn | None = None) -> Callable[[Converter], Converter]:
    """Register `fn(module, recipe)` to convert modules of `cls` (and its subclasses) in place.

    `unsupported_reason(module, recipe)` returns why a module cannot be converted (it is then
    skipped and reported) or None; `convert` asks it for every module before converting any, so a
    model is never left half converted.
    """

    def deco(fn: Converter) -> Converter:
        _REGISTRY[cls] = (fn, unsupported_reason)
        return fn

    return deco


def _entry_for(module: nn.Module) -> tuple[Converter, ReasonFn | None] | None:
    for cls in type(module).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    return None


def _quantized_class(cls: type) -> type:
    if cls is nn.Linear:
        return Linear
    if cls not in _SUBCLASS_CACHE:
        _SUBCLASS_CACHE[cls] = type(f"Quantized{cls.__name__}", (cls, Linear), {"__module__": cls.__module__})
    return _SUBCLASS_CACHE[cls]


def _linear_unsupported_reason(module: nn.Module, recipe: Recipe) -> str | None:
    cls = type(module)
    if cls.forward is not nn.Linear.forward and not getattr(cls, "tq_linear_semantics", False):
        return (
            f"{cls.__name__} overrides forward; if it computes through super().forward(...), set the class attribute "
            "tq_linear_semantics = True to convert it"
        )
    return recipe.unsupported_reason(module.in_features, module.out_features)


@register_converter(nn.Linear, unsupported_reason=_linear_unsupported_reason)
def _convert_linear(module: nn.Module, recipe: Recipe) -> None:
    module.__class__ = _quantized_class(type(module))
    module._init_quantized(recipe)


def conversion_plan(model: nn.Module, recipe: Recipe, *, filter_fn: Callable[[nn.Module, str], bool] | None = None) -> list[PlannedConversion]:
    """What `convert(model, recipe, filter_fn=...)` would do to each convertible layer."""
    plan = []
    for name, module in model.named_modules():
        if isinstance(module, _Quantized):
            if module.recipe != recipe:
                raise ValueError(
                    f"tq.convert: layer {name!r} is already converted with recipe {module.recipe.name!r}; "
                    f"converting it again with {recipe.name!r} is not supported (convert a fresh model)"
                )
            plan.append(PlannedConversion(name, type(module).__name__, "already converted"))
            continue
        entry = _entry_for(module)
        if entry is None or (filter_fn is not None and not filter_fn(module, name)):
            continue
        reason = (entry[1](module, recipe) if entry[1] is not None else None) or ""
        plan.append(PlannedConversion(name, type(module).__name__, "skip" if reason else "convert", reason))
    return plan


def convert(
    model: nn.Module,
    recipe: Recipe,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    fsdp_quantized_all_gather: bool | None = None,
) -> nn.Module:
    """Convert, in place, every layer of `model` that has a registered converter and passes
    `filter_fn(module, fqn)`, and return `model`.

    Layers whose shapes `recipe` cannot serve (or that override forward without declaring
    Linear semantics) are left alone and reported in one `ConversionWarning`. Converting again
    with the same recipe changes nothing; with another recipe it raises.

    `fsdp_quantized_all_gather`: make the converted weights `tq.distributed.QuantizedWeight`s, which
    FSDP2's `fully_shard` all-gathers quantized (docs/distributed.md). None (default): when a
    default process group is initialized; False: never (weights are gathered in high precision).

    Example:
        >>> model = tq.convert(model, tq.recipes.mxfp8(), filter_fn=lambda m, fqn: "lm_head" not in fqn)
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"tq.convert: recipe must be a tq.Recipe (e.g. tq.recipes.mxfp8()), got {type(recipe).__name__}")
    plan = conversion_plan(model, recipe, filter_fn=filter_fn)
    modules = dict(model.named_modules())
    for p in plan:
        if p.action == "convert":
            _entry_for(modules[p.name])[0](modules[p.name], recipe)
    if fsdp_quantized_all_gather is None:
        fsdp_quantized_all_gather = distributed_fsdp._is_initialized()
    if fsdp_quantized_all_gather:
        for p in plan:
            if p.action == "convert":
                distributed_fsdp.enable_quantized_all_gather(modules[p.name], p.name)
    skipped = [p for p in plan if p.action == "skip"]
    if skipped:
        lines = "\n".join(f"  {p.name or '<root>'} ({p.module_type}): {p.reason}" for p in skipped)
        warnings.warn(f"tq.convert left {len(skipped)} layer(s) in high precision:\n{lines}", ConversionWarning, stacklevel=2)
    return model
