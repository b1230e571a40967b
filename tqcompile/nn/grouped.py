"""`tq.nn.GroupedLinear`: MoE experts, one quantized linear per expert, each with its own scales.

Two ways in:

- dense (E, C, in) tokens (a fixed capacity per expert, as expert-choice routing gives): one
  `tq.nn.linear` per expert, E static calls;
- (T, in) tokens sorted by expert with `m_splits`, the per-expert token counts, as an int64
  tensor (what token-choice routing computes on the device each step) or a list of ints. The
  counts become the segment ends (`torch._grouped_mm`'s `offs`) and every GEMM is one grouped op
  (`tqcompile.ops.grouped_gemm`) whose output shape depends on T only, so a compiled model does
  not recompile when the routing changes. (A list is a Python constant to torch.compile: each new
  list recompiles. Pass a tensor.)

The grouped path quantizes each expert's tokens with their own scales (per-expert amaxes by a
scatter_reduce over token -> expert ids, all-reduced over `amax_group` as an (E,) vector), each
expert's weight with its own, and pads each expert's tokens to the block of the wgrad operands
inside the op (see `tqcompile.ops.grouped_gemm` for the layout and its cost), so uneven counts
work with every recipe. Its results equal the per-expert loop's bit for bit wherever the loop can
run (stochastic rounding aside: one random stream per layer instead of one per expert).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from tqcompile import ops
from tqcompile._opaque import TORCH_MINOR
from tqcompile.api import SUPPORTED_DTYPES
from tqcompile.groups import all_reduce_amax
from tqcompile.nn.functional import linear
from tqcompile.nn.quantized_linear import _check_recipe, _Quantized
from tqcompile.ops import grouped_gemm as gops
from tqcompile.ops.errors import raise_error, shape_str
from tqcompile.quantizers import Granularity, Quantizer
from tqcompile.recipes import Recipe
from tqcompile.tensor import GroupedQuantizedTensor

__all__ = ["GroupedLinear", "grouped_linear", "grouped_unsupported_reason", "wrong_counts_length"]

_TOKEN_OPERANDS = ("fprop_input", "dgrad_grad", "wgrad_grad", "wgrad_input")


def grouped_unsupported_reason(recipe: Recipe, in_features: int, out_features: int, *, histories: bool = False) -> str | None:
    """Why `recipe` cannot serve a GroupedLinear of these sizes (None if it can); `histories`: the
    caller owns per-expert delayed-scaling histories (converted experts modules do)."""
    if recipe.amax_history_len and not histories:
        return (
            "it uses delayed scaling, whose one amax history per layer per-expert scales cannot use; use a current-scaling recipe"
        )
    for field in _TOKEN_OPERANDS:
        q = getattr(recipe, field)
        if q is None:
            continue
        gran, axis, _ = q.layout()
        if gran is Granularity.BLOCKWISE_2D:
            return f"{field}={q!r}: 2-D blocks on a token operand would mix tokens of different experts; use 1-D blocks"
        if gran is Granularity.ROWWISE and axis not in (-1, 1):
            return f"{field}={q!r}: a token operand's rowwise scales must run along the reduction dim (axis=-1)"
    return recipe.unsupported_reason(in_features, out_features)


@dataclasses.dataclass(frozen=True)
class _Grouped:
    """A grouped quantized operand (see `tqcompile.ops.grouped_gemm` for the layouts)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor | None  # per-expert (group-reduced) amax, where the quantizer uses one
    quantizer: Quantizer

    def args(self) -> tuple:
        """(payload, scale_inv, amax, quantizer) for `grouped_gemm_tn`: a global scale (NVFP4)
        dequantizes with the amax; FP8/INT tensorwise scales are already per expert."""
        return self.data, self.scale_inv, self.amax if self.quantizer.has_global_scale() else None, self.quantizer


