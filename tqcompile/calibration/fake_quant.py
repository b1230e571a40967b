"""Fake quantization: ``tq.quantize(x, q, amax=static_amax).dequantize()`` with a straight-through
estimator, and `TensorQuantizer`, the module that holds one quantizer's calibrated state.

There is no second implementation of the numerics here: the forward *is* `tq.quantize` followed
by `QuantizedTensor.dequantize`, the same ops and kernels training uses, with the calibrated amax
passed in (`tq.quantize(..., amax=...)`).

Which amaxes are static (calibrated, kept in the `amax` buffer):

- quantizers with a tensor-level amax (TENSORWISE FP8/INT, and NVFP4's global amax): one per
  tensor (per expert for `GroupedLinear`: ``[num_experts, 1, 1]`` weights, ``[num_experts]`` inputs);
- weights quantized per channel or per block (ROWWISE / BLOCKWISE FP8 and INT): one per scaling
  unit, shape ``quantizer.scale_shape(weight)``;
- nothing else: MX block scales come from each 32-block, and activations quantized per row or per
  block get their scales from each input (their amax changes with every token).

Straight-through estimators (backward of fake quantization):

- "plain": the gradient passes unchanged;
- "clipped": zero gradient where ``|x| > amax`` (the static amax, broadcast over its unit), i.e.
  where the quantizer saturates; elsewhere unchanged. Where there is no static amax (MX, dynamic
  scales) nothing is clipped by a calibrated range and the clipped STE equals the plain one; so
  does NVFP4 with the Hadamard transform (its amax is of the transformed values).
"""

from __future__ import annotations

import torch
from torch import nn

from tqcompile.api import quantize
from tqcompile.quantizers import Granularity, MXQuantizer, Quantizer

__all__ = ["fake_quantize", "TensorQuantizer", "static_amax_kind"]


def static_amax_kind(q: Quantizer | None, role: str) -> str | None:
    """ "tensor" (one static amax per tensor), "unit" (one per scaling unit: weights only) or None (dynamic)."""
    if q is None or isinstance(q, MXQuantizer):
        return None
    if q.uses_tensor_amax():
        return "tensor"
    return "unit" if role == "weight" else None


def _expand_amax(amax: torch.Tensor, shape: torch.Size, q: Quantizer) -> torch.Tensor:
    """Broadcast a static amax (tensor-level or one per unit) to the element shape."""
    gran, _, block = q.layout()
    if amax.dim() == 0 or gran in (Granularity.TENSORWISE, Granularity.ROWWISE) or q.uses_tensor_amax():
        return amax
    if gran is Granularity.BLOCKWISE_1D:
        return amax.repeat_interleave(block, dim=-1)
    return amax.repeat_interleave(block, dim=-1).repeat_interleave(block, dim=-2)


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, amax: torch.Tensor | None, quantizer: Quantizer, clipped: bool) -> torch.Tensor:
        y = quantize(x, quantizer, amax=amax).dequantize()
        clip = clipped and amax is not None and not quantizer.hadamard_transformed()
        ctx.clip = clip
        if clip:
            # NaN/Inf inputs are outside every range: their gradient is zero.
            ctx.save_for_backward(x.abs() <= _expand_amax(amax, x.shape, quantizer))
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.clip:
            (inside,) = ctx.saved_tensors
            dy = torch.where(inside, dy, torch.zeros((), dtype=dy.dtype, device=dy.device))
        return dy, None, None, None


def fake_quantize(
    x: torch.Tensor, quantizer: Quantizer, amax: torch.Tensor | None = None, *, ste: str = "clipped"
) -> torch.Tensor:
    """``tq.quantize(x, quantizer, amax=amax).dequantize()``, differentiable with a straight-through estimator.

    Args:
        x: a float32 / bfloat16 / float16 tensor.
        quantizer: any `tq.Quantizer`.
        amax: a static amax (see `tq.quantize`), or None for scales computed from `x`.
        ste: "clipped" (zero gradient where ``|x| > amax``) or "plain" (gradient unchanged).

    Example:
        >>> y = fake_quantize(x, tq.IntQuantizer(), torch.tensor(2.0))   # values beyond ±2 saturate
    """
    if ste not in ("clipped", "plain"):
        raise ValueError(f"fake_quantize: ste={ste!r} is not allowed; allowed: 'clipped', 'plain'")
    return _FakeQuantize.apply(x, amax, quantizer, ste == "clipped")


