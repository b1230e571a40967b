"""What the weight transforms share: each layer's input statistics (an observer,
`tqcompile.calibration.observers`), the weight a layer's GEMM uses, the run's context with one
record per unit, and the undo log (see `tqcompile.calibration.transforms`)."""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn

from tqcompile.calibration.algorithms import AlgorithmPlan
from tqcompile.calibration.modules import ExpertGemmQuantizers

__all__ = [
    "LayerStats",
    "SharedGram",
    "WeightUndo",
    "UnitRecord",
    "unit_records",
    "Context",
    "tied_parameters",
    "weight_of",
    "input_module",
    "reads_module_input",
    "per_expert",
    "TRANSFORM_KINDS",
]

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


def _add_double(acc: torch.Tensor, g: torch.Tensor, rows: int = 1024) -> None:
    """``acc += g`` for a float64 `acc` and float32 `g`: float64 copies of `g` added a band of rows
    at a time (2.7x faster than letting `add_` cast each element, measured on a 512-wide Gram on
    this CPU; the bands keep the copy small where a Gram is GBs). The same values either way."""
    for r in range(0, g.shape[0], rows):
        acc[r : r + rows] += g[r : r + rows].double()


class SharedGram:
    """``xᵀx`` of the last input one group's statistics saw, handed to the next layer that reads
    the same tensor unchanged: q/k/v (gate/up) read one input, and its Gram matrix, the statistics'
    main cost, was computed once per projection (a third of a Llama layer's Hessian work at hidden
    512). Held by a weak reference to the input and its version counter, so a new or changed
    tensor is never taken for the old; `clear` lets the matrix go when the group's pass ends."""

    def __init__(self):
        self._of: weakref.ref | None = None
        self._version = -1
        self._gram: torch.Tensor | None = None

    def __call__(self, source: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x.T @ x`` for `x`, the (n, in) float32 rows of `source` as given to `LayerStats.record`."""
        if source.is_inference():  # no version counter to tell a changed tensor by: not shared
            return x.T @ x
        if self._of is not None and self._of() is source and source._version == self._version:
            return self._gram
        self.clear()
        gram = x.T @ x
        self._of, self._version, self._gram = weakref.ref(source), source._version, gram
        return gram

    def clear(self) -> None:
        self._of, self._gram = None, None


class LayerStats:
    """One layer's input statistics (index e: an expert; a Linear has one), recorded as the
    observer of its input quantizer: the per-channel max of |x| always, the per-channel sum of |x|
    with `mean` (AWQ's x_mean), the Hessian with `hessian` (GPTQ, AWQ). SmoothQuant alone needs only
    the max: the others cost more than the max itself. `gram`: shared by the layers of one group,
    so that the ones reading one input compute its ``xᵀx`` once."""

    def __init__(self, unit: nn.Module, in_features: int, experts: int, *, hessian: bool, mean: bool, gram: SharedGram | None = None):
        self.unit = unit
        self.gram = gram
        dev = weight_of(unit).device
        self.n = torch.zeros(experts, dtype=torch.float64, device=dev)
        self.ch_max = torch.zeros(experts, in_features, device=dev)
        self.abs_sum = torch.zeros(experts, in_features, dtype=torch.float64, device=dev) if mean else None
        self.h = torch.zeros(experts, in_features, in_features, dtype=torch.float64, device=dev) if hessian else None

    def record(self, x: torch.Tensor, ends: torch.Tensor | None) -> None:
        with torch.no_grad():
            source, x = x, x.detach().reshape(-1, x.shape[-1]).float()
            bounds = [0, x.shape[0]] if ends is None else [0, *ends.tolist()]
            for e in range(len(bounds) - 1):
                xs = x[bounds[e] : bounds[e + 1]]
                if xs.shape[0] == 0:
                    continue
                a = xs.abs()
                top = a.amax(0)
                # amax propagates NaN and Inf: checking the (in,) maxima checks every element, for
                # the price of a reduction the statistics take anyway (isfinite(x) would be a pass of its own).
                if not bool(torch.isfinite(top).all()):
                    raise ValueError(
                        f"tq.calibrate: the input of module {self.unit.input_quantizer.owner!r} holds NaN or Inf values during "
                        "calibration; calibration needs finite activations (check the data and the model's numerics before this layer)"
                    )
                self.n[e] += xs.shape[0]
                self.ch_max[e] = torch.maximum(self.ch_max[e], top)
                if self.abs_sum is not None:
                    self.abs_sum[e] += a.sum(0, dtype=torch.float64)
                if self.h is not None:
                    shared = self.gram is not None and ends is None
                    _add_double(self.h[e], self.gram(source, xs) if shared else xs.T @ xs)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.n, self.abs_sum, self.h) if t is not None]

    def hessian(self, e: int) -> torch.Tensor:
        return 2.0 * self.h[e] / self.n[e].clamp(min=1)

    def take_hessian(self, e: int) -> torch.Tensor:
        """`hessian(e)` computed in the statistics' own memory (the same values: 2 h, then / n),
        for a consumer that uses it last (GPTQ): no copy of a matrix that can be GBs. A Linear's
        statistics then let go of it, so the consumer can free it as it goes."""
        h = self.h[e].mul_(2.0).div_(self.n[e].clamp(min=1))
        if self.h.shape[0] == 1:
            self.h = None
        return h

    def x_mean(self) -> torch.Tensor:
        return (self.abs_sum.sum(0) / self.n.sum().clamp(min=1)).float()

    def rescale(self, s: torch.Tensor) -> None:
        """The statistics of ``x / s`` (after a fold)."""
        s64 = s.double()
        self.ch_max /= s
        if self.abs_sum is not None:
            self.abs_sum /= s64
        if self.h is not None:
            self.h /= torch.outer(s64, s64)


@dataclasses.dataclass(eq=False)
class UnitRecord:
    """What the weight transforms did to one converted unit (a Linear, an experts GEMM), for
    `tqcompile.calibration.pipeline.finalize`."""

    name: str
    methods: list[str] = dataclasses.field(default_factory=list)  # how its weight was made, in order: "awq", "gptq"
    amax: torch.Tensor | None = None  # the static weight amax GPTQ fixed: the weight it rounded needs it as it is
    finished: bool = False  # its group is done: its weight is final

    @property
    def method(self) -> str | None:
        """The methods joined ("awq+gptq"), None if no transform ran on the unit."""
        return "+".join(self.methods) or None


def unit_records(named: list[tuple[str, nn.Module]]) -> dict[nn.Module, UnitRecord]:
    """A fresh record for each (name, unit), keyed by the unit itself."""
    return {m: UnitRecord(name) for name, m in named}


@dataclasses.dataclass
class Context:
    """One `run_transforms` call: the model, the user's loop, the plan, and what the groups found."""

    model: nn.Module
    root: nn.Module
    forward_loop: object
    plan: AlgorithmPlan
    amax_groups: tuple
    progress: bool
    undo: WeightUndo
    units: dict[nn.Module, UnitRecord]
    tied_weights: set[torch.Tensor]  # parameters that more than one module holds (a tied lm_head and embedding)
    device: torch.device
    probe: tuple | None = None  # (args, kwargs) of the model's first call
    unsmoothed: list[str] = dataclasses.field(default_factory=list)
    smoothed: int = 0  # layers a smoothing fold was kept for
    fell_back: list[str] = dataclasses.field(default_factory=list)
    fold_runner: object = None  # while a replayed group smooths: its layer on its first cached batch

    def name(self, unit: nn.Module, default: str = "?") -> str:
        rec = self.units.get(unit)
        return default if rec is None else rec.name

    def tied(self, t: torch.Tensor) -> bool:
        """Whether `t` (a weight, or a view of one) is a parameter another module holds too."""
        return (t._base if t._base is not None else t) in self.tied_weights

    def finished(self, module: nn.Module) -> bool:
        """Whether `module` computes a unit of an earlier group (its weight is final)."""
        return any(rec.finished and input_module(u) is module for u, rec in self.units.items())

    def finish(self, members: list) -> None:
        """The group of `members` is done: later groups must not change their weights."""
        for u in members:
            self.units[u].finished = True


def tied_parameters(model: nn.Module) -> set[torch.Tensor]:
    """The parameters held under more than one name (tied weights)."""
    seen: dict[torch.Tensor, int] = {}  # tensors hash by identity
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[p] = seen.get(p, 0) + 1
    return {p for p, n in seen.items() if n > 1}


def weight_of(unit: nn.Module) -> torch.Tensor:
    """The (E, out, in) or (out, in) weight a unit's GEMM uses (a view of the parameter)."""
    return unit.weight


def input_module(unit: nn.Module) -> nn.Module:
    """The module whose forward input is the unit's input (an experts GEMM: its experts module)."""
    return unit.owner if isinstance(unit, ExpertGemmQuantizers) else unit


def reads_module_input(unit: nn.Module) -> bool:
    """Whether the unit computes on its module's input itself (an experts down GEMM does not)."""
    if not isinstance(unit, ExpertGemmQuantizers):
        return True
    layout = unit.owner.tq_experts_layout
    return unit.gemm in layout.gemms[: 2 if layout.style == "torchtitan" else 1]


def per_expert(unit) -> list[tuple[int, torch.Tensor]]:
    w = weight_of(unit)
    return [(e, w[e]) for e in range(w.shape[0])] if w.dim() == 3 else [(0, w)]
