"""Weights a serving engine fuses into one GEMM, and the one NVFP4 global amax they share.

vLLM and TensorRT-LLM load q/k/v, gate/up (and the other families of `FUSED_SIBLINGS`: an engine
fact, kept with the others in `tqcompile.engines`) as one GEMM with one NVFP4 global scale for the
fused weight, so a checkpoint holds one global scale for such siblings. tq gives them that one tensor amax, the max of theirs (a smaller one would saturate
the sibling holding the largest value), in the model's own calibrated state, so that the model's
forward, QAT, `tq.quant_state` / `tq.restore` and `tq.export` all compute with the same one:

- `tq.calibrate` sets it after every algorithm (`share_fused_weight_amax`); GPTQ rounds the
  siblings under it from the start (`fused_nvfp4_groups`, `shared_amax` of their weights);
- `tq.restore` and `tq.load_exported` set it on what they load (a state saved by an older tq, a
  checkpoint of another tool that holds different amaxes for siblings: warned);
- `tq.export` writes it; for a `tq.convert`ed model, whose training computed each weight's amax
  from the weight, it shares them there.

When calibration kept each sibling's own amax and only the export shared it, the served k_proj,
v_proj and up_proj differed from the calibrated model's by a quantization step (SQNR 21 dB between
them on a tiny Llama; issue 25). Per-expert weights (one amax per expert) are not grouped here.

This file is the one place the rule lives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch
from torch import nn

from tqcompile.engines import FUSED_SIBLINGS, fused_family  # FUSED_SIBLINGS re-exported: its home is tqcompile.engines
from tqcompile.quantizers import Quantizer

__all__ = ["FUSED_SIBLINGS", "fused_nvfp4_groups", "shared_amax", "share_fused_weight_amax"]

T = TypeVar("T")


def fused_nvfp4_groups(items: Iterable[tuple[str, T]], quantizer_of: Callable[[T], Quantizer | None]) -> list[list[tuple[str, T]]]:
    """The groups of `items` ((canonical name, item) pairs) that an engine serves under one NVFP4
    global scale: two or more siblings of one `FUSED_SIBLINGS` family under one parent module, each
    with ``quantizer_of(item)`` a quantizer with a global scale (NVFP4's, `Quantizer.has_global_scale`;
    return None to leave an item out)."""
    families: dict[tuple[str, tuple[str, ...]], list[tuple[str, T]]] = {}
    for name, item in items:
        parent, _, leaf = name.rpartition(".")
        family = fused_family(leaf)
        q = quantizer_of(item) if family is not None else None
        if q is not None and q.has_global_scale():  # NVFP4's: a global scale above the block scales
            families.setdefault((parent, family), []).append((name, item))
    return [group for group in families.values() if len(group) > 1]


def shared_amax(amaxes: Sequence[torch.Tensor]) -> torch.Tensor:
    """The one tensor amax of a fused group: the max of its members' (a float32 scalar)."""
    device = amaxes[0].device
    return torch.stack([a.detach().reshape(()).to(device, torch.float32) for a in amaxes]).amax()


def share_fused_weight_amax(units: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """Give each fused group among the fake-quantized `units` ((canonical name, module) pairs)
    one static weight amax, `shared_amax` of theirs, in place. Weights with a static tensor amax
    only (per-expert amaxes are left alone). Returns one line per group whose amaxes differed
    (names and values), for the caller's warning."""

    def quantizer_of(module: nn.Module) -> Quantizer | None:
        t = module.weight_quantizer
        return t.quantizer if t.amax is not None and t.num_experts is None else None

    differed = []
    for group in fused_nvfp4_groups(units, quantizer_of):
        amaxes = [m.weight_quantizer.amax for _, m in group]
        top = shared_amax(amaxes)
        if any(not torch.equal(a.reshape(()).to(top.device), top) for a in amaxes):
            differed.append(", ".join(f"{name} {float(a):.6g}" for (name, _), a in zip(group, amaxes)))
        for _, m in group:
            t = m.weight_quantizer
            t.set_amax(top.to(t.amax.device).reshape(t.amax.shape))
    return differed
