"""The mixin every module `tq.compress` makes derives from (linear layers, experts, attention)."""

from __future__ import annotations

__all__ = ["PackedModule"]


class PackedModule:
    """Mixin of the deployed modules `compress` makes: its forward replaces the class's own."""

    tq_mixin_first = True
    tq_class_prefix = "Packed"
    tq_kernel: str
    tq_kernel_reason: str
