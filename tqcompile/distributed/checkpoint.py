"""`torch.distributed.checkpoint` (DCP) save and load of converted models, sharded or not.

A converted model's state dict has exactly `nn.Linear`'s keys, and `save` writes the
high-precision tensors the FSDP2 weight wrapper (`QuantizedWeight`) holds, so DCP reshards it like
any model: a
checkpoint saved by FSDP2 on 2 ranks loads into 1 process and the other way round. What DCP cannot
check is that the checkpoint was made for the same quantization: `save` adds one entry, the recipe
of every converted layer, and `load` compares it before it loads anything else.

Every collective happens inside `dcp.save`/`dcp.load` and torch's state-dict helpers; nothing here
runs one during the checkpointer's traversal.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils._pytree import tree_map_only

__all__ = ["save", "load", "quantization_metadata", "CheckpointMismatchError"]

_KEY = "tqcompile_quantization"
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class CheckpointMismatchError(ValueError):
    """A checkpoint made for another model or another quantization recipe."""


def _clean(fqn: str) -> str:
    # Wrappers (compile, DDP, activation checkpointing) add prefixes that are not part of the model.
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


def quantization_metadata(model: nn.Module) -> dict[str, str]:
    """{layer name: its recipe's repr} for every converted layer of `model` (wrapper prefixes removed)."""
    from tqcompile.nn.linear import _Quantized

    return {_clean(name): repr(m.recipe) for name, m in model.named_modules() if isinstance(m, _Quantized)}


def _plain(value):
    """The high-precision tensor a `QuantizedWeight` (or a DTensor of one) holds, sharing its storage,
    so the files hold plain tensors that any process can load (with `weights_only=True`)."""
    from torch.distributed.tensor import DTensor

    from tqcompile.distributed.fsdp import QuantizedWeight

    if isinstance(value, DTensor) and isinstance(value._local_tensor, QuantizedWeight):
        return DTensor.from_local(
            value._local_tensor._tensor,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value._tensor if isinstance(value, QuantizedWeight) else value


def _check_describable(model: nn.Module) -> None:
    """Refuse, before any collective, a parameter whose DTensor placements do not describe it.

    Measured on torch 2.13: FSDP2 on the dp dim of a weight that a fused `ColwiseParallel`
    (`fused_chunks` > 1, placed `_StridedShard(0)` over TP) already splits on dim 0 places it
    `(_StridedShard(0), _StridedShard(0))`, whose global view is not the weight (`full_tensor()`
    reorders its rows, and DCP's planner rejects the overlapping chunks). Every rank holds the same
    parameters, so every rank raises here alike."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or len(p.placements) < 2:
            continue
        inner = p.placements[-1]
        if isinstance(inner, _StridedShard) and any(getattr(pl, "dim", None) == inner.dim for pl in p.placements[:-1]):
            raise ValueError(
                f"checkpoint.save: parameter {_clean(name)!r} is placed {p.placements}: FSDP2 sharded a fused "
                "ColwiseParallel weight (fused_chunks > 1) along the same dim again, a layout DTensor cannot describe, "
                "so its checkpoint would hold its rows in the wrong order. Parallelize that layer with fused_chunks=1 "
                "(separate projections), or leave it out of fully_shard's dp sharding"
            )


def save(model: nn.Module, optimizer: torch.optim.Optimizer | None, checkpoint_id: str | os.PathLike) -> None:
    """Save `model` (and `optimizer`) with DCP, sharded as they are, plus the quantization metadata.

    Call it on every rank. Example:
        >>> tq.distributed.checkpoint.save(model, optimizer, "ckpt/step100")
    """
    import torch.distributed.checkpoint as dcp

    _check_describable(model)
    state = {"model": get_model_state_dict(model), _KEY: json.dumps(quantization_metadata(model), sort_keys=True)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(tree_map_only(torch.Tensor, _plain, state), checkpoint_id=checkpoint_id)


def _check(saved: dict[str, str], current: dict[str, str], checkpoint_id) -> None:
    problems = []
    for name in sorted(saved.keys() | current.keys()):
        if name not in current:
            problems.append(f"layer {name!r} is quantized in the checkpoint ({saved[name]}) but not in the model")
        elif name not in saved:
            problems.append(f"layer {name!r} is quantized in the model ({current[name]}) but not in the checkpoint")
        elif saved[name] != current[name]:
            problems.append(f"layer {name!r}: checkpoint recipe {saved[name]}, model recipe {current[name]}")
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointMismatchError(
            f"checkpoint {str(checkpoint_id)!r} was saved for another quantization of this model:\n  {shown}\n"
            "Convert the model with the checkpoint's recipe (tq.convert) before loading, or load into the model it was saved from."
        )


def load(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, checkpoint_id: str | os.PathLike, *, strict: bool = True
) -> None:
    """Load a checkpoint written by `save` into `model` (and `optimizer`), in whatever layout they
    now have (FSDP2 on any number of ranks, or one process). Raises `CheckpointMismatchError` if
    the checkpoint's converted layers or recipes differ from the model's, before loading anything.

    Example:
        >>> tq.distributed.checkpoint.load(model, optimizer, "ckpt/step100")
    """
    import torch.distributed.checkpoint as dcp

    meta = {_KEY: ""}
    try:
        dcp.load(meta, checkpoint_id=checkpoint_id)
    except Exception as e:  # DCP's error for a missing key is long; say what is missing
        if _KEY in str(e) or "Missing key" in str(e):
            raise CheckpointMismatchError(
                f"checkpoint {str(checkpoint_id)!r} has no tqcompile quantization metadata; it was not written by "
                "tq.distributed.checkpoint.save (load it with torch.distributed.checkpoint directly)"
            ) from e
        raise
    _check(json.loads(meta[_KEY]), quantization_metadata(model), checkpoint_id)
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
