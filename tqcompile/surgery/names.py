"""Canonical module names: a model's names without the components its wrappers add.

DDP and DataParallel hold the model as ``module``, `torch.compile` as ``_orig_mod``, torch's
activation-checkpoint wrapper as ``_checkpoint_wrapped_module`` and FSDP1 as
``_fsdp_wrapped_module``: a layer's raw name (``named_modules()``) then depends on how the model
was wrapped when it was asked. Everything tqcompile keys by layer (config rules, `tq.convert`'s
`filter_fn`, saved quantization state, DCP metadata, export) uses the canonical name instead, so
the same layer has one name wrapped or not.

Wrappers are recognised by type and only their own component is removed, as a whole path
component: a submodule a user named ``module`` keeps its name (a string match once turned
``encoder.submodule.fc`` into ``encoder.subfc``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["canonical_modules", "canonical_renamer", "unwrap", "wrapped_child"]


@functools.cache
def _wrappers() -> tuple[tuple[type, str], ...]:
    """(wrapper class, the attribute holding the wrapped module)."""
    # torch.compile's wrapper has no public name (checked on torch 2.11, 2.13, 2.14).
    from torch._dynamo.eval_frame import OptimizedModule

    found = [(nn.parallel.DistributedDataParallel, "module"), (nn.DataParallel, "module"), (OptimizedModule, "_orig_mod")]
    if torch.distributed.is_available():
        # checkpoint_wrapper's class lives in a private module, its only home (checked on torch 2.13, 2.14).
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
        from torch.distributed.fsdp import FullyShardedDataParallel

        found += [(ActivationWrapper, "_checkpoint_wrapped_module"), (FullyShardedDataParallel, "_fsdp_wrapped_module")]
    return tuple(found)


def wrapped_child(module: nn.Module) -> str | None:
    """The name of the child a wrapper `module` holds the wrapped model under; None for other modules."""
    for cls, attr in _wrappers():
        if isinstance(module, cls) and attr in module._modules:
            return attr
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside any number of DDP / DataParallel / torch.compile / activation
    checkpoint / FSDP1 wrappers (`model` itself when it is not wrapped).

    Example:
        >>> tq.surgery.unwrap(torch.compile(DDP(model))) is model
        True
    """
    while (attr := wrapped_child(model)) is not None:
        model = model._modules[attr]
    return model


def _walk(model: nn.Module) -> Iterator[tuple[str, str, nn.Module, bool]]:
    """(raw name, canonical name, module, is a wrapper) of every module, each once, in `named_modules` order."""
    seen: set[int] = set()

    def walk(mod: nn.Module, raw: str, canonical: str):
        if id(mod) in seen:
            return
        seen.add(id(mod))
        inner = wrapped_child(mod)
        yield raw, canonical, mod, inner is not None
        for name, child in mod._modules.items():
            if child is None:
                continue
            child_raw = f"{raw}.{name}" if raw else name
            yield from walk(child, child_raw, canonical if name == inner else (f"{canonical}.{name}" if canonical else name))

    yield from walk(model, "", "")


def canonical_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(canonical name, module) of every module of `model` except the wrappers themselves, each once,
    in `named_modules` order.

    Example:
        >>> dict(tq.surgery.canonical_modules(torch.compile(model))).keys() == dict(model.named_modules()).keys()
        True
    """
    for _, canonical, module, is_wrapper in _walk(model):
        if not is_wrapper:
            yield canonical, module


def canonical_renamer(model: nn.Module) -> Callable[[str], str]:
    """A function from a raw name of `model` (a module's, or a parameter's or buffer's, as
    `named_parameters` gives it) to its canonical name."""
    names = {raw: canonical for raw, canonical, _, _ in _walk(model)}

    def rename(fqn: str) -> str:
        if fqn in names:
            return names[fqn]
        owner, _, leaf = fqn.rpartition(".")
        prefix = names.get(owner, owner)
        return f"{prefix}.{leaf}" if prefix else leaf

    return rename
