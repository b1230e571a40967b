"""GPT-OSS through tq into its own MXFP4 format and back out through transformers, as a user runs it.

    python benchmarks/gpt_oss_mxfp4.py [--layers 4] [--hidden 512] [--experts 8]

Builds a bf16 GPT-OSS from a config (no download; alternating sliding and full attention as the
released models; biases and router given values), quantizes its experts with
`tq.configs.mxfp4_weight_only(experts_only=True)`, optionally fine-tunes a few QAT steps, exports
with `tq.export(format="mxfp4", dtype=torch.bfloat16)` and loads the directory with transformers'
`from_pretrained` (its GPT-OSS MXFP4 loader; on a CPU it dequantizes to bf16) and with
`tq.load_exported`. Prints: bytes on disk against `save_pretrained` of the bf16 model, whether the
experts transformers built equal tq's bit for bit, the logits' max |difference| against tq's model,
and whether greedy generation gives the same tokens.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import torch
import transformers

import tqcompile as tq


def build(layers: int, hidden: int, experts: int) -> torch.nn.Module:
    cfg = transformers.GptOssConfig(
        vocab_size=2048, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, num_local_experts=experts, num_experts_per_tok=4, max_position_embeddings=512,
        sliding_window=32, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
    )  # fmt: skip
    torch.manual_seed(0)
    # Built in bf16 (not cast after): `.to(bfloat16)` would round the rotary inv_freq buffer too, which
    # from_pretrained keeps in fp32 (measured: 0.25 of logit apart, unquantized).
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "router" in name:
                p.normal_(0, 0.02)
    return model


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--qat-steps", type=int, default=0)
    a = ap.parse_args()
    work = tempfile.mkdtemp()
    model = build(a.layers, a.hidden, a.experts)
    model.save_pretrained(f"{work}/bf16")
    tq.calibrate(model, tq.configs.mxfp4_weight_only(experts_only=True), None, progress=False)
    if a.qat_steps:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(a.qat_steps):
            ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(step))
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
    t0 = time.perf_counter()
    report = tq.export(model, f"{work}/mxfp4", format="mxfp4", dtype=torch.bfloat16)
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(f"{work}/mxfp4").eval()
    load_s = time.perf_counter() - t0
    same = all(
        torch.equal(
            getattr(hf.model.layers[i].mlp.experts, g).detach().float(),
            torch.stack([
                getattr(model.model.layers[i].mlp.experts, f"{g}_gemm").weight_quantizer(w.t()).t()
                for w in getattr(model.model.layers[i].mlp.experts, g).detach()
            ]).float(),
        )
        for i in range(a.layers) for g in ("gate_up_proj", "down_proj")
    )  # fmt: skip
    ids = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        d = (hf(ids).logits.float() - model(ids).logits.float()).abs().max().item()
        prompt = ids[:, :16]
        g_hf = hf.generate(prompt, max_new_tokens=24, do_sample=False)
        g_tq = model.generate(prompt, max_new_tokens=24, do_sample=False)
    back = tq.load_exported(f"{work}/mxfp4", dtype=torch.bfloat16)
    with torch.no_grad():
        d_back = (back(ids).logits.float() - model(ids).logits.float()).abs().max().item()
    print(f"GPT-OSS {a.layers} layers, hidden {a.hidden}, {a.experts} experts (top 4), bf16, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; QAT steps {a.qat_steps}")
    print(f"{len(report.rows)} experts GEMMs quantized, {len(report.ignored)} layers kept in bf16; export {export_s:.1f} s")
    print("| checkpoint | bytes on disk | transformers loads (s) | experts = tq's, bit for bit | max abs logit diff vs tq | greedy tokens equal |")
    print("|---|---|---|---|---|---|")
    print(f"| save_pretrained bf16 | {dir_bytes(f'{work}/bf16') / 2**20:.1f} MiB | | | | |")
    print(f"| tq.export mxfp4 | {dir_bytes(f'{work}/mxfp4') / 2**20:.1f} MiB | {load_s:.1f} | {same} | {d:.3g} | "
          f"{torch.equal(g_hf, g_tq)} |")
    print(f"tq.load_exported of the same files: max abs logit diff vs tq's model {d_back:.3g}")


if __name__ == "__main__":
    main()
