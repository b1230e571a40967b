"""`tq.quant_state` / `tq.restore`: save a calibrated model's quantization state, rebuild it on a
freshly built float model, and `tq.summary`, the table of every quantizable module.

The state is keyed by *canonical* module names (wrapper components removed; it is read off the
model's `LayerSpec`s, `tqcompile.surgery.specs`) and records each
module's *kind* (its family: BatchNorm2d and SyncBatchNorm are both "BatchNorm"), so a state saved
from a DDP-wrapped SyncBatchNorm model restores into a plain single-process BatchNorm model and
back. It holds plain Python values and tensors only: ``torch.load(path, weights_only=True)``
reads it.

A module replaced after calibration by one that copies children but not the class (what
`nn.SyncBatchNorm.convert_sync_batchnorm` does to a fake-quantized BatchNorm) keeps its
quantizers; `reattach` gives it its fake-quant forward back (needed only if one of its quantizers
is enabled; the default configs disable every norm quantizer).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tqcompile.calibration.attention import AttentionQuantizers
from tqcompile.calibration.config import ATTENTION_SLOTS, SLOTS, QuantConfig, quantizer_from_dict, quantizer_to_dict
from tqcompile.calibration.fused import share_fused_weight_amax
from tqcompile.calibration.modules import (
    PER_EXPERT_KINDS,
    SHARDED_FIX,
    class_name,
    convert_module,
    holds_quantizers,
    kind_of,
    module_device,
    params_owner,
    quant_units,
    read_by_parent,
    runs_its_quantizers,
    static_amax_shape,
    swap_class,
    unit_decision,
    unit_slots,
    unsupported_reason,
)
from tqcompile.calibration.passes import CalibrationWarning
from tqcompile.calibration.record import CalibrationRecord, set_record
from tqcompile.quantizers import Granularity, IntGrid, IntQuantizer, MXQuantizer, NVFP4Quantizer, Quantizer
from tqcompile.surgery.checks import check_not_sharded
from tqcompile.surgery.names import canonical_modules
from tqcompile.surgery.plan import Decision, apply
from tqcompile.surgery.specs import LayerSpec, OperandSpec, layer_specs

if TYPE_CHECKING:  # only a hint: torch.distributed may be unavailable on some platforms
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["quant_state", "restore", "reattach", "summary", "QuantSummary", "SummaryRow", "STATE_FORMAT"]

STATE_FORMAT = "tqcompile.quant_state/1"


def calibrated_layers(model: nn.Module) -> Iterator[LayerSpec]:
    """The `LayerSpec` of every fake-quantized module of `model` (every quantizer off included)."""
    return (spec for spec in layer_specs(model) if spec.source == "calibrated")


def _record(model: nn.Module) -> CalibrationRecord:
    for _, m in canonical_modules(model):
        rec = getattr(m, "tq_calibration", None)
        if isinstance(rec, CalibrationRecord):
            return rec
    raise ValueError(
        "tq.quant_state: the model is not calibrated; run tq.calibrate(model, config, forward_loop) or tq.restore first"
    )


def _warn_detached(spec: LayerSpec, what: str) -> None:
    module = spec.unit
    if not runs_its_quantizers(module) and any(op is not None for op in spec.operands().values()):
        warnings.warn(
            f"{what}: {spec.name!r} ({type(module).__name__}) was replaced after quantization (e.g. by convert_sync_batchnorm) and its "
            "enabled quantizers no longer run; call tq.calibration.reattach(model)",
            CalibrationWarning,
            stacklevel=3,
        )


def reattach(model: nn.Module) -> nn.Module:
    """Give modules that hold quantizers but lost their fake-quant class (a module replaced after
    quantization that kept its children, as `convert_sync_batchnorm` does) their forward back."""
    for spec in list(calibrated_layers(model)):
        if not runs_its_quantizers(spec.unit):
            swap_class(spec.unit)
    return model


def quant_state(model: nn.Module, *, expert_mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """The config and every calibrated amax of a fake-quantized model, keyed by canonical module name.

    Plain Python values and tensors only: save it with `torch.save` and read it back with
    ``torch.load(path, weights_only=True)``; `tq.restore` rebuilds the model from it.

    The amax tensors are the model's buffers themselves (not copies), so
    `torch.distributed.checkpoint.load` into this dict loads them in place.

    Args:
        expert_mesh: for expert parallelism, a 1-D DeviceMesh over the expert-parallel group, when
            each rank's `GroupedLinear` (or experts module) holds its own equal share of the experts (rank r the r-th
            block). Per-expert amaxes are then DTensors sharded on the expert dim
            (`DTensor.from_local`, which runs no collective), so `torch.distributed.checkpoint`
            saves them once and reshards them on load, to any expert-parallel size.

    Example:
        >>> torch.save(tq.quant_state(model), "quant_state.pt")
    """
    rec = _record(model)
    modules: dict[str, Any] = {}
    for spec in calibrated_layers(model):
        name = spec.name
        _warn_detached(spec, "tq.quant_state")
        entry: dict[str, Any] = {"kind": spec.kind}
        for s, op in spec.operands().items():
            amax = None if op is None or op.amax is None else op.amax.detach()
            if amax is not None and amax.is_meta:
                raise ValueError(
                    f"tq.quant_state: the {s} amax of {name!r} is on the meta device (it holds no values: the model was "
                    "built, prepared or restored on the meta device); save the state of a model with real weights, "
                    "calibrated or restored on a real device"
                )
            if amax is not None and expert_mesh is not None and op.per_expert and amax.dim() > 0:
                from torch.distributed.tensor import DTensor, Shard

                amax = DTensor.from_local(amax, expert_mesh, [Shard(0)], run_check=False)
            entry[s] = {"quantizer": None if op is None else quantizer_to_dict(op.quantizer), "amax": amax}
            if op is not None and op.method is not None:
                entry[s]["method"] = op.method  # how GPTQ / AWQ / SmoothQuant made the weight, for tq.summary
        modules[name] = entry
    for name, module in attention_units(model):
        modules[name] = {
            "kind": "Attention",
            **{s: {"quantizer": None if t.quantizer is None else quantizer_to_dict(t.quantizer), "amax": _amax_of(name, s, t.amax)}
               for s, t in module.quantizers().items()},
        }
    return {
        "format": STATE_FORMAT,
        "config": rec.config.to_dict(),
        "algorithm": rec.algorithm,
        "percentile": rec.percentile,
        "modules": modules,
    }


def attention_units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(canonical name, module) of every attention module holding KV-cache quantizers."""
    return ((n, m) for n, m in canonical_modules(model) if isinstance(m, AttentionQuantizers))


