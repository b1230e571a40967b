"""GPT-OSS with MXFP4 experts, as released: what round to nearest, GPTQ and QAT cost in perplexity.

    python benchmarks/bench_gpt_oss_ptq.py [--steps 1000] [--qat-steps 100] [--workdir /tmp/tq_gpt_oss]

1. builds a Hugging Face `GptOssForCausalLM` from a config (byte-level vocabulary of 256, hidden
   256, experts' intermediate 256, 2 layers (sliding-window attention, then full), 8 experts, top 2,
   4 query and 2 KV heads of 64) and trains it with AdamW on the bytes of Python's help texts (the
   first 90%; the last 10% are held out), as `bench_ptq_algorithms.py` trains its Llama; the trained
   model is cached in --workdir;
2. quantizes its experts to MXFP4 (`tq.configs.mxfp4_weight_only(experts_only=True)`: OpenAI's
   release format; the rest of the model, fp32 here, stays as it is) by round to nearest (`max`: no
   data) and by GPTQ (32 calibration windows of 256 tokens from the training split), then fine-tunes
   each `--qat-steps` steps on the training split through its fake-quantized experts (QAT: AdamW,
   lr 1e-4), as NVIDIA ModelOpt's GPT-OSS recipe does before it exports MXFP4, beside the control:
   the float model trained the same steps on the same windows (QAT's gain is part training, part
   recovery; its distance to the control is what quantization still costs);
3. scores each on the held-out windows (`ptq_eval.scores`: perplexity and the KL of its next-token
   distributions from its float model's: the float model, or the control for the QAT rows) and
   checks the export: the GPTQ + QAT model written with `tq.export(format="mxfp4")` and loaded by
   transformers (`Mxfp4Config(dequantize=True)`) scores the same.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_ptq_algorithms import fit as fit_windows  # noqa: E402
from bench_ptq_algorithms import split_text  # noqa: E402
from ptq_eval import paired_difference, scores, windows  # noqa: E402

import tqcompile as tq  # noqa: E402

SEQ = 256


def fit(model, train_ids: torch.Tensor, steps: int, lr: float, seed: int, log: str = "train") -> float:
    """`bench_ptq_algorithms.fit` on 256-token windows, warming up over the first 5% of the steps."""
    return fit_windows(model, train_ids, steps=steps, seq=SEQ, lr=lr, warmup=max(1, steps // 20), seed=seed, log=log)


def config():
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=SEQ,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
    )  # fmt: skip


def trained(workdir: Path, train_ids: torch.Tensor, steps: int, seed: int):
    from transformers import AutoModelForCausalLM

    model_dir = workdir / f"gpt_oss_{steps}_{seed}"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config())
        seconds = fit(model, train_ids, steps, 3e-3, seed)
        model.save_pretrained(model_dir)
        (model_dir / "train_seconds.txt").write_text(f"{seconds:.1f}\n")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), model_dir


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "tq_gpt_oss"))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--qat-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calib", type=int, default=32, help="calibration windows of 256 tokens (GPTQ)")
    a = p.parse_args()
    t_all = time.perf_counter()
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    train_ids, held_out = split_text()
    base, model_dir = trained(workdir, train_ids, a.steps, a.seed)
    rows = windows(held_out, SEQ)
    g = torch.Generator().manual_seed(1234)
    calib = torch.stack([train_ids[s : s + SEQ] for s in torch.randint(0, train_ids.numel() - SEQ, (a.calib,), generator=g).tolist()])
    config_ = tq.configs.mxfp4_weight_only(experts_only=True)

    def calibrated(algorithm):
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loop = None if algorithm == "max" else (lambda m: [m(input_ids=calib[i : i + 8]) for i in range(0, calib.shape[0], 8)])
            tq.calibrate(model, config_, loop, algorithm=algorithm, progress=False)
        return model, time.perf_counter() - t0

    # The control for QAT: the float model trained the same steps on the same windows. QAT's gain over
    # round to nearest is part training, part recovery; its distance to this model is what quantization costs.
    control = copy.deepcopy(base)
    fit(control, train_ids, a.qat_steps, 1e-4, a.seed + 1, log="control")
    results = {"float": (scores(base, rows, base), None, None)}  # name -> (scores, its float's scores, seconds)
    results[f"float trained {a.qat_steps} steps more (QAT's control)"] = (scores(control, rows, control), None, None)
    rtn, t_rtn = calibrated("max")
    results["MXFP4 experts, round to nearest"] = (scores(rtn, rows, base), results["float"][0], t_rtn)
    gptq, t_gptq = calibrated("gptq")
    results["MXFP4 experts, GPTQ"] = (scores(gptq, rows, base), results["float"][0], t_gptq)
    control_scores = results[f"float trained {a.qat_steps} steps more (QAT's control)"][0]
    for start, name in ((rtn, "round to nearest"), (gptq, "GPTQ")):
        qat = copy.deepcopy(start)
        t_qat = fit(qat, train_ids, a.qat_steps, 1e-4, a.seed + 1, log=f"QAT from {name}")
        results[f"MXFP4 experts, {name} + QAT {a.qat_steps} steps"] = (scores(qat, rows, control), control_scores, t_qat)

    # The QAT model as the release format holds it, read by transformers.
    import transformers

    out = workdir / "qat_mxfp4"
    tq.export(qat, str(out), format="mxfp4", overwrite=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
        ).float().eval()
    exported = scores(hf, rows)

    print(f"\nGPT-OSS (2 layers, hidden 256, 8 experts top 2; trained {a.steps} steps, "
          f"{(model_dir / 'train_seconds.txt').read_text().strip()} s), {rows.shape[0]} held-out windows of {SEQ} bytes; "
          f"torch {torch.__version__}, transformers {transformers.__version__}\n")
    print("| model | perplexity | KL from its float model (10⁻³ nats) | cost: log ppl − its float's (10⁻³) | seconds |")
    print("|---|---|---|---|---|")
    for name, (r, ref, sec) in results.items():
        cost = "" if ref is None else "{:+.2f} ± {:.2f}".format(*(1e3 * v for v in paired_difference(r["row_nll"], ref["row_nll"])))
        kl = "" if ref is None else f"{1e3 * r['kl']:.2f}"
        print(f"| {name} | {r['ppl']:.4f} | {kl} | {cost} | {'' if sec is None else f'{sec:.0f}'} |")
    print("\n(Its float model: the float model for round to nearest and GPTQ, the control for the QAT rows.)")
    print(f"\nThe GPTQ + QAT model exported (format='mxfp4') and loaded by transformers: perplexity {exported['ppl']:.4f} "
          f"(tq's {results[f'MXFP4 experts, GPTQ + QAT {a.qat_steps} steps'][0]['ppl']:.4f})")
    print(f"whole run {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
