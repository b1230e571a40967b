"""SmoothQuant and AWQ inside `tq.calibrate`: find the folds of one group's layers, compute their
per-input-channel scales, fold them (`tqcompile.calibration.folds`), and AWQ's clipping search.

Each fold is proved exact with power-of-two scales before its scales are computed, and checked
again with the scales chosen; a fold that would change a weight an earlier group already rounded,
or that ranks disagree on, is not made. Layers without a fold are reported, and with AWQ still get
the clipping search.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from tqcompile.calibration.algorithms import AWQ, SmoothQuant
from tqcompile.calibration.awq import awq_clip, awq_scales
from tqcompile.calibration.awq_output import ParentCalls, lowest_common_parent, parent_loss
from tqcompile.calibration.folds import Fold, FoldRecorder, apply_fold, fold_tolerance, outputs, prove_fold, same_outputs
from tqcompile.calibration.layer_stats import Context, LayerStats, input_module, per_expert, reads_module_input, weight_of
from tqcompile.calibration.modules import ExpertGemmQuantizers
from tqcompile.calibration.passes import CalibrationWarning
from tqcompile.surgery.names import canonical_modules

__all__ = ["smooth"]


def smooth(ctx: Context, members: list, stats: dict, recorder: FoldRecorder, parents: ParentCalls | None = None) -> None:
    """Smooth the group's layers (in place; statistics rescaled to match), then AWQ's clipping.
    `parents`: the recorded calls of the units' common parents, for `tq.AWQ(loss="output")`."""
    algo = ctx.plan.smoothing
    name = "smoothquant" if isinstance(algo, SmoothQuant) else "awq"
    # One run gives the outputs every proof and check compares against: a proof undoes its
    # power-of-two fold exactly, so the model computes them again until a fold is kept.
    run = _runner(ctx)
    baseline = _baseline(ctx, run)
    folds, left = _find_folds(ctx, members, recorder, run, baseline)
    made = []
    for fold in folds:
        try:
            s = (
                _smoothquant_scales(fold, stats[fold.consumers[0]], algo)
                if name == "smoothquant"
                else _awq_scales(fold, stats, algo, _loss_of(ctx, fold, parents))
            )
        except ValueError as err:  # a weight format the search cannot serve (e.g. NVFP4 with the Hadamard transform)
            left += [(u, str(err)) for u in fold.consumers]
            continue
        saved = {id(t): (t, t.detach().clone()) for t in _fold_tensors(fold)}
        apply_fold(fold, s, weight_of, ctx.undo.save)
        made.append((fold, s, saved))
    smoothed = []
    for fold, s, _ in _checked(ctx, made, run, baseline, left):
        for u in fold.consumers:
            stats[u].rescale(s)
            ctx.units[u].methods.append(name)
            smoothed.append(u)
    ctx.smoothed += len(smoothed)
    clip = isinstance(algo, AWQ) and algo.clip
    for u, reason in left:
        ctx.unsmoothed.append(f"  {ctx.name(u)}: {reason}" + ("; weight clipping search only" if clip else ""))
        if clip:
            ctx.units[u].methods.append("awq-clip")
    if clip:  # after every fold of the group: a later fold may still rescale an earlier layer's rows
        for u in [*smoothed, *(u for u, _ in left)]:
            _awq_clip(ctx, u, stats[u], algo)


def _checked(ctx: Context, made: list, run, baseline, left: list) -> list:
    """The folds made with the scales found that keep the model's outputs (within the rounding of
    the folded weights, `fold_tolerance`). All of them are checked on one run, against the strictest
    of their tolerances; only where that fails is each one checked on its own, as if made alone
    after the ones kept before it (all are undone, newest first, then redone one at a time): a fold
    that is linear only over part of the range (a clamp) is put back exactly and its layers added
    to `left`."""
    if not made:
        return []
    with torch.no_grad():
        ok = same_outputs(run(), baseline, min(fold_tolerance(f, weight_of) for f, _, _ in made))
    if _agree(ctx, ok):
        return made
    with torch.no_grad():
        for _, _, saved in reversed(made):
            for t, copy in saved.values():
                t.copy_(copy)
    kept = []
    for fold, s, _ in made:
        saved = {id(t): (t, t.detach().clone()) for t in _fold_tensors(fold)}
        apply_fold(fold, s, weight_of, ctx.undo.save)
        with torch.no_grad():
            ok = same_outputs(run(), baseline, fold_tolerance(fold, weight_of))
        if _agree(ctx, ok):
            kept.append((fold, s, saved))
            continue
        with torch.no_grad():  # put the weights back exactly
            for t, copy in saved.values():
                t.copy_(copy)
        left += [(u, f"the fold into {fold.producer_name!r} changed the model's output with the scales found") for u in fold.consumers]
    return kept


