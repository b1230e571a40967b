"""Fake-quantized modules, and converting a model to them in place (and back, on failure).

A module is converted by giving it a new class that inherits from a fake-quant mixin and its
own class (the first class in its MRO with an entry in `_KINDS` decides the mixin, so
subclasses match), and three `TensorQuantizer` children: ``input_quantizer``,
``weight_quantizer``, ``output_quantizer``. Parameters, buffers, hooks and attributes stay as they
were; `unconvert` undoes exactly that.

Module names are *canonical*: the fully qualified name with the components that wrappers add
removed (DDP's and DataParallel's ``module``, `torch.compile`'s ``_orig_mod``). Wrappers are
recognised by type, so a submodule a user named ``module`` keeps its name.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tqcompile.calibration.config import SLOTS
from tqcompile.calibration.fake_quant import TensorQuantizer
from tqcompile.nn.grouped import GroupedLinear

__all__ = [
    "FakeQuantModule",
    "canonical_modules",
    "kind_of",
    "convert_module",
    "unconvert_module",
    "weight_view",
    "base_class",
    "swap_class",
]


class FakeQuantModule:
    """Mixin marking a fake-quantized module; it owns three `TensorQuantizer` children."""

    tq_kind: str
    input_quantizer: TensorQuantizer
    weight_quantizer: TensorQuantizer
    output_quantizer: TensorQuantizer

    def quantizers(self) -> dict[str, TensorQuantizer]:
        return {s: getattr(self, f"{s}_quantizer") for s in SLOTS}

    def __reduce_ex__(self, protocol):
        # The fake-quant class is made at run time, so pickle cannot find it by name (torch.save of
        # a whole model, multiprocessing): rebuild it from the module's own class instead.
        rv = super().__reduce_ex__(protocol)
        return (_new_fake_quant, (base_class(self),), *rv[2:])


class _LinearFQ(FakeQuantModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self.input_quantizer(x), self.weight_quantizer(self.weight), self.bias)
        return self.output_quantizer(y)


class _ConvFQ(FakeQuantModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_quantizer(self.weight.flatten(1)).view_as(self.weight)
        y = self._conv_forward(self.input_quantizer(x, channel_dim=1), w, self.bias)
        return self.output_quantizer(y, channel_dim=1)


class _GroupedLinearFQ(FakeQuantModule):
    def forward(self, x: torch.Tensor, m_splits: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        if m_splits is None:
            if x.dim() != 3 or x.shape[0] != self.num_experts:
                raise ValueError(
                    f"GroupedLinear: expected x of shape ({self.num_experts}, tokens, {self.in_features}) or m_splits, got {tuple(x.shape)}"
                )
            chunks = x.unbind(0)
        else:
            # A tensor of counts becomes Python ints here: each expert's tokens get that expert's
            # static input amax. (Under torch.compile that is a data-dependent split; compiled QAT
            # of MoE layers should pass the dense (experts, tokens, in) form.)
            splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
            if x.dim() != 2 or len(splits) != self.num_experts or sum(splits) != x.shape[0]:
                raise ValueError(
                    f"GroupedLinear: m_splits={splits} must have {self.num_experts} entries summing to the tokens of x, "
                    f"of shape (tokens, {self.in_features}); got x of shape {tuple(x.shape)}"
                )
            chunks = x.split(splits, 0)
        w = self.weight_quantizer(self.weight)
        outs = [
            self.output_quantizer(F.linear(self.input_quantizer(c, expert=e), w[e], None if self.bias is None else self.bias[e]))
            for e, c in enumerate(chunks)
        ]
        return torch.stack(outs) if m_splits is None else torch.cat(outs)


class _ChannelNormFQ(FakeQuantModule):
    """BatchNorm*, SyncBatchNorm, GroupNorm: channels on dim 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_quantizer(super().forward(self.input_quantizer(x, channel_dim=1)), channel_dim=1)


class _LastDimNormFQ(FakeQuantModule):
    """LayerNorm, RMSNorm: features on the last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_quantizer(super().forward(self.input_quantizer(x)))


class _EmbeddingFQ(FakeQuantModule):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        w = self.weight_quantizer(self.weight)
        y = F.embedding(idx, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
        return self.output_quantizer(y)


# (class, kind, mixin, slots it may enable). The kind names a family: BatchNorm2d and SyncBatchNorm
# are both "BatchNorm", so their saved state is the same.
_KINDS: tuple[tuple[type, str, type, tuple[str, ...]], ...] = (
    (GroupedLinear, "GroupedLinear", _GroupedLinearFQ, SLOTS),
    (nn.Linear, "Linear", _LinearFQ, SLOTS),
    (nn.Conv1d, "Conv1d", _ConvFQ, SLOTS),
    (nn.Conv2d, "Conv2d", _ConvFQ, SLOTS),
    (nn.Conv3d, "Conv3d", _ConvFQ, SLOTS),
    (nn.modules.batchnorm._BatchNorm, "BatchNorm", _ChannelNormFQ, ("input", "output")),
    (nn.GroupNorm, "GroupNorm", _ChannelNormFQ, ("input", "output")),
    (nn.LayerNorm, "LayerNorm", _LastDimNormFQ, ("input", "output")),
    (nn.RMSNorm, "RMSNorm", _LastDimNormFQ, ("input", "output")),
    (nn.Embedding, "Embedding", _EmbeddingFQ, ("weight", "output")),
)
_FORWARD_OWNER = {
    GroupedLinear: GroupedLinear,
    nn.Linear: nn.Linear,
    nn.Conv1d: nn.Conv1d,
    nn.Conv2d: nn.Conv2d,
    nn.Conv3d: nn.Conv3d,
}
_CLASS_CACHE: dict[tuple[type, type], type] = {}


def _wrapper_types() -> tuple[type, ...]:
    from torch._dynamo.eval_frame import OptimizedModule  # torch.compile's wrapper; no public name (checked on 2.11, 2.13)

    return (nn.parallel.DistributedDataParallel, nn.DataParallel, OptimizedModule)


def canonical_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(canonical name, module) of every module, each once, wrappers' own components removed."""
    wrappers = _wrapper_types()
    seen: set[int] = set()

    def walk(mod: nn.Module, prefix: str):
        if id(mod) in seen:
            return
        seen.add(id(mod))
        if not isinstance(mod, wrappers):
            yield prefix, mod
        for name, child in mod._modules.items():
            if child is None:
                continue
            skip = isinstance(mod, wrappers) and name in ("module", "_orig_mod")
            yield from walk(child, prefix if skip else (f"{prefix}.{name}" if prefix else name))

    yield from walk(model, "")