class TensorQuantizer(nn.Module):
    """One quantizer slot (input, weight or output) of a fake-quantized module.

    Holds the `tq.Quantizer` (None: disabled), the static amax buffer (None until calibrated, or
    for dynamic scales) and, while calibrating, the statistics. Its buffers are not persistent:
    the model's `state_dict` keeps exactly the float model's keys; `tq.quant_state` carries the
    amaxes.
    """

    def __init__(self, quantizer: Quantizer | None, role: str, owner: str, num_experts: int | None = None, ste: str = "clipped"):
        super().__init__()
        self.quantizer = quantizer
        self.role = role
        self.owner = owner  # canonical name of the module this belongs to, for messages
        self.num_experts = num_experts
        self.ste = ste
        self.calibrating = False
        self.register_buffer("amax", None, persistent=False)
        self._reset_stats()

    # --- state ---------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.quantizer is not None

    @property
    def static_kind(self) -> str | None:
        return static_amax_kind(self.quantizer, self.role)

    def _reset_stats(self) -> None:
        self.stat_max: torch.Tensor | None = None  # running max of the amax (per expert: [E])
        self.hist: torch.Tensor | None = None  # histogram of |x| over [0, hist_max] (percentile, mse)
        self.hist_max: torch.Tensor | None = None
        self.collect = "max"  # "max" or "hist": what a calibrating forward records
        self.unfit: str | None = None  # why the quantizer cannot serve a tensor seen while calibrating
        self.beyond_max = False  # the histogram pass saw values beyond the max pass's max

    def set_amax(self, amax: torch.Tensor | None) -> None:
        self.amax = None if amax is None else amax.detach().to(torch.float32).clone()

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` / `.half()` cast every floating buffer; a static amax must stay
        # float32 with its calibrated value (tq.quantize refuses other dtypes), so only its device follows.
        before = self.amax
        super()._apply(fn, recurse)
        if before is not None and self.amax is not None and self.amax.dtype != before.dtype:
            self.amax = before.to(device=self.amax.device)
        return self

    def extra_repr(self) -> str:
        amax = "" if self.amax is None else f", amax{tuple(self.amax.shape)}"
        return f"{self.role}: {self.quantizer!r}{amax}" if self.enabled else f"{self.role}: disabled"

    # --- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *, channel_dim: int | None = None, expert: int | None = None) -> torch.Tensor:
        """Fake-quantize `x` (or, while calibrating, record its statistics and return it unchanged).

        `channel_dim`: a conv/norm activation's channel dim, moved last while quantizing so that
        blocks and rows run along channels. `expert`: the expert whose amax applies (GroupedLinear).
        """
        q = self.quantizer
        if q is None:
            return x
        moved = channel_dim is not None and q.layout()[0] is not Granularity.TENSORWISE and x.dim() > 1
        if moved:
            x = x.movedim(channel_dim, -1)
        if self.calibrating:
            self._record(x, expert)
            y = x
        else:
            y = self._fake_quant(x, expert)
        return y.movedim(-1, channel_dim) if moved else y

    def _fake_quant(self, x: torch.Tensor, expert: int | None) -> torch.Tensor:
        amax = self.amax
        if amax is None or self.num_experts is None:
            return fake_quantize(x, self.quantizer, amax, ste=self.ste)
        if expert is not None:  # an expert's input
            return fake_quantize(x, self.quantizer, amax[expert].reshape(()), ste=self.ste)
        if amax.dim() == 3 and amax.shape[1:] == (1, 1):  # stacked weights, one amax per expert
            return torch.stack(
                [fake_quantize(x[e], self.quantizer, amax[e].reshape(()), ste=self.ste) for e in range(x.shape[0])]
            )
        return fake_quantize(x, self.quantizer, amax, ste=self.ste)

    # --- calibration ---------------------------------------------------------------------------
    def _record(self, x: torch.Tensor, expert: int | None) -> None:
        if self.role == "weight":
            return  # weights are calibrated from the weights
        if self.unfit is None:
            try:
                self.quantizer.check_shape(x.shape)
            except ValueError as e:
                self.unfit = f"its {tuple(x.shape)} {self.role} does not fit: {e}"  # calibrate disables it and says so
        if self.static_kind is None:
            return  # dynamic scales need no statistics
        if x.numel() == 0:
            return
        with torch.no_grad():
            if not bool(torch.isfinite(x).all()):
                bad = "NaN" if bool(torch.isnan(x).any()) else "Inf"
                raise ValueError(
                    f"tq.calibrate: the {self.role} of module {self.owner!r} holds {bad} values during calibration; "
                    "calibration needs finite activations (check the data and the model's numerics before this layer)"
                )
            if self.collect == "hist":
                self._record_hist(x)
                return
            from tqcompile import ops

            a = ops.amax(x, self.quantizer)
            # `calibrate` allocated stat_max (-1: not seen yet); one entry per expert for experts' inputs.
            if self.num_experts is not None:
                self.stat_max[expert] = torch.maximum(self.stat_max[expert], a)
            else:
                self.stat_max = torch.maximum(self.stat_max, a)

    def _record_hist(self, x: torch.Tensor) -> None:
        top = float(self.hist_max)
        a = x.detach().float().abs().flatten()
        if bool((a > top).any()):
            # The second pass saw values beyond the first pass's max (forward_loop ran other data):
            # histc would drop them, biasing the percentile low; count them in the top bin instead.
            self.beyond_max = True
            a = a.clamp(max=top)
        counts = torch.histc(a, bins=HIST_BINS, min=0.0, max=top if top > 0 else 1.0)
        self.hist += counts.double()


HIST_BINS = 2048
