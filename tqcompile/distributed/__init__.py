"""Distributed pieces: amax reduction groups (re-exported from `tqcompile.groups`, which sits below
`tqcompile.tensor`), FSDP2 quantized all-gather, DCP checkpoints,
tensor/sequence-parallel styles for converted layers, and expert parallelism for converted MoE experts."""

from tqcompile.distributed import checkpoint, tensor_parallel
from tqcompile.distributed.expert_dispatch import ExpertParallelDispatch, expert_parallel
from tqcompile.distributed.fsdp import (
    QuantizedAllGatherWarning,
    QuantizedWeight,
    enable_quantized_all_gather,
    quantized_all_gather_reason,
)
from tqcompile.distributed.precompute import precompute_scales
from tqcompile.distributed.recompute import recompute_in_backward
from tqcompile.distributed.tensor_parallel import (  # noqa: F401  (listed in __all__ through tensor_parallel.__all__)
    ColwiseParallel,
    PrepareModuleInput,
    QuantizedSequenceParallelInput,
    RowwiseParallel,
    SequenceGatheredInput,
    SequenceParallel,
)
from tqcompile.groups import all_reduce_amax, group_name_of, resolve_group

__all__ = [
    "QuantizedAllGatherWarning",
    "enable_quantized_all_gather",
    "expert_parallel",
    "precompute_scales",
    "recompute_in_backward",
    "checkpoint",
    *tensor_parallel.__all__,  # ColwiseParallel, RowwiseParallel, ... (imported above)
]

