"""Inference speed and memory of deployed (packed) tq models against bf16 and torchao, in one process.

A Hugging Face Llama built from a config (hidden 1024, intermediate 2816, 4 layers, vocab 32000,
bf16, random weights: speed does not depend on them), one thread by default. For each variant:

- decode tok/s: batch 1, greedy, 32 new tokens after a 32-token prompt, HF StaticCache; eager and
  ``torch.compile(fullgraph=True)`` (inductor) of the one-token step;
- prefill tok/s: a forward of 4 x 256 tokens (no cache), eager and compiled;
- cold compile: seconds of the first compiled prefill and decode calls;
- weights: bytes the model's parameters and buffers hold (packed payloads and scales counted);
- KV cache B/token: the bytes the decode's static cache holds per token it can hold (all layers,
  keys and values; an FP8 KV cache, `tq.configs.fp8_kv_cache()` then `tq.compress`, holds codes);
- %BW: decode tok/s (compiled) as a fraction of the memory-bandwidth limit, the machine's read
  bandwidth (measured here, one thread: sum of a 512 MB tensor) over the bytes of weights a token reads.

Variants alternate in rounds (each round measures every variant once; the table shows medians).
The tq rows calibrate with `max` on random tokens and then `tq.compress` (the deployment form);
``--simulated`` adds the calibrated (fake-quantized) models as they were before compress.
torchao rows need torchao (0.18 measured): int8 weight-only, int8 dynamic-activation int8 weight,
int4 weight-only g128 (its CPU layout).

    python benchmarks/bench_inference.py [--threads 1] [--rounds 3] [--simulated] [--variants bf16,tq-int4] [--prompt 32]
    python benchmarks/bench_inference.py --model gpt_oss   # an MoE shaped as GPT-OSS (32 experts, top 4), experts quantized
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tqcompile as tq  # noqa: E402

PROMPT, NEW, PREFILL = 32, 32, (4, 256)


def build_model(kind: str = "llama"):
    from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig

    if kind == "gpt_oss":  # an MoE as GPT-OSS is shaped: 32 experts, top 4 (hidden and experts 768)
        cfg = GptOssConfig(
            hidden_size=768, intermediate_size=768, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
            num_local_experts=32, num_experts_per_tok=4, vocab_size=32000, max_position_embeddings=2048,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )  # fmt: skip
    else:
        cfg = LlamaConfig(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, vocab_size=32000
        )
    torch.manual_seed(0)
    # Built in bf16 (not cast after: `.to(bfloat16)` would also round the rotary inv_freq buffer).
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a wrapper subclass's (tq's, torchao's) inner tensors, recursively."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model) -> int:
    return sum(tensor_bytes(t) for t in [*model.parameters(), *model.buffers()])


def read_bandwidth() -> float:
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)  # 512 MB
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def tq_variant(config_name, compress: bool, fallback: str = "packed", kv: bool = False):
    """A tq row: `config_name`'s preset (or a callable making the config; None: no weight
    quantization), with an FP8 KV cache (per-tensor scales) where `kv`."""

    def make(base):
        m = copy.deepcopy(base)
        ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(1))
        rules = (tq.configs.fp8_kv_cache(),) if kv else ()
        preset = getattr(tq.configs, config_name) if isinstance(config_name, str) else config_name
        config = tq.calibration.QuantConfig(rules) if config_name is None else preset().with_rules(*rules)
        tq.calibrate(m, config, lambda model: model(ids), progress=False)
        if compress:
            tq.compress(m, fallback=fallback)
        return m

    return make


def torchao_variant(kind: str):
    def make(base):
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

        m = copy.deepcopy(base)
        config = {
            "int8wo": lambda: Int8WeightOnlyConfig(),
            "int8dq": lambda: Int8DynamicActivationInt8WeightConfig(),
            # torchao 0.18's CPU INT4 (Int4OpaqueTensor, torch._weight_int4pack_mm_for_cpu)
            "int4wo": lambda: PrototypeInt4WeightOnlyConfig(group_size=128),
        }[kind]()
        quantize_(m, config, filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and "lm_head" not in fqn)
        return m

    return make


VARIANTS = {
    "bf16": lambda base: copy.deepcopy(base),
    "tq-int8 (W8A8 static)": tq_variant("int8", True),
    "tq-int8_dynamic (W8A8)": tq_variant("int8_dynamic", True),
    "tq-int8_weight_only": tq_variant("int8_weight_only", True),
    "tq-int4_weight_only g128": tq_variant("int4_weight_only", True),
    "tq-fp8 kv cache (bf16 weights)": tq_variant(None, True, kv=True),
    "tq-int4_weight_only g128 + fp8 kv cache": tq_variant("int4_weight_only", True, kv=True),
    "tq-fp8 packed": tq_variant("fp8", True),
    "tq-fp8 dequantized": tq_variant("fp8", True, "dequantized"),
    "tq-mxfp8 packed": tq_variant("mxfp8", True),
    "tq-mxfp6 packed": tq_variant("mxfp6", True),
    "tq-mxfp4_weight_only packed": tq_variant("mxfp4_weight_only", True),
    "tq-nvfp4 packed": tq_variant("nvfp4", True),
    "tq-nvfp4 dequantized": tq_variant("nvfp4", True, "dequantized"),
    "torchao int8 weight-only": torchao_variant("int8wo"),
    "torchao int8 dyn-act int8 weight": torchao_variant("int8dq"),
    "torchao int4 weight-only g128": torchao_variant("int4wo"),
}
def _experts_only(config_name: str):
    """`config_name`'s preset on the MoE experts alone (every nn.Linear in bf16)."""
    keep = tq.calibration.QuantRule.disable(module_types=(torch.nn.Linear,), must_match=False)
    return lambda: getattr(tq.configs, config_name)().with_rules(keep)


