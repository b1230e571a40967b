"""The geometry of scaling units: which elements share one scale, and the four ways code walks
them. Every quantizer maps onto one *layout* ``(granularity, axis, block)`` (`Quantizer.layout`):

=================  ====================================================  =====================
granularity        elements that share a scale                           scale shape for (…, M, K)
=================  ====================================================  =====================
TENSORWISE         all                                                   ()
ROWWISE            all along `axis` (one scale per row for axis=-1)      shape with axis set to 1
BLOCKWISE_1D       `block` consecutive elements of the last dim          (…, M, K/block)
BLOCKWISE_2D       `block` x `block` tiles of the last two dims          (…, M/block, K/block)
=================  ====================================================  =====================

`unit_amax` reduces a tensor to one value per unit, `expand` broadcasts one value per unit back
to the elements, `unit_sum` sums a per-element quantity per unit, and `unit_view` shows a 2-D
weight as its units (AWQ's clipping search). The kernels, fake quantization, calibration and AWQ
all use these; none writes its own.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["Granularity", "Layout", "TENSOR", "scale_shape", "unit_amax", "expand", "unit_sum", "unit_view"]


class Granularity(enum.Enum):
    """Which elements share one scale (see the table in `tqcompile.quantizers.geometry`)."""

    __module__ = "tqcompile.quantizers"  # the name pickles of quantizers hold (see tqcompile.quantizers)

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE_1D = "blockwise_1d"
    BLOCKWISE_2D = "blockwise_2d"


Layout = tuple[Granularity, int, int]
TENSOR: Layout = (Granularity.TENSORWISE, -1, 1)  # one unit: the whole tensor (a tensor-level amax)
BLOCKS = (Granularity.BLOCKWISE_1D, Granularity.BLOCKWISE_2D)


def scale_shape(shape: tuple[int, ...] | torch.Size, layout: Layout) -> tuple[int, ...]:
    """Shape of the per-unit tensor (scales, amaxes) of a tensor of `shape`."""
    gran, axis, block = layout
    shape = tuple(shape)
    if gran is Granularity.TENSORWISE:
        return ()
    if gran is Granularity.ROWWISE:
        axis %= len(shape)
        return shape[:axis] + (1,) + shape[axis + 1 :]
    if gran is Granularity.BLOCKWISE_1D:
        return shape[:-1] + (shape[-1] // block,)
    return shape[:-2] + (shape[-2] // block, shape[-1] // block)


def unit_amax(a: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Max of each scaling unit of the non-negative tensor `a`, in `scale_shape` (0 for empty units)."""
    gran, axis, block = layout
    if gran is Granularity.TENSORWISE:
        return a.amax() if a.numel() else a.new_zeros(())
    if gran is Granularity.ROWWISE:
        if a.shape[axis] == 0:
            return a.new_zeros(a.shape[: axis % a.dim()] + (1,) + a.shape[axis % a.dim() + 1 :])
        return a.amax(dim=axis, keepdim=True)
    if gran is Granularity.BLOCKWISE_1D:
        blocks = a.unflatten(-1, (a.shape[-1] // block, block))
        return blocks.amax(-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:-1])
    blocks = a.unflatten(-1, (a.shape[-1] // block, block)).unflatten(-3, (a.shape[-2] // block, block))
    return blocks.amax((-3, -1)) if blocks.numel() else blocks.new_zeros(blocks.shape[:-3] + blocks.shape[-2:-1])


def expand(per_unit: torch.Tensor, shape: torch.Size | tuple[int, ...], layout: Layout) -> torch.Tensor:
    """A per-unit tensor (in `scale_shape`, or flat, as a columnwise usage stores block scales)
    broadcast to the elements of a tensor of `shape`. Tensorwise, rowwise and 0-dim values
    broadcast as they are."""
    gran, _, block = layout
    if gran not in BLOCKS or per_unit.dim() == 0:
        return per_unit
    if gran is Granularity.BLOCKWISE_1D:
        per_unit = per_unit.reshape(*shape[:-1], shape[-1] // block)
        return per_unit.unsqueeze(-1).expand(*per_unit.shape, block).reshape(shape)
    s = per_unit
    return s[..., :, None, :, None].expand(*s.shape[:-2], s.shape[-2], block, s.shape[-1], block).reshape(shape)


def unit_sum(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Sum of `t` over each scaling unit, in `scale_shape`."""
    gran, axis, block = layout
    if gran is Granularity.TENSORWISE:
        return t.sum()
    if gran is Granularity.ROWWISE:
        return t.sum(axis, keepdim=True)
    if gran is Granularity.BLOCKWISE_1D:
        return t.unflatten(-1, (-1, block)).sum(-1)
    return t.unflatten(-1, (-1, block)).unflatten(-3, (-1, block)).sum((-3, -1))


def unit_view(w: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A 2-D (out, in) `w` as (R, rows, G, cols): unit (r, g) holds the elements ``[r, :, g, :]``
    (rowwise layouts along the input dim, axis -1 or 1)."""
    out_f, in_f = w.shape
    gran, _, block = layout
    if gran is Granularity.TENSORWISE:
        return w.reshape(1, out_f, 1, in_f)
    if gran is Granularity.ROWWISE:
        return w.reshape(out_f, 1, 1, in_f)
    if gran is Granularity.BLOCKWISE_1D:
        return w.reshape(out_f, 1, in_f // block, block)
    return w.reshape(out_f // block, block, in_f // block, block)