def _quantize_grouped(
    x: torch.Tensor,
    q: Quantizer,
    ends: torch.Tensor,
    *,
    columnwise: bool,
    amax_group: str | None,
    like: _Grouped | None = None,
    history: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> _Grouped:
    """Quantize grouped tokens; `like`, an operand quantized from the same `x`, lends its
    per-expert amax when neither quantizer transforms (the amax is then the same). Delayed
    scaling: `history` (L, E) gives the amax to scale with (and is rolled: pass a clone where it
    must stay), or `amax` is that already decided."""
    if amax is None and q.uses_tensor_amax():
        if like is not None and like.amax is not None and not (q.hadamard_transformed() or like.quantizer.hadamard_transformed()):
            amax = like.amax
        else:
            amax = gops.grouped_amax(x, q, ends, columnwise)
            if amax_group is not None:
                amax = all_reduce_amax(amax, amax_group)
            if history is not None:
                amax = ops.amax_history_update(history, amax)
    seed = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64, device=x.device) if q.needs_seed() else None
    data, scale_inv = gops.grouped_quantize(x, q, ends, amax, seed, columnwise)
    return _Grouped(data, scale_inv, amax, q)


def quantize_expert_weight(
    weight: torch.Tensor, q: Quantizer, *, dgrad: bool, history: torch.Tensor | None = None, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(payload, scale_inv, amax) of the (E, N, K) expert weight as the grouped GEMMs read it, each
    expert with its own scales: fprop's (E*N, K) operand, or with `dgrad` that of the per-expert
    transposes, (E*K, N). Experts are quantized independently, so quantizing a slice of experts
    (an FSDP2 shard on dim 0) gives that slice of the whole's result. `history` / `amax`: delayed
    scaling's (`_quantize_grouped`)."""
    e, n, k = weight.shape
    w = weight.transpose(1, 2) if dgrad else weight
    rows = k if dgrad else n
    ends = gops.equal_ends(e, rows, weight.device)
    g = _quantize_grouped(w.reshape(e * rows, -1), q, ends, columnwise=False, amax_group=None, history=history, amax=amax)
    return g.data, g.scale_inv, g.amax


def _weight_operand(weight: torch.Tensor, q: Quantizer, *, dgrad: bool, history=None, amax=None) -> _Grouped:
    """fprop's (or dgrad's) grouped operand of the (E, N, K) weight: quantized here, or, for a weight
    FSDP2 all-gathered quantized (a `GroupedQuantizedTensor`), its rowwise (columnwise) usage as it is."""
    if isinstance(weight, GroupedQuantizedTensor):
        return _Grouped(*weight.usage(dgrad), weight.quantizer)
    return _Grouped(*quantize_expert_weight(weight, q, dgrad=dgrad, history=history, amax=amax), q)


@dataclasses.dataclass(frozen=True)
class _GroupedCtx:
    recipe: Recipe
    amax_group: str | None
    input_dtype: torch.dtype
    wgrad_quantizer: Quantizer | None  # the saved input's quantizer (None: saved in high precision)
    has_bias: bool
    update_histories: bool  # delayed scaling: roll the histories in backward (False: eval mode)


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ends, recipe: Recipe, amax_group, backward: bool, update: bool, hist_x, hist_w, hist_dy):
        # hist_*: delayed scaling's (L, E) histories, or None. Forward scales from clones (as
        # tq.nn.linear does): backward rolls the real ones, so a recomputed forward rolls nothing twice.
        r = recipe
        next_x, next_w = (None, None) if hist_x is None else (hist_x.clone(), hist_w.clone())
        qx = _quantize_grouped(x, r.fprop_input, ends, columnwise=False, amax_group=amax_group, history=next_x)
        qw = _weight_operand(weight, r.fprop_weight, dgrad=False, history=next_w)
        y = gops.grouped_gemm_tn(*qx.args(), *qw.args(), ends, False, x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)[gops.expert_ids(ends, x.shape[0])]

        saved = []
        if backward and ctx.needs_input_grad[1] and r.wgrad_input is not None:
            qxt = _quantize_grouped(x, r.wgrad_input, ends, columnwise=True, amax_group=amax_group, like=qx)
            saved = list(qxt.args()[:3])
        elif backward and ctx.needs_input_grad[1]:
            saved = [x, None, None]
        else:
            saved = [None, None, None]
        # The weight is a parameter: keep it (no extra memory) and quantize its columnwise usage in
        # backward, as it would be in forward (weights are never stochastically rounded).
        delayed = None if next_x is None else torch.stack((next_x[0], next_w[0], qw.amax))  # current x, W; W's used amax
        ctx.save_for_backward(weight, ends, *saved, delayed)
        ctx.histories = (hist_x, hist_w, hist_dy)
        ctx.args = _GroupedCtx(r, amax_group, x.dtype, r.wgrad_input, bias is not None, update)
        return y

    @staticmethod
    def backward(ctx, dy):
        a: _GroupedCtx = ctx.args
        r = a.recipe
        weight, ends, saved_x, saved_scale_inv, saved_amax, delayed = ctx.saved_tensors
        hist_x, hist_w, hist_dy = ctx.histories
        if hist_dy is not None and not a.update_histories:
            hist_dy = hist_dy.clone()  # eval mode: scale dy from its history, leave the history as it is
        if hist_x is not None and a.update_histories:
            ops.amax_history_update(hist_x, delayed[0])
            ops.amax_history_update(hist_w, delayed[1])
        num_experts, n, k = weight.shape
        dx = dw = db = qdy = None
        if ctx.needs_input_grad[0] or hist_dy is not None:
            qdy = _quantize_grouped(dy, r.dgrad_grad, ends, columnwise=False, amax_group=a.amax_group, history=hist_dy)
        if ctx.needs_input_grad[0]:
            w_used = None if delayed is None else delayed[2]  # delayed scaling: the weight's forward scale
            qwt = _weight_operand(weight, r.dgrad_weight, dgrad=True, amax=w_used)
            dx = gops.grouped_gemm_tn(*qdy.args(), *qwt.args(), ends, False, a.input_dtype)
        if ctx.needs_input_grad[1]:
            if a.wgrad_quantizer is None:
                dw = gops.grouped_mm_wgrad(dy, saved_x, ends, weight.dtype)
            else:
                qdyt = _quantize_grouped(dy, r.wgrad_grad, ends, columnwise=True, amax_group=a.amax_group, like=qdy)
                dw = gops.grouped_gemm_tn(
                    *qdyt.args(), saved_x, saved_scale_inv, saved_amax, a.wgrad_quantizer, ends, True, weight.dtype
                )
        if a.has_bias and ctx.needs_input_grad[2]:
            ids = gops.expert_ids(ends, dy.shape[0])
            db = dy.new_zeros(num_experts, n, dtype=torch.float32).index_add_(0, ids, dy.float()).to(dy.dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None


# Whether Dynamo traces a message lambda given to `torch._check_value` (torch 2.13 does; 2.11
# failed with "Failed to convert args/kwargs to proxy ... NestedUserFunctionVariable").
_CHECK_MESSAGE_TRACES = TORCH_MINOR >= (2, 13)


def wrong_counts_length(counts: torch.Tensor, num_experts: int) -> bool:
    """Whether the per-expert token count tensor `counts` surely is not of shape (num_experts,).

    Compiled, counts from `torch.bincount(ids, minlength=E)` have a data-dependent (unbacked)
    length, on which a Python `if` cannot branch. Then this is False, and a `torch._check_value`
    tells the compiler that the length is E (the fake kernels then see E) and checks it when the
    compiled code runs. Its message is a constant: Dynamo (torch 2.13) drops a message whose
    lambda reads a variable, and cannot name the length it does not know."""
    if counts.dim() != 1 or guard_or_false(counts.shape[0] != num_experts):
        return True
    same = counts.shape[0] == num_experts
    if statically_known_true(same):  # a known length, found equal (torch 2.11's Dynamo cannot pass a constant and a lambda to the check)
        return False
    if _CHECK_MESSAGE_TRACES:
        torch._check_value(
            same,
            lambda: (
                "tq experts: a per-expert token count tensor (m_splits, num_tokens_per_expert) has a length other than "
                "the number of experts; allowed: one count per expert"
            ),
        )
    else:  # torch 2.11's Dynamo cannot pass the message's lambda: the check, with torch's own message
        torch._check_value(same)
    return False


def _splits_error(m_splits, num_experts: int, num_tokens: int, device: torch.device) -> tuple[type[Exception], str] | None:
    """(exception type, message) of the first problem with `m_splits`, or None (see `_ends_from`)."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dtype not in (torch.int64, torch.int32):
            return (
                TypeError,
                f"GroupedLinear: m_splits tensor has dtype {m_splits.dtype}; allowed: torch.int64 (or torch.int32) per-expert token counts",
            )
        if wrong_counts_length(m_splits, num_experts):
            shape = shape_str(m_splits.shape)
            return (
                ValueError,
                f"GroupedLinear: m_splits tensor has shape {shape}; expected ({num_experts},), one count per expert",
            )
        if m_splits.device != device:
            return (
                ValueError,
                f"GroupedLinear: m_splits is on {m_splits.device} but x is on {device}; put them on the same device",
            )
        if m_splits.device.type == "cpu" and not torch.compiler.is_compiling():
            # Free on a CPU tensor in eager mode; compiled, the op kernels check the same at run time.
            if bool((m_splits < 0).any()) or int(m_splits.sum()) != num_tokens:
                return (
                    ValueError,
                    f"GroupedLinear: m_splits={m_splits.tolist()} must be non-negative counts summing to x.shape[0]={num_tokens}",
                )
        return None
    if not isinstance(m_splits, Sequence) or not all(isinstance(m, int) and not isinstance(m, bool) for m in m_splits):
        return (
            TypeError,
            f"GroupedLinear: m_splits must be an int64 tensor or a list of ints, got {type(m_splits).__name__} {m_splits!r}",
        )
    if len(m_splits) != num_experts or sum(m_splits) != num_tokens or any(m < 0 for m in m_splits):
        return (
            ValueError,
            f"GroupedLinear: m_splits={list(m_splits)} must have {num_experts} entries summing to x.shape[0]={int(num_tokens)}",
        )
    return None


def _ends_from(m_splits, num_experts: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """The segment ends (int64, on `device`) of validated `m_splits` (see `_splits_error`)."""
    if isinstance(m_splits, torch.Tensor):
        return torch.cumsum(m_splits.to(torch.int64), 0)
    return torch.tensor(m_splits, dtype=torch.int64, device=device).cumsum(0)


def _grouped_input_error(
    x: torch.Tensor, m_splits, weight: torch.Tensor, recipe: Recipe, histories: bool = False
) -> tuple[type[Exception], str] | None:
    """(exception type, message) of the first problem with a grouped call, or None. Shapes in
    messages are plain ints (`shape_str`): under dynamic shapes a message must be a constant."""
    if x.dtype not in SUPPORTED_DTYPES:
        return (
            TypeError,
            f"grouped_linear: input dtype {x.dtype} is not supported; allowed: torch.float32, torch.bfloat16, torch.float16",
        )
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        return (
            ValueError,
            f"grouped_linear: expected x of shape (tokens, {weight.shape[-1]}) and weight (experts, out, in), "
            f"got x {shape_str(x.shape)} and weight {shape_str(weight.shape)}",
        )
    reason = grouped_unsupported_reason(recipe, weight.shape[2], weight.shape[1], histories=histories)
    if reason:
        if recipe.amax_history_len and not histories:
            reason += "; or pass amax_histories (converted experts modules own them)"
        return ValueError, f"grouped_linear: recipe {recipe.name!r} cannot serve this call: {reason}"
    return _splits_error(m_splits, weight.shape[0], x.shape[0], x.device)


def grouped_linear(
    x: torch.Tensor,
    m_splits: torch.Tensor | Sequence[int],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    *,
    amax_group: str | None = None,
    amax_histories: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    update_amax_histories: bool = True,
) -> torch.Tensor:
    """Per expert e, ``y_e = x_e @ weight[e].T + bias[e]`` for the (T, in) tokens `x` sorted by
    expert, ``m_splits[e]`` of them for expert e, every GEMM operand quantized per expert as
    `recipe` says (the grouped path of `tq.nn.GroupedLinear`).

    Args:
        x: (T, in_features) tokens, float32/bfloat16/float16, expert 0's first.
        m_splits: per-expert token counts: an int64 tensor of shape (E,) on x's device (no
            recompile when it changes) or a list of E ints.
        weight: (E, out_features, in_features); bias: (E, out_features) or None.
        amax_group: name of the group whose ranks share activation and gradient amaxes.
        amax_histories: delayed scaling (recipes with `amax_history_len`): the (input, weight,
            grad) histories, fp32 of shape (amax_history_len, E), one window per expert; rolled
            in backward when `update_amax_histories` (training), as `tq.nn.linear` rolls its own.
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"grouped_linear: recipe must be a tq.Recipe (e.g. tq.recipes.mxfp8()), got {type(recipe).__name__}")
    error = _grouped_input_error(x, m_splits, weight, recipe, amax_histories is not None)
    if error is not None:
        # Raises now in eager mode; under torch.compile, when the compiled code runs, so the user
        # sees this message rather than Dynamo's "Observed exception" (tqcompile.ops.errors).
        return raise_error(*error, like=x, shape=(*x.shape[:-1], weight.shape[1]))
    ends = _ends_from(m_splits, weight.shape[0], x.shape[0], x.device)
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    hists = amax_histories if recipe.amax_history_len and amax_histories is not None else (None, None, None)
    return _GroupedLinearFn.apply(x, weight, bias, ends, recipe, amax_group, backward, update_amax_histories, *hists)


