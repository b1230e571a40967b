"""Fake quantization: ``tq.quantize(x, q, amax=static_amax).dequantize()`` with a straight-through
estimator, and `TensorQuantizer`, the module that holds one quantizer's calibrated state.

There is no second implementation of the numerics here: the forward *is* `tq.quantize` followed
by `QuantizedTensor.dequantize`, the same ops and kernels training uses, with the calibrated amax
passed in (`tq.quantize(..., amax=...)`). Experts' tokens, sorted by expert, and stacked expert
weights are fake-quantized per expert the way training quantizes them: `grouped_quantize` then
`grouped_dequantize` (`tqcompile.ops.grouped_gemm`), each expert with its own amax, gathered per
token by expert id, so the shapes never depend on the routing (no `.tolist()`: it compiles).

Which amaxes are static (calibrated, kept in the `amax` buffer):

- quantizers with a tensor-level amax (TENSORWISE FP8/INT, and NVFP4's global amax): one per
  tensor (per expert for `GroupedLinear` and fused experts: ``[num_experts, 1, 1]`` weights,
  ``[num_experts]`` inputs);
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

from typing import Protocol

import torch
from torch import nn

from tqcompile.api import quantize
from tqcompile.ops import grouped_gemm as gops
from tqcompile.quantizers import Granularity, Quantizer
from tqcompile.quantizers.base import in_range

__all__ = [
    "fake_quantize",
    "fake_quantize_grouped",
    "TensorQuantizer",
    "Observer",
    "static_amax_kind",
    "static_weight_amax",
    "round_to_nearest",
    "UNIT_ROLES",
]


# Roles whose scaling units are fixed by the model, not by the data: a weight's rows and blocks, a
# KV cache's heads. Only these keep a static amax per unit; an activation's rows are its tokens.
UNIT_ROLES = ("weight", "key", "value")


def static_amax_kind(q: Quantizer | None, role: str) -> str | None:
    """ "tensor" (one static amax per tensor), "unit" (one per scaling unit: weights and KV heads) or None (dynamic)."""
    if q is None or not q.takes_static_amax():
        return None
    if q.uses_tensor_amax():
        return "tensor"
    return "unit" if role in UNIT_ROLES else None


def static_weight_amax(w: torch.Tensor, q: Quantizer) -> torch.Tensor | None:
    """The static amax `max` calibration gives the weight `w` in the quantizer's layout: tensor-level
    (NVFP4's global amax included), one per scaling unit, or None (MX: block scales from the data)."""
    from tqcompile.kernels.reference import unit_amax
    from tqcompile.ops import amax as tensor_amax

    kind = static_amax_kind(q, "weight")
    if kind is None:
        return None
    return tensor_amax(w, q) if kind == "tensor" else unit_amax(w, q)


def round_to_nearest(w: torch.Tensor, q: Quantizer, *, amax: torch.Tensor | None = None) -> torch.Tensor:
    """What `max` calibration makes of the weight `w`: fake-quantized with `static_weight_amax`,
    or with `amax` where given (the NVFP4 global amax of a fused group, `tqcompile.calibration.fused`)."""
    return fake_quantize(w, q, amax=static_weight_amax(w, q) if amax is None else amax)


def _in_range(x: torch.Tensor, amax: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """Where `x` lies within a static amax (tensor-level, or one per unit: `quantizers.base.in_range`)."""
    return x.abs() <= amax if q.uses_tensor_amax() else in_range(q, x, amax)


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, amax: torch.Tensor | None, quantizer: Quantizer, clipped: bool) -> torch.Tensor:
        y = quantize(x, quantizer, amax=amax).dequantize()
        clip = clipped and amax is not None and not quantizer.hadamard_transformed()
        ctx.clip = clip
        if clip:
            # NaN/Inf inputs are outside every range: their gradient is zero.
            ctx.save_for_backward(_in_range(x, amax, quantizer))
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _ste_grad(ctx, dy), None, None, None


def _ste_grad(ctx, dy: torch.Tensor) -> torch.Tensor:
    """The straight-through gradient: `dy`, zero where the clipped STE saved that |x| > amax."""
    if not ctx.clip:
        return dy
    (inside,) = ctx.saved_tensors
    return torch.where(inside, dy, torch.zeros((), dtype=dy.dtype, device=dy.device))


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


class _FakeQuantizeGrouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: torch.Tensor, amax: torch.Tensor | None, quantizer: Quantizer, clipped: bool):
        clip = clipped and amax is not None and not quantizer.hadamard_transformed()
        if amax is None and quantizer.uses_tensor_amax():
            amax = gops.grouped_amax(x, quantizer, ends, False)  # dynamic: each expert's own tokens
        seed = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64, device=x.device) if quantizer.needs_seed() else None
        data, scale_inv = gops.grouped_quantize(x, quantizer, ends, amax, seed, False)
        y = gops.grouped_dequantize(data, scale_inv, amax, quantizer, ends, x.dtype)
        ctx.clip = clip
        if clip:
            # Each token against its expert's static amax (gathered by expert id: static shapes).
            ctx.save_for_backward(x.abs() <= amax[gops.expert_ids(ends, x.shape[0])].unsqueeze(-1))
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _ste_grad(ctx, dy), None, None, None, None


