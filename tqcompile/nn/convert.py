"""The layer half of `tq.convert` (`convert_layers`): swap a model's layers for quantized ones, in
place, through a registry. (`tq.convert` itself, in `tqcompile.conversion`, then sets up FSDP2's
quantized all-gather of the converted weights.)

Layers are named, planned and changed through the surgery layer (`tqcompile.surgery`, shared
with `tq.calibrate`): canonical names (wrappers' components removed, the names `filter_fn` sees),
a plan of per-layer `Decision`s (reported as `PlannedConversion` rows), then applied in place.

A module is converted by the registered converter of the first class in its MRO that has one,
so subclasses of `nn.Linear` match too. A subclass is converted by giving the module a new class
that inherits from both its own class and `tq.nn.Linear` (attributes, extra methods and hooks are
kept; the new class, `tqcompile.surgery.classes`, pickles by naming the two it is made of). A subclass that overrides `forward`
keeps Linear semantics only if that forward computes through `super().forward(...)`; it cannot be
checked, so such a class must say so with a class attribute ``tq_linear_semantics = True`` (then
its `super().forward` runs quantized), otherwise it is skipped and reported.

A layer is reported converted only if its GEMMs then run quantized. Some modules read a child's
weight themselves instead of calling the child: `nn.MultiheadAttention` reads `out_proj.weight`,
and `nn.TransformerEncoderLayer`'s inference fast path reads the weights of `self_attn`, `linear1`
and `linear2` (registered in `tqcompile.surgery.checks`). Their converters (`tqcompile.nn.attention`) replace those reads, and planning skips
the children of such a module when the module itself is not converted (filtered out or refused),
with the reason. Modules whose parameters are not materialised yet (`nn.LazyLinear`) are skipped:
their shapes, and whether the recipe can serve them, are known only after their first forward.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

from torch import nn
from torch.nn.parameter import is_lazy

from tqcompile.nn.attention import QuantizedMultiheadAttention, QuantizedTransformerEncoderLayer, mha_unsupported_reason
from tqcompile.nn.base import is_converted
from tqcompile.nn.experts import QuantizedExperts, experts_layout, experts_unsupported_reason
from tqcompile.nn.quantized_linear import Linear
from tqcompile.recipes import Recipe
from tqcompile.surgery.checks import check_not_sharded, register_weight_reader, weight_reads
from tqcompile.surgery.classes import generated_class, new_instance
from tqcompile.surgery.names import canonical_modules
from tqcompile.surgery.plan import Decision, apply

__all__ = ["convert_layers", "conversion_plan", "register_converter", "ConversionWarning", "PlannedConversion"]

Converter = Callable[[nn.Module, Recipe], None]
ReasonFn = Callable[[nn.Module, Recipe], "str | None"]
ReadsFn = Callable[[nn.Module], dict[str, str]]


@dataclasses.dataclass(frozen=True)
class _Entry:
    convert: Converter
    unsupported_reason: ReasonFn | None = None
    # The converter only stops the module from reading its children's weights (it has no GEMM of its
    # own): listed in a plan only when one of those children is converted.
    adapter_only: bool = False


_REGISTRY: dict[type, _Entry] = {}


class ConversionWarning(UserWarning):
    """Layers `tq.convert` left in high precision, with the reason."""


@dataclasses.dataclass(frozen=True)
class PlannedConversion:
    """What `tq.convert` does to one layer: `action` is "convert", "skip" (with `reason`) or "already converted".

    The report of the surgery layer's `Decision` for that layer (which also holds the module)."""

    name: str
    module_type: str
    action: str  # "convert", "skip" or "already converted"
    reason: str = ""


def _row(d: Decision) -> PlannedConversion:
    return PlannedConversion(d.name, d.module_type, d.action, d.reason)


# Pickles of converted models made before the surgery layer name this function: it makes the same class.
_new_converted = new_instance


