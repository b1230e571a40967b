"""The scale searches: a static amax from what calibration recorded ("max", "percentile", "mse"
over an activation's histogram; "max" or a per-unit clipping search for weights), and the
per-expert amaxes of experts that received no tokens. `tqcompile.calibration.pipeline` runs them."""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
from torch import nn

from tqcompile.api import quantize
from tqcompile.calibration.fake_quant import TensorQuantizer, static_weight_amax
from tqcompile.calibration.modules import weight_view
from tqcompile.calibration.observers import HIST_BINS, AmaxObserver
from tqcompile.calibration.passes import CalibrationWarning
from tqcompile.quantizers import Granularity, Quantizer, geometry

__all__ = ["activation_amax", "weight_amax", "uses_histogram"]

_MSE_CANDIDATES = 128
_WEIGHT_MSE_RATIOS = 40  # clipping ratios 0.5 ... 1.0 tried per weight unit


def uses_histogram(t: TensorQuantizer) -> bool:
    """Static activation amaxes per tensor, and per KV head (the only activations with static units)."""
    return (
        t.role != "weight" and t.static_kind is not None and t.num_experts is None and not t.quantizer.has_global_scale()
    )


def activation_amax(name: str, t: TensorQuantizer, obs: AmaxObserver, algorithm: str, percentile: float) -> torch.Tensor:
    if bool((obs.stat_max < 0).all()):
        raise RuntimeError(
            f"tq.calibrate: the {t.role} quantizer of {name!r} saw no data during calibration (the module never ran); "
            f"run data through it in forward_loop, or disable it with QuantRule(name={name!r}, {t.role}=False)"
        )
    if t.num_experts is not None:
        return _expert_amax(name, obs.stat_max)
    if not uses_histogram(t) or algorithm == "max":
        return obs.stat_max
    # One histogram per static amax (a KV cache's heads; one for a tensor-level amax), each searched
    # with the quantizer one unit sees: tensorwise.
    q = t.quantizer
    if q.layout()[0] is not Granularity.TENSORWISE:
        q = dataclasses.replace(q, granularity=Granularity.TENSORWISE)
    tops = obs.hist_max.reshape(-1)
    # On the CPU: a few thousand bins, searched with a host read per candidate (on a GPU, a sync each).
    hist = obs.hist.cpu()
    found = [_histogram_amax(hist[i], float(tops[i]), q, algorithm, percentile) for i in range(tops.numel())]
    return torch.stack(found).reshape(obs.stat_max.shape).to(obs.stat_max.device)


def _histogram_amax(hist: torch.Tensor, top: float, q: Quantizer, algorithm: str, percentile: float) -> torch.Tensor:
    """The "percentile" or "mse" amax of one histogram of |x| over [0, top]."""
    edges = torch.linspace(0.0, top, HIST_BINS + 1, dtype=torch.float64)
    if algorithm == "percentile":
        cdf = hist.cumsum(0) / hist.sum()
        idx = int(torch.searchsorted(cdf, torch.tensor(percentile / 100.0, dtype=cdf.dtype)).clamp(max=HIST_BINS - 1))
        return edges[idx + 1].to(torch.float32)
    return _mse_amax(hist, edges, q)


def _mse_amax(hist: torch.Tensor, edges: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The clipping value minimising the histogram-weighted squared error of fake quantization.

    Candidates are bin edges spaced geometrically (finer where small clips are), each tried with
    the library's own quantize on the bin centres."""
    centers = ((edges[:-1] + edges[1:]) / 2).to(torch.float32)
    counts = hist.to(torch.float64)
    ks = torch.unique(torch.logspace(0, math.log10(HIST_BINS), _MSE_CANDIDATES).round().long())
    best, best_err = edges[-1].to(torch.float32), math.inf
    for k in ks.tolist():
        c = edges[k].to(torch.float32)
        dq = quantize(centers, q, amax=c).dequantize()
        err = float((((dq - centers).double()) ** 2 * counts).sum())
        if err < best_err:
            best, best_err = c, err
    return best


def _expert_amax(name: str, per_expert: torch.Tensor) -> torch.Tensor:
    """Per-expert input amaxes; an expert that received no tokens gets the max over the others."""
    unseen = per_expert < 0
    if bool(unseen.all()):
        raise RuntimeError(
            f"tq.calibrate: no expert of {name!r} received any token during calibration; calibrate with data that reaches it"
        )
    if bool(unseen.any()):
        idle = unseen.nonzero().flatten().tolist()
        warnings.warn(
            f"tq.calibrate: experts {idle} of {name!r} received no tokens during calibration; "
            "their input amax is set to the max over the other experts",
            CalibrationWarning,
            stacklevel=4,
        )
    return torch.where(unseen, per_expert.max(), per_expert)


def weight_amax(module: nn.Module, t: TensorQuantizer, algorithm: str) -> torch.Tensor:
    """The static amax `algorithm` ("max" or "mse") gives the weight of the converted `module`."""
    q = t.quantizer
    with torch.no_grad():
        w = weight_view(module, module.weight.detach())
        if t.num_experts is not None and t.static_kind == "tensor":
            from tqcompile import ops

            amax = torch.stack([ops.amax(w[e], q) for e in range(w.shape[0])]).reshape(-1, 1, 1)
            if algorithm == "mse":
                amax = torch.stack([_mse_weight(w[e], q, amax[e].reshape(())) for e in range(w.shape[0])]).reshape(-1, 1, 1)
            return amax
        amax = static_weight_amax(w, q)
        return _mse_weight(w, q, amax) if algorithm == "mse" else amax


def _mse_weight(w: torch.Tensor, q: Quantizer, amax: torch.Tensor) -> torch.Tensor:
    """Per-unit amax ``r * amax`` with r in [0.5, 1] minimising that unit's squared error (an
    asymmetric unit's ``(-min, max)`` both scaled by r)."""
    best_amax, best_err = amax, None
    for i in range(_WEIGHT_MSE_RATIOS + 1):
        cand = amax * (0.5 + 0.5 * i / _WEIGHT_MSE_RATIOS) if i < _WEIGHT_MSE_RATIOS else amax
        sq_err = (quantize(w, q, amax=cand).dequantize(torch.float32) - w.float()) ** 2
        err = geometry.unit_sum(sq_err, q.layout() if amax.dim() else geometry.TENSOR)  # per unit of `amax`
        if best_err is None:
            best_amax, best_err = cand, err
        else:
            better = err < best_err
            pick = better.unsqueeze(-1) if q.has_zero_point() else better  # an asymmetric unit's (-min, max) move together
            best_amax, best_err = torch.where(pick, cand, best_amax), torch.where(better, err, best_err)
    return best_amax
