"""Small reference models used by the demo and the training tests."""

from tqcompile.models.gpt import GPT, GPTConfig, quantize_model
from tqcompile.models.parallel import parallelize_gpt

__all__ = ["GPT", "GPTConfig", "quantize_model", "parallelize_gpt"]
