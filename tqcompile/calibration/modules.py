"""Fake-quantized modules, and converting a model to them in place (and back, on failure).

A module is converted by giving it a new class that inherits from a fake-quant mixin and its
own class (the first class in its MRO with an entry in `_KINDS` decides the mixin, so
subclasses match), and three `TensorQuantizer` children: ``input_quantizer``,
``weight_quantizer``, ``output_quantizer``. Parameters, buffers, hooks and attributes stay as they
were; `unconvert` undoes exactly that.

MoE experts modules holding fused 3-D weights (Hugging Face's ``gate_up_proj``/``down_proj``,
torchtitan's ``w1``/``w2``/``w3``; recognised by structure, `tqcompile.nn.experts.experts_layout`)
run two or three grouped GEMMs, each with its own input and weight. Each GEMM is one quantizable
unit: an `ExpertGemmQuantizers` child named ``<weight>_gemm`` (``experts.gate_up_proj_gemm``),
which holds the three quantizers and no parameter, so configs, `tq.summary` and `tq.quant_state`
treat it by canonical name as they treat a Linear, and the model's `state_dict` keeps its keys.
The experts module itself gets a class whose forward is `tqcompile.nn.experts`' routing (the one
`tq.convert` uses: tokens sorted by expert, counts as a tensor) with every GEMM fake-quantized per
expert (`_fake_quant_grouped_linear`); calibrating runs the same routing, so every expert's
tokens reach its quantizers, whatever `experts_implementation` the model was built with.

Module names are *canonical*: the fully qualified name with the components that wrappers add
removed (DDP's and DataParallel's ``module``, `torch.compile`'s ``_orig_mod``). Wrappers are
recognised by type, so a submodule a user named ``module`` keeps its name.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tqcompile.calibration.config import SLOTS, register_module_type
from tqcompile.calibration.fake_quant import TensorQuantizer, static_amax_kind
from tqcompile.calibration.fused import FUSED_SIBLINGS  # re-exported: its home is fused.py
from tqcompile.nn.base import is_converted
from tqcompile.nn.experts import ExpertGemm, ExpertsRouting, expert_weight, experts_layout
from tqcompile.nn.grouped import GroupedLinear, wrong_counts_length
from tqcompile.ops.grouped_gemm import equal_ends, expert_ids, grouped_mm
from tqcompile.quantizers import Quantizer

__all__ = [
    "FakeQuantModule",
    "FUSED_SIBLINGS",
    "ExpertGemmQuantizers",
    "PER_EXPERT_KINDS",
    "canonical_modules",
    "quant_units",
    "params_owner",
    "class_name",
    "holds_quantizers",
    "kind_of",
    "convert_module",
    "unconvert_module",
    "weight_view",
    "static_amax_shape",
    "check_not_meta",
    "base_class",
    "swap_class",
]


# Kinds whose input and weight quantizers keep one amax per expert.
PER_EXPERT_KINDS = ("GroupedLinear", "Experts")


class FakeQuantModule:
    """Mixin marking a fake-quantized module; it owns three `TensorQuantizer` children."""

    tq_kind: str
    input_quantizer: TensorQuantizer
    weight_quantizer: TensorQuantizer
    output_quantizer: TensorQuantizer

    def quantizers(self) -> dict[str, TensorQuantizer]:
        return {s: getattr(self, f"{s}_quantizer") for s in SLOTS}


def _reduce_generated(self, protocol: int):
    # A fake-quant class is made at run time, so pickle cannot find it by name (torch.save of a
    # whole model, multiprocessing, deepcopy): rebuild it from the module's own class and the mixin.
    rv = object.__reduce_ex__(self, max(protocol, 2))
    cls = type(self)
    return (_new_fake_quant, (cls.tq_base, cls.tq_mixin), *rv[2:])


def _fake_quant_grouped_linear(slots: FakeQuantModule, x, ends, weight, bias) -> torch.Tensor:
    """One fake-quantized grouped GEMM: per expert e, ``fq(x_e) @ fq(weight[e]).T + bias[e]`` for
    the (T, in) tokens `x` sorted by expert (segment `ends`), each expert's input and weight with
    that expert's amax; the GEMM in high precision, differentiable (QAT). Static shapes: one graph
    for every routing."""
    y = grouped_mm(slots.input_quantizer(x, ends=ends), slots.weight_quantizer(weight), ends)
    if bias is not None:
        y = y + bias.to(y.dtype)[expert_ids(ends, x.shape[0])]
    return slots.output_quantizer(y)


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
            e, c, _ = x.shape  # a fixed capacity: E segments of c tokens
            ends = equal_ends(e, c, x.device)
            return _fake_quant_grouped_linear(self, x.reshape(e * c, -1), ends, self.weight, self.bias).view(e, c, -1)
        # The counts stay a tensor (no .tolist()): a compiled QAT model serves every routing with one graph.
        counts = m_splits if isinstance(m_splits, torch.Tensor) else torch.tensor(list(m_splits), device=x.device)
        if x.dim() != 2 or wrong_counts_length(counts, self.num_experts):
            raise ValueError(
                f"GroupedLinear: m_splits of shape {tuple(counts.shape)} and x of shape {tuple(x.shape)}; expected "
                f"({self.num_experts},) per-expert token counts and x of shape (tokens, {self.in_features})"
            )
        return _fake_quant_grouped_linear(self, x, torch.cumsum(counts.to(torch.int64), 0), self.weight, self.bias)


def _unit_attr(gemm: ExpertGemm) -> str:
    """The experts module's attribute holding the `ExpertGemmQuantizers` of `gemm`."""
    return f"{gemm.weight}_gemm"


