"""The weight transforms of `tq.calibrate` (SmoothQuant, AWQ, GPTQ), run group by group.

The model is cut into sequential groups: each element of a ``ModuleList`` (a decoder layer) is
one group; a layer outside any list is a group of its own; ``sequential=False`` makes one group.
For each group, in order:

1. one pass of ``forward_loop`` collects, for each of the group's Linear and experts layers, its
   input statistics: the Hessian ``2 X^T X / n`` (float64, in x in; per expert for experts), the
   per-channel max and mean of ``|x|`` (reduced across `amax_groups`: data-parallel ranks then
   compute the same transform from the union of their data). Nothing else is kept, so memory is
   the model plus one group's statistics, whatever the number of calibration batches;
2. SmoothQuant or AWQ computes per-input-channel scales and folds them into the op that produces
   the layers' input (`tqcompile.calibration.folds`); the statistics are rescaled to match;
3. GPTQ rounds each weight (per expert for experts) and fixes its static amax.

Later groups are calibrated on the outputs of the earlier groups as transformed and rounded, as in
GPTQ's own sequential scheme. The model computes in high precision while this runs (the
quantizers only record), so the activation amaxes calibrated afterwards see the final weights.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from tqcompile.calibration.algorithms import AWQ, AlgorithmPlan, SmoothQuant
from tqcompile.calibration.fake_quant import fake_quantize, static_amax_kind
from tqcompile.calibration.folds import Fold, FoldRecorder, apply_fold, outputs, prove_fold
from tqcompile.calibration.gptq import gptq_quantize
from tqcompile.calibration.modules import FUSED_SIBLINGS, ExpertGemmQuantizers, canonical_modules, kind_of
from tqcompile.calibration.passes import CalibrationWarning, reduce_stats, run_loop
from tqcompile.kernels.reference import unit_amax
from tqcompile.ops import amax as tensor_amax
from tqcompile.quantizers import Granularity, NVFP4Quantizer, Quantizer

__all__ = ["run_transforms", "WeightUndo", "TRANSFORM_KINDS"]

TRANSFORM_KINDS = ("Linear", "Experts", "GroupedLinear")


class WeightUndo:
    """Copies (on the CPU) of every parameter a transform changed, taken before its first change,
    so that a failing `tq.calibrate` leaves the model exactly as it was."""

    def __init__(self):
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def save(self, t: torch.Tensor) -> None:
        base = t._base if t._base is not None else t
        if id(base) not in self._saved:
            self._saved[id(base)] = (base, base.detach().to("cpu", copy=True))

    def restore(self) -> None:
        with torch.no_grad():
            for base, copy in self._saved.values():
                base.copy_(copy.to(base.device))
        self._saved.clear()


class _Stats:
    """One layer's input statistics (index e: an expert; a Linear has one)."""

    def __init__(self, unit: nn.Module, in_features: int, experts: int, hessian: bool):
        self.unit = unit
        dev = _weight(unit).device
        self.n = torch.zeros(experts, dtype=torch.float64, device=dev)
        self.ch_max = torch.zeros(experts, in_features, device=dev)
        self.abs_sum = torch.zeros(experts, in_features, dtype=torch.float64, device=dev)
        self.h = torch.zeros(experts, in_features, in_features, dtype=torch.float64, device=dev) if hessian else None

    def __call__(self, x: torch.Tensor, ends: torch.Tensor | None) -> None:
        with torch.no_grad():
            x = x.detach().reshape(-1, x.shape[-1]).float()
            if not bool(torch.isfinite(x).all()):
                raise ValueError(
                    f"tq.calibrate: the input of module {self.unit.input_quantizer.owner!r} holds NaN or Inf values during "
                    "calibration; calibration needs finite activations (check the data and the model's numerics before this layer)"
                )
            bounds = [0, x.shape[0]] if ends is None else [0, *ends.tolist()]
            for e in range(len(bounds) - 1):
                xs = x[bounds[e] : bounds[e + 1]]
                if xs.shape[0] == 0:
                    continue
                a = xs.abs()
                self.n[e] += xs.shape[0]
                self.ch_max[e] = torch.maximum(self.ch_max[e], a.amax(0))
                self.abs_sum[e] += a.sum(0, dtype=torch.float64)
                if self.h is not None:
                    self.h[e] += (xs.T @ xs).double()

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.n, self.abs_sum, self.h) if t is not None]

    def hessian(self, e: int) -> torch.Tensor:
        return 2.0 * self.h[e] / self.n[e].clamp(min=1)

    def x_mean(self) -> torch.Tensor:
        return (self.abs_sum.sum(0) / self.n.sum().clamp(min=1)).float()

    def rescale(self, s: torch.Tensor) -> None:
        """The statistics of ``x / s`` (after a fold)."""
        s64 = s.double()
        self.ch_max /= s
        self.abs_sum /= s64
        if self.h is not None:
            self.h /= torch.outer(s64, s64)


