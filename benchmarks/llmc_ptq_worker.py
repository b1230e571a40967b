"""The llmcompressor half of `bench_ptq_algorithms.py`: runs in llmcompressor's own environment
(llmcompressor 0.14 needs transformers <= 5.17), with torch, transformers, datasets and
llmcompressor only; it needs neither tqcompile nor this repository's other files (except `ptq_eval.py`
beside it, torch only).

    LLMC_PYTHON benchmarks/llmc_ptq_worker.py --model DIR --data DATA.pt --recipe gptq --group 128 \
        --out CKPT_DIR --result RESULT.json

1. loads the float model (fp32) from DIR (it holds the byte-level tokenizer, which `oneshot` loads as
   its processor: it insists on one when a dataset is given, though the rows are already token ids);
2. runs `oneshot` with the recipe on DATA.pt's calibration rows (the same rows tq calibrates on, in
   order: `shuffle_calibration_samples=False`), timing it and reading the process's peak RSS right after;
3. writes the compressed checkpoint (`save_pretrained(save_compressed=True)`) and drops the model;
4. loads the checkpoint back with transformers (`CompressedTensorsConfig(dequantize=True)`:
   compressed-tensors decompresses the weights to ``q * scale``; each Linear keeps its quantized
   forward, which quantizes its input per token for W8A8), checks that every targeted Linear's weights are integer codes times
   its scales and that its input quantization is on, and computes the held-out perplexity with
   `ptq_eval.scores` (and its KL divergence from the float model).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ptq_eval import peak_rss_mib, scores  # noqa: E402

RECIPES = ("rtn", "gptq", "awq", "w8a8", "sq", "sq_gptq")


def _w4a16(group: int, bits: int = 4, asym: bool = False):
    """compressed-tensors' W4A16 preset (symmetric INT4, static groups, minmax observer) with `group`;
    `bits` and `asym` change its width and make it asymmetric (its W4A16_ASYM: zero points)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("W4A16_ASYM" if asym else "W4A16", ["Linear"])
    scheme.weights = scheme.weights.model_copy(update={"group_size": group, "num_bits": bits})
    return {"group_0": scheme}


def recipe(name: str, group: int, bits: int = 4, asym: bool = False) -> list:
    """The modifiers of one table row: llmcompressor's defaults, the scheme set as tq's config sets it."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    ignore = ["lm_head"]
    groups = _w4a16(group, bits, asym)
    if name == "rtn":
        return [QuantizationModifier(config_groups=groups, ignore=ignore)]
    if name == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=ignore)]
    if name == "awq":
        return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=ignore)]
    if name == "w8a8":
        return [QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)]
    if name == "sq":
        return [SmoothQuantModifier(smoothing_strength=0.5), QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)]
    if name == "sq_gptq":
        return [SmoothQuantModifier(smoothing_strength=0.5), GPTQModifier(targets="Linear", scheme="W8A8", ignore=ignore)]
    raise ValueError(f"recipe={name!r} is not allowed; allowed: {', '.join(RECIPES)}")


def check_quantized(model: torch.nn.Module) -> dict:
    """Evidence that the loaded model computes with llmcompressor's quantized weights and, where the
    scheme says so, with per-token quantized inputs: every targeted Linear's weight is integer codes in
    the scheme's range times its channel/group scales, and turning compressed-tensors' quantized
    forward off changes a W8A8 layer's output on a random input (the weights are on their grid, so
    only the input's quantization can change it) and leaves a weight-only layer's unchanged."""
    layers = off_grid = input_quantized = 0
    gen = torch.Generator().manual_seed(0)
    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if not isinstance(m, torch.nn.Linear) or scheme is None or scheme.weights is None:
            continue
        layers += 1
        args = scheme.weights
        scale = m.weight_scale.detach().float()
        if args.group_size:
            scale = scale.repeat_interleave(args.group_size, dim=1)
        codes = m.weight.detach().float() / scale
        if not args.symmetric:  # (q - zero_point) * scale: the codes are the zero point's offset
            zp = m.weight_zero_point.detach().float()
            codes = codes + (zp.repeat_interleave(args.group_size, dim=1) if args.group_size else zp)
        lo, hi = -(2 ** (args.num_bits - 1)), 2 ** (args.num_bits - 1) - 1
        off_grid += int(((codes - codes.round()).abs().gt(1e-3) | codes.round().lt(lo) | codes.round().gt(hi)).sum())
        x = torch.randn(4, m.in_features, generator=gen)
        with torch.no_grad():
            on = m(x)
            m.quantization_enabled = False
            off = m(x)
            m.quantization_enabled = True
        changed = not torch.equal(on, off)
        if changed != (scheme.input_activations is not None):
            raise RuntimeError(f"{name}: turning quantization off {'changed' if changed else 'left'} the output "
                               f"({'' if scheme.input_activations else 'no '}input quantization in the scheme)")
        input_quantized += changed
    if off_grid:
        raise RuntimeError(f"{off_grid} weights of the loaded checkpoint are not integer codes times their scales")
    return {"quantized_linears": layers, "weights_off_grid": off_grid, "input_quantized_linears": input_quantized}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--recipe", required=True, choices=RECIPES)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--bits", type=int, default=4, help="weight-only recipes: the integer width")
    p.add_argument("--asym", action="store_true", help="weight-only recipes: asymmetric (zero points)")
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

    if not torch.accelerator.is_available():
        # llmcompressor 0.14's AWQ pins its cached activations in page-locked memory (for faster copies
        # to an accelerator) unconditionally, which CPU-only torch refuses ("Cannot access accelerator
        # device when none is available"). Pinning changes no value: without an accelerator, skip it.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    data = torch.load(a.data)
    calib = data["calib"]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    rss_before = peak_rss_mib()
    t0 = time.perf_counter()
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe(a.recipe, a.group, a.bits, a.asym),
        num_calibration_samples=calib.shape[0],
        max_seq_length=calib.shape[1],
        shuffle_calibration_samples=False,
        processor=a.model,
    )
    seconds = time.perf_counter() - t0
    rss = peak_rss_mib()
    model.save_pretrained(a.out, save_compressed=True)
    del model

    # dequantize=True: the weights decompressed to q * scale at load (not on the first forward), so
    # that check_quantized sees them.
    loaded = AutoModelForCausalLM.from_pretrained(a.out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    evidence = check_quantized(loaded)
    reference = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    result = {
        **scores(loaded, data["eval"], reference),
        "seconds": seconds,
        "peak_rss_mib": rss,
        "rss_before_mib": rss_before,
        "versions": {"llmcompressor": llmcompressor.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        **evidence,
    }
    Path(a.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
