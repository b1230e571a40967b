"""MoE experts as users' models hold them: fused 3-D expert weights, quantized per expert.

Hugging Face transformers (v5) keeps a MoE layer's experts in one plain `nn.Module`
(`MixtralExperts`, `Qwen3MoeExperts`, `GptOssExperts`, ... every class decorated with
`transformers.integrations.use_experts_implementation`) holding 3-D parameters ``gate_up_proj``
(E, 2I, H) and ``down_proj`` (E, H, I) (``up_proj`` without a gate; transposed (E, in, out) with
``is_transposed``, GPT-OSS; ``*_bias`` (E, out) with ``has_bias``), and runs them through
`torch._grouped_mm` with routing offsets, or a loop that indexes the weight per expert.
torchtitan's `GroupedExperts` holds ``w1``/``w3`` (E, hidden, dim) and ``w2`` (E, dim, hidden)
and takes tokens already sorted by expert with ``num_tokens_per_expert``.

`tq.convert` recognises both by structure (`experts_layout`), not by class, so a model nobody
wrote a converter for converts too, and gives the module a class whose `forward` runs every
expert GEMM through `tq.nn.grouped_linear`: per-expert weight scales (amax ``[E]`` along axis 0),
per-expert activation and gradient scales from the routing offsets, the three GEMMs of forward
and backward grouped, whatever `experts_implementation` the model was built with. Parameters
and `state_dict` keys stay as they were. The routing itself (sort by expert, counts, weights,
unpermute) is the model's own algorithm written once here for each layout: its shapes depend on
the token count only, so a compiled model never recompiles for a new routing.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tqcompile.nn.base import QuantizedModule
from tqcompile.nn.grouped import grouped_linear, grouped_unsupported_reason
from tqcompile.nn.histories import HISTORY_PREFIX, _AmaxHistoryOwner
from tqcompile.recipes import Recipe

__all__ = [
    "ExpertGemm",
    "ExpertsLayout",
    "experts_layout",
    "ExpertsRouting",
    "QuantizedExperts",
    "experts_unsupported_reason",
    "expert_weight",
    "sort_by_expert",
]


@dataclasses.dataclass(frozen=True)
class ExpertGemm:
    """One grouped GEMM of an experts module: its 3-D weight parameter, stored (E, out, in), or
    (E, in, out) when `transposed`, and its (E, out) bias parameter, if any."""

    weight: str
    transposed: bool = False
    bias: str | None = None


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module computes: `style` "hf" (routing inside: `forward(hidden_states,
    top_k_index, top_k_weights)`) or "torchtitan" (`forward(x, num_tokens_per_expert)`, tokens
    sorted by expert), and its GEMMs in the order the forward runs them."""

    style: str
    gemms: tuple[ExpertGemm, ...]


def _param3d(module: nn.Module, name: str) -> bool:
    p = module._parameters.get(name)
    return p is not None and p.dim() == 3


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The `ExpertsLayout` of a Hugging Face or torchtitan experts module, or None if `module` is not one."""
    if isinstance(module, ExpertsRouting):
        return module.tq_experts_layout
    if all(hasattr(module, a) for a in ("has_gate", "is_transposed", "has_bias", "_apply_gate")):
        first = "gate_up_proj" if module.has_gate else "up_proj"
        if _param3d(module, first) and _param3d(module, "down_proj"):
            t, b = bool(module.is_transposed), bool(module.has_bias)
            gemms = tuple(ExpertGemm(w, t, f"{w}_bias" if b else None) for w in (first, "down_proj"))
            return ExpertsLayout("hf", gemms)
    if all(_param3d(module, w) for w in ("w1", "w2", "w3")):
        try:
            params = inspect.signature(type(module).forward).parameters
        except (TypeError, ValueError):
            return None
        if "num_tokens_per_expert" in params:
            return ExpertsLayout("torchtitan", (ExpertGemm("w1"), ExpertGemm("w3"), ExpertGemm("w2")))
    return None


def _gemm_shape(module: nn.Module, g: ExpertGemm) -> tuple[int, int, int]:
    """(experts, in_features, out_features) of one expert GEMM."""
    e, a, b = module._parameters[g.weight].shape
    return (e, a, b) if g.transposed else (e, b, a)


def experts_unsupported_reason(module: nn.Module, recipe: Recipe) -> str | None:
    """Why `recipe` cannot serve the experts module (None if it can)."""
    layout = experts_layout(module)
    if layout is None:
        return "not a recognised experts module"
    if layout.style == "hf" and getattr(module, "_is_expert_parallel", False):
        return (
            "transformers' own expert parallelism is enabled on it (its sentinel routing is not supported); "
            "shard experts with tq.distributed's expert parallelism instead (docs/moe.md)"
        )
    for g in layout.gemms:
        _, k, n = _gemm_shape(module, g)
        reason = grouped_unsupported_reason(recipe, k, n, histories=True)
        if reason:
            return f"{g.weight} ({k} -> {n} per expert): {reason}"
    return None


_OPERANDS = ("input", "weight", "grad")


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, counts): the stable order that sorts the flat `expert_ids` by expert, and the int64
    token count of each of `num_experts` experts. Static shapes (no bincount), so a compiled
    model serves every routing, empty experts included, with one graph."""
    _, perm = torch.sort(expert_ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_ids.device)
    counts.index_add_(0, expert_ids, torch.ones_like(expert_ids, dtype=torch.int64))
    return perm, counts


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: the local shard of an expert-parallel DTensor (an autograd
    view: the gradient flows back to the DTensor), else the parameter itself."""
    return p.to_local() if isinstance(p, DTensor) else p


def expert_weight(module: nn.Module, gemm: ExpertGemm) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of one expert GEMM: the (E, out, in) weight (a view of a transposed
    parameter) and the (E, out) bias or None; under expert parallelism this rank's experts only."""
    w = _local(module._parameters[gemm.weight])
    return (w.transpose(1, 2) if gemm.transposed else w), (None if gemm.bias is None else _local(module._parameters[gemm.bias]))