def _weight(unit: nn.Module) -> torch.Tensor:
    """The (E, out, in) or (out, in) weight a unit's GEMM uses (a view of the parameter)."""
    return unit.weight


def _input_module(unit: nn.Module) -> nn.Module:
    """The module whose forward input is the unit's input (an experts GEMM: its experts module)."""
    return unit.owner if isinstance(unit, ExpertGemmQuantizers) else unit


def _reads_module_input(unit: nn.Module) -> bool:
    """Whether the unit computes on its module's input itself (an experts down GEMM does not)."""
    if not isinstance(unit, ExpertGemmQuantizers):
        return True
    layout = unit.owner.tq_experts_layout
    return unit.gemm in layout.gemms[: 2 if layout.style == "torchtitan" else 1]


def sequential_groups(model: nn.Module, units: list, sequential: bool) -> list[tuple[str, list]]:
    """(name, units) per group, in the model's order (see the module docstring): each element of a
    ``ModuleList`` is a group; consecutive layers outside any list form one group together (so a
    linear's scale can still fold into the one before it)."""
    if not sequential:
        return [("model", [u for _, u in units])]
    lists = [n for n, m in canonical_modules(model) if isinstance(m, nn.ModuleList)]
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


@dataclasses.dataclass
class _Context:
    model: nn.Module
    root: nn.Module
    forward_loop: object
    plan: AlgorithmPlan
    amax_groups: tuple
    progress: bool
    undo: WeightUndo
    names: dict[int, str]
    probe: tuple | None = None  # (args, kwargs) of the model's first call
    methods: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    amaxes: dict[int, torch.Tensor | None] = dataclasses.field(default_factory=dict)
    unsmoothed: list[str] = dataclasses.field(default_factory=list)
    fell_back: list[str] = dataclasses.field(default_factory=list)


def run_transforms(model, forward_loop, planned, plan: AlgorithmPlan, amax_groups, progress: bool, sequential: bool, undo):
    """Run `plan`'s weight transforms on the planned (converted, calibrating) units; returns
    ({id(unit): method}, {id(unit): static weight amax fixed by GPTQ})."""
    root = next(m for _, m in canonical_modules(model))
    ctx = _Context(model, root, forward_loop, plan, tuple(amax_groups), progress, undo, {id(p.module): p.name for p in planned})
    units = [(p.name, p.module) for p in planned if p.module.weight_quantizer.enabled and kind_of(p.module)[0] in TRANSFORM_KINDS]
    groups = sequential_groups(model, units, sequential)
    for i, (gname, members) in enumerate(groups):
        _run_group(ctx, gname, members, f"{plan.describe()}: group {i + 1}/{len(groups)} ({gname})")
    if ctx.unsmoothed:
        warnings.warn(
            f"tq.calibrate: {type(plan.smoothing).__name__} left these layers unsmoothed (no op produces their input that a "
            "per-channel scale folds into exactly; proved on the first calibration batch); they are rounded without scales:\n"
            + "\n".join(ctx.unsmoothed),
            CalibrationWarning,
            stacklevel=3,
        )
    if ctx.fell_back:
        warnings.warn(
            "tq.calibrate: GPTQ rounded these to nearest instead:\n" + "\n".join(ctx.fell_back), CalibrationWarning, stacklevel=3
        )
    return {k: "+".join(v) for k, v in ctx.methods.items()}, ctx.amaxes


