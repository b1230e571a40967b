"""Which converted layers run their forward again during backward (activation checkpointing).

Why FSDP2's quantized all-gather needs to know (see `tqcompile.distributed.fsdp`): for weight
quantizers whose columnwise usage is not the transpose of the rowwise one (FP8 rowwise, MX, FP8
1x128 blocks), a layer that FSDP2 reshards after forward is gathered twice per step, the forward's
gather bringing the rowwise usage (fprop) and the backward's re-gather the columnwise one (dgrad).
A forward recomputed by activation checkpointing *inside* an FSDP unit runs after that unit's
backward re-gather (FSDP2's pre-forward hook does nothing while its unit is in backward), so it
reads the weight the backward gathered: that gather must then bring both usages.

FSDP2 fixes the size of a weight's all-gather buffer at its first gather, in the first forward,
before any recompute has happened, so the decision is made from the module structure, once:

- a `CheckpointWrapper` (`torch.distributed.algorithms._checkpoint.checkpoint_wrapper`) or a module
  given the composable `torch.distributed._composable.checkpoint`, anywhere on the path from the
  layer's FSDP2 unit, or from the FSDP2 root, down to the layer, both inclusive (`torch.compile`'d
  modules are looked through: their `_orig_mod` is a child module). A checkpoint *around* several
  units matters too: the non-reentrant checkpoint recomputes them when a unit's backward first
  needs a saved tensor, after that unit's pre-backward gather;
- a Hugging Face transformers decoder layer (`GradientCheckpointingLayer`) after
  `model.gradient_checkpointing_enable()`, which checkpoints its own forward;
- or the layer marked with `recompute_in_backward`, for what the structure cannot show
  (`torch.utils.checkpoint.checkpoint` called inside a forward).

`will_recompute_forward` answers for one layer; `fix_recompute` is what FSDP2's first gather of the
layer's weight asks, and it records the answer so that a later `recompute_in_backward` raises
instead of silently changing nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from torch import nn

from tqcompile.distributed.fsdp_state import fsdp_roots
from tqcompile.nn.base import is_converted

__all__ = ["recompute_in_backward", "will_recompute_forward", "fix_recompute"]

# Plain attributes on the converted layer (not the weight: FSDP2 replaces the parameter object when
# it shards it), written by this module only. Only FSDP2's all-gather hooks read them, outside any
# compiled code. _MARK: the switch `recompute_in_backward` sets; _FIXED: (the answer FSDP2's first
# gather of the layer's weight used, the layer's name there), see `fix_recompute`.
_MARK = "_tq_recompute_in_backward"
_FIXED = "_tq_recompute_fixed"


def _gathered_layer(module: nn.Module) -> bool:
    """A converted layer with a weight FSDP2 can gather quantized (the attention adapters have none)."""
    return is_converted(module) and isinstance(getattr(module, "weight", None), nn.Parameter)


def recompute_in_backward(module: nn.Module, enabled: bool = True) -> int:
    """Declare that the forward of every converted layer in `module` (itself included) may run again
    during backward, so that FSDP2's backward all-gather of their weights brings the rowwise usage
    (which the recomputed forward reads) along with the columnwise one (dgrad's).

    Needed only where the module structure cannot show it: `torch.utils.checkpoint.checkpoint`
    called inside a forward, within an FSDP2 unit that reshards after forward, for recipes whose
    weight usages are not transposes of each other (`mxfp8`, the FP8 rowwise recipes). A
    `checkpoint_wrapper`'d or composable-`checkpoint`'ed module is found without it. Call it after
    `tq.convert` and before the first forward (FSDP2 fixes its gather buffers then); it costs the
    backward gather the columnwise usage's bytes again (see docs/distributed.md). Returns how many
    layers it marked; raises ValueError if `module` holds no converted layer, or if FSDP2 already
    gathered one of their weights without it (too late: the gather sizes are fixed).

    Example:
        >>> model = tq.convert(model, tq.recipes.mxfp8())
        >>> tq.distributed.recompute_in_backward(model.blocks[0].mlp)  # its forward calls checkpoint(...)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"recompute_in_backward: module must be an nn.Module, got {type(module).__name__}")
    layers = [m for m in module.modules() if _gathered_layer(m)]
    if not layers:
        raise ValueError(
            f"recompute_in_backward: {type(module).__name__} holds no layer converted by tq.convert; call it after tq.convert"
        )
    for layer in layers:
        fixed = layer.__dict__.get(_FIXED)
        # FSDP2 sized this weight's gathers without the rowwise usage in backward: too late to change.
        if enabled and fixed is not None and not fixed[0]:
            raise ValueError(
                f"recompute_in_backward: layer {fixed[1]!r} was already all-gathered by FSDP2, which fixed what its "
                "backward gather brings; call recompute_in_backward before the first forward"
            )
    for layer in layers:
        setattr(layer, _MARK, bool(enabled))
    return len(layers)


def _checkpoints_forward(module: nn.Module) -> bool:
    """`module`'s forward is activation-checkpointed (recomputed in backward) by a torch wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if isinstance(module, CheckpointWrapper):
        return True
    # The composable API records itself in the module's registry of applied APIs; `_get_registry` is
    # private, and the only way to read it (checked on torch 2.11 and 2.13).
    from torch.distributed._composable.contract import _get_registry

    registry = _get_registry(module)
    if registry is not None and "checkpoint" in registry:
        return True
    return _hf_checkpointed(module)


def _hf_checkpointed(module: nn.Module) -> bool:
    """A Hugging Face transformers layer after `model.gradient_checkpointing_enable()`.

    transformers (checked on 5.23) wraps the `forward` of every `GradientCheckpointingLayer` (each
    decoder layer) in `torch.utils.checkpoint` while the layer's `gradient_checkpointing` is True and
    it trains; inside a compiled layer the recompute then runs in the compiled backward, where no
    check of ours can run, so it must be found here. tqcompile does not import transformers: a
    model's layer can only be one if transformers is already imported.
    """
    layers = sys.modules.get("transformers.modeling_layers")
    base = getattr(layers, "GradientCheckpointingLayer", None)
    return base is not None and isinstance(module, base) and getattr(module, "gradient_checkpointing", False) is True


def _path(top: nn.Module, layer: nn.Module) -> list[nn.Module] | None:
    """The modules from `top` down to `layer`, both included, or None if `layer` is not in `top`."""
    if top is layer:
        return [top]
    for child in top.children():
        below = _path(child, layer)
        if below is not None:
            return [top, *below]
    return None


def will_recompute_forward(layer: nn.Module, fsdp_modules: Iterable[nn.Module]) -> bool:
    """Whether `layer`'s forward runs again during backward: it is marked with `recompute_in_backward`,
    or a module from an FSDP2 module down to it is activation-checkpointed. `fsdp_modules`: those of
    the FSDP2 parameter group that gathers its weight; the FSDP2 roots are searched too, since a
    checkpoint around several FSDP2 units recomputes a unit whose backward gather already ran (the
    non-reentrant checkpoint recomputes when the unit's backward first needs a saved tensor, after
    the unit's pre-backward hook)."""
    if getattr(layer, _MARK, False):
        return True
    for top in [*fsdp_modules, *fsdp_roots()]:
        path = _path(top, layer)
        if path is not None and any(_checkpoints_forward(m) for m in path):
            return True
    return False


def fix_recompute(layer: nn.Module, fsdp_modules: Iterable[nn.Module], name: str) -> bool:
    """`will_recompute_forward(layer, fsdp_modules)`, decided once: FSDP2's first all-gather of the
    weight of `layer` (called `name` in messages) asks, as FSDP2 fixes the buffer size there; later
    calls return the same answer, and `recompute_in_backward` refuses to change it."""
    fixed = layer.__dict__.get(_FIXED)
    if fixed is None:
        fixed = (will_recompute_forward(layer, fsdp_modules), name)
        setattr(layer, _FIXED, fixed)
    return fixed[0]