class ExpertGemmQuantizers(FakeQuantModule, nn.Module):
    """The quantizers of one grouped GEMM of a fake-quantized experts module (see the module
    docstring): a child of the experts module named ``<weight>_gemm``, holding `input_quantizer`,
    `weight_quantizer` and `output_quantizer` and no parameter. Match it in a config by name
    (``"*.experts.down_proj_gemm"``) or by class (``module_types=(ExpertGemmQuantizers,)``, as
    the presets do); a rule matching the experts module (``"*.mlp.experts"``,
    ``module_types=(MixtralExperts,)``) matches all of its GEMMs.

    `weight` is the experts module's weight in the GEMM's (experts, out, in) view (a transposed
    view for GPT-OSS's (experts, in, out) storage): scaling units follow the GEMM, amaxes are per
    expert along dim 0.
    """

    tq_kind = "Experts"

    def __init__(self, owner: nn.Module, gemm: ExpertGemm):
        super().__init__()
        # In a tuple: a module attribute would be registered as a child of its own child (a cycle).
        self._owner = (owner,)
        self.gemm = gemm
        self.num_experts = owner._parameters[gemm.weight].shape[0]

    @property
    def owner(self) -> nn.Module:
        """The experts module whose GEMM this is."""
        return self._owner[0]

    @property
    def tq_rule_owner(self) -> nn.Module:
        """Config rules that match the experts module match this unit too (`QuantRule.matches`)."""
        return self.owner

    @property
    def weight(self) -> torch.Tensor:
        return expert_weight(self.owner, self.gemm)[0]

    @property
    def attr_name(self) -> str:
        return _unit_attr(self.gemm)

    def extra_repr(self) -> str:
        e, n, k = self.weight.shape
        return f"{self.gemm.weight}: {e} experts, {k} -> {n}"


