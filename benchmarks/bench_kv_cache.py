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
with FP8 KV per tensor and per head; and three "+ tq QAT" rows: tq's calibrated model then trained
--qat-steps steps by distillation from the float model (`distill`; llmcompressor has no QAT, so they
face its PTQ row of the same scheme). Weights are round to nearest on both sides. Measured figures:
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
from bench_ptq_algorithms import _cell_cost, _cell_difference, _cell_ppl, add_anchor_args, anchor, split_text, tq_run  # noqa: E402
from ptq_eval import scores  # noqa: E402

import tqcompile as tq  # noqa: E402

# (label, weight preset or None, KV: None, "tensor" or "head", tq's kv_scale_search (None: its default), against
# llmcompressor's row of the same scheme, tq's QAT after calibrating). tq's default: "mse" for per-tensor KV amaxes,
# "max" per head; the `max` rows are the other rule. A QAT row is tq's calibrated model trained --qat-steps steps by
# distillation from the float model (`distill`); llmcompressor has no QAT, so it is compared with the same llmc row
# as its PTQ row (run once).
ROWS = (
    ("FP8 KV per tensor", None, "tensor", None, True, False),
    ("FP8 KV per head", None, "head", None, True, False),
    ("FP8 KV per tensor, tq `max`", None, "tensor", "max", False, False),
    ("FP8 KV per head, tq `mse`", None, "head", "mse", False, False),
    ("W8A8", "w8a8", None, None, True, False),
    ("W8A8 + FP8 KV per tensor", "w8a8", "tensor", None, True, False),
    ("W8A8 + FP8 KV per tensor, tq `max`", "w8a8", "tensor", "max", False, False),
    ("W8A8 + FP8 KV per head", "w8a8", "head", None, True, False),
    ("W4A16 g128", "w4a16", None, None, True, False),
    ("W4A16 g128 + FP8 KV per tensor", "w4a16", "tensor", None, True, False),
    ("W4A16 g128 + FP8 KV per tensor, tq `max`", "w4a16", "tensor", "max", False, False),
    ("W4A16 g128 + FP8 KV per head", "w4a16", "head", None, True, False),
    ("FP8 KV per tensor + tq QAT", None, "tensor", None, True, True),
    ("FP8 KV per head + tq QAT", None, "head", None, True, True),
    ("W8A8 + FP8 KV per tensor + tq QAT", "w8a8", "tensor", None, True, True),
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


def distill(steps: int, lr: float, seq: int, model, reference) -> dict:
    """QAT of the calibrated `model` (in place): `steps` AdamW steps (learning rate `lr`, no weight
    decay) on the KL from the float `reference`'s next-token distribution, batches of 8 random
    `seq`-token windows of the training split (never the held-out text); every quantizer, the KV
    cache's included, fake-quantizes in forward with its straight-through gradient, amaxes fixed."""
    train_ids, _ = split_text()
    gen = torch.Generator().manual_seed(11)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    start = time.perf_counter()
    for _ in range(steps):
        starts = torch.randint(0, train_ids.numel() - seq, (8,), generator=gen).tolist()
        x = torch.stack([train_ids[i : i + seq] for i in starts])
        with torch.no_grad():
            target = reference(input_ids=x).logits.float().log_softmax(-1)
        logp = model(input_ids=x).logits.float().log_softmax(-1)
        loss = (target.exp() * (target - logp)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return {"qat_steps": steps, "qat_lr": lr, "qat_seconds": time.perf_counter() - start}


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
              f"{_cell_cost(tq_r)}{_qat_cost(tq_r)} | {_cell_cost(llmc)} |")


def _qat_cost(r: dict | None) -> str:
    return f" + QAT {r['qat_seconds']:.0f} s" if r is not None and "qat_seconds" in r else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_anchor_args(p)  # the calibration and held-out rows exactly as bench_ptq_algorithms.py picks them
    p.add_argument("--qat-steps", type=int, default=400, help="the QAT rows' distillation steps (batches of 8 windows)")
    p.add_argument("--qat-lr", type=float, default=1e-5, help="the QAT rows' AdamW learning rate")
    p.add_argument("--only", action="append", default=None, metavar="TEXT",
                   help="run only the rows whose label contains TEXT (case-insensitive; repeatable)")
    args = p.parse_args()
    begin = time.perf_counter()
    a = anchor(args, "data_kv.pt")
    workdir, model_dir, data_path, eval_rows, reference = a["workdir"], a["model_dir"], a["data_path"], a["eval_rows"], a["reference"]
    float_ppl, unigram, train_s, layers, steps, n_calib, seq = (a[k] for k in ("float_ppl", "unigram", "train_s", "layers", "steps", "n_calib", "seq"))

    rows, llmc_runs = [], {}
    for label, weights, kv, kv_search, with_llmc, qat in ROWS:
        if (args.quick and label not in QUICK) or (args.only and not any(o.lower() in label.lower() for o in args.only)):
            continue
        print(f"== {label}", flush=True)
        finetune = functools.partial(distill, args.qat_steps, args.qat_lr, a["seq"]) if qat else None
        run = functools.partial(tq_run, calibrate_kwargs={"kv_scale_search": kv_search}, finetune=finetune)
        tq_r = in_fresh_process(run, str(model_dir), str(data_path), tq_config(weights, kv), "max", args.threads, kv_amaxes)
        print(f"   tq   {tq_r}", flush=True)
        llmc_r = None
        if args.llmc_python and with_llmc:
            recipe = llmc_recipe(weights, kv)
            if recipe not in llmc_runs:
                llmc_runs[recipe] = _llmc_run(args.llmc_python, model_dir, data_path, recipe, workdir, args.threads, reference)
            llmc_r = llmc_runs[recipe]
            print(f"   llmc {llmc_r}", flush=True)
        rows.append({"label": label, "weights": weights, "kv": kv, "qat": qat, "tq": tq_r, "llmc": llmc_r})

    print(f"\nModel: LlamaForCausalLM, {layers} layers, hidden 256, 4 query heads and 2 KV heads of 64, byte vocabulary; held-out "
          f"perplexity (last 10% of pydoc_data.topics, {eval_rows.shape[0]} windows of {seq} bytes): float {float_ppl:.4f}, unigram "
          f"baseline {unigram:.3f}. Calibration: the same {n_calib} windows of {seq} bytes for both tools. torch threads: {args.threads}.")
    print_table(float_ppl, rows)
    total = time.perf_counter() - begin
    print(f"\n{FOOTNOTE} '+ tq QAT' rows: {args.qat_steps} distillation steps (AdamW, learning rate {args.qat_lr:g}) after "
          f"calibrating, scored against llmcompressor's PTQ row of the same scheme.\n\nWhole run: {total:.0f} s (training, cached, took {train_s:.0f} s when built).")
    if args.json:
        meta = {"layers": layers, "steps": steps, "calib": [n_calib, seq], "eval_tokens": eval_rows.numel(), "float_ppl": float_ppl,
                "unigram_ppl": unigram, "train_seconds": train_s, "threads": args.threads, "total_seconds": total, "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