class GroupedLinear(_Quantized, nn.Module):
    """MoE experts: one (out_features, in_features) weight per expert, each with its own scales.

    `forward(x, m_splits=None)` takes tokens grouped by expert, either as a dense
    (num_experts, tokens, in) tensor (a fixed capacity: one quantized linear per expert), or as
    (total_tokens, in) sorted by expert with `m_splits`, the per-expert token counts: an int64
    tensor (a compiled model then never recompiles for a new routing) or a list of ints. With
    `m_splits` every GEMM is one grouped op, and uneven counts work with every recipe (each
    expert's tokens are padded to the wgrad block inside).

    Example:
        >>> experts = tq.nn.GroupedLinear(4, 64, 128, recipe=tq.recipes.fp8_rowwise())
        >>> y = experts(torch.randn(4, 32, 64))                                  # (4, 32, 128)
        >>> y = experts(torch.randn(50, 64), torch.tensor([20, 0, 25, 5]))       # (50, 128)
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device=None,
        dtype=None,
        *,
        recipe: Recipe,
        amax_group=None,
    ):
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"GroupedLinear: num_experts={num_experts!r}; allowed: an int >= 1")
        _check_recipe(recipe, in_features, out_features, "tq.nn.GroupedLinear")
        reason = grouped_unsupported_reason(recipe, in_features, out_features, histories=True)
        if reason:
            raise ValueError(
                f"tq.nn.GroupedLinear: recipe {recipe.name!r} cannot serve {num_experts} experts {in_features} -> {out_features}: {reason}"
            )
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()
        self._init_quantized(recipe, amax_group)

    def _init_quantized(self, recipe: Recipe, amax_group=None) -> None:
        super()._init_quantized(recipe, amax_group)
        for name in self._amax_history_names():  # delayed scaling: one window per expert, (L, E)
            self._register_amax_history(name, recipe.amax_history_len, self.weight.device, self.num_experts)

    def reset_parameters(self) -> None:
        for e in range(self.num_experts):
            nn.init.kaiming_uniform_(self.weight[e], a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(self.in_features), 1 / math.sqrt(self.in_features))

    def forward(self, x: torch.Tensor, m_splits: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        if m_splits is not None:
            if x.dim() != 2 or x.shape[1] != self.in_features:
                message = (
                    f"GroupedLinear: with m_splits, expected x of shape (tokens, {self.in_features}), got {shape_str(x.shape)}"
                )
                return raise_error(ValueError, message, like=x, shape=(*x.shape[:-1], self.out_features))
            return self._grouped(x, m_splits)
        if x.dim() != 3 or x.shape[0] != self.num_experts:
            message = (
                f"GroupedLinear: expected x of shape ({self.num_experts}, tokens, {self.in_features}) or m_splits, "
                f"got {shape_str(x.shape)}"
            )
            return raise_error(ValueError, message, like=x, shape=(*x.shape[:-1], self.out_features))
        if self.recipe.amax_history_len:
            # Delayed scaling: the per-expert histories serve the grouped op; equal counts give
            # the per-expert loop's results.
            counts = torch.full((self.num_experts,), x.shape[1], dtype=torch.int64, device=x.device)
            return self._grouped(x.reshape(-1, x.shape[-1]), counts).view(*x.shape[:2], self.out_features)
        # One quantized linear per expert: every expert's weight and tokens get their own scales.
        outs = [
            linear(
                chunk, self.weight[e], None if self.bias is None else self.bias[e], self.recipe, amax_group=self.amax_group_name
            )
            for e, chunk in enumerate(x.unbind(0))
        ]
        return torch.stack(outs)

    def _grouped(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        hist = self._histories()
        update = self.training if hist is not None else True
        return grouped_linear(
            x, m_splits, self.weight, self.bias, self.recipe, amax_group=self.amax_group_name, amax_histories=hist, update_amax_histories=update
        )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe.name}"