def base_class(module: nn.Module) -> type:
    """The module's own class (the one it had before it was fake-quantized)."""
    cls = type(module)
    return next(c for c in cls.__mro__[1:] if not issubclass(c, FakeQuantModule)) if isinstance(module, FakeQuantModule) else cls


def kind_of(module: nn.Module) -> tuple[str, type, tuple[str, ...]] | None:
    """(kind, mixin, allowed slots) for a module tqcompile can fake-quantize, else None."""
    base = base_class(module)
    for cls, kind, mixin, slots in _KINDS:
        if issubclass(base, cls):
            return kind, mixin, slots
    return None


def unsupported_reason(module: nn.Module) -> str | None:
    """Why a module of a supported family cannot be converted (a subclass that overrides forward)."""
    for cls, owner in _FORWARD_OWNER.items():
        if isinstance(module, cls):
            if type(module).forward is not owner.forward:
                return f"{type(module).__name__} overrides forward, so its computation cannot be fake-quantized from outside"
            return None
    return None


def read_by_parent(model: nn.Module) -> dict[int, str]:
    """{id(module): why} for the modules of `model` whose parent computes with their weight itself
    and never calls them, so a fake quantizer on them would never run.

    `nn.MultiheadAttention.forward` passes `out_proj.weight` to `F.multi_head_attention_forward`:
    before this was checked, `out_proj` was converted and shown as quantized while it stayed in high
    precision, and a static config failed calibration saying it "saw no data"."""
    reasons: dict[int, str] = {}
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention) and type(module).forward is nn.MultiheadAttention.forward:
            reasons[id(module.out_proj)] = (
                "its parent nn.MultiheadAttention reads out_proj.weight itself (F.multi_head_attention_forward) and never "
                "calls it; build the attention from nn.Linear projections to quantize it"
            )
    return reasons


def module_device(module: nn.Module) -> torch.device:
    """Where a module's tensors live (a LayerNorm without affine parameters has none: the CPU)."""
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        return t.device
    return torch.device("cpu")


def weight_view(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The view of a weight its weight quantizer sees: a conv's (out, in/groups * kernel) GEMM matrix."""
    return weight.flatten(1) if isinstance(module, nn.modules.conv._ConvNd) else weight


def _fake_quant_class(base: type) -> type:
    """The fake-quant class for modules of class `base` (one per class, made on first use)."""
    kind, mixin = next((kind, mixin) for cls, kind, mixin, _ in _KINDS if issubclass(base, cls))
    key = (mixin, base)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(f"FakeQuant{base.__name__}", (mixin, base), {"__module__": base.__module__, "tq_kind": kind})
    return _CLASS_CACHE[key]


def _new_fake_quant(base: type) -> nn.Module:
    """Unpickling: an empty instance of `base`'s fake-quant class (its state is set after)."""
    cls = _fake_quant_class(base)
    return cls.__new__(cls)


def swap_class(module: nn.Module) -> None:
    """Give `module` the fake-quant class of its kind (its quantizer children must exist)."""
    module.__class__ = _fake_quant_class(base_class(module))


def convert_module(module: nn.Module, name: str, quantizers: dict, ste: str) -> None:
    """Make `module` fake-quantized in place with the given {slot: Quantizer | None}."""
    experts = module.num_experts if kind_of(module)[0] == "GroupedLinear" else None
    for slot in SLOTS:
        module.add_module(
            f"{slot}_quantizer", TensorQuantizer(quantizers[slot], slot, name, experts if slot != "output" else None, ste)
        )
    swap_class(module)


def unconvert_module(module: nn.Module) -> None:
    """Undo `convert_module` (used to leave a model as it was when calibration fails)."""
    if not isinstance(module, FakeQuantModule):
        return
    module.__class__ = base_class(module)
    for slot in SLOTS:
        if f"{slot}_quantizer" in module._modules:
            del module._modules[f"{slot}_quantizer"]
