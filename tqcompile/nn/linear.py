"""`tq.nn.Linear` and `tq.nn.GroupedLinear`: quantized drop-ins for training."""

from __future__ import annotations

import math

import torch
from torch import nn

from tqcompile.distributed.groups import group_name_of
from tqcompile.nn.functional import linear
from tqcompile.recipes import Recipe

__all__ = ["Linear", "GroupedLinear", "grouped_unsupported_reason"]

_HISTORIES = ("amax_history_input", "amax_history_weight", "amax_history_grad")


def _check_recipe(recipe: Recipe, in_features: int, out_features: int, what: str) -> None:
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{what}: recipe must be a tq.Recipe (e.g. tq.recipes.mxfp8()), got {type(recipe).__name__}")
    reason = recipe.unsupported_reason(in_features, out_features)
    if reason:
        raise ValueError(f"{what}: recipe {recipe.name!r} cannot serve in_features={in_features}, out_features={out_features}: {reason}")


def grouped_unsupported_reason(recipe: Recipe, in_features: int, out_features: int) -> str | None:
    """Why `recipe` cannot serve a GroupedLinear of these sizes (None if it can)."""
    if recipe.amax_history_len:
        return "it uses delayed scaling, whose one amax history per layer per-expert scales cannot use; use a current-scaling recipe"
    return recipe.unsupported_reason(in_features, out_features)


class _Quantized:
    """What every quantized linear module has: a recipe, an amax group, delayed-scaling buffers.

    Delayed-scaling histories are library-owned state with three rules, kept here for every module:

    - always fp32: float casts of the module (`.to(torch.bfloat16)`, `.half()`, `.double()`) move them
      to the new device but keep their dtype and values (`_apply`);
    - never uninitialised: materialising them from the meta device (`to_empty`) zeroes them, and
      `reset_parameters` zeroes them; zeros are the first-step state (scale from the current amax);
    - persistent, yet an `nn.Linear` checkpoint without them still loads: missing histories load as
      zeros (`_load_from_state_dict`).
    """

    recipe: Recipe
    amax_group_name: str | None

    def _init_quantized(self, recipe: Recipe, amax_group=None) -> None:
        self.recipe = recipe
        self.amax_group_name = group_name_of(amax_group)
        device = self.weight.device
        for name in _HISTORIES:
            hist = torch.zeros(recipe.amax_history_len, dtype=torch.float32, device=device) if recipe.amax_history_len else None
            self.register_buffer(name, hist)

    def _histories(self):
        return tuple(getattr(self, n) for n in _HISTORIES) if self.recipe.amax_history_len else None

    def reset_amax_histories(self) -> None:
        """Zero the delayed-scaling histories: the next step scales from its current amaxes, as a first step does."""
        for name in _HISTORIES:
            hist = self._buffers.get(name)
            if hist is not None and not hist.is_meta:
                with torch.no_grad():
                    hist.zero_()

    def _apply(self, fn, recurse=True):
        before = {name: self._buffers[name] for name in _HISTORIES if self._buffers.get(name) is not None}
        result = super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if old.is_meta and not new.is_meta:
                # Materialised from meta (`to_empty`): its memory is uninitialised; start at the first step.
                self._buffers[name] = torch.zeros(old.shape, dtype=torch.float32, device=new.device)
            elif new.dtype != torch.float32:
                # A float cast of the model: amaxes stay fp32 (a bf16 history would round them and give
                # bf16 scales); take the values from the fp32 original, on the new device.
                self._buffers[name] = old.to(device=new.device)
        return result

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        keys = [prefix + name for name in _HISTORIES if self._buffers.get(name) is not None]
        if keys and not any(k in state_dict for k in keys):
            # A checkpoint without delayed-scaling state (an nn.Linear's, or a current-scaling layer's):
            # the histories start as on a fresh layer. (`load_state_dict` passes its own copy of the dict.)
            weight = state_dict.get(prefix + "weight")
            on_weight = isinstance(weight, torch.Tensor) and not weight.is_meta
            device = weight.device if on_weight else self._buffers[_HISTORIES[0]].device
            for k in keys:
                state_dict[k] = torch.zeros(self.recipe.amax_history_len, dtype=torch.float32, device=device)
        for k in keys:
            v = state_dict.get(k)
            if isinstance(v, torch.Tensor) and v.shape != (self.recipe.amax_history_len,):
                error_msgs.append(
                    f"{k}: the checkpoint holds an amax history of shape {tuple(v.shape)}; this layer's recipe "
                    f"{self.recipe.name!r} keeps ({self.recipe.amax_history_len},) (amax_history_len={self.recipe.amax_history_len})"
                )
                state_dict.pop(k)
            elif isinstance(v, torch.Tensor) and v.dtype != torch.float32:
                state_dict[k] = v.float()  # histories are fp32 (a `load_state_dict(assign=True)` would keep the dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


