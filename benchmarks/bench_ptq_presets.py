"""Output SQNR of every PTQ preset on one small MLP, as docs/choosing.md's preset table reports it.

A 3-layer MLP (256 -> 512 -> 512 -> 256, GELU, random weights, seed 0), `max` calibration on 4
batches of 64 random inputs, SQNR of the output against the float model on 256 other inputs. The
inputs come from a generator seeded 1; the figures docs/ptq.md compares with ModelOpt came from an
earlier script on other random inputs (MXFP8: 21.69 dB there, 21.78 here), so compare the presets
within one run of this script.

    python benchmarks/bench_ptq_presets.py

The integer presets run on their default grid (FULL: llmcompressor's) and again on SYMMETRIC
(ModelOpt's) and ASYMMETRIC (weights with zero points).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import tqcompile as tq
from tqcompile.testing import sqnr

PRESETS = ("int8", "int8_dynamic", "int8_weight_only", "int4_weight_only", "fp8", "mxfp8", "mxfp6", "mxfp4_weight_only", "nvfp4")
# The integer presets again on the other grids: SYMMETRIC is ModelOpt's (docs/ptq.md compares the two).
GRIDS = {
    f"{name} {grid.name}": (lambda name=name, grid=grid: getattr(tq.configs, name)(grid=grid))
    for name in ("int8", "int8_dynamic", "int8_weight_only", "int4_weight_only")
    for grid in (tq.IntGrid.SYMMETRIC, tq.IntGrid.ASYMMETRIC)
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 256)).eval()


def main() -> None:
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(64, 256, generator=g) for _ in range(4)]
    test = torch.randn(256, 256, generator=g)
    print(f"{'preset':<30} output SQNR (dB)")
    configs = {name: getattr(tq.configs, name) for name in PRESETS} | GRIDS
    for name, make in configs.items():
        model = _mlp()
        with torch.no_grad():
            ref = model(test)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. layers a preset leaves in high precision
            tq.calibrate(model, make(), lambda m: [m(b) for b in calib], progress=False)
        with torch.no_grad():
            print(f"{name:<30} {sqnr(ref.double(), model(test)):.4f}")


if __name__ == "__main__":
    main()
