"""Reading a model's tensors from a checkpoint directory one at a time (`tq.export(checkpoint=...)`,
`tq.quantize_checkpoint`)."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from tqcompile.export.files import CheckpointFiles
from tqcompile.export.names import Placement, placements, put_placed
from tqcompile.export.units import ExportError
from tqcompile.surgery.names import canonical_modules

__all__ = ["safetensors_reader", "trim_heap"]


def safetensors_reader(path: str, model: nn.Module):
    """``read(key, value)`` of one of `model`'s tensors (by its canonical state-dict name) from the
    safetensors checkpoint in `path`, read when asked. Where the checkpoint holds it as several
    tensors (transformers saves fused experts per expert: ``experts.3.gate_proj.weight``), they are
    put together as `tq.export` splits them (`tqcompile.export.names.placements`)."""
    files = CheckpointFiles(path)
    shapes = {f"{n}.{k}" if n else k: p.shape for n, m in canonical_modules(model) for k, p in m._parameters.items() if p is not None}
    where = placements(model, shapes)

    def read(key: str, value: torch.Tensor) -> torch.Tensor:
        trim_heap()  # the previous tensor's copies, freed: back to the system before the next one comes
        parts = where.get(key, [Placement(key)])
        lost = [p.name for p in parts if p.name not in files.entries]
        if lost:
            raise ExportError(f"tq.export: the checkpoint {path!r} holds no tensor {lost[0]!r} (of the model's {key!r}); was it saved from this model?")
        if len(parts) == 1 and parts[0].name == key:
            t = files.get(key)
            if tuple(t.shape) != tuple(value.shape):
                raise ExportError(f"tq.export: {path!r}'s {key!r} is {list(t.shape)}; the model's is {list(value.shape)}")
            return t
        first = files.get(parts[0].name)
        out, mismatch = torch.empty(value.shape, dtype=first.dtype), []
        for p in parts:
            put_placed(out, first if p is parts[0] else files.get(p.name), p, value.dim() == 3, 1, mismatch, p.name)
        if mismatch:
            raise ExportError(f"tq.export: {path!r}: {mismatch[0]}")
        return out

    return read


def trim_heap() -> None:
    """Give freed heap memory back to the operating system (glibc's `malloc_trim`; elsewhere nothing).
    A weight's float copy and its quantization's temporaries, freed, otherwise stay in the
    process's heap as fragments that the next weight's sizes do not fit: `tq.quantize_checkpoint`
    of a Llama at hidden 2048 measured +45 MiB resident a layer without it (peak 860 MiB at 4
    layers, 1191 at 16), flat with it (804, 813)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
