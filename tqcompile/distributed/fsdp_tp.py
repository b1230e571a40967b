"""FSDP2's quantized all-gather of a weight that tensor parallelism also splits (a 2-D mesh).

On a (dp, tp) mesh a converted layer's weight is a DTensor over the TP mesh (tqcompile's
`ColwiseParallel` shards it on N, `RowwiseParallel` on K), and `fully_shard` on the dp mesh splits
each rank's TP-local piece again along its rows. FSDP2 calls `QuantizedWeight.fsdp_pre_all_gather`
on that FSDP shard of the TP-local piece, gathers over the dp group only, and wraps what
`fsdp_post_all_gather` returns (the TP-local `QuantizedTensor`) into a DTensor with the TP
placement again; the TP layer takes `weight.to_local()` and uses it as its fprop / dgrad operand
without quantizing it again (`tqcompile.distributed.tp_linear`).

So each rank quantizes a piece that *two* groups split, and every amax that piece cannot see whole
is MAX-reduced over each group that splits it, to equal the single-process scale bit for bit:

| amax | reduced over |
|---|---|
| tensor amax (FP8 tensorwise, delayed scaling, NVFP4's fp32 scale) | dp, then tp |
| per-column amax of the columnwise usage (FP8 rowwise) | dp, and tp where TP splits N (colwise) |
| per-row amax of the rowwise usage (FP8 rowwise) | tp where TP splits K (rowwise) |

Blocks (MX 32, FP8 1x128 / 128x128, NVFP4 16 / 16x16) reduce nothing: the TP style already refuses
a K or N split that cuts them, and FSDP's row split follows the 1-D rule (`fsdp_layout._cut_blocks`: a
warning, then a high-precision gather).

The gathered tensor records the **TP** group as its amax group: it is the group the TP layer would
have reduced over itself, and the layer checks it (a weight reduced over another group is refused).

Row order: FSDP2 chunks the TP-local tensor along dim 0 and gathers the chunks back in rank order,
so the gathered piece is the TP-local piece row for row, also when TP itself splits dim 0 with a
stride (a fused q/k/v weight placed `_StridedShard`); the global view FSDP2 keeps for the state
dict is its own affair (`_StridedShard` on the dp dim).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tqcompile.groups import all_reduce_amax
from tqcompile.quantizers import Granularity, Quantizer

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class TPSplit:
    """How the TP mesh splits the weight FSDP2 gathers: the TP group's name and the split dim
    (0: N, a colwise layer; 1: K, a rowwise layer)."""

    group: str
    dim: int


def tp_split(spec: Any, module: Any) -> TPSplit | None:
    """The TP split of a DTensor weight placed by `spec` (its DTensor spec before FSDP2 sharded it:
    `fsdp_state.ManagedParam.tp_spec`) when `module` is a tqcompile TP layer (whose forward takes a
    quantized local weight), else None (gathered in high precision, as before)."""
    if getattr(module, "_tp", None) is None:
        return None
    if spec is None or spec.mesh.ndim != 1:
        return None
    placement = spec.placements[0]
    if isinstance(placement, Replicate):
        return None
    # _StridedShard (a fused colwise weight) is no Shard subclass in torch 2.13; both have `dim`.
    if not isinstance(placement, (Shard, _StridedShard)) or placement.dim not in (0, 1):
        return None
    # The layer's own TP group, not the spec mesh's: the two have the same ranks, but a mesh made
    # again (init_device_mesh per run, as the sharded demo does) may resolve to another group
    # object of another name, and the layer checks the name it reduces over.
    tp = module._tp
    if spec.mesh.size() != tp.world:
        return None
    return TPSplit(tp.group, placement.dim)


def _finite_row_amax(x: torch.Tensor) -> torch.Tensor:
    # The reference kernel's per-row amax (fp32 |x|, non-finite values as 0): MAX is exact, so the
    # reduction over the ranks gives the whole row's amax bit for bit.
    a = x.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device)).amax(dim=1, keepdim=True)


def reduce_over_tp(
    q: Quantizer,
    split: TPSplit,
    x: torch.Tensor,
    tensor_amax: torch.Tensor | None,
    column_amax: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(tensor amax, per-column amax, per-row amax) of the whole weight, from the dp-reduced ones
    of this rank's piece `x` (the padded FSDP shard of the TP-local weight, in param dtype), in one
    MAX all-reduce over the TP group. The per-row amax is None unless TP splits K under a per-row
    (along K) scale; the per-column amax is reduced only where TP splits N."""
    row_amax = None
    if q.layout()[0] is Granularity.ROWWISE and split.dim == 1:
        row_amax = _finite_row_amax(x)
    parts = [t for t in (tensor_amax, column_amax if split.dim == 0 else None, row_amax) if t is not None]
    if not parts:
        return tensor_amax, column_amax, None
    sizes = [t.numel() for t in parts]
    reduced = all_reduce_amax(torch.cat([t.reshape(-1).float() for t in parts]), split.group).split(sizes)
    it = iter(reduced)
    if tensor_amax is not None:
        tensor_amax = next(it).reshape(tensor_amax.shape).to(tensor_amax.dtype)
    if column_amax is not None and split.dim == 0:
        column_amax = next(it).reshape(column_amax.shape).to(column_amax.dtype)
    if row_amax is not None:
        row_amax = next(it).reshape(row_amax.shape)
    return tensor_amax, column_amax, row_amax
