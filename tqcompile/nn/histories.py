"""Delayed-scaling amax histories as module state: one mixin for every module that owns them.

A module that quantizes with a delayed-scaling recipe (`tq.nn.Linear`, a converted
`nn.MultiheadAttention`) keeps one fp32 history buffer per GEMM operand, named ``amax_history_*``.
The library owns these buffers, so it guarantees, for every such module:

- **fp32 always**: float casts of the module (`.to(torch.bfloat16)`, `.half()`, `.double()`) move
  them to the new device but keep their dtype and values (a bf16 history would round the amaxes and
  give bf16 scales);
- **never uninitialised**: materialised from the meta device (`to_empty`) they are zeros, whatever
  initialises the weights afterwards; `reset_amax_histories()` zeroes them (`reset_parameters` calls
  it). Zeros are the first-step state: the scale comes from the current amax;
- **persistent**: saved in the `state_dict` and restored, while a checkpoint without any of them
  (an `nn.Linear`'s, or the model's before `tq.convert`) still loads, strictly, with zero histories.
"""

from __future__ import annotations

import torch

from tqcompile.nn.base import is_converted

__all__: list[str] = []  # used by tqcompile.nn's modules; nothing public

HISTORY_PREFIX = "amax_history_"


class _AmaxHistoryOwner:
    """Mixin (before the `nn.Module` base) for modules whose ``amax_history_*`` buffers hold delayed-scaling state."""

    def _register_amax_history(self, name: str, length: int, device: torch.device | None, columns: int | None = None) -> None:
        """Register the history `name` (``amax_history_...``): `length` fp32 zeros (`columns` of
        them side by side, (length, columns), one window per expert), or None when `length` is 0."""
        if not name.startswith(HISTORY_PREFIX):
            raise ValueError(f"amax history buffer name {name!r} must start with {HISTORY_PREFIX!r}")
        shape = (length,) if columns is None else (length, columns)
        self.register_buffer(name, torch.zeros(shape, dtype=torch.float32, device=device) if length else None)

    def _amax_history_names(self) -> list[str]:
        return [n for n, b in self._buffers.items() if n.startswith(HISTORY_PREFIX) and b is not None]

    def reset_amax_histories(self) -> None:
        """Zero the delayed-scaling histories: the next step scales from its current amaxes, as a first step does."""
        for name in self._amax_history_names():
            if not self._buffers[name].is_meta:
                with torch.no_grad():
                    self._buffers[name].zero_()

    def _apply(self, fn, recurse=True):
        before = {name: self._buffers[name] for name in self._amax_history_names()}
        result = super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if old.is_meta and not new.is_meta:
                # Materialised from meta (`to_empty`): its memory is uninitialised; start at the first step.
                self._buffers[name] = torch.zeros(old.shape, dtype=torch.float32, device=new.device)
            elif new.dtype != torch.float32:
                # A float cast of the model: take the values from the fp32 original, on the new device.
                self._buffers[name] = old.to(device=new.device)
        return result

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        names = self._amax_history_names()
        keys = [prefix + n for n in names]
        if keys and not any(k in state_dict for k in keys):
            # A checkpoint without delayed-scaling state: the histories start as on a fresh layer.
            # (`load_state_dict` hands each module its own copy of the dict: adding keys is safe.)
            for name, key in zip(names, keys):
                state_dict[key] = torch.zeros_like(self._buffers[name], device="cpu" if self._buffers[name].is_meta else None)
        recipe = self.recipe if is_converted(self) else None
        for name, key in zip(names, keys):
            value, expected = state_dict.get(key), tuple(self._buffers[name].shape)
            if not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) != expected:
                held_by = f"this layer's recipe {recipe.name!r}" if recipe is not None else "this layer"
                error_msgs.append(
                    f"{key}: the checkpoint holds an amax history of shape {tuple(value.shape)}; {held_by} keeps {expected} "
                    "(a checkpoint of another recipe or amax_history_len)"
                )
                state_dict.pop(key)
            elif value.dtype != torch.float32:
                state_dict[key] = value.float()  # `load_state_dict(assign=True)` would otherwise keep its dtype
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
