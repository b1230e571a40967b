"""What one FSDP2 quantized all-gather of a converted weight moves: which usages, in which buffer
layout and size, and which shard shapes keep scaling blocks whole (see `tqcompile.distributed.fsdp`,
whose module docstring draws the data flow), and the pure functions that pack a shard into that
buffer and unpack the gathered buffers. No collectives, no FSDP2 state."""

from __future__ import annotations

import dataclasses
import math

import torch

from tqcompile import ops
from tqcompile.distributed.fsdp_tp import TPSplit
from tqcompile.quantizers import Granularity, Quantizer

_U8 = torch.uint8


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
    fmt = q.element_format()
    if extent % fmt.pack_elements:
        extent, what = math.lcm(extent, fmt.pack_elements), [*what, f"{fmt.bits}-bit packing"]
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
    """The payload of the transpose; packed payloads (4-bit: element 2i in the low nibble) are
    unpacked, transposed and packed again."""
    codec = q.element_format().codec
    if codec.pack_elements == 1:
        return data.view(_U8).t().contiguous().view(data.dtype)
    return codec.pack(codec.unpack(data).t()).contiguous()


def padded_shard(shard: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's shard in `dtype` (what a high-precision gather would send), with zero rows (3-D:
    experts) up to the padded shard's `rows` (FSDP2 pads the last shard; zeros change no amax)."""
    x = shard.detach().to(dtype)
    if x.shape[0] < rows:
        x = torch.cat((x, x.new_zeros(rows - x.shape[0], *x.shape[1:])))
    return x


def pack(x: torch.Tensor, plan: _Plan, tensor_amax, column_amax, row_amax) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Quantize the padded shard `x` (param dtype) into one flat uint8 buffer of `plan.buffer_bytes`
    holding the usages `plan` moves; returns it with the scales that are not in it (equal on
    every rank, or per-row scales of the transpose made from the reduced `column_amax`).

    `tensor_amax` / `column_amax`: reduced over the shard group; `row_amax`: per-row amaxes along a
    TP-split K (`fsdp_tp`), else None."""
    q, n = plan.quantizer, plan.rows
    packed = []
    scales = {}
    if plan.rowwise:
        data, scale_inv = ops.quantize(x, q, tensor_amax if row_amax is None else row_amax, None)
        packed.append(data.view(_U8).reshape(-1))
        if any(name == "_scale_inv" for name, _, _ in plan.parts(True, False)):
            packed.append(scale_inv.view(_U8).reshape(-1))
        else:
            scales["_scale_inv"] = scale_inv
    if plan.columnwise:
        xt = x.t()
        if column_amax is not None:
            # Per-row scales of the transpose are per-column amaxes of the whole weight: plant the
            # reduced amax as an extra column, so the kernel's own row amax is the global one.
            data_t, scale_inv_t = ops.quantize(torch.cat((xt, column_amax[:, None]), 1), q, None, None)
            data_t = data_t[:, :n]
            scales["_scale_inv_t"] = scale_inv_t
        else:
            data_t, scale_inv_t = ops.quantize(xt, q, tensor_amax, None)
        packed.append(data_t.contiguous().view(_U8).reshape(-1))
        if "_scale_inv_t" not in scales:
            packed.append(scale_inv_t.view(_U8).reshape(-1))
    buf = torch.cat(packed) if packed else x.new_zeros(0, dtype=_U8)
    if buf.numel() < plan.buffer_bytes:
        buf = torch.cat((buf, buf.new_zeros(plan.buffer_bytes - buf.numel())))
    return buf, scales


def unpack(gathered: torch.Tensor, plan: _Plan, tensor_amax, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The unsharded QuantizedTensor's inner tensors, from every rank's buffer (`gathered`, rank
    after rank) and the scales that did not travel: the usages `plan` moved, dgrad's columnwise
    usage transposed from the rowwise one where `columnwise_is_transpose`, each a fresh contiguous tensor."""
    world, (rows, k), q = plan.world, plan.shape, plan.quantizer
    per_rank = gathered.view(_U8).view(world, -1)
    got: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape, dtype in plan.parts(plan.rowwise, plan.columnwise):
        size = math.prod(shape) * _itemsize(dtype)
        chunk = per_rank[:, offset : offset + size].contiguous().view(dtype).view(world, *shape)
        offset += size
        full = _full_shapes(q, rows, k)[name]
        if name in ("_data", "_scale_inv"):  # rank blocks stack along dim 0
            got[name] = chunk.reshape(world * shape[0], shape[1])[: full[0]]
        else:  # the columnwise usage's dim 1 is the sharded one
            got[name] = chunk.permute(1, 0, 2).reshape(shape[0], world * shape[1])[:, : full[1]]
    got.update(scales)
    if tensor_amax is not None:
        got["_amax"] = tensor_amax
        if plan.columnwise or q.columnwise_is_transpose():
            got["_amax_t"] = tensor_amax
    if q.columnwise_is_transpose():
        got["_data_t"] = _transpose_payload(got["_data"], q)
        got["_scale_inv_t"] = got["_scale_inv"].t()
    if "_scale_inv_t" in got and q.flat_columnwise_scale():  # gathered as (K, N // block), kept flat
        got["_scale_inv_t"] = got["_scale_inv_t"].reshape(-1)
    return {name: t.contiguous().clone() for name, t in got.items()}


def add_unfilled_usages(got: dict[str, torch.Tensor], plan: _Plan, has_tensor_amax: bool, device: torch.device) -> None:
    """Add to `got` the inner tensors of the usages this gather did not bring, poisoned (`poison`):
    every usage exists from the first gather on, since FSDP2 frees and refills these same tensors,
    and a pass that does not gather a usage does not read it."""
    (rows, k), q = plan.shape, plan.quantizer
    for name, shape in _full_shapes(q, rows, k).items():
        if name == "_scale_inv_t":
            shape = q.columnwise_scale_shape((k, rows))
        if name not in got and (has_tensor_amax or not name.startswith("_amax")):
            dtype = (
                torch.float32 if name.startswith("_amax") else q.scale_dtype() if "scale" in name else q.element_format().storage_dtype
            )
            got[name] = torch.empty(shape, dtype=dtype, device=device)
            if name in USAGE_PARTS:
                poison(got[name])


# A usage this gather did not bring holds NaN, not stale or uninitialised bytes (FSDP2 frees and
# refills these tensors). A forward recomputed after a backward re-gather gets both usages where
# `tqcompile.distributed.recompute` sees it coming, and raises where it reads an unfilled rowwise
# usage in Python (`fsdp._mark_rowwise`); what is left, a recompute inside a compiled backward graph
# that nothing declared, reads these NaN (which a ReLU's backward can still turn into zero gradients).
# 0xFF is NaN in E4M3, E5M2 and E8M0; NVFP4's E2M1 payload has no NaN, but its E4M3 block scales do,
# and fp32 scales are filled with NaN.
USAGE_PARTS = ("_data", "_scale_inv", "_data_t", "_scale_inv_t")


def poison(t: torch.Tensor) -> None:
    with torch.no_grad():
        if t.element_size() == 1:
            t.view(_U8).fill_(0xFF)
        else:
            t.fill_(float("nan"))
