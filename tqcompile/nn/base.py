"""The one answer to "is this module converted?": `QuantizedModule` and `is_converted`."""

from __future__ import annotations

from torch import nn

from tqcompile.recipes import Recipe

__all__ = ["QuantizedModule", "is_converted"]


class QuantizedModule:
    """Base of every module whose GEMMs tqcompile runs quantized: `tq.nn.Linear`, `tq.nn.GroupedLinear`,
    and what `tq.convert` makes of `nn.MultiheadAttention` and `nn.TransformerEncoderLayer`. Each
    holds the `recipe` it quantizes with.

    A mixin, placed before the `nn.Module` base; ask `is_converted(module)` rather than looking
    for a `recipe` attribute (a user's module may have one of its own).
    """

    recipe: Recipe


def is_converted(module: nn.Module) -> bool:
    """Whether `module` itself quantizes (built as a tq.nn module or converted by `tq.convert`);
    its children are not looked at.

    Example:
        >>> [name for name, m in tq.convert(model, tq.recipes.mxfp8()).named_modules() if tq.nn.is_converted(m)]
    """
    return isinstance(module, QuantizedModule)