class _ExpertsFQ(ExpertsRouting):
    """Fake-quantized experts: the routing of `tqcompile.nn.experts`, each GEMM fake-quantized
    with the quantizers of its `ExpertGemmQuantizers` child."""

    def _expert_gemm(self, index: int, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        g = self.tq_experts_layout.gemms[index]
        w, bias = expert_weight(self, g)
        return _fake_quant_grouped_linear(self._modules[_unit_attr(g)], x, torch.cumsum(counts.to(torch.int64), 0), w, bias)


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
register_module_type(GroupedLinear, ExpertGemmQuantizers)  # the GEMM classes tq.configs' presets name
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
    return type(module).__dict__.get("tq_base", type(module))


def holds_quantizers(module: nn.Module) -> bool:
    """Whether `module` is already fake-quantized (holds quantizer slots), as opposed to a float
    module or a fresh experts GEMM unit of `quant_units`."""
    return any(isinstance(module._modules.get(f"{s}_quantizer"), TensorQuantizer) for s in SLOTS)


def class_name(module: nn.Module) -> str:
    """The class a user knows a quantizable unit by: its own, or its experts module's."""
    return base_class(params_owner(module)).__name__


def params_owner(module: nn.Module) -> nn.Module:
    """The module that holds the unit's parameters (an experts GEMM's: the experts module)."""
    return module.owner if isinstance(module, ExpertGemmQuantizers) else module


def quant_units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`canonical_modules`, plus, after every float experts module, one new (not yet attached)
    `ExpertGemmQuantizers` per GEMM, named ``<experts>.<weight>_gemm``: what `tq.calibrate` and
    `tq.restore` match rules against and convert. Nothing of the model changes."""
    for name, module in canonical_modules(model):
        yield name, module
        layout = None if isinstance(module, _ExpertsFQ) else experts_layout(module)
        for g in () if layout is None else layout.gemms:
            unit = ExpertGemmQuantizers(module, g)
            yield (f"{name}.{unit.attr_name}" if name else unit.attr_name), unit


def kind_of(module: nn.Module) -> tuple[str, type | None, tuple[str, ...]] | None:
    """(kind, mixin, allowed slots) for a module tqcompile can fake-quantize, else None."""
    if isinstance(module, ExpertGemmQuantizers):
        return "Experts", None, SLOTS  # born fake-quantized: no class to swap
    base = base_class(module)
    for cls, kind, mixin, slots in _KINDS:
        if issubclass(base, cls):
            return kind, mixin, slots
    return None


def unsupported_reason(module: nn.Module) -> str | None:
    """Why a module of a supported family cannot be converted (a subclass that overrides forward)."""
    if isinstance(module, ExpertGemmQuantizers):
        if is_converted(module.owner):
            return "its experts module was converted by tq.convert (it quantizes with its training recipe); calibrate the float model"
        if getattr(module.owner, "_is_expert_parallel", False):
            return "transformers' own expert parallelism is enabled on its experts module (its sentinel routing is not supported)"
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


def check_not_meta(model: nn.Module, who: str, fix: str) -> None:
    """Refuse a model with a parameter or buffer on the meta device (shapes, no values), naming the
    first one: a meta tensor fails far from the cause ("Tensor.item() cannot be called on meta
    tensors"). `fix`: what to do instead."""
    for name, module in canonical_modules(model):
        for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
            for key, t in tensors.items():
                if t is not None and t.is_meta:
                    full = f"{name}.{key}" if name else key
                    raise ValueError(
                        f"{who}: {kind} {full!r} is on the meta device (a shape without values: the model was built under "
                        f"torch.device('meta') or loaded with device_map='meta'); {fix}"
                    )


def weight_view(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The view of a weight its weight quantizer sees: a conv's (out, in/groups * kernel) GEMM matrix."""
    return weight.flatten(1) if isinstance(module, nn.modules.conv._ConvNd) else weight


def static_amax_shape(module: nn.Module, slot: str, q: Quantizer | None) -> tuple[int, ...] | None:
    """The shape of the static amax `q` keeps for `slot` of `module` (None: it keeps none): () per
    tensor, one per expert for the input (E,) and weight (E, 1, 1) of an experts unit, or the
    weight quantizer's scale shape."""
    kind = static_amax_kind(q, slot)
    if kind is None:
        return None
    experts = module.num_experts if kind_of(module)[0] in PER_EXPERT_KINDS and slot != "output" else None
    if slot == "weight":
        w = weight_view(module, module.weight)
        return tuple(q.scale_shape(w.shape)) if kind == "unit" else ((w.shape[0], 1, 1) if experts else ())
    return (experts,) if experts else ()


def _fake_quant_class(base: type, mixin: type) -> type:
    """The fake-quant class for modules of class `base` with `mixin` (one per pair, made on first use)."""
    key = (mixin, base)
    if key not in _CLASS_CACHE:
        kind = next((k for cls, k, m, _ in _KINDS if m is mixin and issubclass(base, cls)), None)
        attrs = {
            "__module__": base.__module__,
            "tq_kind": kind,
            "tq_base": base,
            "tq_mixin": mixin,
            "__reduce_ex__": _reduce_generated,
        }
        _CLASS_CACHE[key] = type(f"FakeQuant{base.__name__}", (mixin, base), attrs)
    return _CLASS_CACHE[key]


def _new_fake_quant(base: type, mixin: type) -> nn.Module:
    """Unpickling: an empty instance of `base`'s fake-quant class (its state is set after)."""
    cls = _fake_quant_class(base, mixin)
    return cls.__new__(cls)


def swap_class(module: nn.Module) -> None:
    """Give `module` the fake-quant class of its kind (its quantizer children must exist)."""
    module.__class__ = _fake_quant_class(base_class(module), kind_of(module)[1])


def convert_module(module: nn.Module, name: str, quantizers: dict, ste: str) -> None:
    """Make `module` fake-quantized in place with the given {slot: Quantizer | None}; an
    `ExpertGemmQuantizers` is attached to its experts module, which gets the fake-quant experts class."""
    experts = module.num_experts if kind_of(module)[0] in PER_EXPERT_KINDS else None
    for slot in SLOTS:
        module.add_module(
            f"{slot}_quantizer", TensorQuantizer(quantizers[slot], slot, name, experts if slot != "output" else None, ste)
        )
    if not isinstance(module, ExpertGemmQuantizers):
        swap_class(module)
        return
    owner = module.owner
    if not isinstance(owner, _ExpertsFQ):
        owner.tq_experts_layout = experts_layout(owner)
        owner.__class__ = _fake_quant_class(base_class(owner), _ExpertsFQ)
    owner.add_module(module.attr_name, module)


def unconvert_module(module: nn.Module) -> None:
    """Undo `convert_module` (used to leave a model as it was when calibration fails)."""
    if isinstance(module, ExpertGemmQuantizers):
        owner = module.owner
        owner._modules.pop(module.attr_name, None)
        if isinstance(owner, _ExpertsFQ) and not any(isinstance(c, ExpertGemmQuantizers) for c in owner.children()):
            owner.__class__ = base_class(owner)
            del owner.tq_experts_layout
        return
    if not isinstance(module, FakeQuantModule):
        return
    module.__class__ = base_class(module)
    for slot in SLOTS:
        if f"{slot}_quantizer" in module._modules:
            del module._modules[f"{slot}_quantizer"]