# --model gpt_oss: the experts quantized, every linear layer in bf16 (as GPT-OSS is released).
# torchao's quantize_ converts nn.Linear only, so it leaves these experts (3-D parameters) in bf16.
MOE_VARIANTS = {
    "bf16": lambda base: copy.deepcopy(base),
    "tq-mxfp4 experts packed": tq_variant(lambda: tq.configs.mxfp4_weight_only(experts_only=True), True),
    "tq-mxfp4 experts dequantized": tq_variant(lambda: tq.configs.mxfp4_weight_only(experts_only=True), True, "dequantized"),
    "tq-int4_weight_only g128 experts packed": tq_variant(_experts_only("int4_weight_only"), True),
    "tq-int8_weight_only experts packed": tq_variant(_experts_only("int8_weight_only"), True),
    "tq-int8 (W8A8 static) experts packed": tq_variant(_experts_only("int8"), True),
    "tq-int8_dynamic (W8A8) experts packed": tq_variant(_experts_only("int8_dynamic"), True),
    "tq-fp8 experts packed": tq_variant(_experts_only("fp8"), True),
}
SIMULATED = {
    "tq-int8 simulated": tq_variant("int8", False),
    "tq-int4_weight_only simulated": tq_variant("int4_weight_only", False),
    "tq-fp8 simulated": tq_variant("fp8", False),
}


