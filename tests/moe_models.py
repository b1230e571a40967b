"""MoE models the experts tests run on: tiny Hugging Face MoE models built from configs, and a
torchtitan-style MoE written here (the shape of torchtitan's `GroupedExperts`: 3-D w1/w2/w3 run
through `torch._grouped_mm` on tokens sorted by expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HF_MOE_KINDS = ("mixtral", "qwen3_moe", "gpt_oss")


def tiny_hf_moe(
    kind: str,
    *,
    seed: int = 0,
    num_experts: int = 4,
    hidden: int = 64,
    layers: int = 2,
    intermediate: int = 64,
    experts_implementation: str | None = None,
    **overrides,
) -> nn.Module:
    """A tiny `*ForCausalLM` of `kind` (see `HF_MOE_KINDS`) built from its config, seeded, in eval
    mode; `experts_implementation` as transformers takes it ("grouped_mm", the default, or "eager")."""
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=num_experts, num_experts_per_tok=2, **common, **overrides)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=intermediate, head_dim=16, **common, **overrides
        )
    elif kind == "gpt_oss":
        cfg = transformers.GptOssConfig(num_local_experts=num_experts, num_experts_per_tok=2, head_dim=16, **common, **overrides)
    else:
        raise ValueError(f"tiny_hf_moe: kind={kind!r}; allowed: {HF_MOE_KINDS}")
    torch.manual_seed(seed)
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = transformers.AutoModelForCausalLM.from_config(cfg, **kwargs)
    if kind == "gpt_oss":
        # GPT-OSS initialises its expert biases and router to zeros: give them values, so that a
        # test sees biases applied and tokens routed unevenly.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "bias" in name or "router" in name:
                    p.normal_(0, 0.02)
    return model.eval()


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module (its own 3-D parameters) in `model`."""
    return [(n, m) for n, m in model.named_modules() if any(p.dim() == 3 for p in m.parameters(recurse=False))]


class GroupedExperts(nn.Module):
    """torchtitan's `GroupedExperts` shape: w1/w3 (E, hidden, dim), w2 (E, dim, hidden); tokens sorted by expert."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) / hidden_dim**0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


class TitanMoE(nn.Module):
    """A torchtitan-style MoE layer: a router (`nn.Linear`), top-k, tokens sorted by expert, `GroupedExperts`."""

    def __init__(self, dim: int = 64, hidden_dim: int = 128, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = self.router(x).softmax(-1)
        top_w, top_i = scores.topk(self.top_k, dim=-1)
        flat = top_i.reshape(-1)
        perm = torch.sort(flat, stable=True)[1]
        counts = torch.zeros(self.experts.num_experts, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        out = self.experts(x[perm // self.top_k], counts) * top_w.reshape(-1)[perm].unsqueeze(-1)
        combined = torch.zeros_like(x).index_add_(0, perm // self.top_k, out.to(x.dtype))
        return combined.reshape(shape)


class TitanMoEModel(nn.Module):
    """Two residual MoE blocks between an input and an output projection (the test's toy model)."""

    def __init__(self, dim: int = 64, num_experts: int = 4, layers: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(TitanMoE(dim, 2 * dim, num_experts) for _ in range(layers))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def moe_batch(kind: str, batch: int, seq: int, hidden: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for a model of `kind` ("titan": `TitanMoEModel`, random vectors; else an
    HF causal LM of `tiny_hf_moe`: token ids and the next tokens), seeded."""
    g = torch.Generator().manual_seed(1)
    if kind == "titan":
        return torch.randn(batch, seq, hidden, generator=g), torch.randn(batch, seq, hidden, generator=g)
    ids = torch.randint(0, 128, (batch, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def moe_loss(model: nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor, *, tokens: int | None = None) -> torch.Tensor:
    """The loss of `model` on a `moe_batch`: MSE (titan) or next-token cross entropy, in fp32,
    averaged over the batch's tokens, or summed over them and divided by `tokens` (a data-parallel
    rank's part of the loss of a global batch of that many tokens)."""
    out = model(x) if kind == "titan" else model(input_ids=x, use_cache=False).logits
    out, y = (out.float(), y) if kind == "titan" else (out.flatten(0, 1).float(), y.flatten())
    loss = F.mse_loss if kind == "titan" else F.cross_entropy
    return loss(out, y) if tokens is None else loss(out, y, reduction="sum") / tokens
