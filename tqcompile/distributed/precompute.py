"""`precompute_scales`: the amaxes of every FSDP2-gathered weight in one batched pass, so the
all-gathers of the next forward run no collective of their own (see `tqcompile.distributed.fsdp`)."""

from __future__ import annotations

import torch
from torch import nn

from tqcompile.distributed.fsdp import QuantizedWeight, managed_param
from tqcompile.distributed.fsdp_amax import shard_amaxes
from tqcompile.distributed.fsdp_state import local_tensor
from tqcompile.groups import all_reduce_amax

__all__ = ["precompute_scales"]


def precompute_scales(model: nn.Module) -> int:
    """Compute the amaxes of every FSDP2-gathered weight of `model` now, in one batched pass and one
    MAX all-reduce per shard group, so the next all-gathers run no collective of their own.

    Call it after `optimizer.step()`. Optional: the all-gathers compute the same amaxes themselves
    when it is not called (or when a weight changed after it), so results are bit-identical either
    way. Returns how many weights it prepared.

    Example:
        >>> loss.backward(); optimizer.step(); tq.distributed.precompute_scales(model)
    """
    by_group: dict[str | None, list[tuple[QuantizedWeight, torch.Tensor | None, torch.Tensor | None]]] = {}
    for p in model.parameters():
        w = local_tensor(p)
        if not isinstance(w, QuantizedWeight) or w.dim() == 3:
            continue  # 3-D expert weights: each rank quantizes its own whole experts, no amax to reduce (fsdp_experts)
        found = managed_param(w)
        name = found.shard_group().group_name if found is not None else None
        by_group.setdefault(name, []).append((w, *shard_amaxes(w.quantizer, w._tensor)))
    count = 0
    for name, items in by_group.items():
        flat = [x.reshape(-1) for _, t, c in items for x in (t, c) if x is not None]
        reduced = all_reduce_amax(torch.cat(flat), name) if flat and name is not None else (torch.cat(flat) if flat else None)
        offset = 0
        for w, t, c in items:
            parts = []
            for x in (t, c):
                if x is None:
                    parts.append(None)
                else:
                    parts.append(reduced[offset : offset + x.numel()].reshape(x.shape))
                    offset += x.numel()
            w.amaxes.set_reduced(*parts)
            count += 1
    return count
