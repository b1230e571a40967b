"""What an export writes, read off a model's `LayerSpec`s (`tqcompile.surgery.specs`, whichever way
it was quantized): one `ExportUnit` per quantized GEMM weight, and its
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

import torch
from torch import nn

from tqcompile.api import quantize
from tqcompile.ops import amax as tensor_amax
from tqcompile.quantizers import Quantizer
from tqcompile.surgery.specs import LayerSpec, layer_specs

__all__ = ["ExportError", "ExportUnit", "QuantizedWeight", "collect_units", "quantize_unit", "full_tensor", "check_not_transposed"]


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
    transposed: bool = False  # experts stored (E, in, out) (GPT-OSS): the GEMM view is the weight transposed


@dataclasses.dataclass
class QuantizedWeight:
    """A unit's weight quantized by `tq.quantize`: payload and `scale_inv` in tq's layout
    (`quantizer.payload_shape`, `quantizer.scale_shape`), and the tensor-level amax (NVFP4's
    global scale comes from it); each with a leading expert dim for experts."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor | None


_SERVED_KINDS = ("Linear", "Experts", "GroupedLinear")


def _export_unit(spec: LayerSpec) -> ExportUnit | None:
    """The unit an export writes for one quantized layer (None: a calibrated layer with every quantizer off)."""
    if spec.recipe is not None:
        return _recipe_unit(spec)
    w, i, o = spec.weight, spec.input, spec.output
    if w is None and i is None and o is None:
        return None  # converted, every slot disabled: a float layer
    name = spec.name
    if spec.kind not in _SERVED_KINDS:
        raise ExportError(
            f"tq.export: {spec.kind} {name!r} is quantized, but serving formats quantize only linear layers "
            f"(and MoE experts); keep it in high precision: QuantRule.disable({name!r}) in the config"
        )
    if o is not None:
        raise ExportError(
            f"tq.export: layer {name!r} quantizes its output ({o.quantizer!r}); serving formats quantize a "
            "layer's weight and input only: disable the output quantizer (QuantRule(..., output=False))"
        )
    if w is None:
        raise ExportError(
            f"tq.export: layer {name!r} quantizes its input but not its weight; serving formats need a quantized "
            "weight wherever the input is quantized: enable its weight quantizer or disable the layer"
        )
    iq = None if i is None else i.quantizer
    iamax = None if i is None or i.amax is None else i.amax.detach().float()
    wamax = None if w.amax is None else w.amax.detach().float()
    return ExportUnit(name, spec.weight_key, spec.bias_key, w.quantizer, wamax, iq, iamax, spec.experts, spec.source, spec.transposed)


def check_not_transposed(unit: ExportUnit, format_name: str) -> None:
    """Refuse experts stored transposed, (E, in, out), in a format that holds experts per expert as (out, in)."""
    if unit.transposed:
        raise ExportError(
            f"tq.export: experts GEMM {unit.name!r} stores its weight transposed, (experts, in, out) (GPT-OSS); {format_name} "
            "checkpoints hold no quantized experts that way. GPT-OSS's own MXFP4 layout does: quantize the experts with "
            "tq.configs.mxfp4_weight_only(experts_only=True) and export with format='mxfp4'; or keep these experts in high "
            f"precision (QuantRule.disable({unit.name.rsplit('.', 1)[0]!r}) in the config, or a tq.convert filter_fn)"
        )


def _recipe_unit(spec: LayerSpec) -> ExportUnit:
    """A layer `tq.convert` converted: weights and inputs quantized as training did, from each tensor."""
    if spec.kind not in _SERVED_KINDS:
        raise ExportError(
            f"tq.export: {type(spec.unit).__name__} {spec.name!r} was converted by tq.convert, but serving formats hold only "
            "linear layers and MoE experts quantized; leave it out of the conversion (tq.convert's filter_fn)"
        )
    iq, src = spec.input.quantizer, spec.source
    if iq.has_global_scale():
        # An NVFP4 activation's global scale is static in every serving format, and training
        # computed it from each input: without a calibrated amax, the weights export alone.
        iq, src = None, src + "; activations 16-bit: calibrate an NVFP4 input amax (tq.calibrate) for W4A4"
    return ExportUnit(spec.name, spec.weight_key, spec.bias_key, spec.weight.quantizer, None, iq, None, spec.experts, src, spec.transposed)


def collect_units(model: nn.Module) -> list[ExportUnit]:
    """Every quantized GEMM weight of `model`, in module order (see the module docstring)."""
    return [unit for spec in layer_specs(model) if (unit := _export_unit(spec)) is not None]


def _rne(q: Quantizer) -> Quantizer:
    # An exported weight is rounded to nearest: a checkpoint holds one value per weight. (A family
    # needs a seed for stochastic rounding only, which it names `stochastic_rounding`.)
    if q.needs_seed():
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
        data, scale_inv, _ = quantize(w2, q, amax=t if t is not None else u).usage(columnwise=False)
        return data, scale_inv

    if not unit.experts:
        data, scale_inv = one(w, tamax, unit_amax)
        return QuantizedWeight(data, scale_inv, tamax)
    parts = [one(w[e], None if tamax is None else tamax[e], None if unit_amax is None else unit_amax[e]) for e in range(w.shape[0])]
    return QuantizedWeight(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), tamax)
