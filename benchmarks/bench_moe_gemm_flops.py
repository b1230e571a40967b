"""How much of a MoE training step's GEMM work runs quantized: the GEMM FLOPs of one forward +
backward of a Hugging Face MoE model (built from a config: no hub access), counted op by op, as
float (aten mm/addmm/bmm/`_grouped_mm`, transformers' grouped-mm fallback, tqcompile's
high-precision grouped wgrad) or quantized (`tqcompile::gemm_tn`, `tqcompile::grouped_gemm_tn`).
Attention's score/value products are counted as float only where the model runs them as
matmuls (GPT-OSS's eager attention with sinks); SDPA kernels are not counted. Prints a table.

    python benchmarks/bench_moe_gemm_flops.py                       # Mixtral-shaped, fp8_tensorwise
    python benchmarks/bench_moe_gemm_flops.py --model qwen3_moe --recipe mxfp8
"""

from __future__ import annotations

import argparse
import collections
import math
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tqcompile as tq


def _flops(name: str, args, out) -> tuple[str, int] | None:
    """(kind, FLOPs) of a GEMM op, or None for any other op."""
    if name in ("aten.mm", "aten.bmm"):
        return "float", 2 * out.numel() * args[0].shape[-1]
    if name in ("aten.addmm", "aten.baddbmm"):
        return "float", 2 * out.numel() * args[1].shape[-1]
    if name == "aten._grouped_mm":
        # (T, K) x (E, K, N) -> (T, N): 2 T K N; (N, T) x (T, K) -> (E, N, K): 2 N T K.
        a = args[0]
        return "float", 2 * out.shape[-2] * a.shape[-1] * out.shape[-1]
    if name == "transformers.grouped_mm_fallback":
        return "float", 2 * out.numel() * args[0].shape[-1]
    if name == "transformers.grouped_mm_fallback_backward":
        return "float", 4 * args[0].numel() * args[1].shape[-1]
    if name == "tqcompile.grouped_mm_wgrad":
        return "float", 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
    if name == "tqcompile.gemm_tn":
        k = args[3].logical_shape(args[0].shape)[-1]
        return "quantized", 2 * out.numel() * k
    if name == "tqcompile.grouped_gemm_tn":
        wgrad = args[9]
        if wgrad:  # out (E, N, K); the reduction runs over the routed tokens
            return "quantized", 2 * out.shape[1] * out.shape[2] * int(args[8][-1])
        k = args[3].logical_shape(args[0].shape)[-1]
        return "quantized", 2 * out.numel() * k
    return None


class FlopCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) else None
        got = None if first is None else _flops(f"{func.namespace}.{func._opname}", args, first)
        if got is not None:
            self.flops[got[0]] += got[1]
        return out


def build(kind: str, *, hidden: int = 256, intermediate: int = 896, experts: int = 8, vocab: int = 1024) -> torch.nn.Module:
    """A `kind` ("mixtral", "qwen3_moe", "gpt_oss") *ForCausalLM from its config: 2 layers, 4
    heads, top-2 routing, seeded, in training mode (also used by bench_moe_training.py)."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
    )
    cfg = {
        "mixtral": lambda: transformers.MixtralConfig(num_local_experts=experts, **common),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            num_experts=experts, moe_intermediate_size=intermediate, head_dim=hidden // 4, **common
        ),
        "gpt_oss": lambda: transformers.GptOssConfig(num_local_experts=experts, head_dim=hidden // 4, **common),
    }[kind]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).train()


def step_flops(model: torch.nn.Module) -> collections.Counter[str]:
    ids = torch.randint(0, 1024, (2, 128), generator=torch.Generator().manual_seed(0))
    with FlopCount() as counter:
        model(ids, labels=ids).loss.backward()
    return counter.flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mixtral", choices=("mixtral", "qwen3_moe", "gpt_oss"))
    parser.add_argument("--recipe", default="fp8_tensorwise", choices=tq.recipes.RECIPES)
    args = parser.parse_args()
    rows = []
    filters = {
        "float": None,
        f"{args.recipe}, experts float (as before)": lambda m, fqn: "lm_head" not in fqn and not fqn.endswith("experts"),
        f"{args.recipe}, lm_head float": lambda m, fqn: "lm_head" not in fqn,
        f"{args.recipe}, all": lambda m, fqn: True,
    }
    for label, filter_fn in filters.items():
        model = build(args.model)
        if filter_fn is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", tq.nn.ConversionWarning)
                tq.convert(model, tq.recipes.get(args.recipe), filter_fn=filter_fn)
        f = step_flops(model)
        total = f["float"] + f["quantized"]
        rows.append((label, total / 1e9, f["quantized"] / 1e9, f["float"] / 1e9, 100 * f["quantized"] / total))
    print(f"GEMM FLOPs of one training step (forward + backward), {args.model}, torch {torch.__version__}")
    print(f"{'run':<44} {'total GF':>9} {'quantized GF':>13} {'float GF':>9} {'quantized %':>12}")
    for label, total, q, fl, pct in rows:
        print(f"{label:<44} {total:>9.3f} {q:>13.3f} {fl:>9.3f} {pct:>11.1f}%")
    assert math.isclose(rows[0][1], rows[-1][1], rel_tol=0.02), "the converted step should do the same GEMM work"


if __name__ == "__main__":
    main()