def register_converter(
    cls: type, *, unsupported_reason: ReasonFn | None = None, reads_weights_of: ReadsFn | None = None
) -> Callable[[Converter], Converter]:
    """Register `fn(module, recipe)` to convert modules of `cls` (and its subclasses) in place.

    `unsupported_reason(module, recipe)` returns why a module cannot be converted (it is then
    skipped and reported) or None; `convert` asks it for every module before converting any, so a
    model is never left half converted.

    `reads_weights_of(module)` returns the children whose weights the module's *unconverted*
    forward reads directly (child name -> where), as `nn.MultiheadAttention` reads
    `out_proj.weight`: the converter must replace those reads, and when the module is not
    converted (filtered out or refused) those children are skipped too, with the reason, since a
    converted child that is never called would not run quantized.
    """

    def deco(fn: Converter) -> Converter:
        _REGISTRY[cls] = _Entry(fn, unsupported_reason)
        if reads_weights_of is not None:
            register_weight_reader(cls, reads_weights_of)
        return fn

    return deco


# Converters that recognise a module by its structure rather than its class (experts modules
# are plain nn.Modules of many classes): (predicate, entry), asked after the class registry.
_STRUCTURAL: list[tuple[Callable[[nn.Module], bool], _Entry]] = []


def _entry_for(module: nn.Module) -> _Entry | None:
    for cls in type(module).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    for matches, entry in _STRUCTURAL:
        if matches(module):
            return entry
    return None


def _lazy_reason(module: nn.Module) -> str | None:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    if not any(is_lazy(t) for t in tensors):
        return None
    becomes = getattr(module, "cls_to_become", None)
    then = f" (it then becomes a {becomes.__name__})" if becomes is not None else ""
    return (
        f"{type(module).__name__} has uninitialized (lazy) parameters, whose shapes are known only after its first forward; "
        f"run one forward first{then}, then convert"
    )


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
    module.__class__ = generated_class(type(module), Linear)
    module._init_quantized(recipe)


def _mha_reason(module: nn.Module, recipe: Recipe) -> str | None:
    cls = type(module)
    if cls.forward is not nn.MultiheadAttention.forward:
        return f"{cls.__name__} overrides forward; tq.convert cannot know which projections it computes how"
    return mha_unsupported_reason(module, recipe)


# Which children's weights nn.MultiheadAttention and nn.TransformerEncoderLayer read themselves is
# registered in tqcompile.surgery.checks (calibration skips them too); these converters replace those reads.
@register_converter(nn.MultiheadAttention, unsupported_reason=_mha_reason)
def _convert_mha(module: nn.Module, recipe: Recipe) -> None:
    module.__class__ = generated_class(type(module), QuantizedMultiheadAttention)
    module._init_quantized(recipe)


def _convert_experts(module: nn.Module, recipe: Recipe) -> None:
    layout = experts_layout(module)
    module.__class__ = generated_class(type(module), QuantizedExperts)
    module._init_quantized(recipe, layout)


_STRUCTURAL.append((lambda m: experts_layout(m) is not None, _Entry(_convert_experts, experts_unsupported_reason)))


def _convert_encoder_layer(module: nn.Module, recipe: Recipe) -> None:
    module.__class__ = generated_class(type(module), QuantizedTransformerEncoderLayer)
    module.recipe = recipe


_REGISTRY[nn.TransformerEncoderLayer] = _Entry(_convert_encoder_layer, adapter_only=True)


