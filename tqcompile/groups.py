"""Amax reduction groups, kept as *names* so they trace on every supported torch.

Measured (docs/concepts.md, "The amax group"): a ProcessGroup object in `__tensor_flatten__` metadata breaks compile when
the tensor is a graph input (Dynamo deep-copies metadata for its guard), and torch 2.11 does not
accept one as a flatten attribute. A group name is a plain string, and functional collectives
take it directly, so the name is what QuantizedTensor records.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

AmaxGroup = "dist.ProcessGroup | str | None"


def group_name_of(group: dist.ProcessGroup | str | None) -> str | None:
    """The name of `group` (a ProcessGroup or its name), or None. Errors if this rank is not in it."""
    if group is None or isinstance(group, str):
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "amax_group: this rank is not a member of the process group it was given "
            "(new_group returned GroupMember.NON_GROUP_MEMBER); pass a group this rank belongs to, or None"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"amax_group must be a torch.distributed.ProcessGroup, its group_name (str) or None; got {type(group).__name__}")
    return group.group_name


def resolve_group(name: str | None) -> dist.ProcessGroup | None:
    """The ProcessGroup registered under `name`.

    `_resolve_process_group` is private; it is the only way from a name back to the group
    (checked on torch 2.11 and 2.13).
    """
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def all_reduce_amax(amax: torch.Tensor, group_name: str) -> torch.Tensor:
    """MAX all-reduce of an amax over the group, as a functional collective (traceable)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(amax, "max", group_name))
