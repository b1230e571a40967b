"""Validation of a quantized linear call, as a message instead of a raise.

`tq.nn.functional.linear` runs inside code that torch.compile traces; there an exception becomes
Dynamo's "Observed exception". It hands the message to `tqcompile.ops.errors.raise_error`, which
raises it in eager mode and defers it to run time under compile (see that module).
"""

from __future__ import annotations

import math

import torch

from tqcompile.api import SUPPORTED_DTYPES
from tqcompile.nn.base import QuantizedModule
from tqcompile.ops.errors import static_shape
from tqcompile.recipes import Recipe, unsupported_reason

__all__ = ["linear_input_error"]


def linear_input_error(
    x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, backward: bool, layer: QuantizedModule | None = None
) -> tuple[type[Exception], str] | None:
    """(exception type, message) of the first problem with ``linear(x, weight, ..., recipe)``, or None.

    `layer`: the calling module, whose name in the model `tq.convert` converted (`tq_fqn`) the
    message then names; None for a direct call."""
    if _error(tuple(x.shape), tuple(weight.shape), x.dtype, recipe, backward, None) is None:
        return None
    # Read only here, on the error path: read on every call, its name would be a constant torch.compile
    # guards on, and a model compiled block by block would recompile for every block (measured on 2.13).
    name = None if layer is None else layer.tq_fqn
    # Formatted again from plain ints: a message from symbolic sizes is no constant (see static_shape).
    return _error(static_shape(x.shape), static_shape(weight.shape), x.dtype, recipe, backward, name)


def _error(
    x_shape, w_shape, dtype: torch.dtype, recipe: Recipe, backward: bool, layer: str | None
) -> tuple[type[Exception], str] | None:
    what = "linear" if layer is None else f"linear {layer!r}"
    if dtype not in SUPPORTED_DTYPES:
        return TypeError, f"{what}: input dtype {dtype} is not supported; allowed: torch.float32, torch.bfloat16, torch.float16"
    in_features, out_features = w_shape[-1], w_shape[0]
    if len(x_shape) == 0:
        return ValueError, f"{what}: input must have shape (..., in_features={in_features}), got a 0-dim tensor"
    if x_shape[-1] != in_features:
        return ValueError, f"{what}: input last dim {x_shape[-1]} does not match weight in_features {in_features}"
    tokens = math.prod(x_shape[:-1])
    reason = unsupported_reason(recipe, in_features, out_features, tokens, backward=backward)
    if reason is None:  # not `not reason`: torch 2.11 cannot branch on a string formatted from symbolic sizes
        return None
    message = f"{what}: recipe {recipe.name!r} cannot serve this call: {reason}"
    if layer is not None and unsupported_reason(recipe, in_features, out_features, backward=backward) is None:
        # The token count is what the blocks cannot split. Padding the tokens is no fix for a layer
        # that sees one token per sample (a pooler, a classification head); leaving it out is.
        message += (
            ". Two fixes: make batch x sequence a multiple of the block (pad the batch or the sequence; mask the padding out "
            "of the loss), or keep this layer in high precision, the fix for a layer that sees few tokens (a pooler, a "
            f"classification head): tq.convert(model, recipe, filter_fn=lambda m, fqn: fqn != {layer!r})"
        )
    return ValueError, message
