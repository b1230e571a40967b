"""Distributed pieces: amax reduction groups (more arrives with the FSDP2 and TP issues)."""

from tqcompile.distributed.groups import all_reduce_amax, group_name_of, resolve_group

__all__ = ["all_reduce_amax", "group_name_of", "resolve_group"]
