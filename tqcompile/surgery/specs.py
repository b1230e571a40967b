"""`LayerSpec`: what one quantized layer of a model does, whichever way it was quantized.

A model is quantized either for training (`tq.convert` with a `tq.Recipe` and a `filter_fn`) or
for PTQ/QAT (`tq.calibrate` with a `QuantConfig` of rules). Both languages resolve, per layer, to
the same description: its canonical name and kind, the quantizer of each operand it quantizes and
whether that operand's amax is static (calibrated, a buffer of the model) or computed from each
tensor, and where that came from ("recipe <name>" or "calibrated"). `layer_specs(model)` asks a
model for them; export, DCP checkpoints and `tq.quant_state` read that instead of looking at
modules of either kind.

The packages that make quantized layers register how to read theirs (`register_spec_reader`):
`tqcompile.nn` for converted layers, `tqcompile.calibration` for fake-quantized ones. This
package sits below both and knows neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from tqcompile.surgery.names import canonical_modules

if TYPE_CHECKING:
    from tqcompile.quantizers import Quantizer
    from tqcompile.recipes import Recipe

__all__ = ["LayerSpec", "OperandSpec", "layer_specs", "register_spec_reader", "SLOTS"]

# The operands a layer may quantize: its input, its weight and its output.
SLOTS = ("input", "weight", "output")


@dataclasses.dataclass(frozen=True)
class OperandSpec:
    """How a layer quantizes one operand.

    `amax`: the static amax the layer quantizes with, the model's own buffer (per tensor, per
    scaling unit, or per expert with `per_expert`); None: computed from each tensor (dynamic).
    `method`: how a weight transform made the weight ("gptq", "awq+max"), None for none."""

    quantizer: Quantizer
    amax: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    per_expert: bool = False
    method: str | None = None

    @property
    def static(self) -> bool:
        return self.amax is not None


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One quantized layer (or quantizable one: a calibrated model's layers with every quantizer
    off are listed too, so that saved state covers them).

    `name` is the canonical name of the unit that quantizes (an experts GEMM: ``<experts>.<weight>_gemm``),
    `layer` the canonical name of the module holding its parameters (the experts module for an
    experts GEMM, else `name`), `weight_key` / `bias_key` their canonical `state_dict` keys. The
    weight is (out, in), or (experts, out, in) with `experts` (stored (experts, in, out) where
    `transposed`). `input`, `weight`, `output`: how each operand is quantized, None where it is
    not. `recipe`: the training recipe of a converted layer. `unit`: the module itself.
    """

    name: str
    kind: str
    module_class: str
    layer: str
    weight_key: str | None
    bias_key: str | None
    input: OperandSpec | None
    weight: OperandSpec | None
    output: OperandSpec | None
    source: str  # "calibrated" or "recipe <name>"
    experts: bool = False
    transposed: bool = False
    recipe: Recipe | None = dataclasses.field(default=None, repr=False)  # `source` names it
    unit: nn.Module | None = dataclasses.field(default=None, compare=False, repr=False)

    def operands(self) -> dict[str, OperandSpec | None]:
        """{slot: its operand spec} for the slots input, weight and output."""
        return {s: getattr(self, s) for s in SLOTS}


SpecReader = Callable[[str, nn.Module], Iterable[LayerSpec] | None]
_SPEC_READERS: list[SpecReader] = []


def register_spec_reader(reader: SpecReader | None = None, *, first: bool = False):
    """Register `reader(canonical name, module)`, which returns the specs of the quantized layers
    `module` itself holds, or None when it holds none of its kind. Readers are asked in order; the
    first that answers wins. `first`: ask this one before those registered so far (fake quantizers
    decide what a module computes, also on a `tq.nn.GroupedLinear` built directly and calibrated).
    Usable as a decorator, with or without arguments."""

    def add(fn: SpecReader) -> SpecReader:
        _SPEC_READERS.insert(0 if first else len(_SPEC_READERS), fn)
        return fn

    return add if reader is None else add(reader)


def layer_specs(model: nn.Module) -> list[LayerSpec]:
    """The spec of every quantized layer of `model` (converted by `tq.convert`, or fake-quantized by
    `tq.calibrate` / `tq.restore`), in module order, by canonical name.

    Example:
        >>> [(s.name, s.weight.quantizer) for s in tq.surgery.layer_specs(model) if s.weight is not None]
    """
    specs: list[LayerSpec] = []
    for name, module in canonical_modules(model):
        for reader in _SPEC_READERS:
            found = reader(name, module)
            if found is not None:
                specs.extend(found)
                break
    return specs
