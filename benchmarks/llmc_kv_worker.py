"""The llmcompressor half of `bench_kv_cache.py`: FP8 KV-cache rows (llmcompressor 0.14's
``kv_cache_scheme``), run in llmcompressor's own environment like `llmc_ptq_worker.py`, whose
weight schemes and checks it reuses (it needs neither tqcompile nor transformers >= 5.18).

    LLMC_PYTHON benchmarks/llmc_kv_worker.py --model DIR --data DATA.pt --recipe w4a16_kv_head \
        --out CKPT_DIR --result RESULT.json

1. loads the float model (fp32) and runs `oneshot` with one `QuantizationModifier` whose
   ``kv_cache_scheme`` is FP8 E4M3, static, symmetric, strategy "tensor" or "attn_head" (the
   observer as shipped: "minmax", a moving average of each calibration row's amax), plus the
   recipe's weight scheme (none, W8A8 or W4A16 g128, as `llmc_ptq_worker.recipe` sets them);
2. scores the model in memory right after `oneshot`: compressed-tensors' hooks (a
   ``QuantizedKVCache`` swapped in for ``past_key_values``) fake-quantize the keys and values with
   the calibrated ``k_scale`` / ``v_scale``; turning the attentions' quantization off must change
   the logits (checked: otherwise the KV cache was not quantized and the row is an error);
3. writes the compressed checkpoint, loads it back with transformers (as `llmc_ptq_worker.py`),
   checks its weights and again that its KV quantization is on, and scores it too. The table shows
   the reloaded model's number (what a user of the checkpoint gets); the result holds both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llmc_ptq_worker import _w4a16, check_quantized  # noqa: E402
from ptq_eval import peak_rss_mib, scores  # noqa: E402

# recipe name: (weight scheme, KV strategy)
RECIPES = {
    "kv_tensor": (None, "tensor"),
    "kv_head": (None, "attn_head"),
    "w8a8": ("w8a8", None),
    "w8a8_kv_tensor": ("w8a8", "tensor"),
    "w8a8_kv_head": ("w8a8", "attn_head"),
    "w4a16": ("w4a16", None),
    "w4a16_kv_tensor": ("w4a16", "tensor"),
    "w4a16_kv_head": ("w4a16", "attn_head"),
}


def recipe(name: str) -> list:
    """One QuantizationModifier: the weight scheme (round to nearest) and the FP8 KV-cache scheme."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.quantization import QuantizationModifier

    weights, strategy = RECIPES[name]
    kwargs: dict = {"ignore": ["lm_head"]}
    if weights == "w8a8":
        kwargs |= {"targets": "Linear", "scheme": "W8A8"}
    elif weights == "w4a16":
        kwargs["config_groups"] = _w4a16(128)
    if strategy is not None:
        kwargs["kv_cache_scheme"] = QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=False, symmetric=True)
    return [QuantizationModifier(**kwargs)]


def _attentions(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "k_scale") and hasattr(m, "v_scale")]


@torch.no_grad()
def check_kv(model: torch.nn.Module, rows: torch.Tensor, expected: bool) -> dict:
    """Evidence that `model` computes with its quantized KV cache (when `expected`): its attentions
    hold ``k_scale`` / ``v_scale``, and turning their quantization off changes the logits."""
    attentions = _attentions(model)
    if not expected:
        if attentions:
            raise RuntimeError(f"{attentions[0][0]} holds k_scale but the recipe quantizes no KV cache")
        return {"kv_attentions": 0}
    if not attentions:
        raise RuntimeError("no attention holds k_scale / v_scale: the KV cache is not quantized")
    x = rows[:2]
    on = model(input_ids=x).logits
    for _, m in attentions:
        m.quantization_enabled = False
    off = model(input_ids=x).logits
    for _, m in attentions:
        m.quantization_enabled = True
    if torch.equal(on, off):
        raise RuntimeError("turning the attentions' quantization off left the logits unchanged: the KV cache is not quantized")
    return {
        "kv_attentions": len(attentions),
        "k_scale": {n: m.k_scale.detach().flatten().tolist() for n, m in attentions},
        "v_scale": {n: m.v_scale.detach().flatten().tolist() for n, m in attentions},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--recipe", required=True, choices=sorted(RECIPES))
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    import llmcompressor
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    data = torch.load(a.data)
    calib, rows = data["calib"], data["eval"]
    kv = RECIPES[a.recipe][1] is not None
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    rss_before = peak_rss_mib()
    t0 = time.perf_counter()
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe(a.recipe),
        num_calibration_samples=calib.shape[0],
        max_seq_length=calib.shape[1],
        shuffle_calibration_samples=False,
        processor=a.model,
    )
    seconds = time.perf_counter() - t0
    rss = peak_rss_mib()
    reference = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    in_memory = {**scores(model.eval(), rows, reference), **check_kv(model, rows, kv)}
    model.save_pretrained(a.out, save_compressed=True)
    del model

    loaded = AutoModelForCausalLM.from_pretrained(a.out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    evidence = {**check_quantized(loaded), **check_kv(loaded, rows, kv)}
    result = {
        **scores(loaded, rows, reference),
        "in_memory": in_memory,
        "seconds": seconds,
        "peak_rss_mib": rss,
        "rss_before_mib": rss_before,
        "versions": {"llmcompressor": llmcompressor.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        **evidence,
    }
    Path(a.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