class Linear(_Quantized, nn.Linear):
    """Drop-in for `nn.Linear` whose GEMMs run quantized as `recipe` says.

    Same parameters and `state_dict` keys as `nn.Linear`, plus, for delayed-scaling recipes, the
    fp32 buffers `amax_history_input`, `amax_history_weight` and `amax_history_grad`. An `nn.Linear`
    checkpoint loads as is (strictly; missing histories load as zeros, the first-step state).

    Example:
        >>> layer = tq.nn.Linear(256, 512, recipe=tq.recipes.mxfp8())
        >>> y = layer(torch.randn(64, 256))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *, recipe: Recipe, amax_group=None):
        _check_recipe(recipe, in_features, out_features, "tq.nn.Linear")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_quantized(recipe, amax_group)

    def reset_parameters(self) -> None:
        """Re-initialise weight and bias as `nn.Linear` does, and zero the delayed-scaling histories."""
        super().reset_parameters()
        self.reset_amax_histories()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Histories roll in training mode only (in the backward of each step; see `tq.nn.functional.linear`).
        # Read `training` only where it matters, so Dynamo guards on it only for delayed-scaling recipes.
        update = self.training if self.recipe.amax_history_len else True
        return linear(
            x,
            self.weight,
            self.bias,
            self.recipe,
            amax_group=self.amax_group_name,
            amax_histories=self._histories(),
            update_amax_histories=update,
        )


class GroupedLinear(_Quantized, nn.Module):
    """MoE experts: one (out_features, in_features) weight per expert, each with its own scales.

    `forward(x)` takes tokens grouped by expert, either as a dense (num_experts, tokens, in)
    tensor (static shapes, what compiled MoE dispatch with a fixed capacity produces) or as
    (total_tokens, in) with `m_splits`, a list of per-expert token counts (Python ints).

    Example:
        >>> experts = tq.nn.GroupedLinear(4, 64, 128, recipe=tq.recipes.fp8_rowwise())
        >>> y = experts(torch.randn(4, 32, 64))          # (4, 32, 128)
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None, *, recipe: Recipe, amax_group=None):
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"GroupedLinear: num_experts={num_experts!r}; allowed: an int >= 1")
        _check_recipe(recipe, in_features, out_features, "tq.nn.GroupedLinear")
        reason = grouped_unsupported_reason(recipe, in_features, out_features)
        if reason:
            raise ValueError(f"tq.nn.GroupedLinear: recipe {recipe.name!r} cannot serve {num_experts} experts {in_features} -> {out_features}: {reason}")
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()
        self._init_quantized(recipe, amax_group)

    def reset_parameters(self) -> None:
        for e in range(self.num_experts):
            nn.init.kaiming_uniform_(self.weight[e], a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(self.in_features), 1 / math.sqrt(self.in_features))

    def forward(self, x: torch.Tensor, m_splits: list[int] | None = None) -> torch.Tensor:
        if m_splits is None:
            if x.dim() != 3 or x.shape[0] != self.num_experts:
                raise ValueError(f"GroupedLinear: expected x of shape ({self.num_experts}, tokens, {self.in_features}) or m_splits, got {tuple(x.shape)}")
            chunks = x.unbind(0)
        else:
            if len(m_splits) != self.num_experts or sum(m_splits) != x.shape[0]:
                raise ValueError(f"GroupedLinear: m_splits={m_splits} must have {self.num_experts} entries summing to x.shape[0]={x.shape[0]}")
            chunks = x.split(m_splits, 0)
        # One quantized linear per expert: every expert's weight and tokens get their own scales.
        outs = [
            linear(chunk, self.weight[e], None if self.bias is None else self.bias[e], self.recipe, amax_group=self.amax_group_name)
            for e, chunk in enumerate(chunks)
        ]
        return torch.stack(outs) if m_splits is None else torch.cat(outs)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe.name}"
