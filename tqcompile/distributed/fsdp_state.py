"""FSDP2's private state, read in this one module (as Transformer Engine's `_get_module_fsdp_state`).

Private; why: nothing public says which FSDP2 parameter group manages a sharded tensor, whether
the all-gather running now is the forward's or the backward's, whether the backward will gather
again (`reshard_after_forward`), which modules are FSDP2 roots, or how a parameter was placed on a
TP mesh before FSDP2 sharded it; and those decide what a quantized all-gather must carry
(`tqcompile.distributed.fsdp`). Checked on torch 2.13 (every name here) and 2.11
(`_fsdp_param_group` instead of `_fsdp_param_groups`); `_tp_spec` is the name earlier releases
give `_unsharded_dtensor_spec` in their source (not run here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__: list[str] = []  # used by tqcompile.distributed's FSDP2 code; nothing public


@dataclasses.dataclass(frozen=True)
class ManagedParam:
    """The FSDP2 parameter group (`FSDPParamGroup`) and parameter (`FSDPParam`) that manage one
    sharded tensor; every question the quantized all-gather asks FSDP2 goes through here."""

    group: Any
    param: Any

    def in_backward(self) -> bool:
        """The all-gather running now is the backward's re-gather."""
        return self.group._training_state.name == "PRE_BACKWARD"

    def reshards_after_forward(self) -> bool:
        """The backward gathers the weight again (`fully_shard(..., reshard_after_forward=True)`)."""
        return bool(self.group._reshard_after_forward)

    def modules(self) -> tuple[nn.Module, ...]:
        """The modules `fully_shard` was applied to for this group."""
        return tuple(self.group.modules)

    def param_name(self) -> str:
        """The parameter's name on the module that holds it (`modules()` are the FSDP2 units)."""
        return self.param._module_info.param_name

    def shard_dim(self) -> int:
        return self.param.fsdp_placement.dim

    def shard_group(self) -> dist.ProcessGroup:
        return self.param.shard_mesh.get_group()

    def is_dtensor(self) -> bool:
        """The parameter was a DTensor (a TP mesh) before FSDP2 sharded it."""
        return bool(getattr(self.param, "is_dtensor", False))

    def tp_spec(self) -> Any | None:
        """The DTensor spec (TP mesh and placement) of an `is_dtensor` parameter before FSDP2 sharded it."""
        return getattr(self.param, "_unsharded_dtensor_spec", None) or getattr(self.param, "_tp_spec", None)


def find_managed(tensor: torch.Tensor) -> ManagedParam | None:
    """The FSDP2 group and parameter that hold `tensor` as their sharded local tensor, or None."""
    from torch.distributed._composable_state import _module_state_mapping

    for ref in list(_module_state_mapping.values()):
        state = ref()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for fsdp_param in group.fsdp_params:
                if fsdp_param._sharded_local_tensor is tensor:
                    return ManagedParam(group, fsdp_param)
    return None


def fsdp_roots() -> list[nn.Module]:
    """The modules of the root FSDP2 states (set at the root's lazy init, before its first gather)."""
    from torch.distributed._composable_state import _module_state_mapping

    roots = []
    for module, ref in list(_module_state_mapping.items()):
        state = ref()
        if getattr(state, "_is_root", False):
            roots.append(module)
    return roots


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local tensor (a 2-D TP x FSDP2 parameter, or the
    unsharded parameter FSDP2 refills), else `t` itself. `_local_tensor` rather than `to_local()`:
    no autograd view, the very object FSDP2 refills."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t
