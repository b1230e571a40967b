"""Writes `gptq_int4_g128.pt`: llmcompressor's own GPTQ (`quantize_weight`, 0.14 defaults: block 128,
dampening 0.01, static activation order, memoryless min-max group scales) of one weight under one
Hessian, symmetric and asymmetric INT4 in groups of 128. tests/test_gptq_llmcompressor.py rounds the
same weight under the same Hessian with tq and compares (issue 28).

llmcompressor 0.14 runs in its own environment (see ../make_fixtures.py):

    llmc/bin/python tests/data/llmcompressor/gptq/make_fixture.py

Generated with llmcompressor 0.14.0.1, compressed-tensors 0.19.0, torch 2.13.0 (CPU).
"""

from pathlib import Path

import torch
from compressed_tensors.quantization import preset_name_to_scheme
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
from llmcompressor.observers.base import Observer

HERE = Path(__file__).resolve().parent


def weight_and_hessian() -> tuple[torch.Tensor, torch.Tensor]:
    """The weight (64, 256) and ``2 X^T X / n`` (float64) of correlated inputs: a copy of
    tests/test_gptq_llmcompressor.py's `weight_and_hessian` (this runs without the repository)."""
    g = torch.Generator().manual_seed(28)
    x = torch.randn(2048, 16, generator=g) @ torch.randn(16, 256, generator=g) + 0.3 * torch.randn(2048, 256, generator=g)
    x = x * torch.linspace(0.2, 3.0, 256)  # channels of unequal size, as activations have: act_order matters
    w = torch.randn(64, 256, generator=g) * 0.05
    x = x.double()
    return w, 2.0 * x.T @ x / x.shape[0]


if __name__ == "__main__":
    torch.set_num_threads(1)
    w, h = weight_and_hessian()
    out = {}
    for preset in ("W4A16", "W4A16_ASYM"):
        args = preset_name_to_scheme(preset, ["Linear"]).weights.model_copy(update={"group_size": 128, "actorder": "static"})
        # The weight observer llmcompressor 0.14 resolves for these presets (its checkpoints say so).
        args = args.model_copy(update={"observer": "memoryless_minmax"})
        observer = Observer.load_from_registry(args.observer, base_name="weight", args=args)
        observer(w)
        qp = observer.get_qparams()
        q, _, _ = quantize_weight(w[None].clone(), h.float()[None].clone(), qp["scale"][None], qp["zero_point"][None], None, args)
        # Stored as codes: Q = (codes - zero_point) * scale, per group of 128 (compressed-tensors' dequantization).
        scale, zp = (t.repeat_interleave(128, dim=1) for t in (qp["scale"], qp["zero_point"].float()))
        codes = (q[0] / scale).round() + zp
        assert torch.equal((codes - zp) * scale, q[0])
        out[preset] = {"codes": codes.to(torch.int8), "scale": qp["scale"], "zero_point": qp["zero_point"]}
    torch.save(out, HERE / "gptq_int4_g128.pt")
