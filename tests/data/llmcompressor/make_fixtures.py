"""Writes the compressed-tensors checkpoints in this folder with llmcompressor itself: what a user
who quantized with llmcompressor brings to `tq.load_exported` (tests/test_export_llmcompressor.py).

llmcompressor 0.14 needs transformers <= 5.17, so it runs in its own environment:

    python -m venv llmc && llmc/bin/pip install torch==2.13.0 && llmc/bin/pip install "llmcompressor==0.14.*" "transformers<=5.17" torch==2.13.0
    llmc/bin/python tests/data/llmcompressor/make_fixtures.py

It builds a tiny Llama from a config (seed 0; no download; bfloat16, as users' models are), and runs
`oneshot` with each data-free preset scheme on it (W8A8: INT8 channel weights, dynamic per-token
activations; W4A16: INT4 groups of 128; FP8_DYNAMIC: FP8 channel weights, dynamic per-token).
Generated with llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0, torch 2.13.0.
"""

import tempfile
from pathlib import Path

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, LlamaConfig

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    float_dir = tempfile.mkdtemp()
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(float_dir)
    for scheme in ("W8A8", "W4A16", "FP8_DYNAMIC"):
        model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.bfloat16)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
        model.save_pretrained(HERE / scheme, save_compressed=True)