def _capture_probe(ctx: _Context):
    def hook(_module, args, kwargs):
        if ctx.probe is None:
            clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            ctx.probe = (tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()})

    return ctx.root.register_forward_pre_hook(hook, with_kwargs=True)


def _run_group(ctx: _Context, gname: str, members: list, desc: str) -> None:
    plan = ctx.plan
    need_h = plan.gptq is not None or isinstance(plan.smoothing, AWQ)
    stats = {}
    for u in members:
        w = _weight(u)
        stats[id(u)] = _Stats(u, w.shape[-1], w.shape[0] if w.dim() == 3 else 1, need_h)
        u.input_quantizer.observer = stats[id(u)]
    handles = [_capture_probe(ctx)] if ctx.probe is None else []
    recorder = FoldRecorder(ctx.model, ctx.root, members, _input_module) if plan.smoothing is not None else None
    try:
        run_loop(ctx.model, ctx.forward_loop, members, desc, ctx.progress)
    finally:
        for u in members:
            u.input_quantizer.observer = None
        for h in handles:
            h.remove()
        if recorder is not None:
            recorder.remove()
    reduce_stats([t for s in stats.values() for t in s.tensors()], ctx.amax_groups, op=torch.distributed.ReduceOp.SUM)
    reduce_stats([s.ch_max for s in stats.values()], ctx.amax_groups)
    for u in members:
        ctx.methods.setdefault(id(u), [])
    if plan.smoothing is not None:
        _smooth(ctx, members, stats, recorder)
    held = _fused_nvfp4_amax(ctx, members) if plan.gptq is not None else {}
    for u in members:
        if plan.gptq is not None:
            _gptq(ctx, u, stats[id(u)], held.get(id(u)))
        else:
            ctx.methods[id(u)].append(plan.scale_search)


# ------------------------------------------------------------------------------------------------
# Smoothing (SmoothQuant, AWQ)
# ------------------------------------------------------------------------------------------------
def _find_folds(ctx: _Context, members: list, recorder: FoldRecorder) -> tuple[list[Fold], list]:
    """Proved folds for the group's layers, and the layers left without one."""
    if ctx.probe is None:
        return [], list(members)
    args, kwargs = ctx.probe
    run = lambda: ctx.root(*args, **kwargs)  # noqa: E731
    with torch.no_grad():
        baseline = outputs(run())
        readers = {
            id(m): m for _, m in ctx.model.named_modules() if (w := m._parameters.get("weight")) is not None and w.dim() == 2
        }
        folds, done, left = [], set(), []
        ordered = sorted(members, key=lambda u: recorder.order.get(id(_input_module(u)), 1 << 30))
        for u in ordered:
            if id(u) in done:
                continue
            channels, fold = _weight(u).shape[-1], None
            if _reads_module_input(u):
                for producer, pname in recorder.read_from.get(id(_input_module(u)), []):
                    if producer._parameters["weight"].numel() == channels:
                        fold = _norm_fold(producer, pname, channels, members, readers, recorder)
                        if _proved(ctx, fold, run, baseline, channels):
                            break
                        fold = None
            if fold is None and not isinstance(u, ExpertGemmQuantizers):
                fold = _linear_fold(ctx, u, members, recorder, run, baseline, channels)
            if fold is None:
                left.append(u)
                done.add(id(u))
                continue
            folds.append(fold)
            done.update(id(c) for c in fold.consumers)
    return folds, left


def _norm_fold(producer, pname, channels, members, readers, recorder) -> Fold:
    def reads(mid: int) -> bool:
        return any(p is producer for p, _ in recorder.read_from.get(mid, []))

    consumers = [u for u in members if _reads_module_input(u) and reads(id(_input_module(u)))]
    consumer_modules = {id(_input_module(u)) for u in consumers}
    passive = [
        m
        for mid, m in readers.items()
        if reads(mid) and mid not in consumer_modules and m._parameters["weight"].shape[-1] == channels
    ]
    return Fold(producer, pname, "norm", consumers, passive)


