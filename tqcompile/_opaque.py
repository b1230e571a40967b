"""torch's value opaque types, under whichever names the installed torch gives them.

Quantizers and recipes are value opaque types (docs/concepts.md, "Quantizers are immutable value objects"): a base class they subclass and a
registration, both private torch API, the only way to make a frozen value an argument of a custom
op that Dynamo guards on by value (torch 2.11 refuses to register a class that does not subclass
the base; 2.13 accepts either). torch renamed that API in 2.14 and logs a deprecation line for
each use of an old name (13 lines at `import tqcompile` on 2.14.1):

| torch        | base class                                   | register                                        | is one?                   |
|--------------|----------------------------------------------|-------------------------------------------------|---------------------------|
| 2.11 - 2.13  | `torch._opaque_base.OpaqueBase`              | `register_opaque_type(cls, typ="value")`        | `is_opaque_value_type`    |
| 2.14         | `torch._custom_class_base.CustomClassBase`   | `register_custom_class(cls, typ="constant")`    | `is_opaque_constant_type` |

(the last three in `torch._library.opaque_object`; on 2.14 `OpaqueBase` is an alias of
`CustomClassBase`). This module picks by what the installed torch has, not by its version
string, and is the only place in tqcompile that names them. One thing it tells by version: torch
before 2.13 traces a value opaque object as a fake script object whose members Dynamo reads only
where they were registered, so there every member is (`_members`). Checked on torch 2.11.0
(compiled on a CPU, and on an H200), 2.13.0 and 2.14.1.
"""

from __future__ import annotations

import torch
from torch._library import opaque_object

try:
    from torch._custom_class_base import CustomClassBase as OpaqueBase
except ImportError:  # torch < 2.14
    from torch._opaque_base import OpaqueBase

__all__ = ["OpaqueBase", "register_value_type", "is_value_type", "value_type_name", "CAN_TELL_VALUE_TYPES"]

_register = getattr(opaque_object, "register_custom_class", None)
# `is_opaque_value_type` is missing from the oldest torch tqcompile supports (torch_export.py asks).
_is_value_type = getattr(opaque_object, "is_opaque_constant_type", None) or getattr(opaque_object, "is_opaque_value_type", None)
CAN_TELL_VALUE_TYPES = _is_value_type is not None
# torch before 2.13 traces a value opaque object as a fake script object that reads registered
# members only (`_members`); 2.13 traces the real object, and a member list there would make Dynamo
# call each method with constant arguments only (measured: a quantizer method taking a tensor failed).
# The installed torch's (major, minor): what tells the pre-2.13 Dynamo apart (here and in tqcompile.nn.grouped).
TORCH_MINOR = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_READS_REGISTERED_MEMBERS_ONLY = TORCH_MINOR < (2, 13)


def _members(cls: type) -> dict:
    """Every field, property and method of `cls` (of the dunders, comparison, hash and repr) as `MemberType.USE_REAL`: read
    on the real object while tracing and baked into the graph as a constant.

    torch 2.11 hands Dynamo a value opaque object as a fake script object, whose members Dynamo
    reads only where they were registered (measured: `self.recipe.amax_history_len` in a compiled
    forward failed with "Attempted to access unregistered member on an OpaqueObject" on 2.11.0,
    CPU and CUDA alike); 2.13 and 2.14 trace the real object and ignore the list. A value object is
    frozen, so each member's value is a constant of the guarded object."""
    import dataclasses

    names = {n for n in dir(cls) if not n.startswith("__")} | {"__eq__", "__ne__", "__hash__", "__repr__", "__str__"}
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return dict.fromkeys(sorted(names), opaque_object.MemberType.USE_REAL)


def register_value_type(cls: type) -> None:
    """Register `cls` (a frozen, hashable `OpaqueBase` subclass with `__fx_repr__`) as a value
    opaque type: an argument of custom ops that Dynamo guards on by `__eq__`."""
    if _register is not None:
        _register(cls, typ="constant")
    elif _READS_REGISTERED_MEMBERS_ONLY:
        opaque_object.register_opaque_type(cls, typ="value", members=_members(cls))
    else:  # 2.13: a member list would route every method call through USE_REAL (constant arguments only)
        opaque_object.register_opaque_type(cls, typ="value")


def is_value_type(cls: type) -> bool:
    """Whether `cls` is a registered value opaque type (quantizers, recipes, enums); needs
    `CAN_TELL_VALUE_TYPES`."""
    return _is_value_type(cls)


def value_type_name(cls: type) -> str:
    """The name torch registered the value opaque type `cls` under (what an exported graph records)."""
    return opaque_object.get_opaque_type_name(cls)
