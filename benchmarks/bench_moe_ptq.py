"""PTQ logits SQNR of tiny MoE models (fused 3-D experts) per preset, beside dense models of the same size.

Prints a table: rows are models, columns the presets; each cell the SQNR (dB) of the logits of the
calibrated (fake-quantized) model against the float model, with the data and calibration of
tests/test_moe_ptq.py (2 calibration batches of 2x16 tokens, `max`, one test batch). The dense rows
are Llama and Qwen3 causal LMs with the MoE models' sizes (hidden 64, intermediate 64, 2 layers),
built from configs the same way; "experts only" quantizes the MoE models' experts and leaves every
other layer in high precision.

    PYTHONPATH=. python benchmarks/bench_moe_ptq.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

import tqcompile as tq
from tqcompile.calibration import CalibrationWarning, QuantRule
from tqcompile.testing import sqnr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from moe_models import TitanMoEModel, tiny_hf_moe  # noqa: E402

PRESETS = {
    "int8": tq.configs.int8,
    "fp8": tq.configs.fp8,
    "int4_w(32)": lambda: tq.configs.int4_weight_only(32),
    "mxfp8": tq.configs.mxfp8,
    "nvfp4": tq.configs.nvfp4,
}
COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)


def dense(kind: str) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(**COMMON) if kind == "llama" else transformers.Qwen3Config(head_dim=16, **COMMON)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def build(kind: str) -> torch.nn.Module:
    if kind == "titan":
        return TitanMoEModel(seed=0).eval()
    if kind in ("llama", "qwen3"):
        return dense(kind)
    return tiny_hf_moe(kind)


def data(kind: str, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "titan":
        return [torch.randn(2, 16, 64, generator=g) for _ in range(n)]
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def logits(model, x):
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def measure(kind: str, config) -> float:
    model = build(kind)
    cal, test = data(kind, 2, 1), data(kind, 1, 7)[0]
    with torch.no_grad():
        ref = logits(model, test)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        tq.calibrate(model, config, lambda m: [m(x) for x in cal], progress=False)
    with torch.no_grad():
        return sqnr(ref, logits(model, test))


def experts_only(config):
    """The preset with every nn.Linear disabled: only the experts' GEMMs quantized."""
    return config.with_rules(QuantRule.disable(module_types=(torch.nn.Linear,), must_match=False))


def main() -> None:
    rows = [(k, k, lambda c: c) for k in ("mixtral", "qwen3_moe", "gpt_oss", "titan")]
    rows += [(f"{k} (experts only)", k, experts_only) for k in ("mixtral", "qwen3_moe", "gpt_oss")]
    rows += [(f"{k} (dense)", k, lambda c: c) for k in ("llama", "qwen3")]
    print("| model | " + " | ".join(PRESETS) + " |")
    print("|---" * (len(PRESETS) + 1) + "|")
    for label, kind, shape in rows:
        cells = [f"{measure(kind, shape(make())):.1f}" for make in PRESETS.values()]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
