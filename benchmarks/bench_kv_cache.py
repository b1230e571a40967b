"""Perplexity with an FP8 KV cache, tq against llmcompressor 0.14's ``kv_cache_scheme`` on the same model and data.

    PYTHONPATH=. python benchmarks/bench_kv_cache.py --llmc-python /path/to/llmc/bin/python [--json out.json]
    PYTHONPATH=. python benchmarks/bench_kv_cache.py --llmc-python ... --quick    # smoke check: small model, 4 rows

The model, its training, the data split, the calibration rows and the held-out windows are
`bench_ptq_algorithms.py`'s (the same --workdir cache: a trained model there is reused), and so is
the scoring (`ptq_eval.scores`: perplexity and KL from the float model). Per table row, in a fresh
process each:

- tq: loads the float model, ``tq.calibrate(model, config, forward_loop)`` (its defaults: ``mse`` for per-tensor KV
  amaxes, ``max`` for the rest; the rows marked `max` / `mse` name ``kv_scale_search``) with the row's
  config, a preset or none with ``tq.configs.fp8_kv_cache(per_head=...)`` appended, and scores
  the fake-quantized model (keys after the rotary embedding and values quantized as they enter the cache);
- llmcompressor (`llmc_kv_worker.py` in --llmc-python): ``oneshot`` with a ``QuantizationModifier``
  holding the row's weight scheme and ``kv_cache_scheme`` (FP8, static, strategy "tensor" or
  "attn_head"); its compressed checkpoint loaded back with transformers, checked to hold
  k_scale/v_scale and to change its logits when the attentions' quantization is turned off, and
  scored (the model in memory right after ``oneshot`` is scored and checked too; both are in --json).
  Its checkpoint is also read by ``tq.load_exported`` and scored in tq ("llmc ckpt in tq").

Rows: FP8 KV per tensor and per head alone; W8A8 (``tq.configs.int8_dynamic()``; llmcompressor's
W8A8 preset) and W4A16 g128 (``tq.configs.int4_weight_only()``; its W4A16 preset), each without and
with FP8 KV per tensor and per head. Weights are round to nearest on both sides. Measured figures:
docs/ptq.md, "Perplexity with an FP8 KV cache, against llmcompressor".
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling benchmark scripts, imported for their helpers

from bench_export_memory import in_fresh_process  # noqa: E402
from bench_ptq_algorithms import _cell_cost, _cell_difference, _cell_ppl, add_anchor_args, anchor, tq_run  # noqa: E402
from ptq_eval import scores  # noqa: E402

import tqcompile as tq  # noqa: E402

# (label, weight preset or None, KV: None, "tensor" or "head", tq's kv_scale_search (None: its default), with an
# llmcompressor row). tq's default: "mse" for per-tensor KV amaxes, "max" per head; the `max` rows are the other rule.
ROWS = (
    ("FP8 KV per tensor", None, "tensor", None, True),
    ("FP8 KV per head", None, "head", None, True),
    ("FP8 KV per tensor, tq `max`", None, "tensor", "max", False),
    ("FP8 KV per head, tq `mse`", None, "head", "mse", False),
    ("W8A8", "w8a8", None, None, True),
    ("W8A8 + FP8 KV per tensor", "w8a8", "tensor", None, True),
    ("W8A8 + FP8 KV per tensor, tq `max`", "w8a8", "tensor", "max", False),
    ("W8A8 + FP8 KV per head", "w8a8", "head", None, True),
    ("W4A16 g128", "w4a16", None, None, True),
    ("W4A16 g128 + FP8 KV per tensor", "w4a16", "tensor", None, True),
    ("W4A16 g128 + FP8 KV per tensor, tq `max`", "w4a16", "tensor", "max", False),
    ("W4A16 g128 + FP8 KV per head", "w4a16", "head", None, True),
)
QUICK = {"FP8 KV per tensor", "FP8 KV per head", "FP8 KV per tensor, tq `max`", "W4A16 g128 + FP8 KV per head"}

FOOTNOTE = (
    "Cells: held-out perplexity (KL from float, 10⁻³ nats). 'tq − llmc': tq's log perplexity minus llmcompressor's "
    "(negative: tq lower), ± its standard error paired over the held-out windows. Both tools use their defaults: "
    "tq's per-tensor KV amax is the histogram error search ('mse'), per head the largest |k| (|v|) over all calibration "
    "rows ('max'); llmcompressor's 'minmax' observer is a moving average (constant 0.01) of each row's amax. The llmc column is its reloaded checkpoint computed by "
    "compressed-tensors in its own environment (checked to compute with its FP8 KV cache); 'llmc ckpt in tq' is that "
    "checkpoint read by tq.load_exported (its weights and k/v scales) and computed by tq. W8A8 activations: tq per "
    "token at amax/127 (vLLM's), compressed-tensors at amax/127.5. Times: each run's calibration wall seconds, "
    "peak RSS the process's high-water mark after it (in brackets before it); the machine is shared, so times are noisy."
)


def tq_config(weights: str | None, kv: str | None):
    """The row's tq config: the weight preset (or none) with the FP8 KV rule appended (or not)."""
    base = {None: tq.calibration.QuantConfig(), "w8a8": tq.configs.int8_dynamic(), "w4a16": tq.configs.int4_weight_only()}[weights]
    return base if kv is None else base.with_rules(tq.configs.fp8_kv_cache(per_head=kv == "head"))