def fake_quantize_grouped(
    x: torch.Tensor, quantizer: Quantizer, ends: torch.Tensor, amax: torch.Tensor | None = None, *, ste: str = "clipped"
) -> torch.Tensor:
    """Fake-quantize the (T, C) rows `x` grouped by expert (segment `ends`, the cumulative
    per-expert counts), each expert's rows as ``fake_quantize(x_e, quantizer, amax[e])`` would,
    with one graph for every routing (MoE tokens sorted by expert; stacked expert weights as
    (E*N, K) with ``ends = N, 2N, ...``).

    Args:
        amax: (E,) static per-expert amaxes for a quantizer with a tensor-level amax, or None
            (per-expert amaxes computed from `x`; other quantizers' scales come from each row or block).
        ste: "clipped" (zero gradient where ``|x|`` exceeds its expert's static amax) or "plain".
    """
    if ste not in ("clipped", "plain"):
        raise ValueError(f"fake_quantize_grouped: ste={ste!r} is not allowed; allowed: 'clipped', 'plain'")
    return _FakeQuantizeGrouped.apply(x, ends, amax, quantizer, ste == "clipped")


class Observer(Protocol):
    """What calibration attaches to a `TensorQuantizer` (`tqcompile.calibration.observers`)."""

    def record(self, x: torch.Tensor, ends: torch.Tensor | None) -> None:
        """See `x` as the quantizer's scaling units see it (`ends`: an experts input's segments)."""


# What TensorQuantizers pickled before calibration moved to observers held besides their runtime state.
_PRE_OBSERVER_FIELDS = ("calibrating", "collect", "stat_max", "hist", "hist_max", "beyond_max", "unfit")


class TensorQuantizer(nn.Module):
    """One quantizer slot (input, weight or output) of a fake-quantized module.

    Holds the `tq.Quantizer` (None: disabled), the static amax buffer (None until calibrated, or
    for dynamic scales), the straight-through estimator, and how its weight was made (`method`).
    While calibration has an `observer` attached (`tqcompile.calibration.observers`), its forward
    records each input through it and returns the input unchanged. Its buffers are not persistent:
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
        self.observer: Observer | None = None
        # How the weight was rounded ("max", "gptq", "awq+max", ...): a result of calibration that
        # travels with the amax (tq.quant_state saves it beside it, tq.restore puts it back, tq.summary shows it).
        self.method: str | None = None
        self.register_buffer("amax", None, persistent=False)

    def __setstate__(self, state: dict) -> None:
        for name in _PRE_OBSERVER_FIELDS:
            state.pop(name, None)
        super().__setstate__(state)

    # --- state ---------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.quantizer is not None

    @property
    def static_kind(self) -> str | None:
        return static_amax_kind(self.quantizer, self.role)

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
    def forward(
        self, x: torch.Tensor, *, channel_dim: int | None = None, ends: torch.Tensor | None = None, unit_dim: int | None = None
    ) -> torch.Tensor:
        """Fake-quantize `x` (or, with an observer attached, record it and return it unchanged).

        `channel_dim`: a conv/norm activation's channel dim, moved last while quantizing so that
        blocks and rows run along channels. `ends`: for an experts input, the (T, in) tokens are
        sorted by expert and `ends` holds the cumulative per-expert token counts; each expert's
        tokens get that expert's amax. `unit_dim`: the dim whose index is the scaling unit (a KV
        cache's head): a rowwise quantizer sees `x` as one row per index of that dim.
        """
        q, observer = self.quantizer, self.observer
        if q is None:
            if observer is not None:  # a disabled input still feeds a weight transform's statistics
                observer.record(x, ends)
            return x
        if unit_dim is not None and q.layout()[0] is not Granularity.TENSORWISE:
            rows = x.movedim(unit_dim, 0)
            flat = rows.reshape(rows.shape[0], -1)
            if observer is not None:
                observer.record(flat, None)
                return x
            return self._fake_quant(flat, None).view(rows.shape).movedim(0, unit_dim)
        moved = channel_dim is not None and q.layout()[0] is not Granularity.TENSORWISE and x.dim() > 1
        units = x.movedim(channel_dim, -1) if moved else x
        if observer is not None:
            observer.record(units, ends)
            return x
        y = self._fake_quant(units, ends)
        return y.movedim(-1, channel_dim) if moved else y

    def _fake_quant(self, x: torch.Tensor, ends: torch.Tensor | None) -> torch.Tensor:
        amax, q = self.amax, self.quantizer
        if ends is not None:  # experts' tokens, sorted by expert
            return fake_quantize_grouped(x, q, ends, amax, ste=self.ste)
        if self.num_experts is not None and self.static_kind == "tensor":
            # Stacked (E, N, K) expert weights, one tensor-level amax per expert: E segments of N rows.
            e, n, k = x.shape
            w_ends = gops.equal_ends(e, n, x.device)
            per_expert = None if amax is None else amax.reshape(e)
            return fake_quantize_grouped(x.reshape(e * n, k), q, w_ends, per_expert, ste=self.ste).view(e, n, k)
        return fake_quantize(x, q, amax, ste=self.ste)
