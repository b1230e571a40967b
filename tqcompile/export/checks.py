"""What an export refuses or warns about, beyond what its format can express: the serving engines'
facts (`tqcompile.engines`: layers fused into one GEMM, MoE experts with one scheme, the LM head),
the one NVFP4 global scale of fused siblings (the rule is `tqcompile.calibration.fused`'s), and
finite scales."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tqcompile.calibration.fused import fused_nvfp4_groups, shared_amax
from tqcompile.engines import builds_as_linear, fused_sibling_groups
from tqcompile.export.units import ExportError, ExportUnit, weight_tensor_amax
from tqcompile.surgery.names import canonical_modules

__all__ = ["ExportWarning", "check_fused", "check_experts", "extra_targets", "shared_global_amax", "check_scales"]


class ExportWarning(UserWarning):
    """Something an export writes that the format holds but an engine is known to refuse."""


def check_fused(model: nn.Module, schemes: dict) -> None:
    """Warn where layers an engine fuses into one GEMM (q/k/v, gate/up: `tqcompile.engines`) are not
    all quantized with one scheme: vLLM refuses such a checkpoint ("different quantization schemes
    for the shards")."""
    linears = sorted(name for name, m in canonical_modules(model) if isinstance(m, nn.Linear))
    mixed = [
        ", ".join(f"{m}: {schemes[m].describe() if m in schemes else 'high precision'}" for m in members)
        for members in fused_sibling_groups(linears)
        if len({schemes.get(m) for m in members}) > 1
    ]
    if mixed:
        warnings.warn(
            "tq.export: layers that vLLM and TensorRT-LLM fuse into one GEMM are quantized differently, which they refuse "
            "to load (transformers loads it): " + "; ".join(mixed) + ". Quantize them alike (block sizes that fit all of "
            "them) or keep them all in high precision.",
            ExportWarning,
            stacklevel=3,
        )


def check_experts(model: nn.Module, schemes: dict) -> None:
    """An experts module's GEMMs all quantized with one scheme, or all kept in high precision:
    the engines run gate, up and down as one fused MoE with one scheme."""
    from tqcompile.nn.experts import experts_layout

    for name, module in canonical_modules(model):
        layout = experts_layout(module)
        if layout is None:
            continue
        units = [f"{name}.{g.weight}_gemm" for g in layout.gemms]
        if len({schemes.get(u) for u in units}) > 1:
            got = ", ".join(f"{u}: {schemes[u].describe() if u in schemes else 'high precision'}" for u in units)
            raise ExportError(
                f"tq.export: the GEMMs of experts module {name!r} are quantized differently ({got}); serving engines run "
                "an MoE's experts with one scheme: quantize all of its GEMMs alike, or keep them all in high precision"
            )


def check_fused_experts(model: nn.Module, units: list[ExportUnit]) -> None:
    """Refuse quantized experts that a Hugging Face model saves as one tensor of every expert
    (GraniteMoE's ``input_linear.weight``): vLLM maps only that tensor's float name onto its fused
    experts, and `tq.load_exported` reads quantized experts per expert, so nothing could load the
    checkpoint (measured before this check: tq wrote it, its own loader refused it)."""
    from tqcompile.export.names import is_hf_model, placements
    from tqcompile.surgery.names import unwrap

    keys = [u.weight_key for u in units if u.experts]
    if not keys or not is_hf_model(model):
        return
    model = unwrap(model)
    where = placements(model, {k: model.get_parameter(k).shape for k in keys})
    fused = sorted({p.name for k in keys for p in where[k] if p.expert is None})
    if fused:
        raise ExportError(
            f"tq.export: transformers saves these experts as one tensor of every expert: {', '.join(fused)}; vLLM loads such "
            "a tensor only in high precision and tq.load_exported loads quantized experts per expert, so no checkpoint "
            "with them quantized would load: keep the experts in high precision, e.g. "
            "config.with_rules(QuantRule(name='*.experts.*', input=False, weight=False))"
        )


def extra_targets(model: nn.Module, units: list[ExportUnit]) -> list[str]:
    """Quantized layers an engine builds as something other than a Linear: the LM head."""
    return [u.name for u in units if not builds_as_linear(u.name)]


def shared_global_amax(units: list[ExportUnit], schemes: dict, state: dict, read) -> dict[str, torch.Tensor]:
    """For NVFP4 weights an engine fuses (q/k/v, gate/up under one parent), their one tensor amax
    by unit name (`tqcompile.calibration.fused`): one global scale for the fused GEMM. A calibrated
    model already computes with it; a `tq.convert`ed one computed each weight's own in training."""
    shared, differed = {}, []
    for group in fused_nvfp4_groups([(u.name, u) for u in units], lambda u: None if u.experts else u.weight_q):
        # A calibrated amax is the unit's own; only a weight quantized with its own amax is read.
        amaxes = [weight_tensor_amax(u, None if u.weight_amax is not None else read(u.weight_key, state[u.weight_key])) for _, u in group]
        top = shared_amax(amaxes)
        if any(u.weight_amax is not None for _, u in group) and any(not torch.equal(a.reshape(()).to(top.device), top) for a in amaxes):
            differed.append(", ".join(f"{name} {float(a):.6g}" for (name, _), a in zip(group, amaxes)))
        shared.update({u.name: top for _, u in group})
    if differed:
        # Only amaxes set outside tq.calibrate / tq.restore / tq.load_exported (by hand, or loaded
        # in place with torch.distributed.checkpoint from an older state) get here.
        warnings.warn(
            "tq.export: NVFP4 layers that engines fuse into one GEMM under one global scale hold different weight amaxes "
            f"in the model ({'; '.join(differed)}); the checkpoint shares their max, so these layers are served with weights "
            "that differ from the model's by up to a quantization step: restore the model with tq.restore (which shares them) "
            "before exporting",
            ExportWarning,
            stacklevel=3,
        )
    return shared


def check_scales(unit: ExportUnit, tensors: dict) -> None:
    """Every scale finite: an engine would serve NaN or Inf from a layer with one (a NaN amax from
    an unrouted expert is the peers' known failure; tq.calibrate never makes one, a hand-set amax can)."""
    for local, (t, _) in tensors.items():
        if "scale" in local and t.is_floating_point():
            bad = ~torch.isfinite(t.float())
            if bool(bad.any()):
                raise ExportError(
                    f"tq.export: layer {unit.name!r} has {int(bad.sum())} non-finite {local} value(s) (from its amax "
                    f"{'' if unit.weight_amax is None else 'or weight amax '}of the {unit.source} quantizers); "
                    "recalibrate it (tq.calibrate) or set a finite amax"
                )