def _runner(ctx: Context):
    """What a fold is proved on: the replayed layer on its first cached batch (a fold inside the
    layer that leaves its output unchanged leaves the model's unchanged), else the model on its
    first calibration batch."""
    if ctx.fold_runner is not None:
        return ctx.fold_runner
    args, kwargs = ctx.probe if ctx.probe is not None else ((), {})
    return lambda: ctx.root(*args, **kwargs)


def _fold_tensors(fold: Fold) -> list[torch.Tensor]:
    p = fold.producer
    found = [t for t in (p._parameters.get("weight"), p._parameters.get("bias")) if t is not None]
    found += [weight_of(u) for u in fold.consumers] + [m._parameters["weight"] for m in fold.passive]
    return found


def _agree(ctx: Context, ok: bool) -> bool:
    """Every rank of `amax_groups` takes a fold only if all of them proved it."""
    if not ctx.amax_groups:
        return ok
    flag = torch.tensor([1.0 if ok else 0.0], device=ctx.device)
    for g in ctx.amax_groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g)
    return bool(flag.item() == 1.0)


def _baseline(ctx: Context, run) -> list[torch.Tensor] | None:
    """The outputs folds are proved against (None where nothing can call the model)."""
    if ctx.probe is None and ctx.fold_runner is None:
        return None
    with torch.no_grad():
        return outputs(run())


def _find_folds(ctx: Context, members: list, recorder: FoldRecorder, run, baseline) -> tuple[list[Fold], list]:
    """Proved folds for the group's layers, and (layer, reason) for the layers left without one.

    Under `amax_groups`, the candidates each rank saw on its own first batch may differ: the first
    rank of each group decides, and the others take its folds by name (the same number of
    collectives on every rank)."""
    reason = _cannot_prove(ctx, baseline)
    if not _agree(ctx, reason is None):  # every rank skips together, or the broadcast below would wait forever
        return [], [(u, reason or "another rank of amax_groups could not prove folds on its first batch") for u in members]
    with torch.no_grad():
        folds, by_choice = _propose(ctx, members, recorder, run, baseline)
    if ctx.amax_groups:
        folds = _take_first_ranks(ctx, folds, members)
    done = {id(c) for f in folds for c in f.consumers} | by_choice
    why = "no op produces its input that a per-channel scale folds into exactly (proved on the first calibration batch)"
    return folds, [(u, why) for u in members if id(u) not in done]


def _cannot_prove(ctx: Context, baseline: list[torch.Tensor] | None) -> str | None:
    if baseline is None:
        return "forward_loop never called the model itself (only its submodules), so no fold could be proved; call the model"
    if not baseline:
        return "the model's output holds no tensor to compare a fold against (return tensors, tuples, dicts or dataclasses)"
    return None


def _propose(ctx: Context, members: list, recorder: FoldRecorder, run, baseline) -> tuple[list[Fold], set[int]]:
    """The proved folds, and the ids of the layers left out by choice: no norm produces their
    input, and `SmoothQuant(linear_folds=False)` smooths no other (not reported as unsmoothed)."""
    readers = {id(m): m for _, m in ctx.model.named_modules() if (w := m._parameters.get("weight")) is not None and w.dim() == 2}
    algo = ctx.plan.smoothing
    linear_folds = not isinstance(algo, SmoothQuant) or algo.linear_folds
    folds, done, by_choice = [], set(), set()
    for u in sorted(members, key=lambda u: recorder.order.get(id(input_module(u)), 1 << 30)):
        if id(u) in done:
            continue
        channels, fold = weight_of(u).shape[-1], None
        if reads_module_input(u):
            for producer, pname in recorder.read_from.get(id(input_module(u)), []):
                if producer._parameters["weight"].numel() == channels:
                    fold = _norm_fold(ctx, producer, pname, channels, members, readers, recorder)
                    if fold is not None and prove_fold(fold, run, baseline, weight_of, channels, seed=len(folds)):
                        break
                    fold = None
        norm_read = reads_module_input(u) and any(
            p._parameters["weight"].numel() == channels for p, _ in recorder.read_from.get(id(input_module(u)), [])
        )
        if fold is None and not isinstance(u, ExpertGemmQuantizers):
            if linear_folds:
                fold = _linear_fold(ctx, u, members, recorder, run, baseline, channels)
            elif not norm_read:
                by_choice.add(id(u))
        if fold is not None:
            folds.append(fold)
            done.update(id(c) for c in fold.consumers)
    return folds, by_choice


def _norm_fold(ctx: Context, producer, pname, channels, members, readers, recorder) -> Fold | None:
    """The fold into a norm: every group layer that reads its output, and every other module with a
    weight that does (compensated, not smoothed); None if one of those is a layer an earlier group
    already rounded (its weight must not move again) or whose weight is tied to another module."""

    def reads(mid: int) -> bool:
        return any(p is producer for p, _ in recorder.read_from.get(mid, []))

    consumers = [u for u in members if reads_module_input(u) and reads(id(input_module(u)))]
    consumer_modules = {id(input_module(u)) for u in consumers}
    passive = [
        m
        for mid, m in readers.items()
        if reads(mid) and mid not in consumer_modules and m._parameters["weight"].shape[-1] == channels
    ]
    if any(ctx.finished(m) for m in passive) or any(ctx.tied(weight_of(u)) for u in consumers):
        return None
    return Fold(producer, pname, "norm", consumers, passive)