def llmc_recipe(weights: str | None, kv: str | None) -> str:
    """The row's recipe name in `llmc_kv_worker.RECIPES`."""
    parts = [weights] if weights else []
    parts += [f"kv_{kv}"] if kv else []
    return "_".join(parts)


def kv_amaxes(model) -> dict:
    """The calibrated key and value amaxes of every quantized attention (the run's result gets them)."""
    amaxes = {}
    for name, m in model.named_modules():
        if hasattr(m, "key_quantizer") and m.key_quantizer.amax is not None:
            amaxes[name] = {"key": m.key_quantizer.amax.flatten().tolist(), "value": m.value_quantizer.amax.flatten().tolist()}
    return {"kv_amax": amaxes}


def _llmc_run(llmc_python: str, model_dir: Path, data_path: Path, recipe: str, workdir: Path, threads: int, reference) -> dict:
    """llmcompressor's row in its own environment (llmc_kv_worker.py); then its checkpoint read by tq."""
    out = workdir / f"llmc_kv_{recipe}"
    result_path, log_path = out.with_suffix(".json"), out.with_suffix(".log")
    result_path.unlink(missing_ok=True)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # llmcompressor's environment must not pick up this one's packages
    cmd = [llmc_python, str(HERE / "llmc_kv_worker.py"), "--model", str(model_dir), "--data", str(data_path),
           "--recipe", recipe, "--out", str(out), "--result", str(result_path), "--threads", str(threads)]
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    if not result_path.exists():
        lines = [ln for ln in log_path.read_text().strip().splitlines() if ln.strip()]
        return {"error": f"llmcompressor run exited with {proc.returncode}: {(lines or ['no output'])[-1][:200]} (log: {log_path})"}
    result = json.loads(result_path.read_text())
    try:
        result["in_tq"] = scores(tq.load_exported(str(out)), torch.load(data_path)["eval"], reference)
    except Exception as e:  # noqa: BLE001
        result["in_tq_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return result


def print_table(float_ppl: float, rows: list[dict]) -> None:
    print("\n| config | tq | llmcompressor | tq − llmc, log ppl (10⁻³) | llmc ckpt in tq | tq time, peak RSS | llmc time, peak RSS |")
    print("|---|---|---|---|---|---|---|")
    print(f"| float | {float_ppl:.4f} | {float_ppl:.4f} | | | | |")
    for row in rows:
        tq_r, llmc = row["tq"], row["llmc"]
        in_tq = "" if llmc is None else _cell_ppl(llmc["in_tq"]) if "in_tq" in llmc else llmc.get("in_tq_error", "")
        print(f"| {row['label']} | {_cell_ppl(tq_r)} | {_cell_ppl(llmc)} | {_cell_difference(tq_r, llmc)} | {in_tq} | "
              f"{_cell_cost(tq_r)} | {_cell_cost(llmc)} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_anchor_args(p)  # the calibration and held-out rows exactly as bench_ptq_algorithms.py picks them
    args = p.parse_args()
    begin = time.perf_counter()
    a = anchor(args, "data_kv.pt")
    workdir, model_dir, data_path, eval_rows, reference = a["workdir"], a["model_dir"], a["data_path"], a["eval_rows"], a["reference"]
    float_ppl, unigram, train_s, layers, steps, n_calib, seq = (a[k] for k in ("float_ppl", "unigram", "train_s", "layers", "steps", "n_calib", "seq"))

    rows = []
    for label, weights, kv, kv_search, with_llmc in ROWS:
        if args.quick and label not in QUICK:
            continue
        print(f"== {label}", flush=True)
        run = functools.partial(tq_run, calibrate_kwargs={"kv_scale_search": kv_search})
        tq_r = in_fresh_process(run, str(model_dir), str(data_path), tq_config(weights, kv), "max", args.threads, kv_amaxes)
        print(f"   tq   {tq_r}", flush=True)
        llmc_r = None
        if args.llmc_python and with_llmc:
            llmc_r = _llmc_run(args.llmc_python, model_dir, data_path, llmc_recipe(weights, kv), workdir, args.threads, reference)
            print(f"   llmc {llmc_r}", flush=True)
        rows.append({"label": label, "weights": weights, "kv": kv, "tq": tq_r, "llmc": llmc_r})

    print(f"\nModel: LlamaForCausalLM, {layers} layers, hidden 256, 4 query heads and 2 KV heads of 64, byte vocabulary; held-out "
          f"perplexity (last 10% of pydoc_data.topics, {eval_rows.shape[0]} windows of {seq} bytes): float {float_ppl:.4f}, unigram "
          f"baseline {unigram:.3f}. Calibration: the same {n_calib} windows of {seq} bytes for both tools. torch threads: {args.threads}.")
    print_table(float_ppl, rows)
    total = time.perf_counter() - begin
    print(f"\n{FOOTNOTE}\n\nWhole run: {total:.0f} s (training, cached, took {train_s:.0f} s when built).")
    if args.json:
        meta = {"layers": layers, "steps": steps, "calib": [n_calib, seq], "eval_tokens": eval_rows.numel(), "float_ppl": float_ppl,
                "unigram_ppl": unigram, "train_seconds": train_s, "threads": args.threads, "total_seconds": total, "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
