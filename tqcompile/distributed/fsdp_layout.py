"""What one FSDP2 quantized all-gather of a converted weight moves: which usages, in which buffer
layout and size, and which shard shapes keep scaling blocks whole (see `tqcompile.distributed.fsdp`,
whose module docstring draws the data flow). Pure shape arithmetic: no collectives, no FSDP2 state."""

from __future__ import annotations

import dataclasses
import math

import torch

from tqcompile.distributed.fsdp_tp import TPSplit
from tqcompile.quantizers import Granularity, Quantizer

_U8 = torch.uint8


def _transposable(q: Quantizer) -> bool:
    """The columnwise usage is the exact transpose of the rowwise one (same scale for each element)."""
    return q.layout()[0] in (Granularity.TENSORWISE, Granularity.BLOCKWISE_2D)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one gather of an (N, K) weight sharded over `world` ranks moves (see the module docstring)."""

    quantizer: Quantizer
    shape: tuple[int, int]
    world: int
    rowwise: bool
    columnwise: bool
    buffer_bytes: int  # per rank, equal in every gather of this weight
    high_precision: bool = False  # shards would cut blocks: gather param_dtype, quantize after
    tp: TPSplit | None = None  # a 2-D (TP x FSDP2) weight: the TP split its amaxes are also reduced over

    @property
    def rows(self) -> int:  # padded shard rows
        return math.ceil(self.shape[0] / self.world)

    def parts(self, rowwise: bool, columnwise: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(inner name, per-rank shape, dtype) of what a rank packs, in buffer order."""
        q, n, k = self.quantizer, self.rows, self.shape[1]
        out = []
        if rowwise:
            out.append(("_data", q.payload_shape((n, k)), q.element_format().storage_dtype))
            if q.layout()[0] is not Granularity.TENSORWISE:  # else one scale, equal on every rank
                out.append(("_scale_inv", q.scale_shape((n, k)), q.scale_dtype()))
        if columnwise:
            out.append(("_data_t", q.payload_shape((k, n)), q.element_format().storage_dtype))
            if q.layout()[0] is Granularity.BLOCKWISE_1D:
                out.append(("_scale_inv_t", q.scale_shape((k, n)), q.scale_dtype()))
        return out


def _nbytes(parts) -> int:
    return sum(math.prod(shape) * _itemsize(dtype) for _, shape, dtype in parts)


def _cut_blocks(q: Quantizer, shape: tuple[int, int], world: int, layer: str) -> str | None:
    """Why shards of `shape` over `world` ranks would cut `q`'s scaling blocks (None: they do not)."""
    n = math.ceil(shape[0] / world)
    gran, _, block = q.layout()
    extent, what = 1, []
    if gran is Granularity.BLOCKWISE_2D:
        extent, what = block, [f"its {block}x{block} blocks"]
    elif gran is Granularity.BLOCKWISE_1D:
        extent, what = block, [f"the columnwise (dgrad) blocks of {block} along dim 0"]
    if q.element_format().bits == 4 and extent % 2:
        extent, what = extent * 2, [*what, "4-bit packing"]
    if n % extent == 0:
        return None
    return (
        f"layer {layer!r}: its weight of shape {tuple(shape)} sharded over {world} ranks gives shards of {n} rows, which "
        f"cut {' and '.join(what)} ({q!r}; shard rows must be a multiple of {extent}). It is all-gathered in high "
        f"precision instead (same numerics, more bytes). To gather it quantized, make out_features a multiple of "
        f"{extent * world} or shard over fewer ranks; convert with fsdp_quantized_all_gather=False to silence this."
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _full_shapes(q: Quantizer, rows: int, k: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the unsharded QuantizedTensor's inner tensors (both usages), as gathered: a
    columnwise scale that `q.flat_columnwise_scale()` keeps flat is stored with `q.columnwise_scale_shape`."""
    return {
        "_data": q.payload_shape((rows, k)),
        "_scale_inv": q.scale_shape((rows, k)),
        "_amax": (),
        "_data_t": q.payload_shape((k, rows)),
        "_scale_inv_t": q.scale_shape((k, rows)),
        "_amax_t": (),
    }


def _transpose_payload(data: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The payload of the transpose; 4-bit payloads are unpacked (element 2i in the low nibble),
    transposed and packed again."""
    if q.element_format().bits != 4:
        return data.view(_U8).t().contiguous().view(data.dtype)
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2).t()
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
