"""Observers: what `tq.calibrate` records while the model computes in high precision.

A `TensorQuantizer` holds only what the calibrated model runs with (its quantizer, static amax and
straight-through estimator). Calibration attaches an observer to it, in its one ``observer`` slot,
for as long as a stage needs one; while one is attached, the quantizer hands each input to
``observer.record(x, ends)`` (``x`` as its scaling units see it, ``ends`` an experts input's
segments) and returns the input unchanged, so every layer sees the float model's activations.
The pipeline takes every observer off when it ends, whether it returns or raises.

- `AmaxObserver`: the statistics of one quantizer's static amax. It checks that the quantizer
  fits each input's shape (`unfit` says why not: calibration disables it and says so), refuses
  NaN / Inf inputs, keeps the running max of each static amax (per expert, per KV head) once
  `start_max` allocates it, and, once `start_histogram` starts the second pass of "percentile" /
  "mse", fills one histogram of ``|x|`` per static amax over ``[0, max]`` (`beyond_max`: that
  pass saw values beyond the first pass's max).
- `tqcompile.calibration.layer_stats.LayerStats`: one layer's input statistics for the weight
  transforms (Hessian, per-channel max and mean of ``|x|``).
- `Observers`: several on one quantizer, recording in order (a layer's statistics beside its
  input's amax observer while the weight transforms run).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tqcompile.calibration.fake_quant import Observer, TensorQuantizer
from tqcompile.ops import grouped_gemm as gops
from tqcompile.quantizers import Quantizer

__all__ = ["AmaxObserver", "Observers", "attach_amax_observers", "detach_observers", "HIST_BINS"]

HIST_BINS = 2048


class Observers:
    """Several observers of one quantizer's input, each shown every input, in order."""

    def __init__(self, *observers: Observer):
        self.observers = observers

    def record(self, x: torch.Tensor, ends: torch.Tensor | None) -> None:
        for o in self.observers:
            o.record(x, ends)


class AmaxObserver:
    """The statistics of one `TensorQuantizer`'s static amax (see the module docstring).

    Attached, it records nothing but the shape check until `start_max`: the weight transforms run
    the data first, and the activation amaxes must see the weights they leave."""

    def __init__(self, quantizer: Quantizer | None, role: str, owner: str, static_kind: str | None):
        self.quantizer = quantizer
        self.role = role
        self.owner = owner  # the canonical name of the module, for messages
        self.static_kind = static_kind
        self.unfit: str | None = None  # why the quantizer cannot serve a tensor it was shown
        self.stat_max: torch.Tensor | None = None  # running max of each static amax (-1: no data yet)
        self.hist: torch.Tensor | None = None  # (units, HIST_BINS) histograms of |x| over [0, hist_max]
        self.hist_max: torch.Tensor | None = None
        self.beyond_max = False  # the histogram pass saw values beyond the max pass's max

    @classmethod
    def of(cls, t: TensorQuantizer) -> AmaxObserver:
        """The observer of `t`'s static amax, for its quantizer as it is now."""
        return cls(t.quantizer, t.role, t.owner, t.static_kind)

    def start_max(self, shape: tuple[int, ...], device: torch.device) -> None:
        """Record the running max of a static amax of `shape` from the next input on. Every rank
        holds every statistic, seen or not (-1: no data yet), so the reductions line up across
        ranks whatever data each one got."""
        self.stat_max = torch.full(shape, -1.0, device=device)

    def start_histogram(self) -> None:
        """Fill one histogram per static amax, over [0, its recorded max], from the next input on."""
        self.hist_max = self.stat_max.clamp(min=0)
        self.hist = torch.zeros(self.stat_max.numel(), HIST_BINS, dtype=torch.float64, device=self.stat_max.device)

    def record(self, x: torch.Tensor, ends: torch.Tensor | None) -> None:
        if self.role == "weight" or self.quantizer is None:
            return  # weights are calibrated from the weights; a disabled quantizer needs nothing
        if self.unfit is None:
            try:
                self.quantizer.check_shape(x.shape)
            except ValueError as e:
                self.unfit = f"its {tuple(x.shape)} {self.role} does not fit: {e}"
        if self.static_kind is None or self.stat_max is None:
            return  # dynamic scales need no statistics; none are allocated while weight transforms run
        if x.numel() == 0:
            return
        if self.stat_max.device != x.device:  # a module holding no tensor (an experts GEMM unit) started on the CPU
            self.stat_max = self.stat_max.to(x.device)
        with torch.no_grad():
            if not bool(torch.isfinite(x).all()):
                bad = "NaN" if bool(torch.isnan(x).any()) else "Inf"
                raise ValueError(
                    f"tq.calibrate: the {self.role} of module {self.owner!r} holds {bad} values during calibration; "
                    "calibration needs finite activations (check the data and the model's numerics before this layer)"
                )
            if self.hist is not None:
                self._record_hist(x)
                return
            # One entry per expert for experts' inputs.
            if ends is not None:
                a = gops.grouped_amax(x, self.quantizer, ends, False)
                seen = torch.diff(ends, prepend=ends.new_zeros(1)) > 0  # an expert without tokens stays unseen
                self.stat_max = torch.maximum(self.stat_max, torch.where(seen, a, -1.0))
            elif self.static_kind == "unit":  # KV heads: one row each (TensorQuantizer.forward's unit_dim)
                from tqcompile.kernels.reference import unit_amax

                self.stat_max = torch.maximum(self.stat_max, unit_amax(x, self.quantizer))
            else:
                from tqcompile import ops

                self.stat_max = torch.maximum(self.stat_max, ops.amax(x, self.quantizer))

    def _record_hist(self, x: torch.Tensor) -> None:
        # One histogram per static amax: `hist` is (units, HIST_BINS), a tensor-level amax one unit.
        tops = self.hist_max.reshape(-1)
        rows = x.detach().float().abs().reshape(tops.numel(), -1)
        for i in range(tops.numel()):
            top, a = float(tops[i]), rows[i]
            if bool((a > top).any()):
                # The second pass saw values beyond the first pass's max (forward_loop ran other data):
                # histc would drop them, biasing the percentile low; count them in the top bin instead.
                self.beyond_max = True
                a = a.clamp(max=top)
            counts = torch.histc(a, bins=HIST_BINS, min=0.0, max=top if top > 0 else 1.0)
            self.hist[i] += counts.double()


def attach_amax_observers(units: list[nn.Module]) -> dict[TensorQuantizer, AmaxObserver]:
    """An `AmaxObserver` on every quantizer of the converted `units`: from now on they record
    instead of quantizing. A disabled one records nothing, but has one too: the model is being
    calibrated there as well (`tq.calibration.weight_only` refuses to run inside `forward_loop`)."""
    found = {}
    for m in units:
        for t in m.quantizers().values():
            t.observer = found[t] = AmaxObserver.of(t)
    return found


def detach_observers(quantizers: Iterable[TensorQuantizer]) -> None:
    """Take the observers off `quantizers`: they quantize again."""
    for t in quantizers:
        t.observer = None