def _linear_fold(ctx, u, members, recorder, run, baseline, channels) -> Fold | None:
    """The nearest Linear of the group, run before `u`, whose output width is `u`'s input width and
    whose output rows fold into `u` (proved)."""
    mine = recorder.order.get(id(u))
    if mine is None:
        return None
    before = [
        p
        for p in members
        if p is not u
        and not isinstance(p, ExpertGemmQuantizers)
        and recorder.order.get(id(p), 1 << 30) < mine
        and _weight(p).shape[0] == channels
    ]
    for p in sorted(before, key=lambda p: -recorder.order[id(p)]):
        fold = Fold(p, ctx.names.get(id(p), ""), "linear", [u], [])
        if _proved(ctx, fold, run, baseline, channels):
            return fold
    return None


def _proved(ctx: _Context, fold: Fold, run, baseline, channels: int) -> bool:
    ok = prove_fold(fold, run, baseline, _weight, channels, seed=len(ctx.methods))
    if ctx.amax_groups:  # every rank folds the same way, whatever its own first batch showed
        flag = torch.tensor([1.0 if ok else 0.0])
        reduce_stats([flag], ctx.amax_groups, op=torch.distributed.ReduceOp.MIN)
        ok = bool(flag.item() == 1.0)
    return ok


def _smooth(ctx: _Context, members: list, stats: dict, recorder: FoldRecorder) -> None:
    folds, left = _find_folds(ctx, members, recorder)
    algo = ctx.plan.smoothing
    name = "smoothquant" if isinstance(algo, SmoothQuant) else "awq"
    clip = isinstance(algo, AWQ) and algo.clip
    for u in left:
        ctx.unsmoothed.append(f"  {ctx.names.get(id(u), '?')}" + (": weight clipping search only" if clip else ""))
        if clip:  # the clipping search needs no fold
            _awq_clip(ctx, u, stats[id(u)], algo)
            ctx.methods[id(u)].append("awq-clip")
    for fold in folds:
        first = stats[id(fold.consumers[0])]
        if isinstance(algo, SmoothQuant):
            s = _smoothquant_scales(fold, first, algo)
        else:
            s = _awq_scales(fold, stats, algo)
        apply_fold(fold, s, _weight, ctx.undo.save)
        for u in fold.consumers:
            stats[id(u)].rescale(s)
            ctx.methods[id(u)].append(name)
        if isinstance(algo, AWQ) and algo.clip:
            for u in fold.consumers:
                _awq_clip(ctx, u, stats[id(u)], algo)


def _smoothquant_scales(fold: Fold, st: _Stats, algo: SmoothQuant) -> torch.Tensor:
    """``s = max|x|^alpha / max|w|^(1 - alpha)`` per input channel (1 where either is zero)."""
    x_max = st.ch_max.amax(0)
    w_max = torch.stack([_weight(u).detach().abs().float().reshape(-1, x_max.numel()).amax(0) for u in fold.consumers]).amax(0)
    s = x_max.pow(algo.alpha) / w_max.pow(1.0 - algo.alpha)
    ok = (x_max > 0) & (w_max > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s)).clamp(1e-5, 1e5)


def _per_expert(unit) -> list[tuple[int, torch.Tensor]]:
    w = _weight(unit)
    return [(e, w[e]) for e in range(w.shape[0])] if w.dim() == 3 else [(0, w)]


def _awq_scales(fold: Fold, stats: dict, algo: AWQ) -> torch.Tensor:
    from tqcompile.calibration.awq import awq_scales

    weights, quantizers, hessians = [], [], []
    for u in fold.consumers:
        st = stats[id(u)]
        share = st.n / st.n.sum().clamp(min=1)  # experts: each one's error counts by its share of the tokens
        for e, w in _per_expert(u):
            if st.n[e] > 0:
                weights.append(w.detach())  # in its own dtype: the search rounds the folded weight as the model stores it
                quantizers.append(u.weight_quantizer.quantizer)
                hessians.append(st.hessian(e) * share[e])
    x_mean = stats[id(fold.consumers[0])].x_mean()
    if not weights:
        return torch.ones_like(x_mean)
    return awq_scales(weights, quantizers, hessians, x_mean, algo)


