"""The weight transforms of `tq.calibrate` (SmoothQuant, AWQ, GPTQ), run group by group.

The model is cut into sequential groups: each element of a ``ModuleList`` (a decoder layer), or of
an ``nn.Sequential`` of blocks (timm's ``blocks``), is one group; consecutive layers outside those
form one group together; ``sequential=False`` makes one group. For each group, in order:

1. one pass of the data (for consecutive decoder layers, the group's layer replayed on its cached
   inputs, `tqcompile.calibration.replay`; elsewhere a pass of ``forward_loop``) collects, for
   each of the group's Linear and experts layers, its input statistics
   (`tqcompile.calibration.layer_stats`): the Hessian ``2 X^T X / n`` (float64, in x in; per
   expert for experts), the per-channel max and mean of ``|x|`` (reduced across
   `amax_groups`: data-parallel ranks then compute the same transform from the union of their
   data). No activation is kept, whatever the number of calibration batches;
2. SmoothQuant or AWQ computes per-input-channel scales and folds them into the op that produces
   the layers' input (`tqcompile.calibration.smoothing`, `tqcompile.calibration.folds`); the
   statistics are rescaled to match;
3. GPTQ rounds each weight (per expert for experts) and fixes its static amax.

Later groups are calibrated on the outputs of the earlier groups as transformed and rounded, as in
GPTQ's own sequential scheme. The model computes in high precision while this runs (the
quantizers only record), so the activation amaxes calibrated afterwards see the final weights.
A weight held by two modules (a tied lm_head and embedding) is never changed by a transform.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from tqcompile.calibration import replay
from tqcompile.calibration.algorithms import AWQ, AlgorithmPlan
from tqcompile.calibration.awq_output import ParentCalls
from tqcompile.calibration.fake_quant import round_to_nearest, static_weight_amax
from tqcompile.calibration.folds import FoldRecorder
from tqcompile.calibration.fused import fused_nvfp4_groups, shared_amax
from tqcompile.calibration.gptq import gptq_quantize
from tqcompile.calibration.layer_stats import (
    TRANSFORM_KINDS,
    Context,
    LayerStats,
    SharedGram,
    UnitRecord,
    input_module,
    per_expert,
    tied_parameters,
    unit_records,
    weight_of,
)
from tqcompile.calibration.modules import kind_of, module_device
from tqcompile.calibration.observers import Observers
from tqcompile.calibration.passes import CalibrationWarning, reduce_stats, run_loop
from tqcompile.calibration.smoothing import smooth
from tqcompile.surgery.names import canonical_modules, unwrap

__all__ = ["run_transforms", "run_group", "transform_units", "sequential_groups", "REPLAY"]

# Run decoder-layer chains on cached inputs (`tqcompile.calibration.replay`); False: one pass of
# forward_loop per group, as before (the tests compare the two).
REPLAY = True


def sequential_groups(model: nn.Module, units: list, sequential: bool) -> list[tuple[str, list]]:
    """(name, units) per group, in the model's order (see the module docstring)."""
    if not sequential:
        return [("model", [u for _, u in units])]
    lists = [
        n
        for n, m in canonical_modules(model)
        if isinstance(m, nn.ModuleList) or (isinstance(m, nn.Sequential) and not any(kind_of(c) for c in m.children()))
    ]
    groups: list[tuple[str, list]] = []
    for name, u in units:
        key = None
        for ln in lists:
            prefix = f"{ln}." if ln else ""
            if name.startswith(prefix) and name != ln:
                key = prefix + name[len(prefix) :].split(".", 1)[0]
                break
        if groups and (groups[-1][0] == key or (key is None and groups[-1][0].startswith("<"))):
            groups[-1][1].append(u)
        else:
            groups.append((key if key is not None else f"<{name}>", [u]))
    return groups


def transform_units(planned) -> list[tuple[str, nn.Module]]:
    """(name, unit) of the planned units a weight transform changes: Linear and experts layers
    whose weight quantizer is enabled."""
    return [(p.name, p.module) for p in planned if kind_of(p.module)[0] in TRANSFORM_KINDS and p.module.weight_quantizer.enabled]


