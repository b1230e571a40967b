"""One training step of a small Llama-style model per recipe, eager and compiled, against the
high-precision model and torchao's float8 training (when torchao is installed).

The model: `--blocks` pre-norm blocks (RMSNorm, causal attention through SDPA, SwiGLU MLP) of width
`--dim` and MLP width `--ffn`, fp32 weights and activations, batch `--batch` x `--seq` tokens. A
step is forward, backward and an SGD update. Every configuration runs `--runs` times interleaved
(so a busy machine slows each of them alike) and the table prints the median of the per-run
medians, plus the cold compile time (the first step, compile included) and the SQNR of the first
step's output against the high-precision model, so speed is compared at equal numerics.

The "x torchao" column divides each quantized row's step time by torchao's with the same backend.
Every variant is compiled in this one process. That once hid a bug: inductor caches its
decomposition table at its first compile in a process, and tq registered its decompositions
later (when its first op was traced), so tq's inductor graph kept every quantize and GEMM opaque
after the fp32 or torchao model had been compiled first (481 ms against 295 ms alone: the 1.81x
once reported in docs/performance.md). `tqcompile.ops.inductor` now drops that cached copy when it
registers; compile_tests/test_inductor_fusion.py compiles another model first to hold it.

    python benchmarks/bench_step.py                      # CPU: D=256, F=768, 4 blocks, batch 8x128
    python benchmarks/bench_step.py --recipes fp8_tensorwise fp8_rowwise --runs 5
    python benchmarks/bench_step.py --backends eager aot_eager inductor
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import tqcompile as tq


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, dim: int, ffn: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w13 = nn.Linear(dim, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, dim: int, ffn: int, blocks: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim, ffn, heads) for _ in range(blocks)))
        self.norm = RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x))


def _variants(base: nn.Module, recipes: list[str]) -> list[tuple[str, nn.Module]]:
    out = [("fp32 (no quantization)", base)]
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        out.append(
            (
                "torchao float8 tensorwise",
                convert_to_float8_training(copy.deepcopy(base), config=Float8LinearConfig(emulate=True)),
            )
        )
    except ImportError as e:
        print(f"torchao is not importable ({e}): its rows are skipped")
    for name in recipes:
        out.append((f"tq {name}", tq.convert(copy.deepcopy(base), tq.recipes.get(name))))
    return out


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    return 10 * math.log10(ref.pow(2).sum().item() / max((ref - x).pow(2).sum().item(), 1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--recipes", nargs="+", default=["fp8_tensorwise"], choices=list(tq.recipes.RECIPES))
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor"], choices=["eager", "aot_eager", "inductor"])
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs; the table shows the median")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after 2 warm-up steps)")
    args = parser.parse_args()

    # Every variant compiles the same Block.forward code object once per backend: without a higher
    # limit the later variants hit Dynamo's recompile limit (8) and silently run eagerly.
    torch._dynamo.config.recompile_limit = 64
    torch.manual_seed(0)
    base = Model(args.dim, args.ffn, args.blocks, args.heads)
    x = torch.randn(args.batch, args.seq, args.dim)
    target = torch.randn(args.batch, args.seq, args.dim)
    variants = _variants(base, args.recipes)

    def make_step(model: nn.Module, backend: str):
        fwd = model if backend == "eager" else torch.compile(model, fullgraph=True, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step() -> torch.Tensor:
            out = fwd(x)
            F.mse_loss(out, target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out

        return step

    ref_out = base(x).detach()
    rows: dict[tuple[str, str], dict] = {}
    runners = []
    for label, model in variants:
        for backend in args.backends:
            m = copy.deepcopy(model)
            step = make_step(m, backend)
            t0 = time.perf_counter()
            out = step()  # the first step compiles
            cold = time.perf_counter() - t0
            rows[(label, backend)] = {"cold": cold, "ms": [], "sqnr": _sqnr(ref_out, out.detach())}
            step()
            runners.append(((label, backend), step))

    for _ in range(args.runs):
        for key, step in runners:
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
            rows[key]["ms"].append(statistics.median(times))

    print(
        f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; D={args.dim} F={args.ffn} blocks={args.blocks} batch {args.batch}x{args.seq}, fp32"
    )
    print(f"median of {args.runs} interleaved runs of {args.steps} steps (forward + backward + SGD)")
    header = f"{'model':<28} {'backend':<10} {'step ms':>9} {'x torchao':>9} {'cold s':>8} {'SQNR dB':>8}"
    print(header)
    print("-" * len(header))
    for (label, backend), r in rows.items():
        ms = statistics.median(r["ms"])
        ao = rows.get(("torchao float8 tensorwise", backend))
        vs = f"{ms / statistics.median(ao['ms']):.2f}" if ao is not None and label.startswith("tq ") else ""
        print(f"{label:<28} {backend:<10} {ms:>9.1f} {vs:>9} {r['cold']:>8.1f} {r['sqnr']:>8.2f}")


if __name__ == "__main__":
    main()
