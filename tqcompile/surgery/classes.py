"""Generated module classes: a module is converted in place by giving it a class made from its
own class and a mixin, so its parameters, buffers, hooks, attributes and extra methods stay.

`tq.convert` makes ``Quantized<Class>`` (the model's class first, `tq.nn.Linear` after it, so the
model's own methods win), `tq.calibrate` makes ``FakeQuant<Class>`` (the fake-quant mixin first:
its forward replaces the class's own). The mixin says which: ``tq_mixin_first`` and
``tq_class_prefix`` are class attributes of the mixin, so (class, mixin) alone determines the
generated class, and that pair is all a pickle needs to make it again in another process.
"""

from __future__ import annotations

import copyreg

__all__ = ["generated_class", "new_instance", "original_class", "mixin_of"]

_GENERATED: dict[tuple[type, type], type] = {}


def generated_class(base: type, mixin: type) -> type:
    """The class for modules of class `base` converted with `mixin` (one per pair, made on first
    use): `mixin` itself when it already derives from `base` (`tq.nn.Linear` for `nn.Linear`),
    else a class inheriting from both, named ``<mixin.tq_class_prefix><base.__name__>`` in
    `base`'s module, holding `tq_base` and `tq_mixin`."""
    if issubclass(mixin, base):
        return mixin
    key = (base, mixin)
    if key not in _GENERATED:
        namespace = {"__module__": base.__module__, "__reduce_ex__": _reduce_ex, "tq_base": base, "tq_mixin": mixin}
        bases = (mixin, base) if getattr(mixin, "tq_mixin_first", False) else (base, mixin)
        _GENERATED[key] = type(f"{mixin.tq_class_prefix}{base.__name__}", bases, namespace)
    return _GENERATED[key]


def original_class(cls: type) -> type:
    """The model's own class that `generated_class` made `cls` from; `cls` itself for any other class."""
    return cls.__dict__.get("tq_base", cls)


def mixin_of(cls: type) -> type | None:
    """The mixin `generated_class` made `cls` with; None for any other class (a user's subclass of one included)."""
    return cls.__dict__.get("tq_mixin")


def new_instance(base: type, mixin: type, *args):
    """Unpickling: an empty instance of `generated_class(base, mixin)` (its state is set after)."""
    cls = generated_class(base, mixin)
    return cls.__new__(cls, *args)


def _reduce_ex(self, protocol: int):
    # The generated class cannot be found by name, so pickle names the two classes it is made of.
    # object.__reduce_ex__ (protocol >= 2) gives (copyreg.__newobj__, (cls, *args), state, ...).
    rv = object.__reduce_ex__(self, max(protocol, 2))
    cls = type(self)
    # Only for the generated class itself: a user's subclass of it is importable and pickles by name.
    if "tq_mixin" in cls.__dict__ and isinstance(rv, tuple) and rv[0] is copyreg.__newobj__ and rv[1][0] is cls:
        return (new_instance, (cls.tq_base, cls.tq_mixin, *rv[1][1:]), *rv[2:])
    return rv  # the user's class defines its own reduction
