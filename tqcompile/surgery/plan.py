"""Plan, apply, undo: how `tq.convert` and `tq.calibrate` change a model.

Planning decides, per layer and before anything changes, what happens to it: convert it (and
with what), skip it (and why), or nothing, it is already converted. Bad input raises while
planning, so a model is never left half converted. Applying converts the planned layers in place
and records each change; undoing puts back exactly what applying changed (the modules' classes,
and the attributes, children, parameters and buffers conversion added or replaced), which is
`tq.calibrate`'s failure path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = ["Decision", "apply", "Undo"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What happens to one layer: `action` is "convert", "skip" (with `reason`) or "already
    converted". For "convert", `reason` may say what of the layer is left out (a quantizer disabled).

    `module` is the layer, `using` what it is converted with (a `tq.Recipe` for `tq.convert`, the
    quantizer of each slot for `tq.calibrate`), `touches` the other modules converting it changes
    (an experts GEMM's experts module); none of these three takes part in comparisons or the repr.
    """

    name: str
    module_type: str
    action: str  # "convert", "skip" or "already converted"
    reason: str = ""
    module: nn.Module | None = dataclasses.field(default=None, compare=False, repr=False)
    using: Any = dataclasses.field(default=None, compare=False, repr=False)
    touches: tuple[nn.Module, ...] = dataclasses.field(default=(), compare=False, repr=False)


_CONTAINERS = ("_modules", "_parameters", "_buffers")


@dataclasses.dataclass
class _Change:
    """What converting changed on one module: its class, and the entries of its `__dict__` and
    of its children / parameters / buffers that were added (value None) or replaced (old value)."""

    module: nn.Module
    cls: type
    entries: dict[str, dict[str, Any]]


class _Before:
    def __init__(self, module: nn.Module):
        self.module, self.cls = module, type(module)
        self.dict = dict(module.__dict__)
        self.containers = {c: dict(module.__dict__[c]) for c in _CONTAINERS}

    def change(self) -> _Change:
        m = self.module
        entries: dict[str, dict[str, Any]] = {"__dict__": {}}
        for k, v in m.__dict__.items():
            if k not in _CONTAINERS and (k not in self.dict or self.dict[k] is not v):
                entries["__dict__"][k] = (k in self.dict, self.dict.get(k))
        for c in _CONTAINERS:
            old = self.containers[c]
            entries[c] = {k: (k in old, old.get(k)) for k, v in m.__dict__[c].items() if k not in old or old[k] is not v}
        return _Change(m, self.cls, entries)


class Undo:
    """The changes `apply` made, to put back exactly, newest first (`undo`)."""

    def __init__(self):
        self._changes: list[_Change] = []

    def undo(self) -> None:
        for ch in reversed(self._changes):
            m = ch.module
            m.__class__ = ch.cls
            for where, entries in ch.entries.items():
                target = m.__dict__ if where == "__dict__" else m.__dict__[where]
                for k, (existed, old) in entries.items():
                    if existed:
                        target[k] = old
                    else:
                        target.pop(k, None)
        self._changes.clear()


def apply(plan: Iterable[Decision], convert: Callable[[Decision], None]) -> Undo:
    """Run `convert(decision)` for every "convert" decision of `plan`, in order, recording what each
    changes on its module and the modules it `touches`; the returned `Undo` puts them back. If a
    conversion raises, the ones before it are undone first."""
    undo = Undo()
    try:
        for d in plan:
            if d.action != "convert":
                continue
            before = [_Before(m) for m in dict.fromkeys((d.module, *d.touches))]
            try:
                convert(d)
            finally:  # a conversion that raised part way is undone too
                undo._changes.extend(b.change() for b in before)
    except BaseException:
        undo.undo()
        raise
    return undo
