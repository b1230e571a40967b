"""What an export writes, read off a model: one `ExportUnit` per quantized GEMM weight, and its
quantized payload and scales (`QuantizedWeight`), computed by the same `tq.quantize` that PTQ's
fake quantization and training run, so an exported weight dequantizes to exactly what the model
computed with.

Three kinds of model hold quantized GEMMs:

- calibrated (`tq.calibrate`) or QAT models: fake-quantized modules with a weight quantizer, its
  static amax (per tensor, per scaling unit, or per expert), and an input quantizer with a static
  amax (calibrated) or none (scales from each input: dynamic);
- models converted for training (`tq.convert`): each GEMM's weight uses the recipe's
  ``fprop_weight`` quantizer with an amax taken from the weight itself; activations are dynamic
  (``fprop_input``), as training quantized them;
- both with MoE experts holding fused 3-D weights: one unit per expert GEMM, (E, out, in), with a
  scale per expert.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from tqcompile.api import quantize
from tqcompile.calibration.modules import ExpertGemmQuantizers, canonical_modules
from tqcompile.calibration.state import _slots_of
from tqcompile.nn.base import is_converted
from tqcompile.nn.experts import QuantizedExperts
from tqcompile.nn.grouped import GroupedLinear
from tqcompile.nn.quantized_linear import Linear as QuantLinear
from tqcompile.ops import amax as tensor_amax
from tqcompile.quantizers import NVFP4Quantizer, Quantizer

__all__ = ["ExportError", "ExportUnit", "QuantizedWeight", "collect_units", "quantize_unit", "full_tensor"]


class ExportError(ValueError):
    """A model, a layer or an argument that an export format cannot express (the message names
    the layer and what would work)."""


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, detached: a DTensor (FSDP2 / TP / EP shards) is gathered (a collective:
    every rank must call it, in the same order)."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclasses.dataclass
class ExportUnit:
    """One quantized GEMM weight of a model, as an export writes it.

    `name` is the canonical name of the quantized module (an experts GEMM: ``<experts>.<weight>_gemm``);
    `weight_key` / `bias_key` the model's `state_dict` keys of its weight and bias. The weight is
    (out, in), or (E, out, in) for experts (`experts` True), read from the `state_dict` entry only
    when written (an export streams: one unit's tensors at a time). `weight_amax` is the static amax the
    model quantizes the weight with (None: computed from the weight, as training does);
    `input_amax` the static input amax (None: dynamic scales, computed by the engine from each input).
    """

    name: str
    weight_key: str
    bias_key: str | None
    weight_q: Quantizer
    weight_amax: torch.Tensor | None
    input_q: Quantizer | None
    input_amax: torch.Tensor | None
    experts: bool
    source: str  # "calibrated" or "recipe <name>", for the report


@dataclasses.dataclass
class QuantizedWeight:
    """A unit's weight quantized by `tq.quantize`: payload and `scale_inv` in tq's layout
    (`quantizer.payload_shape`, `quantizer.scale_shape`), and the tensor-level amax (NVFP4's
    global scale comes from it); each with a leading expert dim for experts."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor | None


def _calibrated_unit(name: str, module: nn.Module, qs: dict) -> ExportUnit | None:
    w, i, o = qs["weight"], qs["input"], qs["output"]
    if not (w.enabled or i.enabled or o.enabled):
        return None  # converted, every slot disabled: a float layer
    kind = getattr(module, "tq_kind", type(module).__name__)
    if kind not in ("Linear", "Experts", "GroupedLinear"):
        raise ExportError(
            f"tq.export: {kind} {name!r} is quantized, but serving formats quantize only linear layers "
            f"(and MoE experts); keep it in high precision: QuantRule.disable({name!r}) in the config"
        )
    if o.enabled:
        raise ExportError(
            f"tq.export: layer {name!r} quantizes its output ({o.quantizer!r}); serving formats quantize a "
            "layer's weight and input only: disable the output quantizer (QuantRule(..., output=False))"
        )
    if not w.enabled:
        raise ExportError(
            f"tq.export: layer {name!r} quantizes its input but not its weight; serving formats need a quantized "
            "weight wherever the input is quantized: enable its weight quantizer or disable the layer"
        )
    experts = isinstance(module, ExpertGemmQuantizers) or kind == "GroupedLinear"
    if isinstance(module, ExpertGemmQuantizers):
        owner_name = name.rsplit(".", 1)[0]
        _check_not_transposed(name, module.gemm.transposed)
        weight_key = f"{owner_name}.{module.gemm.weight}"
        bias_key = None if module.gemm.bias is None else f"{owner_name}.{module.gemm.bias}"
    else:
        weight_key = f"{name}.weight"
        bias_key = f"{name}.bias" if getattr(module, "bias", None) is not None else None
    iq = i.quantizer if i.enabled else None
    iamax = i.amax.detach().float() if i.enabled and i.amax is not None else None
    wamax = None if w.amax is None else w.amax.detach().float()
    return ExportUnit(name, weight_key, bias_key, w.quantizer, wamax, iq, iamax, experts, "calibrated")


def _check_not_transposed(name: str, transposed: bool) -> None:
    if transposed:
        raise ExportError(
            f"tq.export: experts GEMM {name!r} stores its weight transposed, (experts, in, out) (GPT-OSS); no serving "
            "format holds quantized experts that way: keep these experts in high precision "
            f"(QuantRule.disable({name.rsplit('.', 1)[0]!r}) in the config, or a tq.convert filter_fn)"
        )


def _recipe_units(name: str, module: nn.Module) -> Iterator[ExportUnit]:
    recipe = module.recipe
    wq, iq = recipe.fprop_weight, recipe.fprop_input
    src = f"recipe {recipe.name}"
    if isinstance(iq, NVFP4Quantizer):
        # An NVFP4 activation's global scale is static in every serving format, and training
        # computed it from each input: without a calibrated amax, the weights export alone.
        iq, src = None, src + "; activations 16-bit: calibrate an NVFP4 input amax (tq.calibrate) for W4A4"
    if isinstance(module, QuantizedExperts):
        for g in module.tq_experts_layout.gemms:
            unit_name = f"{name}.{g.weight}_gemm"
            _check_not_transposed(unit_name, g.transposed)
            bias = None if g.bias is None else f"{name}.{g.bias}"
            yield ExportUnit(unit_name, f"{name}.{g.weight}", bias, wq, None, iq, None, True, src)
    elif isinstance(module, (QuantLinear, GroupedLinear)):
        bias = f"{name}.bias" if module.bias is not None else None
        yield ExportUnit(name, f"{name}.weight", bias, wq, None, iq, None, isinstance(module, GroupedLinear), src)
    else:
        raise ExportError(
            f"tq.export: {type(module).__name__} {name!r} was converted by tq.convert, but serving formats hold only "
            "linear layers and MoE experts quantized; leave it out of the conversion (tq.convert's filter_fn)"
        )


def collect_units(model: nn.Module) -> list[ExportUnit]:
    """Every quantized GEMM weight of `model`, in module order (see the module docstring)."""
    units = []
    for name, module in canonical_modules(model):
        qs = _slots_of(module)
        if qs is not None:
            unit = _calibrated_unit(name, module, qs)
            if unit is not None:
                units.append(unit)
        elif is_converted(module):
            units.extend(_recipe_units(name, module))
    return units


def _rne(q: Quantizer) -> Quantizer:
    # An exported weight is rounded to nearest: a checkpoint holds one value per weight.
    if isinstance(q, NVFP4Quantizer) and q.stochastic_rounding:
        return dataclasses.replace(q, stochastic_rounding=False)
    return q


def weight_tensor_amax(unit: ExportUnit, w: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor-level amax the unit's weight is quantized with (per expert: (E,)), or None
    for quantizers without one (scales per row, block or MX block come from the weight). The
    weight `w` is needed only where no static amax was calibrated."""
    q = unit.weight_q
    if not q.uses_tensor_amax():
        return None
    if unit.weight_amax is not None:
        return unit.weight_amax.reshape(-1) if unit.experts else unit.weight_amax.reshape(())
    if unit.experts:
        return torch.stack([tensor_amax(w[e], q) for e in range(w.shape[0])])
    return tensor_amax(w, q)


def quantize_unit(unit: ExportUnit, w: torch.Tensor, tensor_amax_override: torch.Tensor | None = None) -> QuantizedWeight:
    """Quantize the unit's weight `w` as the model does (`tq.quantize` with the unit's static amax,
    or the weight's own amax where the model computes it). `tensor_amax_override`: a tensor-level
    amax to use instead (a global scale shared by weights an engine fuses, e.g. q/k/v)."""
    q = _rne(unit.weight_q)
    tamax = weight_tensor_amax(unit, w) if tensor_amax_override is None else tensor_amax_override
    unit_amax = None if (q.uses_tensor_amax() or unit.weight_amax is None) else unit.weight_amax

    def one(w2: torch.Tensor, t: torch.Tensor | None, u: torch.Tensor | None) -> tuple:
        qt = quantize(w2, q, amax=t if t is not None else u)
        return qt._data, qt._scale_inv

    if not unit.experts:
        data, scale_inv = one(w, tamax, unit_amax)
        return QuantizedWeight(data, scale_inv, tamax)
    parts = [one(w[e], None if tamax is None else tamax[e], None if unit_amax is None else unit_amax[e]) for e in range(w.shape[0])]
    return QuantizedWeight(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), tamax)
