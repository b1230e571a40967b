"""Distributed pieces: amax reduction groups, FSDP2 quantized all-gather, DCP checkpoints
(tensor/sequence-parallel styles arrive with the TP work)."""

from tqcompile.distributed import checkpoint
from tqcompile.distributed.fsdp import (
    QuantizedAllGatherWarning,
    QuantizedWeight,
    enable_quantized_all_gather,
    precompute_scales,
    quantized_all_gather_reason,
)
from tqcompile.distributed.groups import all_reduce_amax, group_name_of, resolve_group

__all__ = [
    "all_reduce_amax",
    "group_name_of",
    "resolve_group",
    "QuantizedWeight",
    "QuantizedAllGatherWarning",
    "enable_quantized_all_gather",
    "precompute_scales",
    "quantized_all_gather_reason",
    "checkpoint",
]
