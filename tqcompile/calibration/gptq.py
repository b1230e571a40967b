"""GPTQ for one weight (issue 18, first part; `tq.calibrate` does not call it yet).

GPTQ (Frantar et al., 2022) quantizes a linear layer's weight one input column at a time and moves
each column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian
of the layer's output error on its calibration inputs, ``H = 2 X^T X / n``. Here each column is
rounded by tq's own numerics, so the result is a weight the calibrated model computes with as it is:

- the scale of each scaling unit is fixed before its first column is quantized (per tensor and
  per row: from the whole weight; 1-D blocks along the input dim: from the block's columns as the
  earlier columns' errors have updated them; lazy-update blocks are whole scale blocks);
- a column is rounded with a ROWWISE copy of the quantizer and that unit's amax, the same element
  arithmetic (``x * (qmax / amax)``, rounded, clamped, times the reciprocal) as the quantizer's own
  granularity;
- the function returns the rounded weight ``Q`` and the amaxes in the quantizer's static layout, so
  that ``fake_quantize(Q, quantizer, amax) == Q`` bit for bit.

Supported: `IntQuantizer` and E4M3 `Float8Quantizer`, TENSORWISE / ROWWISE (axis -1) / BLOCKWISE_1D.
MX and NVFP4 weights compute their block scales from the data they quantize, which GPTQ's updates
change after the scale is chosen; they are left for the next step.

A weight whose GPTQ result has a larger output error on the calibration inputs than round to
nearest (GPTQ is greedy: rare, on near-singular inputs) keeps the round-to-nearest result, so GPTQ
never does worse than `max` calibration on its own data.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from tqcompile.calibration.algorithms import GPTQ
from tqcompile.calibration.fake_quant import fake_quantize
from tqcompile.formats import Format
from tqcompile.kernels.reference import unit_amax
from tqcompile.ops import amax as tensor_amax
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, Quantizer

__all__: list[str] = []  # used by tq.calibrate once it offers algorithm="gptq"; nothing public yet


def hessian(x: torch.Tensor) -> torch.Tensor:
    """``2 X^T X / n`` (float64) of a layer's inputs `x` (..., in)."""
    x = x.reshape(-1, x.shape[-1]).double()
    return 2.0 * x.T @ x / max(1, x.shape[0])


def _check(q: Quantizer) -> Granularity:
    ok = isinstance(q, IntQuantizer) or (isinstance(q, Float8Quantizer) and q.format is Format.E4M3)
    gran, axis, _ = q.layout()
    if not ok or gran is Granularity.BLOCKWISE_2D or (gran is Granularity.ROWWISE and axis not in (-1, 1)):
        raise ValueError(
            f"GPTQ: weight quantizer {q!r} is not supported yet; allowed: IntQuantizer or Float8Quantizer(E4M3), "
            "TENSORWISE, ROWWISE along the input dim, or BLOCKWISE_1D"
        )
    return gran


def _inverse_cholesky(h: torch.Tensor, dampening: float) -> torch.Tensor | None:
    """Upper Cholesky factor of the dampened Hessian's inverse; None if it stays singular after
    raising the dampening tenfold twice."""
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    mean_diag = h.diagonal().mean().clamp(min=1e-12)
    for damp in (dampening, dampening * 10, dampening * 100):
        lower, info = torch.linalg.cholesky_ex(h + damp * mean_diag * eye)
        if int(info) == 0:
            inv = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0:
                return upper
    return None


def _output_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    d = (w - q).double()
    return float(torch.einsum("oi,ij,oj->", d, h, d))