def _child_name(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


_SHARDED_FIX = (
    "Convert the unsharded model first, then shard it: tq.convert, then tq.distributed's TP styles, then torch.compile "
    "per block, then fully_shard (docs/distributed.md)"
)


def conversion_plan(
    model: nn.Module, recipe: Recipe, *, filter_fn: Callable[[nn.Module, str], bool] | None = None
) -> list[PlannedConversion]:
    """What `convert(model, recipe, filter_fn=...)` would do to each convertible layer."""
    return [_row(d) for d in _plan(model, recipe, filter_fn)]


def _plan(model: nn.Module, recipe: Recipe, filter_fn: Callable[[nn.Module, str], bool] | None) -> list[Decision]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"tq.convert: model must be a torch.nn.Module, got {type(model).__name__}")
    modules = dict(canonical_modules(model))
    plan: dict[str, Decision] = {}
    for name, module in modules.items():
        if is_converted(module):
            if module.recipe != recipe:
                raise ValueError(
                    f"tq.convert: layer {name!r} is already converted with recipe {module.recipe.name!r}; "
                    f"converting it again with {recipe.name!r} is not supported (convert a fresh model)"
                )
            plan[name] = Decision(name, type(module).__name__, "already converted", module=module)
            continue
        entry = _entry_for(module)
        if entry is None or (filter_fn is not None and not filter_fn(module, name)):
            continue
        reason = _lazy_reason(module) or (entry.unsupported_reason(module, recipe) if entry.unsupported_reason else None) or ""
        action = "skip" if reason else "convert"
        plan[name] = Decision(name, type(module).__name__, action, reason, module=module, using=recipe)

    # A child whose weight an unconverted parent reads directly would be converted but never run:
    # skip it. Repeat, since a skipped child may itself be such a parent (self_attn and its out_proj).
    readers = list(weight_reads(modules))
    changed = True
    while changed:
        changed = False
        for name, module, reads in readers:
            p = plan.get(name)
            if p is not None and p.action != "skip":
                continue
            why = p.reason if p is not None else "filter_fn excluded it"
            for child, where in reads.children(module).items():
                fqn = _child_name(name, child)
                if fqn in plan and plan[fqn].action == "convert":
                    reason = f"{name or '<root>'} ({type(module).__name__}) is not converted ({why}) and reads its weight directly: {where}"
                    plan[fqn] = dataclasses.replace(plan[fqn], action="skip", reason=reason)
                    changed = True
    for name, module, reads in readers:
        read = [_child_name(name, c) for c in reads.children(module)]
        entry = _entry_for(module)
        if entry is not None and entry.adapter_only and name in plan and not any(plan.get(c) and plan[c].action != "skip" for c in read):
            del plan[name]  # nothing under it runs quantized: there is nothing to adapt
    for name, reason in _left_alone(modules, plan, filter_fn).items():
        plan[name] = Decision(name, type(modules[name]).__name__, "skip", reason, module=modules[name])
    return [plan[name] for name in modules if name in plan]


_ROUTER = (
    "an MoE router: its logits choose the experts, so it stays in high precision (as Transformer Engine and torchao "
    "keep routers); nothing to do"
)
_CONV = (
    "a convolution (e.g. a patch embedding): tq.convert's recipes quantize the GEMMs of linear layers and experts; "
    "it runs in high precision"
)


def _routers(modules: dict[str, nn.Module]) -> set[str]:
    """Names of the MoE routers: modules beside an experts module (under its parent, outside the
    experts) whose 2-D weight has one row per expert (HunYuan nests its `nn.Linear` one level down)."""
    routers = set()
    for name, module in modules.items():
        layout = experts_layout(module)
        if layout is None:
            continue
        num_experts = module._parameters[layout.gemms[0].weight].shape[0]
        parent = name.rpartition(".")[0]
        for sub_name, sub in modules[parent].named_modules(prefix=parent):
            if sub_name == name or sub_name.startswith(f"{name}."):
                continue
            w = sub._parameters.get("weight")
            if w is not None and w.dim() == 2 and w.shape[0] == num_experts:
                routers.add(sub_name)
    return routers