def _awq_clip(ctx: _Context, unit, st: _Stats, algo: AWQ) -> None:
    from tqcompile.calibration.awq import awq_clip

    q = unit.weight_quantizer.quantizer
    with torch.no_grad():
        for e, w in _per_expert(unit):
            if st.n[e] > 0:
                clipped = awq_clip(w.detach(), q, st.hessian(e), algo)
                ctx.undo.save(w)
                w.copy_(clipped.to(w.dtype))


# ------------------------------------------------------------------------------------------------
# GPTQ
# ------------------------------------------------------------------------------------------------
def _rtn_amax(w: torch.Tensor, q: Quantizer) -> torch.Tensor:
    return tensor_amax(w, q) if q.layout()[0] is Granularity.TENSORWISE or q.uses_tensor_amax() else unit_amax(w, q)


def _fused_nvfp4_amax(ctx: _Context, members: list) -> dict[int, torch.Tensor]:
    """{id(unit): amax} for NVFP4 Linear weights an engine fuses into one GEMM (q/k/v, gate/up: one
    global scale, see `FUSED_SIBLINGS`): the max of their tensor amaxes before any is rounded, so each
    is rounded under the global scale it is served with and exports as it is."""
    families: dict[tuple[str, tuple], list] = {}
    for u in members:
        parent, _, leaf = ctx.names.get(id(u), "").rpartition(".")
        fam = next((f for f in FUSED_SIBLINGS if leaf in f), None)
        if fam is not None and isinstance(u.weight_quantizer.quantizer, NVFP4Quantizer) and _weight(u).dim() == 2:
            families.setdefault((parent, fam), []).append(u)
    held = {}
    for group in families.values():
        if len(group) > 1:
            top = torch.stack([_rtn_amax(_weight(u).detach().float(), u.weight_quantizer.quantizer) for u in group]).amax()
            held.update({id(u): top for u in group})
    return held


def _gptq(ctx: _Context, unit, st: _Stats, held_amax: torch.Tensor | None = None) -> None:
    """GPTQ-round the unit's weight in place (per expert), and fix its static amax (`held_amax`: an
    NVFP4 tensor amax shared by a fused group)."""
    t = unit.weight_quantizer
    q, kind, name = t.quantizer, t.static_kind, ctx.names.get(id(unit), "?")
    amaxes, hows = [], set()
    with torch.no_grad():
        for e, w in _per_expert(unit):
            label = f"{name} expert {e}" if _weight(unit).dim() == 3 else name
            if st.n[e] == 0:
                qw, amax, how = _round_to_nearest(w, q), (_rtn_amax(w.float(), q) if kind else None), "rtn"
                ctx.fell_back.append(f"  {label}: received no tokens during calibration (its Hessian is empty)")
            else:
                try:
                    qw, amax, how = gptq_quantize(w, st.hessian(e), q, ctx.plan.gptq, name=label, tensor_amax=held_amax)
                except ValueError as err:
                    qw, amax, how = _round_to_nearest(w, q), (_rtn_amax(w.float(), q) if kind else None), "rtn"
                    ctx.fell_back.append(f"  {label}: {err}")
            ctx.undo.save(w)
            w.copy_(qw.to(w.dtype))
            amaxes.append(amax)
            hows.add(how)
    ctx.methods[id(unit)].append("gptq" if "gptq" in hows else "rtn")
    if kind is None:
        ctx.amaxes[id(unit)] = None
    elif _weight(unit).dim() == 3:
        stacked = torch.stack([a.float() for a in amaxes])
        ctx.amaxes[id(unit)] = stacked.reshape(-1, 1, 1) if kind == "tensor" else stacked
    else:
        ctx.amaxes[id(unit)] = amaxes[0]


def _round_to_nearest(w: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """What `max` calibration would make of `w`."""
    wf = w.detach().float()
    return fake_quantize(wf, q, amax=_rtn_amax(wf, q) if static_amax_kind(q, "weight") else None)