def run_transforms(
    model, forward_loop, planned, plan: AlgorithmPlan, amax_groups, progress: bool, sequential: bool, undo, new_cache=replay.StreamCache
) -> tuple[dict[nn.Module, UnitRecord], bool]:
    """Run `plan`'s weight transforms on the planned (converted, calibrating) units; returns each
    unit's record (how its weight was made, the static weight amax GPTQ fixed) and whether a pass of
    forward_loop ran (the first group's always runs the whole model). `new_cache()` makes the
    `replay.StreamCache` a chain's cached inputs go to."""
    root = unwrap(model)
    records = unit_records([(p.name, p.module) for p in planned])
    units = transform_units(planned)
    device = module_device(units[0][1]) if units else torch.device("cpu")
    ctx = Context(model, root, forward_loop, plan, tuple(amax_groups), progress, undo, records, tied_parameters(model), device)
    groups = sequential_groups(model, units, sequential)
    by_first = {c.first: c for c in (replay.chains(model, [g for g, _ in groups]) if REPLAY and sequential else [])}
    chain = None
    from tqdm.auto import tqdm

    # Counts groups (decoder layers): replayed layers run no pass of forward_loop for run_loop's bar to count.
    bar = tqdm(total=len(groups), desc=f"{plan.describe()}: layers", unit=" layer", disable=not progress or len(groups) < 2)
    try:
        for i, (gname, members) in enumerate(groups):
            desc = f"{plan.describe()}: group {i + 1}/{len(groups)} ({gname})"
            chain = by_first.get(i, chain)
            if chain is not None and i == chain.first:
                # The chain's first layer: its statistics from the pass of forward_loop that captures the chain's inputs.
                if not _first_of_chain(ctx, chain, members, desc, new_cache()):
                    chain = None  # the model does not hand each layer's output to the next: a pass per group
            elif chain is not None and chain.first < i <= chain.last:
                index = i - chain.first
                ctx.fold_runner = functools.partial(replay.first_output, chain, index)
                try:
                    run_group(ctx, members, desc, functools.partial(replay.replay, chain, index, advance=False), chain.modules[index])
                finally:
                    ctx.fold_runner = None
                if i < chain.last:  # the next layer's inputs
                    replay.replay(chain, index, advance=True)
                else:
                    chain.release()
            else:
                run_group(ctx, members, desc)
            ctx.finish(members)
            bar.update(1)
    finally:  # a failure mid-chain: the cached inputs' files go too
        bar.close()
        for c in by_first.values():
            c.release()
    if plan.smoothing is not None and units and ctx.smoothed == 0 and not ctx.unsmoothed:
        # Every layer left out by choice: on a post-norm model (OLMo 2) no norm produces any layer's input.
        warnings.warn(
            "tq.calibrate: SmoothQuant smoothed no layer: no norm produces the input of any quantized layer, and "
            "SmoothQuant(linear_folds=False) folds into nothing else; algorithm=tq.calibration.SmoothQuant(linear_folds=True) "
            "also folds into the linear layer before a layer where the fold is exact (up_proj into down_proj)",
            CalibrationWarning,
            stacklevel=3,
        )
    if ctx.unsmoothed:
        warnings.warn(
            f"tq.calibrate: {type(plan.smoothing).__name__} left these layers unsmoothed, rounded without scales:\n"
            + "\n".join(ctx.unsmoothed),
            CalibrationWarning,
            stacklevel=3,
        )
    if ctx.fell_back:
        warnings.warn(
            "tq.calibrate: GPTQ left these to round to nearest instead:\n" + "\n".join(ctx.fell_back),
            CalibrationWarning,
            stacklevel=3,
        )
    return ctx.units, bool(groups)


def _first_of_chain(ctx: Context, chain, members: list, desc: str, cache: replay.StreamCache) -> bool:
    """Run the group of the chain's first layer on one pass of forward_loop that also captures the
    chain's inputs (`replay.capture`), then hand its rounded outputs on; False where the capture
    found no hand-off (the group itself is done either way: its statistics came from a whole pass)."""
    captured = [False]

    def run_data():
        captured[0] = replay.capture(chain, functools.partial(run_loop, ctx.model, ctx.forward_loop, members, desc, ctx.progress), cache)
        if captured[0]:
            ctx.fold_runner = functools.partial(replay.first_output, chain, 0)

    try:
        run_group(ctx, members, desc, run_data, chain.modules[0])
    finally:
        ctx.fold_runner = None
    if captured[0]:
        replay.replay(chain, 0, advance=True)
    return captured[0]


def _capture_probe(ctx: Context):
    def hook(_module, args, kwargs):
        if ctx.probe is None:
            clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            ctx.probe = (tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()})

    return ctx.root.register_forward_pre_hook(hook, with_kwargs=True)


