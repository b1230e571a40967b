"""Validation of a quantized linear call, as a message instead of a raise.

`tq.nn.functional.linear` runs inside code that torch.compile traces; there an exception becomes
Dynamo's "Observed exception". It hands the message to `tqcompile.ops.errors.raise_error`, which
raises it in eager mode and defers it to run time under compile (see that module).
"""

from __future__ import annotations

import math

import torch

from tqcompile.api import SUPPORTED_DTYPES
from tqcompile.ops.errors import static_shape
from tqcompile.recipes import Recipe

__all__ = ["linear_input_error"]


def linear_input_error(
    x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, backward: bool
) -> tuple[type[Exception], str] | None:
    """(exception type, message) of the first problem with ``linear(x, weight, ..., recipe)``, or None."""
    error = _error(tuple(x.shape), tuple(weight.shape), x.dtype, recipe, backward)
    if error is None:
        return None
    # Formatted again from plain ints: a message from symbolic sizes is no constant (see static_shape).
    return _error(static_shape(x.shape), static_shape(weight.shape), x.dtype, recipe, backward)


def _error(x_shape, w_shape, dtype: torch.dtype, recipe: Recipe, backward: bool) -> tuple[type[Exception], str] | None:
    if dtype not in SUPPORTED_DTYPES:
        return TypeError, f"linear: input dtype {dtype} is not supported; allowed: torch.float32, torch.bfloat16, torch.float16"
    in_features, out_features = w_shape[-1], w_shape[0]
    if len(x_shape) == 0:
        return ValueError, f"linear: input must have shape (..., in_features={in_features}), got a 0-dim tensor"
    if x_shape[-1] != in_features:
        return ValueError, f"linear: input last dim {x_shape[-1]} does not match weight in_features {in_features}"
    tokens = math.prod(x_shape[:-1])
    reason = recipe.unsupported_reason(in_features, out_features, tokens, backward=backward)
    if reason:
        return ValueError, f"linear: recipe {recipe.name!r} cannot serve this call: {reason}"
    return None