class ExpertsRouting:
    """Mixin placed *before* an experts module's own class: its `forward` runs the module's
    routing (one implementation per layout, below) and every expert GEMM through
    `_expert_gemm(index, x_sorted, counts)`, which subclasses define: `QuantizedExperts`
    (`tq.convert`, quantized per expert) and the fake-quantized experts of `tq.calibrate`.

    The forward is routing -> `compute_local` (the experts' MLP on tokens sorted by expert) ->
    combining. Under expert parallelism (`tq.distributed.expert_parallel`), `tq_dispatch` sends
    each token to the rank holding its expert before `compute_local` and brings the result back
    after it; the 3-D weights are then DTensors sharded on dim 0, and `compute_local` uses this
    rank's experts (`expert_weight`)."""

    tq_experts_layout: ExpertsLayout
    # Set by tq.distributed.expert_parallel: an object with `dispatch(x, counts) -> (x, counts, state)`
    # (tokens sorted by global expert -> this rank's experts' tokens, sorted by local expert) and
    # `combine(y, state)` (the way back). None: every expert is local.
    tq_dispatch = None
    tq_mixin_first = True  # the generated class puts this class before the model's own (tqcompile.surgery.classes)

    def _expert_gemm(self, index: int, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """GEMM `index` of the layout on tokens `x` sorted by (local) expert, `counts` (int64) per expert."""
        raise NotImplementedError

    def compute_local(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' MLP on tokens `x` sorted by this rank's experts, `counts` (int64) per expert:
        the part of the forward between the expert-parallel all-to-alls, which runs no collective."""
        if self.tq_experts_layout.style == "hf":
            h = self._expert_gemm(0, x, counts)
            h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
            out = self._expert_gemm(1, h, counts)
            return self.post_expert_norm(out) if getattr(self, "has_post_expert_norm", False) else out
        # torchtitan's GroupedExperts: w2(silu(w1 x) * w3 x) per expert.
        h = torch.nn.functional.silu(self._expert_gemm(0, x, counts)) * self._expert_gemm(1, x, counts)
        return self._expert_gemm(2, h, counts)

    def _sorted_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`compute_local` on tokens sorted by global expert, through `tq_dispatch` where experts are sharded."""
        if self.tq_dispatch is None:
            return self.compute_local(x, counts)
        x_local, counts_local, state = self.tq_dispatch.dispatch(x, counts)
        return self.tq_dispatch.combine(self.compute_local(x_local, counts_local), state)

    def forward(self, *args, **kwargs):
        if self.tq_experts_layout.style == "hf":
            return _hf_forward(self, *args, **kwargs)
        return _torchtitan_forward(self, *args, **kwargs)


class QuantizedExperts(ExpertsRouting, _AmaxHistoryOwner, QuantizedModule):
    """Mixin `tq.convert` puts *before* an experts module's own class (see the module docstring):
    its `forward` runs the module's routing with every expert GEMM quantized per expert.

    Delayed scaling (`fp8_delayed`): each GEMM keeps fp32 histories of shape
    (amax_history_len, E), one window per expert, as persistent buffers
    ``amax_history_<weight>_{input,weight,grad}`` (a checkpoint without them loads, with zeros:
    `tqcompile.nn.histories`). Other recipes add no buffer: the `state_dict` is the float model's.
    """

    amax_group_name: str | None

    def _init_quantized(self, recipe: Recipe, layout: ExpertsLayout) -> None:
        self.recipe = recipe
        self.amax_group_name = None
        self.tq_experts_layout = layout
        for g in layout.gemms:
            w = self._parameters[g.weight]
            for operand in _OPERANDS:
                self._register_amax_history(f"{HISTORY_PREFIX}{g.weight}_{operand}", recipe.amax_history_len, w.device, w.shape[0])

    def _expert_gemm(self, index: int, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        g = self.tq_experts_layout.gemms[index]
        w, bias = expert_weight(self, g)
        histories, update = None, True
        if self.recipe.amax_history_len:  # read `training` only here: Dynamo guards on it for delayed scaling only
            histories = tuple(_local(self._buffers[f"{HISTORY_PREFIX}{g.weight}_{operand}"]) for operand in _OPERANDS)
            update = self.training
        return grouped_linear(
            x, counts, w, bias, self.recipe, amax_group=self.amax_group_name, amax_histories=histories, update_amax_histories=update
        )


def _hf_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped experts forward (`integrations.moe.grouped_mm_experts_forward`): the
    same routing (sort the (token, k) pairs by expert, weight, unpermute, sum over the top-k), with
    every expert GEMM through `_expert_gemm`."""
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = self._parameters[self.tq_experts_layout.gemms[0].weight].shape[0]  # global, also under EP
    perm, counts = sort_by_expert(top_k_index.reshape(-1), num_experts)
    out = self._sorted_experts(hidden_states[perm // top_k], counts)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    # Back to (token, k) order, then the sum over the k experts of each token.
    unsorted = torch.empty_like(out).index_copy_(0, perm, out)
    return unsorted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _torchtitan_forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """torchtitan's `GroupedExperts` forward: ``w2(silu(w1 x) * w3 x)`` per expert, tokens sorted."""
    return self._sorted_experts(x, num_tokens_per_expert.to(torch.int64)).to(x.dtype)
