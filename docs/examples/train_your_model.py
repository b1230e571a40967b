"""Quantized training of a model you wrote, compiled with the default backend (inductor), on CPU.

Run:  python docs/examples/train_your_model.py [recipe]     (default: mxfp8; any of tq.recipes.RECIPES)

The model below is plain PyTorch: a one-block causal transformer written here, not one of
tqcompile's. `tq.convert` swaps its nn.Linear layers for quantized ones in place (the output
head stays high precision), `torch.compile(fullgraph=True)` compiles forward and backward with
inductor, the default backend, which generates C++ on a CPU and Triton on a GPU, and AdamW
steps the weights. The task, predicting the next number of a counting sequence, is learnt in a
few steps, so the printed loss falls from about ln 256 = 5.55 at once (noisily: one random batch
a step). tests/test_without_triton.py runs this file on CPU with Triton made unimportable.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import tqcompile as tq

VOCAB, D_MODEL, N_HEAD, SEQ, BATCH = 256, 128, 4, 64, 2  # 2 x 64 = 128 tokens: every recipe's blocks divide it


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, in the style of nanoGPT."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, N_HEAD, d // N_HEAD).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(SEQ, D_MODEL))
        self.block = Block()
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(tokens) + self.pos)
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), targets.flatten())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences from random starts: the target is each token plus one (mod 256)."""
    seq = (torch.randint(0, VOCAB, (BATCH, 1)) + torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    recipe = tq.recipes.get(sys.argv[1] if len(sys.argv) > 1 else "mxfp8")
    torch.manual_seed(0)
    model = TinyLM()
    # The head's output is the loss's input: common practice keeps it in high precision.
    tq.convert(model, recipe, filter_fn=lambda module, fqn: fqn != "head")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = torch.compile(model, fullgraph=True)  # the default backend: inductor, on CPU as on GPU
    losses = []
    for i in range(8):
        loss = step(*batch())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"{recipe.name} step {i}: loss {losses[-1]:.3f}", flush=True)
    last = sum(losses[-3:]) / 3  # a mean: one batch's loss is noisy (measured: nvfp4's last step rose 1.3 nats)
    assert last < losses[0] - 1.0, f"the mean of the last 3 losses should be more than 1 nat below the first: {losses}"


if __name__ == "__main__":
    main()
