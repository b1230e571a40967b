"""Loss of a few training steps of tiny Hugging Face MoE models (built from configs) per recipe,
against the float run of the same model and data: the gap after each step. Every linear layer and
every experts module is converted (`lm_head` kept float); routers stay float. Prints a table.

    python benchmarks/bench_moe_training.py                 # mixtral, qwen3_moe, gpt_oss; 8 steps
    python benchmarks/bench_moe_training.py --models mixtral --steps 20
"""

from __future__ import annotations

import argparse
import warnings

import torch
from bench_moe_gemm_flops import build  # the same models, smaller

import tqcompile as tq


def losses(kind: str, recipe: str | None, steps: int) -> list[float]:
    model = build(kind, hidden=128, intermediate=128, experts=4, vocab=256)
    if recipe is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tq.nn.ConversionWarning)
            tq.convert(model, tq.recipes.get(recipe), filter_fn=lambda m, fqn: "lm_head" not in fqn)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    # A learnable stream: repeated random phrases.
    phrases = torch.randint(0, 256, (8, 16), generator=g)
    out = []
    for _ in range(steps):
        ids = phrases[torch.randint(0, 8, (4, 8), generator=g)].reshape(4, 128)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mixtral,qwen3_moe,gpt_oss")
    parser.add_argument("--recipes", default=",".join(tq.recipes.RECIPES))
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    print(f"Training loss, {args.steps} AdamW steps, 4 x 128 tokens; torch {torch.__version__}, CPU")
    print(f"{'model':<10} {'recipe':<22} {'first':>7} {'last':>7} {'float last':>10} {'max |gap| / float':>18}")
    for kind in args.models.split(","):
        ref = losses(kind, None, args.steps)
        print(f"{kind:<10} {'float':<22} {ref[0]:>7.4f} {ref[-1]:>7.4f} {ref[-1]:>10.4f} {'':>18}")
        for recipe in args.recipes.split(","):
            got = losses(kind, recipe, args.steps)
            gap = max(abs(a - b) / b for a, b in zip(got, ref))
            print(f"{kind:<10} {recipe:<22} {got[0]:>7.4f} {got[-1]:>7.4f} {ref[-1]:>10.4f} {100 * gap:>17.2f}%")


if __name__ == "__main__":
    main()
