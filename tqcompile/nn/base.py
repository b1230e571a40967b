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

    `tq_fqn` is the module's name in the model `tq.convert` converted (the `fqn` its `filter_fn`
    saw), or None for a module built directly (`tq.nn.Linear(...)`). Errors raised when the module
    runs name it, and can then say how to leave it out of the conversion. (Prefixed `tq_`: a
    converted module's class inherits from the user's, whose attributes it must not shadow.)
    """

    recipe: Recipe
    tq_fqn: str | None = None
    # The class tq.convert generates for a model's own class is named "Quantized<Class>" (tqcompile.surgery.classes).
    tq_class_prefix = "Quantized"


def is_converted(module: nn.Module) -> bool:
    """Whether `module` itself quantizes (built as a tq.nn module or converted by `tq.convert`);
    its children are not looked at.

    Example:
        >>> [name for name, m in tq.convert(model, tq.recipes.mxfp8()).named_modules() if tq.nn.is_converted(m)]
    """
    return isinstance(module, QuantizedModule)