def _amax_of(name: str, slot: str, amax: torch.Tensor | None) -> torch.Tensor | None:
    if amax is not None and amax.is_meta:
        raise ValueError(
            f"tq.quant_state: the {slot} amax of {name!r} is on the meta device (it holds no values); save the state of a "
            "model with real weights, calibrated or restored on a real device"
        )
    return None if amax is None else amax.detach()


def _check_state(state: Any) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"tq.restore: state is not a tq.quant_state dict (format {got!r}; expected {STATE_FORMAT!r})")
    missing = {"config", "algorithm", "percentile", "modules"} - set(state)
    if missing:
        raise ValueError(f"tq.restore: state lacks the keys {sorted(missing)}")


def restore(model: nn.Module, state: dict[str, Any]) -> nn.Module:
    """Rebuild the fake-quantized structure of `state` on a freshly built float `model`, in place,
    and load its amaxes; returns `model`. Load the weights afterwards with `model.load_state_dict`.

    Works whichever way each side was built (BatchNorm or SyncBatchNorm, wrapped in DDP or not).
    A different architecture raises, naming the modules the state has and the model lacks, and the
    other way round; the model is then left unchanged.

    Example:
        >>> model = tq.restore(build_model(), torch.load("quant_state.pt", weights_only=True))
    """
    _check_state(state)
    # A state is data: its rules' class names resolve among the model's own classes (a class defined
    # in a function or in another script's __main__ included) and registered ones, never by import.
    own = {c for m in model.modules() for c in type(m).__mro__ if issubclass(c, nn.Module)}
    config = QuantConfig.from_dict(state["config"], module_types=own)
    ste = config.ste
    current: dict[str, nn.Module] = {}
    parent_reads = read_by_parent(model)
    for name, module in quant_units(model):
        if holds_quantizers(module):
            raise ValueError(f"tq.restore: module {name!r} is already fake-quantized; restore into a freshly built float model")
        found = kind_of(module)
        if found is not None and found[0] == "Attention" and name not in state["modules"]:
            continue  # converted only where the state has KV-cache quantizers for it (a calibrated model's are)
        if found is not None and unsupported_reason(module) is None and id(module) not in parent_reads:
            check_not_sharded("tq.restore", "module", name, params_owner(module), SHARDED_FIX.format(who="tq.restore"))
            current[name] = module
    # A state saved before tq stopped converting a module it cannot fake-quantize (an nn.Embedding
    # subclass with its own forward, such as Gemma's scaled embedding) lists it with every quantizer
    # off: it carries nothing to restore.
    by_name = dict(canonical_modules(model))
    saved: dict[str, Any] = {
        n: e
        for n, e in state["modules"].items()
        if not (n not in current and n in by_name and unsupported_reason(by_name[n]) and _all_off(e))
    }
    missing, extra = sorted(set(saved) - set(current)), sorted(set(current) - set(saved))
    if missing or extra:
        raise ValueError(
            "tq.restore: the model's architecture differs from the saved state's: "
            f"modules in the state but not in the model: {missing or 'none'}; modules in the model but not in the state: {extra or 'none'}"
            + _wrapper_hint(set(saved), set(current))
        )
    plan: list[Decision] = []
    for name, entry in saved.items():
        module = current[name]
        kind = kind_of(module)[0]
        if entry["kind"] != kind:
            raise ValueError(f"tq.restore: module {name!r} is a {kind} in the model but a {entry['kind']} in the state")
        slots = unit_slots(module)
        # An attention saved before the query slot existed has none: its query stays unquantized.
        entries = {s: entry.get(s, {"quantizer": None, "amax": None}) if s == "query" else entry[s] for s in slots}
        qs = {
            s: None if entries[s]["quantizer"] is None else quantizer_from_dict(entries[s]["quantizer"], f"state[{name!r}].{s}")
            for s in slots
        }
        amaxes = {s: _own_shard(entries[s]["amax"]) for s in slots}
        for s in slots:
            _check_amax(name, module, s, qs[s], amaxes[s])
        plan.append(unit_decision(name, module, (qs, amaxes)))

    def convert(d: Decision) -> None:
        qs, amaxes = d.using
        convert_module(d.module, d.name, qs, ste)
        for s, tq_ in d.module.quantizers().items():
            a = amaxes[s]
            tq_.set_amax(None if a is None else a.to(module_device(d.module)))
            tq_.method = saved[d.name].get(s, {}).get("method")

    apply(plan, convert)  # everything checked: now change the model
    differed = share_fused_weight_amax([(d.name, d.module) for d in plan])
    if differed:
        warnings.warn(
            "tq.restore: the state holds different NVFP4 weight amaxes for layers that serving engines fuse into one GEMM "
            f"under one global scale (a state saved by a tq that kept each one's own): {'; '.join(differed)}; each group now "
            "has one amax, the max of theirs, as tq.calibrate gives them and tq.export writes them",
            CalibrationWarning,
            stacklevel=2,
        )
    set_record(model, [d.module for d in plan], CalibrationRecord(config, state["algorithm"], float(state["percentile"])))
    return model