def _left_alone(
    modules: dict[str, nn.Module], plan: dict[str, Decision], filter_fn: Callable[[nn.Module, str], bool] | None
) -> dict[str, str]:
    """{name: why} of the layers holding GEMM weights that tq.convert leaves in high precision by
    design or for want of a converter: MoE routers, convolutions, other modules with 3-D
    parameters. Reported (in the plan and the warning), never silent; `filter_fn` exclusions are the
    user's own choice and are not."""
    routers = _routers(modules)
    out: dict[str, str] = {}
    for name, module in modules.items():
        reason = None
        if name in routers and (name not in plan or plan[name].action != "already converted"):
            reason = _ROUTER
        elif name in plan or is_converted(module):
            continue
        elif isinstance(module, nn.modules.conv._ConvNd):
            reason = _CONV
        else:
            stacked = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and p.shape[0] > 1]
            if stacked:
                reason = (
                    f"holds 3-D parameters {stacked} that no tqcompile converter recognises (an experts module must look like "
                    "transformers' use_experts_implementation classes or torchtitan's GroupedExperts; docs/moe.md)"
                )
        # A router filter_fn already excluded is not in the plan; ask filter_fn about the others only here.
        if reason is not None and (name in plan or filter_fn is None or filter_fn(module, name)):
            out[name] = reason
    return out


def _grouped_lines(skipped: list[Decision]) -> str:
    """One line per (type, reason), naming its layers (the first three, then how many more)."""
    by_reason: dict[tuple[str, str], list[str]] = {}
    for p in skipped:
        by_reason.setdefault((p.module_type, p.reason), []).append(p.name or "<root>")
    lines = []
    for (module_type, reason), names in by_reason.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        lines.append(f"  {', '.join(names[:3])}{more} ({module_type}): {reason}")
    return "\n".join(lines)


def _convert(p: Decision) -> None:
    _entry_for(p.module).convert(p.module, p.using)
    # The name filter_fn saw: errors the layer raises at run time (a token count its blocks
    # cannot split) name it and show the filter_fn that keeps it in high precision.
    if is_converted(p.module):  # (a user's converter may make a module that is not a QuantizedModule)
        p.module.tq_fqn = p.name


def convert_layers(
    model: nn.Module, recipe: Recipe, *, filter_fn: Callable[[nn.Module, str], bool] | None = None
) -> list[PlannedConversion]:
    """The layer part of `tq.convert`: convert, in place, every layer of `model` that has a
    registered converter and passes `filter_fn(module, fqn)`, and return what was done to each
    (`conversion_plan`'s rows). `tq.convert` then sets up FSDP2's quantized all-gather of the
    converted weights (`tqcompile.distributed`, which sits above this package).

    Layers whose shapes `recipe` cannot serve (or that override forward without declaring
    Linear semantics) are left alone and reported in one `ConversionWarning`, as are layers whose
    parent reads their weight directly and is not converted itself (see the module docstring).
    Converting again with the same recipe changes nothing; with another recipe it raises.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"tq.convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"tq.convert: recipe must be a tq.Recipe (e.g. tq.recipes.mxfp8()), got {type(recipe).__name__}")
    plan = _plan(model, recipe, filter_fn)
    for p in plan:
        if p.action == "convert":
            check_not_sharded("tq.convert", "layer", p.name, p.module, _SHARDED_FIX)
    apply(plan, _convert)
    for module in model.modules():
        # nn.TransformerEncoder packs a padded batch into a nested tensor in inference; converted
        # layers take the padded batch and its key padding mask instead.
        if isinstance(module, nn.TransformerEncoder) and getattr(module, "use_nested_tensor", False):
            if any(is_converted(m) for m in module.layers.modules()):
                module.use_nested_tensor = False
    skipped = [p for p in plan if p.action == "skip"]
    if skipped:
        lines = _grouped_lines(skipped)
        # stacklevel 3: the caller of tq.convert.
        warnings.warn(f"tq.convert left {len(skipped)} layer(s) in high precision:\n{lines}", ConversionWarning, stacklevel=3)
    return [_row(d) for d in plan]