def run_group(ctx: Context, members: list, desc: str, run_data=None, layer: nn.Module | None = None) -> None:
    """Collect the group's statistics by one pass of the data (`run_data`: the group's `layer` on its
    cached inputs, `tqcompile.calibration.replay`; None: the user's whole `forward_loop`), then
    transform and round its layers."""
    plan = ctx.plan
    awq = isinstance(plan.smoothing, AWQ)
    stats, attached, gram = {}, {}, SharedGram()
    for u in members:
        w = weight_of(u)
        stats[u] = LayerStats(u, w.shape[-1], w.shape[0] if w.dim() == 3 else 1, hessian=plan.gptq is not None or awq, mean=awq, gram=gram)
        # Beside the input's amax observer, and first: a NaN input is reported as the layer statistics word it.
        t = attached[u] = u.input_quantizer.observer
        u.input_quantizer.observer = stats[u] if t is None else Observers(stats[u], t)
    handles = [_capture_probe(ctx)] if ctx.probe is None else []
    # The producers of the layers' inputs are recorded on the first call of the model, or of the
    # replayed layer (they are inside it).
    recorder = FoldRecorder(ctx.model, layer or ctx.root, members, input_module) if plan.smoothing is not None else None
    parents = ParentCalls(members, layer or ctx.root) if awq and plan.smoothing.loss == "output" else None
    try:
        if run_data is None:
            run_loop(ctx.model, ctx.forward_loop, members, desc, ctx.progress)
        else:
            run_data()
    finally:
        gram.clear()
        for u, t in attached.items():
            u.input_quantizer.observer = t
        for h in handles:
            h.remove()
        if recorder is not None:
            recorder.remove()
        if parents is not None:
            parents.remove()
    reduce_stats([t for s in stats.values() for t in s.tensors()], ctx.amax_groups, op=torch.distributed.ReduceOp.SUM)
    reduce_stats([s.ch_max for s in stats.values()], ctx.amax_groups)
    if plan.smoothing is not None:
        smooth(ctx, members, stats, recorder, parents)
        parents = None  # the recorded calls go with the group's smoothing
    held = _fused_nvfp4_amax(ctx, members) if plan.gptq is not None else {}
    for u in members:
        if plan.gptq is not None:
            _gptq(ctx, u, stats[u], held.get(u))
        else:
            ctx.units[u].methods.append(plan.scale_search)


# ------------------------------------------------------------------------------------------------
# GPTQ
# ------------------------------------------------------------------------------------------------
def _fused_nvfp4_amax(ctx: Context, members: list) -> dict[int, torch.Tensor]:
    """{unit: amax} for NVFP4 Linear weights an engine fuses into one GEMM (q/k/v, gate/up: one
    global scale, `tqcompile.calibration.fused`): the max of their tensor amaxes before any is
    rounded, so each is rounded under the global scale it computes and is served with."""
    named = [(ctx.name(u, ""), u) for u in members]
    held = {}
    for group in fused_nvfp4_groups(named, lambda u: u.weight_quantizer.quantizer if weight_of(u).dim() == 2 else None):
        top = shared_amax([static_weight_amax(weight_of(u).detach().float(), u.weight_quantizer.quantizer) for _, u in group])
        held.update({u: top for _, u in group})
    return held


def _gptq(ctx: Context, unit, st: LayerStats, held_amax: torch.Tensor | None = None) -> None:
    """GPTQ-round the unit's weight in place (per expert), and fix its static amax (`held_amax`: an
    NVFP4 tensor amax shared by a fused group)."""
    t = unit.weight_quantizer
    q, kind, name = t.quantizer, t.static_kind, ctx.name(unit)
    if ctx.tied(weight_of(unit)):
        ctx.fell_back.append(f"  {name}: its weight is tied to another module's (rounding it would change that module too)")
        ctx.units[unit].methods.append(ctx.plan.scale_search)
        return
    amaxes, hows = [], set()
    with torch.no_grad():
        for e, w in per_expert(unit):
            label = f"{name} expert {e}" if weight_of(unit).dim() == 3 else name
            why = "received no tokens during calibration (its Hessian is empty)" if st.n[e] == 0 else None
            if why is None:
                try:
                    # Handed over (float64, in the statistics' memory): GPTQ frees it as it goes.
                    qw, amax, how = gptq_quantize(w, st.take_hessian(e), q, ctx.plan.gptq, name=label, tensor_amax=held_amax, own_hessian=True)
                except ValueError as err:
                    why = str(err)
            if why is not None:
                wf = w.detach().float()
                amax = static_weight_amax(wf, q) if held_amax is None else held_amax
                qw, how = round_to_nearest(wf, q, amax=amax), "rtn"
                ctx.fell_back.append(f"  {label}: {why}")
            ctx.undo.save(w)
            w.copy_(qw.to(w.dtype))
            amaxes.append(amax)
            hows.add(how)
    rec = ctx.units[unit]
    rec.methods.append("gptq" if "gptq" in hows else "rtn")
    if kind is None:
        rec.amax = None
    elif weight_of(unit).dim() == 3:
        stacked = torch.stack([a.float() for a in amaxes])
        rec.amax = stacked.reshape(-1, 1, 1) if kind == "tensor" else stacked
    else:
        rec.amax = amaxes[0]
