"""A model whose parameters are built on the meta device and given real storage one at a time.

`tq.load_exported(..., compress=True)` builds the checkpoint's model this way
(`parameters_on_meta`, as `tq.quantize_checkpoint` does): no float weight is allocated until the
loader fills it (`Materializer`), and a quantized layer's is packed and freed before the next one
is read. Buffers (rotary frequencies, ...) are built as usual: the checkpoint may not hold them.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def parameters_on_meta():
    """Build modules with their parameters on the meta device (no memory) and their buffers real,
    so that tables a model computes at construction (rotary frequencies) are there to run with.
    Each parameter is allocated once, uninitialised, as it is registered, then dropped (a module's
    own initialisation then runs on meta, at no cost). This is accelerate's ``init_empty_weights``
    (``include_buffers=False``), which transformers 5 does not ship: ``nn.Module.register_parameter``
    patched for the block (one thread builds the model), as ``torch.device("meta")`` would put the
    buffers there too. Checked on torch 2.11, 2.13 and 2.14.1."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class Materializer:
    """Gives a meta parameter of `model` (by state_dict key) real, uninitialised storage of its
    shape and dtype on `device`, in place in its module; `retie` then points every module that
    shared it (tied embeddings) at the same new parameter."""

    def __init__(self, model: nn.Module, device: torch.device | None = None):
        self.model, self.device = model, device or torch.device("cpu")
        self.done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta): (meta, real)

    def __call__(self, key: str, meta: torch.Tensor, tie: bool = True) -> nn.Parameter:
        """The new parameter; with `tie` False it is not kept for `retie` (a weight packed and
        freed right after: holding it here would keep every float weight alive)."""
        module_name, _, name = key.rpartition(".")
        module = self.model.get_submodule(module_name)
        old = module._parameters[name]
        if id(old) in self.done:
            real = self.done[id(old)][1]
        else:
            real = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=self.device), requires_grad=old.requires_grad)
            if tie:
                self.done[id(old)] = (old, real)
        module._parameters[name] = real
        return real

    def retie(self) -> None:
        for module in self.model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.is_meta and id(p) in self.done:
                    module._parameters[name] = self.done[id(p)][1]

    def move_buffers(self) -> None:
        """Every buffer on `device` (those the build made on the CPU: rotary tables, ...)."""
        for module in self.model.modules():
            for name, b in list(module._buffers.items()):
                if b is not None and b.device != self.device:
                    module._buffers[name] = b.to(self.device)
