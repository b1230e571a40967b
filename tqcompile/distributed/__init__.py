"""Distributed pieces: amax reduction groups, FSDP2 quantized all-gather, DCP checkpoints, and
tensor/sequence-parallel styles for converted layers."""

from tqcompile.distributed import checkpoint
from tqcompile.distributed.fsdp import (
    QuantizedAllGatherWarning,
    QuantizedWeight,
    enable_quantized_all_gather,
    quantized_all_gather_reason,
)
from tqcompile.distributed.groups import all_reduce_amax, group_name_of, resolve_group
from tqcompile.distributed.precompute import precompute_scales
from tqcompile.distributed.recompute import recompute_in_backward

_TENSOR_PARALLEL = (
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "QuantizedSequenceParallelInput",
    "SequenceGatheredInput",
)

__all__ = [
    "all_reduce_amax",
    "group_name_of",
    "resolve_group",
    "QuantizedWeight",
    "QuantizedAllGatherWarning",
    "enable_quantized_all_gather",
    "precompute_scales",
    "quantized_all_gather_reason",
    "recompute_in_backward",
    "checkpoint",
    *_TENSOR_PARALLEL,
]


def __getattr__(name: str):
    # Imported on first use: tensor_parallel needs tqcompile.api and tqcompile.nn, which import
    # this package (for groups) while tqcompile itself is still importing.
    if name in _TENSOR_PARALLEL:
        from tqcompile.distributed import tensor_parallel

        return getattr(tensor_parallel, name)
    raise AttributeError(f"module 'tqcompile.distributed' has no attribute {name!r}")
