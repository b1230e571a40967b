"""GPTQ's cost against depth: decoder-layer forward calls, time and peak memory of `tq.calibrate`
(W4 g128) on Llamas of growing depth, replaying layers on cached inputs against one pass of
`forward_loop` per layer (the path before `tqcompile.calibration.replay`), and llmcompressor 0.14's
sequential pipeline beside them when its Python is given (it needs its own environment).

A Llama from a config (hidden 512, intermediate 1408, 8 heads, vocab 4096, float32), 16 calibration
sequences of 256 tokens in batches of 1, as in issue 28's table. Each variant runs in a fresh
process (peak RSS is the process's).

    python benchmarks/bench_ptq_depth.py [--layers 2 4 8 16 32] [--llmc-python /path/to/venv/bin/python] [--no-pass-per-layer] [--repeat 3]

A fourth column runs `tq.quantize_checkpoint(..., data=rows, algorithm="gptq")` on the model saved
as a float32 checkpoint: the model never loaded, one decoder layer read at a time. Each cell gives
the calibration's seconds and the seconds in all: loading the float checkpoint, calibrating, and
writing the quantized one (tq.export; llmcompressor's `save_pretrained(save_compressed=True)`);
the layer-by-layer call does all three at once, so both figures are its whole call.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTER, HEADS, VOCAB, SEQS, TOKENS = 512, 1408, 8, 4096, 16, 256


def _model(layers: int):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, vocab_size=VOCAB, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _data():
    import torch

    return torch.randint(0, VOCAB, (SEQS, TOKENS), generator=torch.Generator().manual_seed(1))


def _count_calls(model) -> list[int]:
    calls = [0]
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
    return calls


def run_tq(layers: int, replay: bool) -> dict:
    import torch
    import transformers

    import tqcompile as tq
    from tqcompile.calibration import transforms

    torch.set_num_threads(2)
    transforms.REPLAY = replay
    with tempfile.TemporaryDirectory() as d:
        _model(layers).save_pretrained(f"{d}/float")
        start = time.perf_counter()
        model, data = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/float", dtype=torch.float32), _data()
        calls = _count_calls(model)
        t = time.perf_counter()
        tq.calibrate(model, tq.configs.int4_weight_only(128), lambda m: [m(row[None]) for row in data], algorithm="gptq", progress=False)
        seconds = time.perf_counter() - t
        tq.export(model, f"{d}/out")
        total = time.perf_counter() - start
    return {"calls": calls[0], "seconds": seconds, "total": total, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_tq_layerwise(layers: int) -> dict:
    import torch

    import tqcompile as tq
    from tqcompile.export import streaming

    torch.set_num_threads(2)
    data, calls = _data(), [0]
    build = streaming._meta_model

    def build_and_count(path, buffers=False):
        model = build(path, buffers)
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        return model

    streaming._meta_model = build_and_count
    with tempfile.TemporaryDirectory() as d:
        _model(layers).save_pretrained(f"{d}/float")
        t = time.perf_counter()
        tq.quantize_checkpoint(f"{d}/float", f"{d}/out", tq.configs.int4_weight_only(128), data=[row[None] for row in data],
                               algorithm="gptq", progress=False)
        seconds = time.perf_counter() - t
    # The capture runs weightless stand-ins (one call a layer a batch, counted by the hooks): not layer work.
    # Reading the checkpoint and writing the export are inside the one call: its seconds are its total.
    return {"calls": calls[0] - layers * SEQS, "seconds": seconds, "total": seconds, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_llmc(layers: int) -> dict:
    import torch
    from bench_ptq_algorithms import byte_tokenizer  # oneshot insists on a processor when given a dataset
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    data = _data()
    ds = Dataset.from_dict({"input_ids": data.tolist(), "attention_mask": torch.ones_like(data).tolist()})
    with tempfile.TemporaryDirectory() as d:
        # oneshot reads the model's config and the processor from a directory
        _model(layers).save_pretrained(d)
        byte_tokenizer().save_pretrained(d)
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        calls = _count_calls(model)
        t = time.perf_counter()
        oneshot(
            model=model,
            dataset=ds,
            processor=d,
            recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
            num_calibration_samples=SEQS,
            max_seq_length=TOKENS,
            shuffle_calibration_samples=False,
        )
        seconds = time.perf_counter() - t
        model.save_pretrained(f"{d}/out", save_compressed=True)
        total = time.perf_counter() - start
    return {"calls": calls[0], "seconds": seconds, "total": total, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _child(python: str, what: str, layers: int) -> dict | str:
    code = f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_ptq_depth as b; print('@@' + json.dumps(b.{what}))"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@")), None)
    return json.loads(line[2:]) if line else f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"


def _median(rs: list[dict]) -> dict:
    """The run of median total seconds (its calls, seconds and peak together)."""
    return sorted(rs, key=lambda r: r["total"])[len(rs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--llmc-python", default=None, help="llmcompressor 0.14's Python (its own venv)")
    ap.add_argument("--no-pass-per-layer", action="store_true", help="skip the quadratic pass-per-layer column")
    ap.add_argument("--repeat", type=int, default=1, help="rounds, the variants alternated in each; a cell is the median run")
    args = ap.parse_args()
    print(f"GPTQ W4 g128, Llama hidden {HIDDEN}, {SEQS} x {TOKENS} tokens, 2 threads; calls = decoder-layer forward calls\n")
    print("seconds: the calibration's, then load + calibrate + save (the layer-by-layer call does all three at once)"
          + (f"; the median of {args.repeat} alternated runs" if args.repeat > 1 else "") + "\n")
    print("| L | tq.calibrate (replay): calls / s / s in all / peak MiB | tq pass per layer: calls / s / s in all / peak MiB | "
          "tq.quantize_checkpoint (layer by layer from disk): calls / s / s in all / peak MiB | "
          "llmcompressor 0.14: calls / s / s in all / peak MiB |")
    print("|---|---|---|---|---|")
    for n in args.layers:
        runs = [(f"run_tq({n}, True)", sys.executable), (f"run_tq({n}, False)", None if args.no_pass_per_layer else sys.executable),
                (f"run_tq_layerwise({n})", sys.executable), (f"run_llmc({n})", args.llmc_python)]
        results: list[list] = [[] for _ in runs]
        for _ in range(args.repeat):
            for k, (what, python) in enumerate(runs):
                if python:
                    results[k].append(_child(python, what, n))
        cells = []
        for (_, python), rs in zip(runs, results):
            failed = [r for r in rs if isinstance(r, str)]
            if not python:
                cells.append("not run")
            elif failed:
                cells.append(failed[0])
            else:
                r = _median(rs)
                cells.append(f"{r['calls']} / {r['seconds']:.1f} / {r['total']:.1f} / {r['peak_mib']:.0f}")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
