"""The amaxes of one FSDP2-sharded weight, reused while the weight is unchanged.

A quantized all-gather needs the amaxes of the *whole* weight where a shard cannot see them whole
(`tqcompile.distributed.fsdp`): a collective per gather. The weight does not change between the
forward's gather, the backward's re-gather and a `precompute_scales` call, so each amax is
computed once per weight version and reused; delayed scaling rolls its history once per forward.
"""

from __future__ import annotations

import torch

from tqcompile import ops
from tqcompile.distributed.fsdp_layout import padded_shard
from tqcompile.distributed.fsdp_tp import TPSplit, reduce_over_tp
from tqcompile.groups import all_reduce_amax
from tqcompile.quantizers import Granularity, Quantizer

__all__: list[str] = []  # used by tqcompile.distributed's FSDP2 code; nothing public

Amaxes = tuple[torch.Tensor | None, torch.Tensor | None]


def shard_amaxes(q: Quantizer, shard: torch.Tensor) -> Amaxes:
    """(tensor amax, per-column amax) of this rank's shard in fp32, the parts `q` needs, before any
    reduction over the shard group."""
    tensor_amax = ops.amax(shard, q) if q.uses_tensor_amax() else None
    column_amax = None
    if q.layout()[0] is Granularity.ROWWISE:
        a = shard.detach().float().abs()
        column_amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(0) if a.shape[0] else a.new_zeros(a.shape[1])
    return tensor_amax, column_amax


class WeightAmaxCache:
    """The reduced amaxes of one weight, valid for one `version` of it.

    `version` counts the weight's in-place updates: `QuantizedWeight.__torch_dispatch__` calls
    `changed()` on each (the inner tensor's own version counter does not move under
    `__torch_dispatch__`, which runs below ADInplaceOrView)."""

    def __init__(self) -> None:
        self.version = 0
        self._reduced: tuple[int, torch.Tensor | None, torch.Tensor | None] | None = None
        self._over_tp: tuple[tuple[int, torch.dtype], tuple] | None = None
        self._forward: tuple[int, torch.Tensor] | None = None  # (version, amax the forward's gather scaled with)

    def changed(self) -> None:
        self.version += 1

    def set_reduced(self, tensor_amax: torch.Tensor | None, column_amax: torch.Tensor | None) -> None:
        """Record amaxes already reduced over the shard group (`precompute_scales` batches them)."""
        self._reduced = (self.version, tensor_amax, column_amax)

    def reduced(self, q: Quantizer, shard: torch.Tensor, group_name: str | None) -> Amaxes:
        """The fp32 amaxes of the whole weight: this shard's, MAX-reduced over `group_name` in one collective."""
        if self._reduced is not None and self._reduced[0] == self.version:
            return self._reduced[1], self._reduced[2]
        t, c = shard_amaxes(q, shard)
        flat = [x.reshape(-1) for x in (t, c) if x is not None]
        if flat and group_name is not None:
            reduced = all_reduce_amax(torch.cat(flat), group_name)
            t, c = (reduced[0], reduced[1:]) if t is not None else (None, reduced)
            if c is not None and c.numel() == 0:
                c = None
        self.set_reduced(t, c)
        return t, c

    def over_tp(
        self, q: Quantizer, split: TPSplit, shard: torch.Tensor, rows: int, param_dtype: torch.dtype, tensor_amax, column_amax
    ):
        """`fsdp_tp.reduce_over_tp` of the dp-reduced amaxes of `shard` (padded to `rows` in
        `param_dtype`: zero rows change no amax), cached per version and param dtype, so a backward
        re-gather of an unchanged weight runs no collective."""
        key = (self.version, param_dtype)
        if self._over_tp is None or self._over_tp[0] != key:
            padded = padded_shard(shard, rows, param_dtype)
            self._over_tp = (key, reduce_over_tp(q, split, padded, tensor_amax, column_amax))
        return self._over_tp[1]

    def delayed(self, history: torch.Tensor, amax: torch.Tensor, in_backward: bool) -> torch.Tensor:
        """Delayed scaling: the forward's gather rolls the weight's `history` once (as the layer does
        once per forward); a backward re-gather reuses the amax that forward scaled with."""
        if in_backward and self._forward is not None and self._forward[0] == self.version:
            return self._forward[1]
        used = ops.amax_history_update(history, amax)
        self._forward = (self.version, used)
        return used