class Runner:
    """One variant: its eager and compiled decode step and prefill."""

    def __init__(self, model):
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=PROMPT + NEW)
        self.compiled = torch.compile(self._step, fullgraph=True)
        self.compiled_prefill = torch.compile(self._prefill, fullgraph=True)
        g = torch.Generator().manual_seed(2)
        self.prompt = torch.randint(0, 32000, (1, PROMPT), generator=g)
        self.batch = torch.randint(0, 32000, PREFILL, generator=g)
        self.compile_s = None

    def _step(self, ids, pos):
        return self.model(input_ids=ids, past_key_values=self.cache, cache_position=pos, use_cache=True).logits[:, -1]

    def _prefill(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits

    @torch.no_grad()
    def decode(self, compiled: bool) -> float:
        step = self.compiled if compiled else self._step
        self.cache.reset()
        logits = self._step(self.prompt, torch.arange(PROMPT))  # the prompt, eager in both
        nxt = logits.argmax(-1, keepdim=True)
        t = time.perf_counter()
        for i in range(NEW):
            logits = step(nxt, torch.tensor([PROMPT + i]))
            nxt = logits.argmax(-1, keepdim=True)
        return NEW / (time.perf_counter() - t)

    @torch.no_grad()
    def prefill(self, compiled: bool) -> float:
        fn = self.compiled_prefill if compiled else self._prefill
        return PREFILL[0] * PREFILL[1] / _timed(lambda: fn(self.batch))

    @torch.no_grad()
    def warm(self) -> None:
        t = time.perf_counter()
        self.cache.reset()
        self._step(self.prompt, torch.arange(PROMPT))
        self.compiled(torch.zeros(1, 1, dtype=torch.long), torch.tensor([PROMPT]))
        self.compiled(torch.zeros(1, 1, dtype=torch.long), torch.tensor([PROMPT + 1]))
        self.compiled_prefill(self.batch)
        self.compile_s = time.perf_counter() - t


def main() -> None:
    global PROMPT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--simulated", action="store_true", help="add the calibrated (fake-quantized) models before compress")
    ap.add_argument("--variants", default="", help="comma-separated names (a prefix of a row name selects it)")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens before the decoded ones (the KV cache's length)")
    ap.add_argument("--model", default="llama", choices=("llama", "gpt_oss"), help="gpt_oss: an MoE, its experts quantized")
    args = ap.parse_args()
    PROMPT = args.prompt
    torch.set_num_threads(args.threads)
    # Every variant compiles the same step function (its own model and cache): one graph each.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    variants = MOE_VARIANTS if args.model == "gpt_oss" else {**VARIANTS, **(SIMULATED if args.simulated else {})}
    if args.variants:
        wanted = [w.strip() for w in args.variants.split(",")]
        variants = {k: v for k, v in variants.items() if any(k.startswith(w) for w in wanted)}
        if not variants:
            raise SystemExit(f"--variants {args.variants!r} selects none of {list(VARIANTS) + list(SIMULATED)}")
    base = build_model(args.model)
    bw = read_bandwidth()
    runners, skipped = {}, {}
    for name, make in variants.items():
        try:
            runners[name] = Runner(make(base))
        except ImportError as e:
            skipped[name] = f"not installed: {e.name}"
    for r in runners.values():
        r.warm()
    results = {name: {k: [] for k in ("de", "dc", "pe", "pc")} for name in runners}
    for _ in range(args.rounds):  # alternate: every variant once per round
        for name, r in runners.items():
            res = results[name]
            res["de"].append(r.decode(False))
            res["dc"].append(r.decode(True))
            res["pe"].append(r.prefill(False))
            res["pc"].append(r.prefill(True))
    med = {n: {k: statistics.median(v) for k, v in res.items()} for n, res in results.items()}
    ref = med.get("bf16")
    print(f"prompt {PROMPT} + {NEW} decoded tokens; torch {torch.__version__}, {args.threads} thread(s), read bandwidth {bw / 1e9:.1f} GB/s, {args.rounds} rounds (medians)\n")
    print("| variant | decode tok/s eager / compiled | × bf16 (decode, compiled) | prefill tok/s eager / compiled | prefill × bf16 (compiled) | cold compile | weights in memory | KV cache B/token | %BW (decode, compiled) |")
    print("|---|---|---|---|---|---|---|---|---|")
    # An MoE token reads its routed experts only, not every weight: no bandwidth bound from the weights' bytes.
    pct = (lambda f: "-") if args.model == "gpt_oss" else (lambda f: f"{100 * f:.0f}%")
    for name, m in med.items():
        r = runners[name]
        wb = weight_bytes(r.model)
        limit = bw / wb
        xd = f"{m['dc'] / ref['dc']:.2f}" if ref else "-"
        xp = f"{m['pc'] / ref['pc']:.2f}" if ref else "-"
        print(
            f"| {name} | {m['de']:.1f} / {m['dc']:.1f} | {xd} | {m['pe']:.0f} / {m['pc']:.0f} | {xp} | {r.compile_s:.0f} s | "
            f"{wb / 1e6:.0f} MB | {tq.deploy.kv_cache_bytes(r.cache) // (PROMPT + NEW)} | {pct(m['dc'] / limit)} |"
        )
    for name, why in skipped.items():
        print(f"| {name} | skipped: {why} |")


if __name__ == "__main__":
    main()