def gptq_quantize(
    weight: torch.Tensor, h: torch.Tensor, quantizer: Quantizer, config: GPTQ | None = None, *, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """GPTQ-round `weight` (out, in) for inputs with Hessian `h` (in, in).

    Returns (Q, amax, how): Q the rounded weight (weight's dtype) with ``fake_quantize(Q, quantizer,
    amax) == Q``; amax in the quantizer's static layout (0-dim, (out, 1) or (out, in / block));
    `how` "gptq", or "rtn" where GPTQ was not better or the Hessian stayed singular (warned).
    """
    config = config or GPTQ()
    gran = _check(quantizer)
    quantizer.check_shape(weight.shape)
    w = weight.detach().float().clone()
    out_f, in_f = w.shape
    h = h.double().clone()
    dead = h.diagonal() == 0  # inputs always zero: any weight there is free; make them zero
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    rows = dataclasses.replace(quantizer, granularity=Granularity.ROWWISE, axis=-1)
    block = quantizer.layout()[2]
    if gran is Granularity.TENSORWISE:
        amax = tensor_amax(w, quantizer)
    elif gran is Granularity.ROWWISE:
        amax = unit_amax(w, quantizer)
    else:
        amax = unit_amax(w, quantizer) if config.act_order else torch.zeros(out_f, in_f // block)  # static groups with act_order

    def col_amax(j: int) -> torch.Tensor:
        if gran is Granularity.TENSORWISE:
            return amax.reshape(1, 1).expand(out_f, 1)
        return amax if gran is Granularity.ROWWISE else amax[:, j // block : j // block + 1]

    perm = torch.argsort(h.diagonal(), descending=True) if config.act_order else torch.arange(in_f)
    w, hp = w[:, perm], h[perm][:, perm]
    hinv = _inverse_cholesky(hp, config.dampening)
    if hinv is None:
        warnings.warn(
            f"GPTQ: the Hessian of {name!r} stays singular after dampening x100; it is rounded to nearest instead", stacklevel=2
        )
        return _rtn(weight, quantizer, dead)
    qw = torch.zeros_like(w)
    # Lazy blocks hold whole 1-D scale blocks, so a block's columns are all up to date when its scale is chosen.
    step = -(-config.block_size // block) * block if gran is Granularity.BLOCKWISE_1D else config.block_size
    for i1 in range(0, in_f, step):
        i2 = min(i1 + step, in_f)
        w1, err = w[:, i1:i2].clone(), torch.zeros(out_f, i2 - i1)
        h1 = hinv[i1:i2, i1:i2].float()
        for i in range(i2 - i1):
            j = int(perm[i1 + i])
            if gran is Granularity.BLOCKWISE_1D and not config.act_order and j % block == 0:
                # The block's scale from its columns as the earlier errors left them (they are in order).
                amax[:, j // block] = unit_amax(w1[:, i : i + block], rows).reshape(-1)
            col = w1[:, i : i + 1]
            # Two copies of the column: 4-bit payloads pack pairs (the element arithmetic is per element).
            qc = fake_quantize(col.expand(-1, 2).contiguous(), rows, amax=col_amax(j))[:, :1]
            qw[:, i1 + i] = qc[:, 0]
            e = (col[:, 0] - qc[:, 0]) / h1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * h1[i, i:].unsqueeze(0)
            err[:, i] = e
        w[:, i2:] -= err @ hinv[i1:i2, i2:].float()
    q = torch.empty_like(qw)
    q[:, perm] = qw
    amax_out = amax.reshape(()) if gran is Granularity.TENSORWISE else amax
    rtn, rtn_amax, _ = _rtn(weight, quantizer, dead)
    if _output_error(weight.float(), q, h) > _output_error(weight.float(), rtn, h):
        return rtn, rtn_amax, "rtn"
    return q.to(weight.dtype), amax_out, "gptq"


def _rtn(weight: torch.Tensor, quantizer: Quantizer, dead: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Round to nearest with `max` amaxes (what `tq.calibrate` gives), dead inputs zeroed."""
    w = weight.detach().float() * (~dead).float()
    gran = quantizer.layout()[0]
    amax = tensor_amax(w, quantizer) if gran is Granularity.TENSORWISE else unit_amax(w, quantizer)
    return fake_quantize(w, quantizer, amax=amax).to(weight.dtype), amax, "rtn"
