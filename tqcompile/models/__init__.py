"""Small reference models used by the demo and the training tests."""

from tqcompile.models.gpt import GPT, GPTConfig, quantize_model

__all__ = ["GPT", "GPTConfig", "quantize_model"]
