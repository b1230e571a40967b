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

Module names are *canonical* (`tqcompile.surgery.names`): the fully qualified name with the
components that wrappers add removed (DDP's and DataParallel's ``module``, `torch.compile`'s
``_orig_mod``, ...). The generated classes, their pickling, undoing a conversion and the checks
before one are the surgery layer's too (`tqcompile.surgery`), shared with `tq.convert`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tqcompile.calibration.attention import ATTENTION_MIXINS, ATTENTION_SLOTS, AttentionQuantizers, kv_layout, register_query_tap
from tqcompile.calibration.config import SLOTS, register_module_type
from tqcompile.calibration.fake_quant import TensorQuantizer, static_amax_kind
from tqcompile.calibration.fused import FUSED_SIBLINGS  # re-exported: its home is fused.py
from tqcompile.nn.base import is_converted
from tqcompile.nn.experts import ExpertGemm, ExpertsRouting, expert_weight, experts_layout
from tqcompile.nn.grouped import GroupedLinear, wrong_counts_length
from tqcompile.ops.grouped_gemm import equal_ends, expert_ids, grouped_mm
from tqcompile.quantizers import Quantizer
from tqcompile.surgery.checks import weight_reads
from tqcompile.surgery.classes import generated_class, mixin_of, new_instance
from tqcompile.surgery.names import canonical_modules
from tqcompile.surgery.plan import Decision

__all__ = [
    "FakeQuantModule",
    "FUSED_SIBLINGS",
    "ExpertGemmQuantizers",
    "PER_EXPERT_KINDS",
    "SHARDED_FIX",
    "quant_units",
    "unit_decision",
    "slots_of",
    "params_owner",
    "class_name",
    "holds_quantizers",
    "kind_of",
    "convert_module",
    "weight_view",
    "static_amax_shape",
    "base_class",
    "swap_class",
    "register_mixin",
    "is_fake_quant_experts",
    "runs_its_quantizers",
    "unit_slots",
]


# Kinds whose input and weight quantizers keep one amax per expert.
PER_EXPERT_KINDS = ("GroupedLinear", "Experts")
# What tq.calibrate, tq.restore and tq.calibration.prepare say when a layer is already sharded (tqcompile.surgery.checks).
SHARDED_FIX = (
    "Quantize the unsharded model first, then shard it: {who}, then torch.compile per block, then fully_shard (docs/qat.md)"
)


class FakeQuantModule:
    """Mixin marking a fake-quantized module; it owns three `TensorQuantizer` children."""

    input_quantizer: TensorQuantizer
    weight_quantizer: TensorQuantizer
    output_quantizer: TensorQuantizer
    # The generated class is "FakeQuant<Class>", this mixin first: its forward replaces the class's own.
    tq_mixin_first = True
    tq_class_prefix = "FakeQuant"

    @property
    def tq_kind(self) -> str | None:
        """The module's kind (its family: BatchNorm2d and SyncBatchNorm are both "BatchNorm")."""
        found = kind_of(self)
        return None if found is None else found[0]

    def quantizers(self) -> dict[str, TensorQuantizer]:
        return {s: getattr(self, f"{s}_quantizer") for s in SLOTS}


# Pickles of calibrated models made before the surgery layer name this function: it makes the same class.
_new_fake_quant = new_instance


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

    tq_class_prefix = "FakeQuant"

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
    # `_EmbeddingFQ` calls F.embedding itself: a subclass's own forward would be lost. Hugging Face's
    # Gemma scales its embedding there (GemmaTextScaledWordEmbedding: its logits were silently wrong,
    # cosine 0.82 against the float model with every quantizer of the embedding off) and OPT's
    # learned positions take position_ids (calibration failed). The norm mixins call super().forward.
    nn.Embedding: nn.Embedding,
}
# Forwards of nn.Linear subclasses that compute F.linear(x, weight, bias) and nothing else (read in
# their source), so the fake-quant forward may stand in for them, named by the function (a subclass
# inheriting it matches, one overriding it again does not): transformers' FalconLinear (``x @ W.T``,
# then ``+ b``; every linear layer of a Falcon: without this tq.calibrate quantized none).
LINEAR_FORWARDS = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear.forward"})
# The mixins tq.calibrate (and tq.compress, `register_mixin`) generate classes with: `base_class`
# sees through those classes only.
_MIXINS = {*(mixin for _, _, mixin, _ in _KINDS), _ExpertsFQ, *ATTENTION_MIXINS}


def is_fake_quant_experts(module: nn.Module) -> bool:
    """Whether `module` is an experts module `tq.calibrate` fake-quantized (its GEMMs are children)."""
    return isinstance(module, _ExpertsFQ)


def runs_its_quantizers(module: nn.Module) -> bool:
    """Whether the module's class runs its quantizers: a fake-quant class, or a class a registered
    mixin made (`register_mixin`: `tq.compress`'s packed modules). False for a module that kept its
    quantizer children but lost such a class (`tq.calibration.reattach`)."""
    return isinstance(module, FakeQuantModule | AttentionQuantizers) or mixin_of(type(module)) in _MIXINS


def register_mixin(mixin: type) -> type:
    """Let `base_class` see through the classes generated with `mixin` (a later stage that
    replaces a fake-quantized module's class, as `tq.compress` does, keeping its quantizers)."""
    _MIXINS.add(mixin)
    return mixin


def unit_decision(name: str, module: nn.Module, using: object, action: str = "convert", reason: str = "") -> Decision:
    """The surgery layer's `Decision` for one quantizable unit; converting an experts GEMM changes its experts module too."""
    owner = params_owner(module)
    touches = (owner,) if owner is not module else ()
    return Decision(name, class_name(module), action, reason, module=module, using=using, touches=touches)