def _linear_fold(ctx: Context, u, members, recorder, run, baseline, channels) -> Fold | None:
    """The nearest Linear of the group, run before `u`, whose output width is `u`'s input width and
    whose output rows fold into `u` (proved)."""
    mine = recorder.order.get(id(u))
    if mine is None or ctx.tied(weight_of(u)):
        return None
    before = [
        p
        for p in members
        if p is not u
        and not isinstance(p, ExpertGemmQuantizers)
        and recorder.order.get(id(p), 1 << 30) < mine
        and weight_of(p).shape[0] == channels
        and not ctx.tied(weight_of(p))
    ]
    for p in sorted(before, key=lambda p: -recorder.order[id(p)]):
        fold = Fold(p, ctx.name(p, ""), "linear", [u], [])
        if prove_fold(fold, run, baseline, weight_of, channels, seed=mine):
            return fold
    return None


def _take_first_ranks(ctx: Context, folds: list[Fold], members: list) -> list[Fold]:
    """The folds of each amax group's first rank, by name, on every rank of the group."""
    by_name = dict(canonical_modules(ctx.model))  # as the units are named (ctx.units)
    unit_names = {id(u): ctx.name(u, "") for u in members}
    units = {n: u for u in members if (n := unit_names[id(u)])}
    module_names = {id(m): n for n, m in by_name.items()}
    sig = [
        (f.producer_name, f.kind, [unit_names[id(c)] for c in f.consumers], [module_names[id(m)] for m in f.passive])
        for f in folds
    ]
    for g in ctx.amax_groups:
        box = [sig]
        dist.broadcast_object_list(box, src=dist.get_global_rank(g, 0), group=g)
        sig = box[0]
    producer_of = {n: m for n, m in by_name.items()} | {n: u for n, u in units.items()}
    return [Fold(producer_of[p], p, k, [units[c] for c in cs], [by_name[m] for m in ps]) for p, k, cs, ps in sig]


def _smoothquant_scales(fold: Fold, st: LayerStats, algo: SmoothQuant) -> torch.Tensor:
    """``s = max|x|^alpha / max|w|^(1 - alpha)`` per input channel (1 where either is zero)."""
    x_max = st.ch_max.amax(0)
    w_max = torch.stack([weight_of(u).detach().abs().float().reshape(-1, x_max.numel()).amax(0) for u in fold.consumers]).amax(0)
    s = x_max.pow(algo.alpha) / w_max.pow(1.0 - algo.alpha)
    ok = (x_max > 0) & (w_max > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s)).clamp(1e-5, 1e5)


def _loss_of(ctx: Context, fold: Fold, parents: ParentCalls | None):
    """`tq.AWQ(loss="output")`'s loss for a fold of several layers (None: the Hessians')."""
    if parents is None or len(fold.consumers) < 2:
        return None
    parent = lowest_common_parent(fold.consumers, parents.scope)
    calls = parents.of(parent)
    return None if calls is None else parent_loss(fold, parent, calls, ctx.amax_groups)


def _awq_scales(fold: Fold, stats: dict, algo: AWQ, loss_fn=None) -> torch.Tensor:
    weights, quantizers, hessians = [], [], []
    for u in fold.consumers:
        st = stats[u]
        share = st.n / st.n.sum().clamp(min=1)  # experts: each one's error counts by its share of the tokens
        for e, w in per_expert(u):
            if st.n[e] > 0:
                weights.append(w.detach())  # in its own dtype: the search rounds the folded weight as the model stores it
                quantizers.append(u.weight_quantizer.quantizer)
                hessians.append(st.hessian(e) * share[e])
    x_mean = stats[fold.consumers[0]].x_mean()
    if not weights:
        return torch.ones_like(x_mean)
    return awq_scales(weights, quantizers, hessians, x_mean, algo, loss_fn)


def _awq_clip(ctx: Context, unit, st: LayerStats, algo: AWQ) -> None:
    q = unit.weight_quantizer.quantizer
    name = ctx.name(unit)
    if ctx.tied(weight_of(unit)):
        ctx.unsmoothed.append(f"  {name}: no clipping, its weight is tied to another module's")
        return
    with torch.no_grad():
        for e, w in per_expert(unit):
            if st.n[e] > 0:
                try:
                    clipped = awq_clip(w.detach(), q, st.hessian(e), algo)
                except ValueError as err:
                    warnings.warn(f"tq.calibrate: AWQ's clipping search skipped {name}: {err}", CalibrationWarning, stacklevel=4)
                    return
                ctx.undo.save(w)
                w.copy_(clipped.to(w.dtype))
