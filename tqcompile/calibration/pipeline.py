"""`tq.calibrate`: convert a model to fake-quantized modules and calibrate their static amaxes.

Order of work, so that a failure leaves the model exactly as it was:

1. plan: match the config against every module (nothing is changed yet; bad configs raise here);
2. convert the planned modules; with a weight transform (GPTQ, AWQ, SmoothQuant), run it first
   (`tqcompile.calibration.transforms`: decoder layer by decoder layer, each on the outputs of the
   ones before it as transformed and rounded, replayed on cached inputs, `tqcompile.calibration.replay`);
   then run ``forward_loop(model)`` with the quantizers recording statistics (the model computes in high precision while calibrating, so every layer sees the
   float model's activations); if anything raises, the conversion is undone and the model's
   buffers (e.g. BatchNorm running statistics) and any weight a transform changed are put back;
3. turn the statistics into amaxes (the algorithm), compute weight amaxes from the weights, and
   MAX-reduce all of them over the given process groups, once, in one collective per group.

Algorithms, for the static activation amaxes of quantizers with a per-element error model
(tensorwise FP8 and INT):

- "max": the largest |x| seen;
- "percentile": the `percentile`-th percentile of |x| over all calibration data (a histogram of
  2048 bins over [0, max], which needs a second pass of `forward_loop`);
- "mse": the clipping value (among up to 128 bin edges, spaced geometrically) that
  minimises the expected squared error of ``tq.quantize(v, q, amax=c).dequantize()`` over it.

Per-layer (TENSORWISE) KV-cache amaxes (`tq.configs.fp8_kv_cache()`) have their own search,
`kv_scale_search`, "mse" by default whatever `algorithm` names: one FP8 scale covers a layer's
keys, whose largest entries are rare outliers; there the error search gave a lower KL than the
largest |k| on every model and row measured (docs/ptq.md, "Perplexity with an FP8 KV cache"). Per
KV head the largest |k| measured better, so per-head amaxes follow `algorithm` unless
`kv_scale_search` is named.

NVFP4 global amaxes and per-expert input amaxes always use "max". Weights use "max", except that
"mse" also searches a per-unit clipping ratio of the weight amax that minimises each unit's error.
NVFP4 weights that serving engines fuse into one GEMM (q/k/v, gate/up) then get one amax, the max
of theirs, whatever the algorithm (`tqcompile.calibration.fused`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tqcompile.calibration.algorithms import SCALE_SEARCH, Algorithm, parse_algorithm
from tqcompile.calibration.attention import AttentionQuantizers
from tqcompile.calibration.config import ATTENTION_SLOTS, KV_SLOTS, SLOTS, ConfigError, QuantConfig
from tqcompile.calibration.fake_quant import TensorQuantizer
from tqcompile.calibration.fused import share_fused_weight_amax
from tqcompile.calibration.layer_stats import UnitRecord, WeightUndo
from tqcompile.calibration.modules import (
    PER_EXPERT_KINDS,
    SHARDED_FIX,
    FakeQuantModule,
    class_name,
    convert_module,
    holds_quantizers,
    kind_of,
    module_device,
    params_owner,
    quant_units,
    read_by_parent,
    static_amax_shape,
    unit_decision,
    unsupported_reason,
    weight_view,
)
from tqcompile.calibration.observers import AmaxObserver, attach_amax_observers, detach_observers
from tqcompile.calibration.passes import CalibrationWarning
from tqcompile.calibration.passes import reduce_stats as _reduce
from tqcompile.calibration.passes import run_loop as _run
from tqcompile.calibration.record import CalibrationRecord, set_record
from tqcompile.calibration.replay import StreamCache
from tqcompile.calibration.searches import activation_amax, uses_histogram, weight_amax
from tqcompile.calibration.transforms import run_transforms
from tqcompile.quantizers import Quantizer
from tqcompile.surgery.checks import check_not_meta, check_not_sharded
from tqcompile.surgery.names import canonical_modules
from tqcompile.surgery.plan import Decision, Undo, apply

__all__ = ["calibrate", "prepare", "ALGORITHMS", "CalibrationWarning"]

# `CalibrationRecord` (imported above) stays reachable here: pickles of models calibrated before it
# moved to `tqcompile.calibration.record` name this module.

ALGORITHMS = (*SCALE_SEARCH, "gptq", "awq", "smoothquant")


def plan(model: nn.Module, config: QuantConfig, *, warn_unmatched: bool = True) -> list[Decision]:
    """What `calibrate` would do to each quantizable unit, as the surgery layer's `Decision`s, each
    converted with {slot: Quantizer | None} (raises ConfigError on a config that cannot apply)."""
    planned, matched, skipped = [], [False] * len(config.rules), []
    parent_reads = read_by_parent(model)
    for name, module in quant_units(model):
        if isinstance(module, FakeQuantModule | AttentionQuantizers) and holds_quantizers(module):
            raise ValueError(
                f"tq.calibrate: module {name!r} is already fake-quantized; calibrate a freshly built model (or use tq.restore)"
            )
        for i, rule in enumerate(config.rules):
            if not matched[i] and rule.matches(name, module):
                matched[i] = True
        found = kind_of(module)
        if found is None:
            continue
        check_not_sharded("tq.calibrate", "module", name, params_owner(module), SHARDED_FIX.format(who="tq.calibrate"))
        kind, _, allowed = found
        reason = unsupported_reason(module) or parent_reads.get(id(module))
        quantizers = config.resolve(name, module)
        if kind == "Attention":
            # Converted only where a rule enables its KV cache: a model without one keeps its attention as it was.
            kv = {s: quantizers[s] for s in ATTENTION_SLOTS}
            if kv["query"] is not None and not (kv["key"] and kv["value"]):
                raise ConfigError(
                    f"tq.calibrate: the config quantizes the query of {name!r} but not its keys and values; a query scale "
                    "is what engines' FP8 attention reads beside an FP8 KV cache: add key and value quantizers "
                    "(tq.configs.fp8_kv_cache(query=True))"
                )
            if any(kv.values()):
                planned.append(unit_decision(name, module, kv))
            continue
        if reason:
            if any(quantizers[s] for s in SLOTS):
                skipped.append(f"  {name} ({class_name(module)}): {reason}")
            planned.append(unit_decision(name, module, quantizers, "skip", reason))
            continue
        for slot in SLOTS:
            q = quantizers[slot]
            if q is not None and slot not in allowed:
                raise ConfigError(
                    f"tq.calibrate: the config enables the {slot} quantizer of {name!r} ({kind}), which has only {', '.join(allowed)} "
                    f"quantizers; disable it with a rule such as QuantRule(name={name!r}, {slot}=False)"
                )
        wq = quantizers["weight"]
        # A meta weight has no values to check: only `prepare` (structure only) gets here with one.
        if wq is not None and not module.weight.is_meta and not bool(torch.isfinite(module.weight.detach()).all()):
            bad = "NaN" if bool(torch.isnan(module.weight.detach()).any()) else "Inf"
            raise ValueError(
                f"tq.calibrate: the weight of module {name!r} holds {bad} values; quantization would hide them "
                "(they have no finite scale); fix the weights, or disable the quantizer with "
                f"QuantRule(name={name!r}, weight=False)"
            )
        note = ""
        if wq is not None:
            w = weight_view(module, module.weight)
            try:
                wq.check_shape(w.shape[1:] if kind in PER_EXPERT_KINDS else w.shape)
            except ValueError as e:
                note = f"weight quantizer disabled, its {tuple(w.shape)} weight does not fit: {e}"
                skipped.append(f"  {name} ({class_name(module)}): {note}")
                quantizers["weight"] = None
        planned.append(unit_decision(name, module, quantizers, reason=note))
    kv_rules = [r for r in config.rules if any(isinstance(getattr(r, f), Quantizer) for f in ATTENTION_SLOTS)]
    if kv_rules and warn_unmatched and not any(kind_of(d.module)[0] == "Attention" for d in planned):
        warnings.warn(
            f"tq.calibrate: {kv_rules[0].describe()} quantizes the KV cache, but no attention module of the model takes "
            "KV-cache quantizers (Hugging Face attention whose forward takes past_key_values, or nn.MultiheadAttention, "
            "matched by the rule)",
            CalibrationWarning,
            stacklevel=3,
        )
    if warn_unmatched:
        for i, rule in enumerate(config.rules):
            if rule.must_match and not matched[i]:
                hint = (
                    "; rules match canonical names, without DDP's/DataParallel's 'module.' or torch.compile's '_orig_mod.'"
                    if rule.name is not None and rule.name.startswith(("module.", "_orig_mod."))
                    else ""
                )
                warnings.warn(
                    f"tq.calibrate: {rule.describe()} matches no module of the model{hint}", CalibrationWarning, stacklevel=3
                )
    if skipped:
        warnings.warn("tq.calibrate left these in high precision:\n" + "\n".join(skipped), CalibrationWarning, stacklevel=3)
    if warn_unmatched and not any(d.action == "convert" and any(q is not None for q in d.using.values()) for d in planned):
        others = _unknown_weight_holders(model)
        warnings.warn(
            "tq.calibrate: the config enables no quantizer on this model, so nothing will be quantized"
            + (
                "; these modules hold a 2-D weight but are of no layer kind tq quantizes (nn.Linear or a subclass, "
                f"nn.Conv1d/2d/3d, tq.nn.GroupedLinear, experts modules): {others}"
                if others
                else ""
            ),
            CalibrationWarning,
            stacklevel=3,
        )
    return planned


def _unknown_weight_holders(model: nn.Module, shown: int = 4) -> str:
    """Modules holding a 2-D `weight` parameter that no kind of `kind_of` covers (transformers'
    GPT-2 Conv1D, a user's own GEMM module), named with their classes for the warning above."""
    found = [
        f"{name} ({type(m).__name__})"
        for name, m in canonical_modules(model)
        if kind_of(m) is None and isinstance(m._parameters.get("weight"), torch.Tensor) and m._parameters["weight"].dim() == 2
    ]
    return ", ".join(found[:shown]) + (f" and {len(found) - shown} more" if len(found) > shown else "")


def check_searches(percentile, kv_scale_search, who: str) -> None:
    """Refuse a bad `percentile` or `kv_scale_search` (`who`: the entry point, for the message)."""
    if kv_scale_search is not None and kv_scale_search not in SCALE_SEARCH:
        raise ValueError(
            f"{who}: kv_scale_search={kv_scale_search!r} is not allowed; allowed: None (per-layer KV amaxes 'mse', "
            f"per-head ones as algorithm says) or one of {', '.join(map(repr, SCALE_SEARCH))} for every KV amax"
        )
    if isinstance(percentile, bool) or not isinstance(percentile, int | float) or not (50.0 < percentile <= 100.0):
        raise ValueError(f"{who}: percentile={percentile!r} is not allowed; allowed: a number in (50, 100]")


def _check_args(model, config, forward_loop, algorithm, percentile, amax_groups, kv_scale_search) -> tuple:
    if not isinstance(model, nn.Module):
        raise TypeError(f"tq.calibrate: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, QuantConfig):
        raise TypeError(
            f"tq.calibrate: config must be a tq.calibration.QuantConfig (e.g. tq.configs.int8()), got {type(config).__name__}"
        )
    if forward_loop is not None and not callable(forward_loop):
        raise TypeError(
            f"tq.calibrate: forward_loop must be a callable taking the model, or None (data-free), got {type(forward_loop).__name__}"
        )
    algo = parse_algorithm(algorithm)
    if forward_loop is None and (algo.transforms or algo.scale_search != "max"):
        raise ValueError(
            f"tq.calibrate: algorithm={algo.describe()!r} needs calibration data; forward_loop=None (data-free) allows "
            "'max' only: static weight amaxes from the weights, round to nearest"
        )
    check_searches(percentile, kv_scale_search, "tq.calibrate")
    groups = tuple(amax_groups or ())
    for g in groups:
        if not isinstance(g, dist.ProcessGroup):
            raise TypeError(f"tq.calibrate: amax_groups must hold torch.distributed ProcessGroups, got {type(g).__name__}")
    return groups, algo


def calibrate(
    model: nn.Module,
    config: QuantConfig,
    forward_loop: Callable[[nn.Module], object] | None,
    *,
    algorithm: str | Algorithm | Sequence[str | Algorithm] = "max",
    percentile: float = 99.99,
    kv_scale_search: str | None = None,
    amax_groups: Sequence[dist.ProcessGroup] = (),
    progress: bool = True,
    sequential: bool = True,
    cache_bytes: int | None = None,
    cache_dir: str | None = None,
) -> nn.Module:
    """Convert `model` in place to fake-quantized modules and calibrate their static amaxes.

    Linear, Conv1d/2d/3d, `tq.nn.GroupedLinear`, MoE experts modules with fused 3-D weights
    (Hugging Face's and torchtitan-style: one `ExpertGemmQuantizers` unit per GEMM), Embedding and
    the norm family (BatchNorm*, SyncBatchNorm, LayerNorm, RMSNorm, GroupNorm) are converted,
    whether or not the config enables a quantizer on them, so that every one appears in
    `tq.summary` and `tq.quant_state`.

    Args:
        model: the float model (wrapped in DDP or not; matched by canonical names).
        config: a `QuantConfig`, e.g. `tq.configs.int8()`.
        forward_loop: ``forward_loop(model)`` runs the calibration data through the model.
            It runs once, or twice for "percentile" and "mse" (a second pass fills histograms).
            None: data-free, no forward pass at all: for configs whose activations need no
            calibration (weight-only, or activation scales computed at run time, such as
            `tq.configs.int8_dynamic()` and the MX presets) with the "max" algorithm; a static
            activation amax it cannot calibrate is an error naming its layer.
        algorithm: a scale search, "max", "percentile" or "mse" (see the module docstring); a weight
            transform, "gptq", "awq", "smoothquant" or a `tq.GPTQ` / `tq.AWQ` / `tq.SmoothQuant`
            with its knobs (`tqcompile.calibration.transforms`, docs/ptq.md); or an ordered tuple
            of them, e.g. ``("smoothquant", "gptq")`` (smoothing first, at most one scale search).
            Weight transforms run on Linear layers and MoE experts; `tq.summary` shows what each
            layer got.
        percentile: for "percentile", in (50, 100].
        kv_scale_search: the scale search of KV-cache (key and value) amaxes. None: "mse" for
            per-layer ones (needs `forward_loop` twice, for the histograms), per-head ones as
            `algorithm` says; "max", "percentile" or "mse": that search for every KV amax.
        amax_groups: process groups (data parallel, tensor parallel) over which every static amax
            (and histogram) is reduced, once at the end of each pass, so all ranks get the same
            scales: the ones a single process would get from the union of their data.
        progress: show a progress bar (tqdm) counting the model's forward calls.
        sequential: with a weight transform, calibrate decoder layers (the elements of a
            ``ModuleList``) one after another, keeping only that layer's statistics, each on the
            outputs of the layers before it as transformed: one pass of `forward_loop` captures the
            layers' inputs and each layer is then replayed on them (3 runs a layer per batch,
            whatever the depth; `tqcompile.calibration.replay`), or, where the model does not hand
            each layer's output to the next, one pass per layer. False: one pass for the whole
            model (every layer's Hessian at once; later layers see the float model's inputs).
        cache_bytes: the bound on the decoder layers' cached inputs held in memory while replaying
            (bytes; None: no bound). Batches beyond it are written to files in `cache_dir` (a
            temporary directory by default), read back memory-mapped, and removed at the end.
        cache_dir: where those files go.

    Returns:
        `model`, fake-quantized: it now computes ``dequantize(quantize(x))`` at every enabled
        quantizer, and trains (QAT) with the config's straight-through estimator.

    Example:
        >>> tq.calibrate(model, tq.configs.int8(), lambda m: [m(x) for x in batches])
    """
    groups, algo = _check_args(model, config, forward_loop, algorithm, percentile, amax_groups, kv_scale_search)
    StreamCache(cache_bytes, cache_dir)  # refuses a bad bound before anything changes
    if not isinstance(sequential, bool):
        raise ValueError(f"tq.calibrate: sequential={sequential!r} is not allowed; allowed: True or False")
    check_not_meta(
        model,
        "tq.calibrate",
        "calibration runs data through the real weights: materialize them first, e.g. model.to_empty(device='cpu') "
        "then model.load_state_dict(weights), or load the model without device_map='meta'",
    )
    planned = to_convert(plan(model, config))
    _warn_training(model)
    saved_buffers = {id(b): b.detach().clone() for b in model.buffers()}
    undo, surgery = WeightUndo(), Undo()
    buffers = list(model.buffers())
    observers = {}
    try:
        surgery = apply(planned, lambda d: convert_module(d.module, d.name, d.using, config.ste))
        observers = attach_amax_observers([p.module for p in planned])
        records, ran_data = {}, False
        if algo.transforms:
            # First, while the observers only check shapes: the activation amaxes below must see the final weights.
            new_cache = functools.partial(StreamCache, cache_bytes, cache_dir)
            records, ran_data = run_transforms(model, forward_loop, planned, algo, groups, progress, sequential, undo, new_cache)
        start_activation_stats(planned, observers)
        search = algo.scale_search
        tqs = quantizers_of(planned)
        searches = {t: scale_search_of(t, search, kv_scale_search) for t in tqs}
        hist_tqs = [t for t in tqs if uses_histogram(t) and searches[t] != "max"]
        if forward_loop is None:
            _check_data_free(planned)
        elif algo.transforms and search == "max" and ran_data and not static_activations(planned):
            # The transforms' passes already showed every quantizer its input (while calibrating, each
            # checks that its input's shape fits); a static amax is all a pass would add, and there is none
            # (weight-only, or activation scales computed at run time such as int8_dynamic's per-token ones).
            pass
        else:
            _run(
                model,
                forward_loop,
                [p.module for p in planned],
                "calibrating (1/2: max)" if hist_tqs else "calibrating",
                progress,
            )
        _reduce([o.stat_max for o in observers.values() if o.stat_max is not None], groups)
        if hist_tqs and forward_loop is not None:
            hist_observers = start_histograms(planned, observers, searches)
            _run(model, forward_loop, [p.module for p in planned], "calibrating (2/2: histograms)", progress)
            _reduce([o.hist for o in hist_observers], groups, op=dist.ReduceOp.SUM)
        finalize(planned, observers, search, percentile, groups, records, kv_scale_search)
    except BaseException:
        detach_observers(observers)
        undo.restore()
        surgery.undo()
        with torch.no_grad():
            for b in buffers:
                if id(b) in saved_buffers:
                    b.copy_(saved_buffers[id(b)])
        raise
    set_record(model, [p.module for p in planned], CalibrationRecord(config, describe(algo, searches), float(percentile)))
    return model


def prepare(model: nn.Module, config: QuantConfig) -> nn.Module:
    """Convert `model` in place as `calibrate` would, with every static amax a zero placeholder of
    its final shape, and no data: a template to load a saved state into, e.g. with
    ``torch.distributed.checkpoint.load({"quant": tq.quant_state(model, expert_mesh=mesh)}, ...)``,
    which fills the amax buffers in place (resharding per-expert amaxes to this model's experts).

    Quantizers that calibration would have disabled because an activation's shape does not fit
    cannot be known without data; restore such models with `tq.restore` instead.
    """
    if not isinstance(config, QuantConfig):
        raise TypeError(f"tq.calibration.prepare: config must be a QuantConfig, got {type(config).__name__}")
    planned = to_convert(plan(model, config))
    apply(planned, lambda d: convert_module(d.module, d.name, d.using, config.ste))
    for p in planned:
        m = p.module
        for slot, t in m.quantizers().items():
            shape = static_amax_shape(m, slot, t.quantizer)
            if shape is not None:
                t.set_amax(torch.zeros(shape, device=module_device(m)))
    set_record(model, [p.module for p in planned], CalibrationRecord(config, "max", 99.99))
    return model


def _warn_training(model: nn.Module) -> None:
    """Calibrating in training mode silently changes the model (BatchNorm running statistics) and
    calibrates on activations eval mode never produces (batch statistics, dropout): say so."""
    found = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in canonical_modules(model)
        if m.training
        and (
            (isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats)
            or (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0)
        )
    ]
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        warnings.warn(
            f"tq.calibrate: {shown} in training mode: forward_loop will update BatchNorm running statistics and calibrate "
            "on training-mode activations (batch statistics, dropout); call model.eval() before tq.calibrate",
            CalibrationWarning,
            stacklevel=3,
        )


def start_activation_stats(planned: list[Decision], observers: dict[TensorQuantizer, AmaxObserver]) -> None:
    """The observer of every static activation amax of the planned units starts recording its running max."""
    for p in planned:
        for t in p.module.quantizers().values():
            if t.role != "weight" and t.static_kind is not None:
                observers[t].start_max(static_amax_shape(p.module, t.role, t.quantizer), module_device(p.module))


def start_histograms(planned: list[Decision], observers: dict[TensorQuantizer, AmaxObserver], searches: dict) -> list[AmaxObserver]:
    """The observers of the planned units' quantizers whose amax a histogram decides (their search
    in `searches`, {quantizer: search}: "percentile", "mse"), each set to fill one over [0, its
    recorded max] on the next pass."""
    found = [observers[t] for t in quantizers_of(planned) if uses_histogram(t) and searches[t] != "max"]
    for o in found:
        o.start_histogram()
    return found


def to_convert(decisions: list[Decision]) -> list[Decision]:
    return [d for d in decisions if d.action == "convert"]


def quantizers_of(planned: list[Decision]) -> list[TensorQuantizer]:
    return [q for p in planned for q in p.module.quantizers().values()]


def describe(algo: Algorithm, searches: dict) -> str:
    """The calibration's algorithm as `tq.quant_state` records it: with the KV cache's own search
    where it differs (`searches`: {quantizer: its scale search})."""
    kv = {v for t, v in searches.items() if t.role in KV_SLOTS and t.static_kind is not None and v != algo.scale_search}
    return algo.describe() + (f" (KV cache: {', '.join(sorted(kv))})" if kv else "")


def scale_search_of(t: TensorQuantizer, algorithm: str, kv_scale_search: str | None) -> str:
    """The scale search of `t`'s static activation amax: `algorithm`'s, except for KV-cache amaxes
    (`calibrate`'s `kv_scale_search`; None: "mse" for a per-layer one)."""
    if t.role not in KV_SLOTS or t.quantizer is None:
        return algorithm
    if kv_scale_search is not None:
        return kv_scale_search
    return "mse" if t.static_kind == "tensor" else algorithm


def _enabled_activation_quantizers(planned: list[Decision]):
    """(layer name, TensorQuantizer) of every enabled input and output quantizer."""
    return ((p.name, t) for p in planned for t in p.module.quantizers().values() if t.role != "weight" and t.quantizer is not None)


def static_activations(planned: list[Decision]) -> bool:
    """Whether any enabled input or output quantizer has a static amax (a pass of the data calibrates it)."""
    return any(t.static_kind is not None for _, t in _enabled_activation_quantizers(planned))


def _check_data_free(planned: list[Decision]) -> None:
    check_data_free([(p.name, p.module) for p in planned])


def check_data_free(units: list[tuple[str, nn.Module]], who: str = "tq.calibrate: forward_loop=None (data-free)") -> None:
    """Quantizing without data: every enabled quantizer of the converted `units` (name, module)
    must take its scales from the weights or from the tensor at run time; a static activation
    amax needs data. `who` starts the message."""
    static = [
        f"{name!r} ({t.role}: {t.quantizer!r})"
        for name, m in units
        for t in m.quantizers().values()
        if t.role != "weight" and t.quantizer is not None and t.static_kind is not None
    ]
    if static:
        shown = ", ".join(static[:3]) + (f" and {len(static) - 3} more" if len(static) > 3 else "")
        raise ValueError(
            f"{who} cannot calibrate the static activation amaxes of {shown}; "
            "pass a forward_loop, or use a config whose activations need no calibration (weight-only, "
            "tq.configs.int8_dynamic(), the MX presets)"
        )


def finalize(
    planned: list[Decision],
    observers: dict[TensorQuantizer, AmaxObserver],
    algorithm: str,
    percentile: float,
    groups,
    records: dict[nn.Module, UnitRecord] | None = None,
    kv_scale_search: str | None = None,
) -> None:
    """Turn the planned units' statistics into amaxes and take their observers off. `records`: what
    the weight transforms did to each unit (how its weight was made; the weight amax GPTQ fixed,
    which the weight it rounded needs as it is); `kv_scale_search`: as `calibrate`'s."""
    records = records or {}
    weight_amaxes, unfit, beyond = [], [], []
    detach_observers(quantizers_of(planned))
    for p in planned:
        m, rec = p.module, records.get(p.module)
        for slot, t in m.quantizers().items():
            obs = observers.get(t)
            if obs is not None and obs.beyond_max:
                beyond.append(f"{p.name or '<root>'}.{slot}")
            if obs is not None and obs.unfit is not None:
                unfit.append(f"  {p.name} ({class_name(m)}): {slot} quantizer disabled, {obs.unfit}")
                t.quantizer = None
            if t.quantizer is not None and t.static_kind is not None:
                if slot == "weight":
                    t.set_amax(rec.amax if rec is not None and rec.amax is not None else weight_amax(m, t, algorithm))
                    weight_amaxes.append(t.amax)
                else:
                    t.set_amax(activation_amax(p.name, t, obs, scale_search_of(t, algorithm, kv_scale_search), percentile))
            if slot == "weight" and t.quantizer is not None:
                t.method = (rec.method if rec is not None else None) or algorithm
    if unfit:
        warnings.warn("tq.calibrate left these in high precision:\n" + "\n".join(unfit), CalibrationWarning, stacklevel=3)
    if beyond:
        warnings.warn(
            f"tq.calibrate: the histogram pass of forward_loop ran other data than the first pass (values beyond the first "
            f"pass's max reached {', '.join(beyond[:5])}{' and more' if len(beyond) > 5 else ''}); they were counted at the top "
            "of the range. For percentile and mse, forward_loop must run the same data each time it is called "
            "(no random augmentation, no fresh random batches)",
            CalibrationWarning,
            stacklevel=3,
        )
    # Weights are replicated over data-parallel groups and tensor-level amaxes of sharded weights
    # need the max over the shards: one MAX-reduce covers both (see docs/ptq.md for per-channel).
    _reduce(weight_amaxes, groups)
    # After the reduce, so every rank shares the same values; GPTQ's siblings already share theirs.
    share_fused_weight_amax([(p.name, p.module) for p in planned])
