"""AWQ for the weights that share one input (issue 18; the pure functions `tq.calibrate` calls).

AWQ (Lin et al., 2023) multiplies each input channel of a layer's weight by a scale ``s`` and
divides the op that produces the layer's input by it (a norm's weight, or the previous linear's
output rows), so the float model is unchanged, but channels that carry large activations keep more
of their precision when the weight is rounded. Then a per-scale-unit clipping search shrinks each
unit's range where that lowers the output error.

Everything here works from the Hessian ``H = 2 X^T X / n`` (in x in, float64) of the layer's
calibration inputs, so no activations are kept: replacing a weight W by Ŵ changes the layer's
output by an error ``tr((W - Ŵ) H (W - Ŵ)^T)`` (its mean squared output error, times 2).

- `awq_scales` / `awq_search`: one scale vector for the layers that read the same input (q/k/v,
  gate/up; a router is not passed). Candidates follow llmcompressor's `AWQModifier`:
  ``s = mean|x|^r / w_mean^(1-r)`` for r = i / grid (or ``mean|x|^r`` without `duo_scaling`), where
  w_mean is each input channel's mean of |W| normalised by its scale unit's amax, over the rows of
  every layer; each candidate is divided by ``sqrt(max(s) * min(s))``. The identity is always a
  candidate and wins ties. A candidate's loss is ``sum_layers tr(D H D^T)`` with
  ``D = W - RTN(W diag(s)) diag(1/s)``, RTN being `max` calibration's round to nearest (what
  `tq.calibrate` gives the scaled weight).
- `awq_clip`: per scale unit (a row, a 1-D group, a 16x16 or 128x128 tile, the whole tensor for
  per-tensor scales, an NVFP4 16-block, an MX 32-block), ratios from 1 down to ``1 - max_shrink``;
  a unit's error is ``d_u H_uu d_u^T``, with the diagonal block of H for its input columns. The
  weight is returned *clamped* per unit to ``ratio * amax``: `max` calibration of the clamped
  weight then finds exactly the clipped amax. For Int and FP8 that is bit for bit the same as
  quantizing the unclamped weight with the clipped amax (the elements beyond it saturate); for
  NVFP4 too (elements beyond the bound encode 6 either way); for MX it is not (a FLOOR or RCEIL
  scale leaves room above the bound, where unclamped elements would round higher), and clamping is
  the only form MX can take, having no static amax; the search measures the clamped weight, so it
  is exact for every format.

Supported weight quantizers: `IntQuantizer` (INT4 / INT8; TENSORWISE, ROWWISE along the input
dim, BLOCKWISE_1D), `Float8Quantizer` (also BLOCKWISE_2D), `MXQuantizer`, `NVFP4Quantizer`
without Hadamard transform or stochastic rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from tqcompile.calibration.algorithms import AWQ
from tqcompile.calibration.fake_quant import round_to_nearest
from tqcompile.quantizers import Granularity, Quantizer, geometry

__all__: list[str] = []  # used by tq.calibrate once it offers algorithm="awq"; nothing public yet

# Channel statistics (mean|x|, w_mean) are floored at this fraction of their largest value before
# the power: a zero (dead) channel then gets a finite, non-zero scale, and the floor does not
# depend on the activations' units (llmcompressor's absolute 1e-4 would flatten small activations).
# With both floored, every candidate's max/min ratio is at most 1 / _REL_FLOOR: s stays in [1e-2, 1e2].
_REL_FLOOR = 1e-4


@dataclasses.dataclass(frozen=True)
class AWQSearch:
    """What `awq_search` found: the scales, the exponent r that gave them (None: the identity),
    the output error with them, and the output error of plain round to nearest (the identity)."""

    scales: torch.Tensor
    ratio: float | None
    loss: float
    identity_loss: float


def _check_quantizer(q: Quantizer, who: str) -> None:
    # The search rounds with `round_to_nearest` and walks the units with `geometry.unit_view`, so
    # any family works whose units lie along the input dim, whose payload is a plain rounding of
    # the weight (no transform) and whose rounding is deterministic.
    gran, axis, _ = q.layout()
    ok = (gran is not Granularity.ROWWISE or axis in (-1, 1)) and not q.hadamard_transformed() and not q.needs_seed()
    if not ok:
        raise ValueError(
            f"{who}: weight quantizer {q!r} is not supported; allowed: IntQuantizer or Float8Quantizer (TENSORWISE, "
            "ROWWISE along the input dim, blockwise), MXQuantizer, NVFP4Quantizer without hadamard or stochastic_rounding"
        )


def _check_weight(w: torch.Tensor, q: Quantizer | None, in_features: int, who: str, name: str) -> None:
    if w.dim() != 2 or not w.is_floating_point() or w.shape[1] != in_features:
        raise ValueError(
            f"{who}: {name} has shape {tuple(w.shape)} and dtype {w.dtype}; allowed: a 2-D float (out, {in_features}) weight"
        )
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{who}: {name} holds NaN or Inf values; allowed: finite weights")
    if q is not None:
        _check_quantizer(q, who)
        q.check_shape(w.shape)


def _check_hessian(h: torch.Tensor, in_features: int, who: str) -> None:
    if tuple(h.shape) != (in_features, in_features):
        raise ValueError(f"{who}: h has shape {tuple(h.shape)}; allowed: ({in_features}, {in_features}), the inputs' 2 X^T X / n")
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"{who}: h holds NaN or Inf values; allowed: a finite Hessian (check the calibration inputs)")


def _output_error(d: torch.Tensor, h32: torch.Tensor) -> float:
    """``tr(D H D^T)``: fp32 products (the candidates' order is what matters), summed in fp64."""
    return float(((d @ h32) * d).sum(dtype=torch.float64))


def _floored(stat: torch.Tensor) -> torch.Tensor:
    top = stat.max()
    return torch.ones_like(stat) if top <= 0 else stat.clamp(min=float(top) * _REL_FLOOR)


def _weight_mean(weights: Sequence[torch.Tensor], quantizers: Sequence[Quantizer | None]) -> torch.Tensor:
    """Per input channel mean of |W| / (its scale unit's amax), over the rows of the quantized layers."""
    total, rows = torch.zeros(weights[0].shape[1], dtype=torch.float64, device=weights[0].device), 0
    for w, q in zip(weights, quantizers):
        if q is None:
            continue
        v = geometry.unit_view(w.abs(), q.layout())
        a = v.amax(dim=(1, 3), keepdim=True)
        total += (v / torch.where(a > 0, a, torch.ones_like(a))).reshape(w.shape).sum(0, dtype=torch.float64)
        rows += w.shape[0]
    return total / max(rows, 1)


def _candidates(x_mean: torch.Tensor, w_mean: torch.Tensor | None, config: AWQ):
    """(r, s) for each grid point, after the identity (None, ones); `w_mean` None: no duo scaling."""
    yield None, torch.ones(x_mean.shape[0], device=x_mean.device)
    x = _floored(x_mean.double())
    w = None if w_mean is None else _floored(w_mean)
    for i in range(config.grid):
        r = i / config.grid
        s = x.pow(r) if w is None else x.pow(r) / w.pow(1 - r)
        yield r, (s / (s.max() * s.min()).sqrt()).float()


def awq_search(
    weights: Sequence[torch.Tensor],
    quantizers: Sequence[Quantizer | None],
    h: torch.Tensor | Sequence[torch.Tensor],
    x_mean: torch.Tensor,
    config: AWQ | None = None,
    loss_fn: Callable[[torch.Tensor], float] | None = None,
) -> AWQSearch:
    """AWQ's scale search for the layers whose (out_i, in) `weights` read one input.

    Args:
        quantizers: each weight's quantizer (as `tq.calibrate` will quantize it); None for a layer
            kept in high precision (its output does not change: it adds nothing to the loss).
        h: the input's Hessian ``2 X^T X / n`` (in, in), or one per weight where the layers see
            different rows of the input (MoE experts behind one norm: each expert's Hessian of its
            own tokens, times its share of the tokens, so the losses add up as output errors).
        x_mean: the input's per-channel ``mean|x|`` (in,), non-negative and finite.
        loss_fn: scores a candidate's scales instead of the Hessians (`tq.AWQ(loss="output")`:
            `tqcompile.calibration.awq_output.parent_loss`).

    Returns the `AWQSearch` with the least output error summed over the layers; the scales are
    float32 (in,), positive and finite; the caller multiplies each weight's columns by them and
    divides the input's producer by them.
    """
    config = config or AWQ()
    who = "AWQ"
    if len(weights) == 0 or len(weights) != len(quantizers):
        raise ValueError(
            f"{who}: got {len(weights)} weights and {len(quantizers)} quantizers; allowed: one quantizer per weight, at least one"
        )
    in_f = x_mean.shape[-1] if x_mean.dim() == 1 else -1
    if x_mean.dim() != 1 or not bool(torch.isfinite(x_mean).all()) or bool((x_mean < 0).any()):
        raise ValueError(
            f"{who}: x_mean {tuple(x_mean.shape)} holds NaN, Inf or negative values or is not 1-D; allowed: mean|x| per input channel (in,)"
        )
    for i, (w, q) in enumerate(zip(weights, quantizers)):
        _check_weight(w, q, in_f, who, f"weights[{i}]")
    shared = isinstance(h, torch.Tensor)
    hs = [h] * len(weights) if shared else list(h)
    if len(hs) != len(weights):
        raise ValueError(f"{who}: got {len(hs)} Hessians for {len(weights)} weights; allowed: one Hessian, or one per weight")
    for hi in hs:
        _check_hessian(hi, in_f, who)
    with torch.no_grad():
        ws = [w.detach().float() for w in weights]
        h32s = [h.to(ws[0].device, torch.float32)] * len(ws) if shared else [hi.to(ws[0].device, torch.float32) for hi in hs]
        w_mean = _weight_mean(ws, quantizers) if config.duo_scaling else None
        best = None
        def hessian_loss(s: torch.Tensor) -> float:
            loss = 0.0
            for w, wf, q, h32 in zip(weights, ws, quantizers, h32s):
                if q is not None:
                    scaled = (wf * s).to(w.dtype).float()  # the model's weight after folding, in its dtype
                    loss += _output_error(wf - round_to_nearest(scaled, q) / s, h32)
            return loss

        for r, s in _candidates(x_mean.detach().to(ws[0].device), w_mean, config):
            loss = (loss_fn or hessian_loss)(s)
            if best is None:
                best = identity = AWQSearch(s, None, loss, loss)
            elif loss < best.loss:
                best = AWQSearch(s, r, loss, identity.identity_loss)
    return best


def awq_scales(
    weights: Sequence[torch.Tensor],
    quantizers: Sequence[Quantizer | None],
    h: torch.Tensor | Sequence[torch.Tensor],
    x_mean: torch.Tensor,
    config: AWQ | None = None,
    loss_fn: Callable[[torch.Tensor], float] | None = None,
) -> torch.Tensor:
    """The per-input-channel scales (in,) float32 of `awq_search` (see there)."""
    return awq_search(weights, quantizers, h, x_mean, config, loss_fn).scales


def _unit_errors(d: torch.Tensor, h_blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Each scale unit's ``d_u H_uu d_u^T``, shaped like the unit amaxes (R, G)."""
    r, rows, g, cols = shape
    dg = d.reshape(r * rows, g, cols).transpose(0, 1)  # (G, out, cols)
    per_row = (torch.bmm(dg, h_blocks) * dg).sum(-1, dtype=torch.float64)  # (G, out)
    return per_row.T.reshape(r, rows, g).sum(1)


def awq_clip(weight: torch.Tensor, quantizer: Quantizer | None, h: torch.Tensor, config: AWQ | None = None) -> torch.Tensor:
    """AWQ's clipping search: `weight` (out, in) clamped per scale unit to ``ratio * amax`` (an
    asymmetric unit: to ``[ratio * min, ratio * max]``).

    Ratios run from 1 down to ``1 - config.max_shrink`` in ``config.clip_grid`` steps; each unit
    keeps the one with the least ``d_u H_uu d_u^T`` (ties: the larger). `h` (in, in) is the Hessian
    of the inputs this weight sees: after AWQ's scaling, ``h / (s[:, None] * s[None, :])``.
    NVFP4: the blocks that hold the tensor's amax keep it, so the tensor-level scale, and with it
    every block's scale arithmetic, is the one the search measured. The result is returned
    unclamped if its total output error ``tr(D H D^T)`` would be larger than the unclamped
    weight's (the search ignores the error's cross terms between units), so clipping never
    increases the output error on its data. Returns a tensor of `weight`'s dtype (a copy of
    `weight` where `quantizer` is None: a weight kept in high precision has nothing to clip).
    """
    config = config or AWQ()
    who = "AWQ clip"
    _check_weight(weight, quantizer, weight.shape[-1] if weight.dim() else 0, who, "weight")
    _check_hessian(h, weight.shape[1], who)
    if quantizer is None:
        return weight.detach().clone()
    with torch.no_grad():
        w = weight.detach().float()
        view = geometry.unit_view(w, quantizer.layout())  # NVFP4's units are its blocks: its tensor amax is kept (below)
        if quantizer.has_zero_point():  # an asymmetric unit's range: each side shrinks by the ratio
            below, above = ((-view).clamp(min=0).amax(dim=(1, 3), keepdim=True), view.clamp(min=0).amax(dim=(1, 3), keepdim=True))
        else:
            below = above = view.abs().amax(dim=(1, 3), keepdim=True)
        g, cols = view.shape[2], view.shape[3]
        h32 = h.to(w.device, torch.float32)
        h_blocks = h32.reshape(g, cols, g, cols).diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous()
        keep = above == above.max() if quantizer.has_global_scale() else torch.zeros_like(above, dtype=torch.bool)
        best_lo, best_hi, best_err = below, above, None
        for i in range(config.clip_grid + 1):
            # The bounds in the weight's dtype, so the clamped weight is exactly representable in it.
            ratio = 1 - config.max_shrink * i / config.clip_grid
            lo, hi = (torch.where(keep, b, (b * ratio).to(weight.dtype).float()) for b in (below, above))
            clamped = torch.minimum(torch.maximum(view, -lo), hi).reshape(w.shape)
            err = _unit_errors(w - round_to_nearest(clamped, quantizer), h_blocks, view.shape).reshape(above.shape)
            if best_err is None:
                best_err = err
            else:
                better = err < best_err
                best_lo, best_hi, best_err = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi), torch.where(better, err, best_err)
        clipped = torch.minimum(torch.maximum(view, -best_lo), best_hi).reshape(w.shape)
        if _output_error(w - round_to_nearest(clipped, quantizer), h32) > _output_error(w - round_to_nearest(w, quantizer), h32):
            return weight.detach().clone()
        return clipped.to(weight.dtype)
