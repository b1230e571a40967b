"""A small GPT for the demo and the training tests, in the style of nanoGPT / gpt-fast.

Byte-level (vocab 256, no tokenizer); blocks of RMSNorm -> causal self-attention -> RMSNorm ->
MLP, pre-norm residuals; optionally an expert-choice MoE MLP. Every dimension is a multiple of
128, so every recipe (the 128x128 weight blocks of fp8_blockwise included) can serve every
quantized layer, as long as the token count per step (batch * seq_len) is a multiple of 128 too.

`quantize_model` converts the linears of the blocks (attention, MLP, MoE experts) with
`tq.convert` and keeps the router and the lm_head in high precision: the lm_head's output
feeds the loss directly and the router's tiny GEMM decides token routing, so both are kept
precise in common FP8/FP4 training practice, and they cost little.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

import tqcompile as tq
from tqcompile.nn.grouped import grouped_unsupported_reason

__all__ = ["GPTConfig", "GPT", "Experts", "MoE", "quantize_model", "is_quantized_layer"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape. `n_experts` 0 gives a dense MLP; > 0 an expert-choice MoE MLP in which each
    expert takes `capacity_factor * tokens / n_experts` tokens per step (2.0: each token goes to two
    experts on average, as in expert-choice routing's usual setting). With fp8_blockwise that
    per-expert count must be a multiple of 128 too."""

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    mlp_hidden: int = 512
    n_experts: int = 0
    capacity_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: d_model={self.d_model} must be a multiple of n_head={self.n_head}")


class Experts(nn.Module):
    """`n` expert weights (n, out_features, in_features) applied to tokens grouped per expert
    (n, tokens, in_features), in high precision.

    Same attributes and state_dict as `tq.nn.GroupedLinear` without bias: the converter
    registered below turns it into one, so `tq.convert` quantizes the experts like any linear.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("eti,eoi->eto", x, self.weight.to(x.dtype))


def _experts_unsupported_reason(module: Experts, recipe: tq.Recipe) -> str | None:
    return grouped_unsupported_reason(recipe, module.in_features, module.out_features, histories=True)


@tq.nn.register_converter(Experts, unsupported_reason=_experts_unsupported_reason)
def _convert_experts(module: Experts, recipe: tq.Recipe) -> None:
    module.__class__ = tq.nn.GroupedLinear
    module._init_quantized(recipe)


class MoE(nn.Module):
    """Expert-choice MoE MLP: each expert picks its top-C tokens by router score.

    Every shape is static (C comes from the token count), so it compiles with
    `fullgraph=True` and never recompiles; tokens no expert picks pass through the residual only.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.w_in = Experts(cfg.n_experts, cfg.d_model, cfg.mlp_hidden)
        self.w_out = Experts(cfg.n_experts, cfg.mlp_hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n_experts = self.w_in.num_experts
        capacity = int(self.capacity_factor * x.shape[0] / n_experts)
        scores = self.router(x).float().softmax(-1)  # (T, E)
        gate, idx = torch.topk(scores.t(), capacity, dim=-1)  # (E, C): each expert's tokens
        h = self.w_out(F.gelu(self.w_in(x[idx])))  # (E, C, d)
        h = h * gate.unsqueeze(-1).to(h.dtype)
        out = torch.zeros_like(x, dtype=h.dtype).index_add_(0, idx.flatten(), h.flatten(0, 1))
        return out.reshape(shape).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        # -1, not d // n_head: under tensor parallelism qkv holds this rank's heads only (n_head local).
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """`GPT(cfg)(tokens)` gives logits (batch, seq, vocab); `GPT(cfg)(tokens, targets)` the mean
    cross-entropy loss (fp32), so that one compiled call covers the model and its loss.

    Example:
        >>> model = GPT(GPTConfig())
        >>> loss = model(torch.randint(0, 256, (4, 128)), torch.randint(0, 256, (4, 128)))
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layer)."""
        proj_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:  # RMSNorm weights
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=proj_std if name.endswith(("proj.weight", "w_out.weight")) else 0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def is_quantized_layer(module: nn.Module, fqn: str) -> bool:
    """`filter_fn` for `tq.convert`: True for the layers the recipe quantizes (the blocks' linears
    and experts), False for the lm_head and MoE routers, which stay in high precision."""
    return not fqn.endswith(("lm_head", "router"))


def quantize_model(model: GPT, recipe: tq.Recipe) -> GPT:
    """Convert `model` in place to `recipe` (blocks only; see the module docstring) and return it.

    Raises ValueError, before changing anything, if the recipe cannot serve every layer it should
    quantize: a demo run is only meaningful with all of them in the recipe's formats."""
    skipped = [p for p in tq.nn.conversion_plan(model, recipe, filter_fn=is_quantized_layer) if p.action == "skip"]
    if skipped:
        by_reason: dict[str, list[str]] = {}  # one reason usually covers many layers: say it once
        for p in skipped:
            by_reason.setdefault(p.reason, []).append(p.name)
        raise ValueError(
            f"recipe {recipe.name!r} cannot serve "
            + "; ".join(
                f"{len(names)} layer{'s' if len(names) > 1 else ''} ({', '.join(names)}): {reason}"
                for reason, names in by_reason.items()
            )
        )
    return tq.convert(model, recipe, filter_fn=is_quantized_layer)
