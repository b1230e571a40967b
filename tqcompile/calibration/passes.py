"""One calibration pass over the user's data, and the reduction of its statistics across ranks
(shared by the scale search and the weight transforms of `tq.calibrate`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tqcompile.surgery.names import unwrap

__all__ = ["run_loop", "reduce_stats", "CalibrationWarning", "REDUCE_BUCKET_BYTES"]

# Statistics are reduced in flat buckets of at most this many bytes (one collective each, as
# DDP buckets gradients); a larger tensor (a layer's float64 Hessian) is reduced where it lies.
REDUCE_BUCKET_BYTES = 16 * 2**20


class CalibrationWarning(UserWarning):
    """Something calibration did that a user should know: an unmatched rule, a skipped module,
    an expert that received no tokens."""


def run_loop(model: nn.Module, forward_loop, modules: list[nn.Module], desc: str, progress: bool) -> None:
    """Run `forward_loop(model)` once without gradients, with a progress bar counting the model's
    forward calls; raise if it never called the model (or any of `modules`)."""
    from tqdm.auto import tqdm

    bar = tqdm(desc=desc, unit=" batch", disable=not progress)
    calls = [0, 0]  # forward calls of the model, and of any converted module (a loop may call submodules)

    def count_model(*_):
        calls[0] += 1
        bar.update(1)

    def count_module(*_):
        calls[1] += 1

    # On the module inside any DDP / compile wrapper: calling the wrapper calls it too.
    handles = [unwrap(model).register_forward_pre_hook(count_model)]
    handles += [m.register_forward_pre_hook(count_module) for m in modules]
    try:
        with torch.no_grad():
            forward_loop(model)
    finally:
        for h in handles:
            h.remove()
        bar.close()
    if calls == [0, 0]:
        raise RuntimeError(
            f"tq.calibrate: forward_loop ({desc}) called neither the model nor any of the {len(modules)} layers being calibrated; "
            "it must run calibration data through the model, e.g. lambda m: [m(x) for x in batches]"
        )


def reduce_stats(tensors: list[torch.Tensor], groups, op=dist.ReduceOp.MAX) -> None:
    """Reduce every tensor in place over each group: per dtype, one collective per flat bucket of
    small tensors (`REDUCE_BUCKET_BYTES`), and one per larger tensor, reduced where it lies, so
    the reduction never holds a second copy of a layer's Hessians."""
    if not groups or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in ts:
            nbytes = t.numel() * t.element_size()
            if nbytes > REDUCE_BUCKET_BYTES and t.is_contiguous():
                for g in groups:
                    dist.all_reduce(t, op=op, group=g)
                continue
            if bucket and size + nbytes > REDUCE_BUCKET_BYTES:
                _reduce_flat(bucket, groups, op)
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            _reduce_flat(bucket, groups, op)


def _reduce_flat(ts: list[torch.Tensor], groups, op) -> None:
    flat = torch.cat([t.reshape(-1) for t in ts])
    for g in groups:
        dist.all_reduce(flat, op=op, group=g)
    for t, part in zip(ts, flat.split([t.numel() for t in ts])):
        t.copy_(part.view_as(t))
