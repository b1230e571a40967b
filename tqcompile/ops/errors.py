"""Errors that reach the user with tqcompile's own message under `torch.compile(fullgraph=True)`.

Measured on torch 2.13: an exception raised in code Dynamo traces does not propagate. Dynamo
records it as a graph break ("Observed exception"); with `fullgraph=True` that becomes
`torch._dynamo.exc.Unsupported`, whose message starts with "Observed exception" and carries ours
only in its "Developer debug context". Raising it at the top-level frame, through `torch._check`,
or from a fake kernel does not change that (the last gives a `TorchRuntimeError`), and no public
option makes Dynamo re-raise the user's exception.

So where tqcompile validates a call inside traced code, `raise_error` does not raise while Dynamo
traces: it returns a placeholder of the shape the call would have produced, computed by the op
`tqcompile::raise_error`, whose kernel raises the error when the compiled code runs. The user gets
a plain `ValueError`/`TypeError` with our message, exactly as in eager mode; the price is one
compile of a graph that cannot run (its guards hold the bad shape, so good calls never use it).
Outside torch.compile `raise_error` simply raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.fx.node import has_side_effect

__all__ = ["raise_error", "static_shape", "shape_str"]

# The exception types the op can raise, by name (a custom op takes strings, not classes).
_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}
# Their names by class: torch 2.11's Dynamo cannot pass `ValueError.__name__` to an op (measured).
_NAMES: dict[type[Exception], str] = {cls: name for name, cls in _ERRORS.items()}


@torch.library.custom_op("tqcompile::raise_error", mutates_args=())
def _raise_error_op(like: torch.Tensor, error: str, message: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Raise `error(message)`. Traced, it stands for a tensor of `shape` and `dtype`."""
    raise _ERRORS[error](message)


@_raise_error_op.register_fake
def _raise_error_fake(like, error, message, shape, dtype):
    return like.new_empty(shape, dtype=dtype)


# Its output is only a placeholder: backward never reaches it (forward raises first).
_raise_error_op.register_autograd(lambda ctx, grad: (None, None, None, None, None))
# Never dead-code eliminated, even when the caller drops the placeholder (`layer(x)` whose result is
# unused): fx's DCE keeps side-effecting targets. torch.fx.node.has_side_effect, checked on 2.13.
has_side_effect(torch.ops.tqcompile.raise_error.default)


def static_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """`shape` as plain ints, to format an error message from. Under torch.compile with dynamic
    shapes the sizes are symbolic and a message formatted from them is not a constant (the op
    cannot take it); `int()` specializes the graph to these sizes, which only an error graph does."""
    return tuple(int(d) for d in shape)


def shape_str(shape: Sequence[int]) -> str:
    """`shape` as "(a, b)" from plain ints, for a message: constant even when torch.compile traces the
    sizes symbolically (Dynamo cannot format a tuple of sizes into a string that an op takes)."""
    return "(" + ", ".join(f"{d}" for d in static_shape(shape)) + ("," if len(shape) == 1 else "") + ")"


def raise_error(
    error: type[Exception], message: str, like: torch.Tensor, shape: Sequence[int] | None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Raise `error(message)` now, or, while torch.compile traces, return a placeholder tensor of
    `shape` (dtype `dtype`, default `like`'s) that raises it when the compiled code runs.

    `shape` None: no placeholder can stand in for the result; raise even while tracing (the user
    then sees Dynamo's "Observed exception" with our message in its debug context).
    """
    name = _NAMES.get(error)
    if name is None:
        raise TypeError(f"raise_error: error must be one of {sorted(_ERRORS)}, got {error!r}")
    if shape is None or not torch.compiler.is_compiling():
        raise error(message)
    return _raise_error_op(like, name, message, list(shape), like.dtype if dtype is None else dtype)