def _all_off(entry: Any) -> bool:
    return isinstance(entry, dict) and all(
        not isinstance(v, dict) or v.get("quantizer") is None for k, v in entry.items() if k in (*SLOTS, *ATTENTION_SLOTS)
    )


def _wrapper_hint(saved: set[str], current: set[str]) -> str:
    """When one side's names are the other's under a common prefix, the prefix is a wrapper's."""
    for longer, shorter, side in ((saved, current, "state was saved from"), (current, saved, "model is")):
        prefixes = {n.split(".", 1)[0] for n in longer}
        if len(prefixes) == 1 and shorter:
            p = prefixes.pop()
            if {n.split(".", 1)[1] for n in longer if "." in n} == shorter:
                return (
                    f". Every name differs only by the leading {p + '.'!r}: the {side} a wrapper tqcompile does not strip "
                    "(it strips only the components DDP, DataParallel, torch.compile, activation checkpointing and FSDP1 add: "
                    "'module.', '_orig_mod.', '_checkpoint_wrapped_module.', '_fsdp_wrapped_module.'); save and restore "
                    f"the inner model, e.g. tq.quant_state(wrapper.{p})"
                )
    return ""


def _own_shard(amax: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a DTensor amax (an expert-parallel state loaded with DCP), else the tensor."""
    from torch.distributed.tensor import DTensor

    return amax.to_local() if isinstance(amax, DTensor) else amax


def _check_amax(name: str, module: nn.Module, slot: str, q: Quantizer | None, amax: Any) -> None:
    """Refuse, naming it, an amax the model could not compute with: missing or unexpected, not a
    tensor, without values (meta), non-finite, or of another shape than calibration gives."""
    want = static_amax_shape(module, slot, q)
    if want is None:
        if amax is not None:
            raise ValueError(f"tq.restore: the state has an amax for the {slot} quantizer of {name!r}, whose {q!r} takes none")
        return
    if amax is None:
        raise ValueError(f"tq.restore: the state lacks the amax of the {slot} quantizer of {name!r} ({q!r})")
    if not isinstance(amax, torch.Tensor) or not amax.is_floating_point():
        got = f"a {amax.dtype} tensor" if isinstance(amax, torch.Tensor) else type(amax).__name__
        raise ValueError(f"tq.restore: the {slot} amax of {name!r} is {got}; allowed: a floating-point tensor")
    if amax.is_meta:
        raise ValueError(
            f"tq.restore: the {slot} amax of {name!r} is on the meta device (it holds no values): the state was saved "
            "from a model without data; save it from the calibrated model"
        )
    experts = module.num_experts if kind_of(module)[0] in PER_EXPERT_KINDS else None
    if experts is not None and slot != "output" and amax.dim() > 0 and amax.shape[0] != experts:
        raise ValueError(
            f"tq.restore: the {slot} amax of {name!r} holds {amax.shape[0]} experts; the model's module has {experts} "
            "(an expert-parallel state: load it with torch.distributed.checkpoint into tq.calibration.prepare(model, config))"
        )
    if tuple(amax.shape) != want:
        raise ValueError(f"tq.restore: the {slot} amax of {name!r} has shape {tuple(amax.shape)}; the model's {slot} needs {want}")
    if not bool(torch.isfinite(amax).all()):
        bad = "NaN" if bool(torch.isnan(amax).any()) else "inf"
        raise ValueError(
            f"tq.restore: the {slot} amax of {name!r} holds {bad}; allowed: finite amaxes (a calibrated state has only "
            "finite ones: the file is damaged or was edited)"
        )


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------
@functools.singledispatch
def describe_quantizer(q: Quantizer) -> str:
    """A short name, e.g. 'INT8 per-channel', 'E4M3 tensor', 'MX E4M3', 'NVFP4' (`tq.summary`):
    the element format and the layout, unless the family registers its own."""
    gran, _, block = q.layout()
    how = {
        Granularity.TENSORWISE: "tensor",
        Granularity.ROWWISE: "per-channel",
        Granularity.BLOCKWISE_1D: f"block{block}",
        Granularity.BLOCKWISE_2D: f"block{block}x{block}",
    }[gran]
    return f"{q.element_format().name} {how}"


@describe_quantizer.register(IntQuantizer)
def _(q: IntQuantizer) -> str:
    grid = {IntGrid.SYMMETRIC: "", IntGrid.FULL: " full", IntGrid.ASYMMETRIC: " asym"}[q.grid]
    return describe_quantizer.dispatch(Quantizer)(q) + grid


@describe_quantizer.register(MXQuantizer)
def _(q: MXQuantizer) -> str:
    return f"MX {q.format.name}"


@describe_quantizer.register(NVFP4Quantizer)
def _(q: NVFP4Quantizer) -> str:
    return "NVFP4" + (" 2d" if q.block_2d else "") + (" rht" if q.hadamard else "")


def _describe(op: OperandSpec | None) -> str:
    if op is None:
        return "off"
    text = describe_quantizer(op.quantizer)
    if op.amax is None:
        return f"{text} (dynamic)"
    if op.amax.is_meta:  # a restored or prepared skeleton: a shape, no values
        return f"{text} amax{tuple(op.amax.shape)} on meta"
    a = op.amax.float()
    if a.numel() == 1:
        return f"{text} amax={float(a):.4g}"
    return f"{text} amax{tuple(a.shape)}∈[{float(a.min()):.3g}, {float(a.max()):.3g}]"


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    name: str
    module_class: str
    kind: str
    input: str
    weight: str
    output: str
    method: str = ""  # how a weight transform made the weight ("gptq", "awq+max", "smoothquant+gptq"); "" for none
    key: str = ""  # an attention's KV-cache quantizers; "" for other modules
    value: str = ""
    query: str = ""  # an attention's query quantizer ("off" when only its KV cache is quantized)


@dataclasses.dataclass(frozen=True)
class QuantSummary:
    """`tq.summary`'s result: `rows` for programs, `str()` a table for people."""

    rows: tuple[SummaryRow, ...]

    def __str__(self) -> str:
        head = ("module", "class", "kind", "input", "weight", "output")
        with_method = any(r.method for r in self.rows)
        with_kv = any(r.key or r.value for r in self.rows)
        with_query = any(r.query not in ("", "off") for r in self.rows)
        if with_method:
            head += ("method",)
        if with_kv:
            head += ("key", "value")
        if with_query:
            head += ("query",)
        cells = [head] + [
            (r.name or "<root>", r.module_class, r.kind, r.input, r.weight, r.output)
            + ((r.method or "-",) if with_method else ())
            + ((r.key or "-", r.value or "-") if with_kv else ())
            + ((r.query or "-",) if with_query else ())
            for r in self.rows
        ]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        enabled = sum(1 for r in self.rows for s in (r.input, r.weight, r.output, r.key, r.value, r.query) if s not in ("off", "-", ""))
        lines.append(f"{len(self.rows)} quantizable modules, {enabled} quantizers enabled")
        return "\n".join(lines)

    __repr__ = __str__


def summary(model: nn.Module) -> QuantSummary:
    """A table of every quantizable module of a calibrated model: canonical name, class, kind, and
    each quantizer (format and granularity, its static amax's shape and range, or "off").

    Example:
        >>> print(tq.summary(model))
    """
    rows = []
    for spec in calibrated_layers(model):
        _warn_detached(spec, "tq.summary")
        method = spec.weight.method if spec.weight is not None else None
        rows.append(SummaryRow(spec.name, spec.module_class, spec.kind, *map(_describe, spec.operands().values()), method or ""))
    for name, module in attention_units(model):
        # ROWWISE on an attention's KV cache is one scale per KV head (tqcompile.calibration.attention).
        kv = {
            s: _describe(None if t.quantizer is None else OperandSpec(t.quantizer, t.amax)).replace("per-channel", "per-head")
            for s, t in module.quantizers().items()
        }
        rows.append(SummaryRow(name, class_name(module), "Attention", "-", "-", "-", key=kv["key"], value=kv["value"], query=kv["query"]))
    if not rows:
        raise ValueError("tq.summary: the model has no fake-quantized module; run tq.calibrate or tq.restore first")
    return QuantSummary(tuple(rows))
