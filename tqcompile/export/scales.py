"""Scales in a checkpoint, back and forth, for every checkpoint format: where a format keeps a
global scale (`GlobalScaleTensor`), the fp32 amax whose scale is a checkpoint's (`amax_for_scale`,
the search `tq.load_exported` runs), and what is wrong with a tensor of scales (`bad_values`).

tq computes a scale from an amax with one or two fp32 roundings (``scale_inv = 1 / (qmax /
amax)``), so the amax is searched among the fp32 values a few ulps around an estimate for one
whose scale, computed as tq computes it, is the checkpoint's exactly. For a checkpoint tq wrote
one always exists; a scale another tool computed (``amax / qmax``) may have none, and then the
nearest is taken (an ulp of the scale away; counted as inexact).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from tqcompile.quantizers import Quantizer
from tqcompile.quantizers.scaling import scale_from_amax

__all__ = ["GlobalScaleTensor", "amax_for_scale", "scale_inv_of", "scaled_amax", "bad_values"]

_ULPS = 8  # the amax search's reach either side of its estimate (tq's own scales need at most 3)


@dataclasses.dataclass(frozen=True)
class GlobalScaleTensor:
    """Where a checkpoint format keeps the global scale of a quantizer that has one
    (`Quantizer.has_global_scale`: NVFP4's ``s_enc = 448 * 6 / amax``): the layer's tensor `name`,
    and whether it holds the `reciprocal` ``1 / s_enc`` (ModelOpt) or ``s_enc`` itself
    (compressed-tensors). Writing and reading both ask it, so they cannot disagree."""

    name: str
    reciprocal: bool

    def stored(self, s_enc: torch.Tensor) -> torch.Tensor:
        """The value written for the global scale `s_enc`."""
        return 1.0 / s_enc if self.reciprocal else s_enc


def amax_for_scale(
    target: torch.Tensor, scale_of: Callable[[torch.Tensor], torch.Tensor], estimate: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The fp32 amax, per element of `target`, whose scale as tq computes it (`scale_of`) is the
    checkpoint's `target`: searched within `_ULPS` ulps of `estimate`, nearest first; where none
    gives it exactly, the candidate whose scale is closest. Returns (amax, how many are inexact)."""
    start = estimate.float()
    cands, up, down = [start], start, start
    for _ in range(_ULPS):
        up, down = torch.nextafter(up, torch.full_like(up, math.inf)), torch.nextafter(down, torch.zeros_like(down))
        cands += [up, down]
    c = torch.stack(cands)
    err = (scale_of(c) - target.float()).abs()
    err = torch.where(torch.isnan(err), math.inf, err)
    best = err.argmin(0, keepdim=True)  # the first minimum: the candidate nearest the estimate
    return c.gather(0, best)[0], int((err.gather(0, best) != 0).sum())


def scale_inv_of(q: Quantizer) -> Callable[[torch.Tensor], torch.Tensor]:
    """amax -> the `scale_inv` an amax-scaled quantizer (FP8, INT) stores for it, as its reference
    kernel computes it (`tqcompile.quantizers.scaling.scale_from_amax`, without power-of-two rounding)."""
    fmax = q.scale_max()
    return lambda a: 1.0 / scale_from_amax(a, fmax, q.amax_epsilon, False)


def scaled_amax(scale: torch.Tensor, q: Quantizer) -> tuple[torch.Tensor, int]:
    """The amaxes whose `scale_inv_of(q)` are the checkpoint's `scale` (``amax = scale * qmax``,
    searched), and how many are inexact."""
    s = scale.float()
    return amax_for_scale(s, scale_inv_of(q), s * q.scale_max())


def bad_values(t: torch.Tensor, zero_ok: bool) -> str | None:
    """What is wrong with a tensor of scales, or None: NaN, infinities, negatives, zeros."""
    v = t.float()
    for what, mask in (("NaN", torch.isnan(v)), ("infinite", torch.isinf(v)), ("negative", v < 0), ("zero", None if zero_ok else v == 0)):
        if mask is not None and bool(mask.any()):
            first = tuple(int(i) for i in mask.nonzero()[0]) if v.dim() else ()
            return f"{int(mask.sum())} {what} value(s) (the first at index {first}: {v[first].item()})"
    return None