def slots_of(module: nn.Module) -> dict[str, TensorQuantizer] | None:
    """{slot: its TensorQuantizer} of a fake-quantized module (also one that lost its fake-quant
    class, see `tq.calibration.reattach`), else None."""
    qs = {s: module._modules.get(f"{s}_quantizer") for s in SLOTS}
    return qs if all(isinstance(q, TensorQuantizer) for q in qs.values()) else None


def base_class(module: nn.Module) -> type:
    """The module's own class (the one it had before it was fake-quantized)."""
    cls = type(module)
    return cls.tq_base if mixin_of(cls) in _MIXINS else cls


def holds_quantizers(module: nn.Module) -> bool:
    """Whether `module` is already fake-quantized (holds quantizer slots), as opposed to a float
    module or a fresh experts GEMM unit of `quant_units`."""
    return any(isinstance(module._modules.get(f"{s}_quantizer"), TensorQuantizer) for s in (*SLOTS, *ATTENTION_SLOTS))


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
    layout = kv_layout(module, base)
    if layout is not None:
        return "Attention", layout.mixin, ATTENTION_SLOTS
    for cls, kind, mixin, slots in _KINDS:
        if issubclass(base, cls):
            return kind, mixin, slots
    return None


def unit_slots(module: nn.Module) -> tuple[str, ...]:
    """The quantizer slots of a quantizable unit: key and value for attention, else input, weight, output."""
    return ATTENTION_SLOTS if kind_of(module)[0] == "Attention" else SLOTS


def unsupported_reason(module: nn.Module) -> str | None:
    """Why a module of a supported family cannot be converted (a subclass that overrides forward)."""
    if isinstance(module, ExpertGemmQuantizers):
        if is_converted(module.owner):
            return "its experts module was converted by tq.convert (it quantizes with its training recipe); calibrate the float model"
        if getattr(module.owner, "_is_expert_parallel", False):
            return "transformers' own expert parallelism is enabled on its experts module (its sentinel routing is not supported)"
    own = base_class(module)
    if isinstance(module, nn.Linear) and f"{own.forward.__module__}.{own.forward.__qualname__}" in LINEAR_FORWARDS:
        return None
    for cls, owner in _FORWARD_OWNER.items():
        if isinstance(module, cls):
            if own.forward is not owner.forward:
                return f"{type(module).__name__} overrides forward, so its computation cannot be fake-quantized from outside"
            return None
    return None


def read_by_parent(model: nn.Module) -> dict[int, str]:
    """{id(module): why} for the modules of `model` whose parent computes with their weight itself
    and never calls them, so a fake quantizer on them would never run (the surgery layer's registry,
    `tqcompile.surgery.checks`, of modules that always do: a parent that only does on some path,
    such as `nn.TransformerEncoderLayer`'s inference fast path, calls them while calibrating and training).

    `nn.MultiheadAttention.forward` passes `out_proj.weight` to `F.multi_head_attention_forward`:
    before this was checked, `out_proj` was converted and shown as quantized while it stayed in high
    precision, and a static config failed calibration saying it "saw no data"."""
    reasons: dict[int, str] = {}
    for _, module, reads in weight_reads(dict(canonical_modules(model))):
        if not (reads.always and reads.runs_own_forward(module)):
            continue
        for child, where in reads.children(module).items():
            advice = f"; {reads.advice}" if reads.advice else ""
            reasons[id(module.get_submodule(child))] = f"its parent {where} and never calls it{advice}"
    return reasons


def module_device(module: nn.Module) -> torch.device:
    """Where a module's tensors live: its own, else its submodules' (a Hugging Face attention holds
    only its projections; measured on CUDA: its KV statistics were made on the CPU); a module
    with none (a LayerNorm without affine parameters): the CPU."""
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        return t.device
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


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
    if slot in ATTENTION_SLOTS:
        return (kv_layout(module, base_class(module)).kv_heads, 1) if kind == "unit" else ()
    experts = module.num_experts if kind_of(module)[0] in PER_EXPERT_KINDS and slot != "output" else None
    if slot == "weight":
        w = weight_view(module, module.weight)
        return tuple(q.scale_shape(w.shape)) if kind == "unit" else ((w.shape[0], 1, 1) if experts else ())
    return (experts,) if experts else ()


def swap_class(module: nn.Module) -> None:
    """Give `module` the fake-quant class of its kind (its quantizer children must exist)."""
    module.__class__ = generated_class(base_class(module), kind_of(module)[1])


def convert_module(module: nn.Module, name: str, quantizers: dict, ste: str) -> None:
    """Make `module` fake-quantized in place with the given {slot: Quantizer | None}; an
    `ExpertGemmQuantizers` is attached to its experts module, which gets the fake-quant experts class.
    Run it through `tqcompile.surgery.plan.apply` (with the experts module in `touches`), whose
    `Undo` puts the model back exactly."""
    if kind_of(module)[0] == "Attention":
        for slot in ATTENTION_SLOTS:
            module.add_module(f"{slot}_quantizer", TensorQuantizer(quantizers.get(slot), slot, name, None, ste))
        layout = kv_layout(module, base_class(module))
        if layout.cache_arg is not None:
            module.tq_cache_arg, module.tq_eager_attention = layout.cache_arg, layout.eager
            module.tq_model_config = module.__dict__["config"]  # what `_HFAttentionKV.config` reads
            if module.query_quantizer.enabled:
                register_query_tap()
        swap_class(module)
        return
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
        owner.__class__ = generated_class(base_class(owner), _ExpertsFQ)
    owner.add_module(module.attr_name, module)
