"""Peak memory of `tq.export` against model size: the export streams one layer at a time.

Builds a Llama-style causal LM from a config (no download) at a few sizes, calibrates it with
`tq.configs.int8()` on one small batch, then exports it (compressed-tensors, bf16 for the tensors
kept in high precision) while a thread samples the process's resident memory every 5 ms. Prints, per
size: the float model's bytes (fp32 parameters), the checkpoint's bytes, the peak resident memory
*above* the level just before the export, that peak as a share of the model, the time, and the same
figures for the float model's `save_pretrained` (which holds its state dict) as a reference.

    PYTHONPATH=. python benchmarks/bench_export_memory.py [--sizes 512x4 1024x8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
import warnings

import torch

import tqcompile as tq


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_during(fn) -> tuple[int, float]:
    """(peak RSS above the level before `fn`, seconds) while `fn` runs."""
    base, peak, stop = _rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    stop.set()
    t.join()
    return max(peak[0], _rss()) - base, seconds


def _model(hidden: int, layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _measure(kind: str, hidden: int, layers: int, root: str, queue) -> None:
    """In a fresh process (so that one measurement's freed memory cannot hide the next one's peak):
    build and calibrate the model, then time `tq.export` or the float `save_pretrained`."""
    warnings.simplefilter("ignore")
    model = _model(hidden, layers)
    if kind == "export":
        ids = torch.randint(0, 8192, (1, 64))
        tq.calibrate(model, tq.configs.int8(), lambda m: m(ids), progress=False)
        out = {}
        peak, secs = _peak_during(lambda: out.setdefault("r", tq.export(model, f"{root}/q", dtype=torch.bfloat16)))
        written = out["r"].bytes_written
    else:
        peak, secs = _peak_during(lambda: model.save_pretrained(f"{root}/f"))
        written = sum(os.path.getsize(os.path.join(f"{root}/f", f)) for f in os.listdir(f"{root}/f") if f.endswith(".safetensors"))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    queue.put((sum(p.numel() for p in model.parameters()), largest, written, peak, secs))


def in_fresh_process(target, *args):
    """``target(*args, queue)`` in a new (spawned) process; what it puts on the queue. A fresh
    process per measurement: memory one run freed cannot hide the next run's peak."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join(timeout=60)
    return result


def sizes_from_args(doc: str) -> list[tuple[str, int, int]]:
    """(label, hidden, layers) of the `--sizes` argument ("hidden x layers"), header printed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["512x4", "1024x8", "1536x12"], help="hidden x layers")
    print(f"torch {torch.__version__}, CPU; resident memory sampled every 5 ms, each run in a fresh process")
    return [(s, *(int(v) for v in s.split("x"))) for s in parser.parse_args().sizes]


def main() -> None:
    sizes = sizes_from_args(__doc__)
    mib = 2**20
    print("| model (hidden x layers) | params | fp32 model MiB | largest fp32 tensor MiB | checkpoint MiB | export peak MiB | "
          "peak / model | export s | float save_pretrained peak MiB | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size, hidden, layers in sizes:
        root = tempfile.mkdtemp()
        try:
            n, largest, written, peak, secs = in_fresh_process(_measure, "export", hidden, layers, root)
            _, _, _, ref_peak, ref_secs = in_fresh_process(_measure, "save_pretrained", hidden, layers, root)
        finally:
            shutil.rmtree(root)
        print(f"| {size} | {n / 1e6:.1f}M | {n * 4 / mib:.0f} | {largest / mib:.0f} | {written / mib:.0f} | {peak / mib:.1f} | "
              f"{peak / (n * 4):.1%} | {secs:.2f} | {ref_peak / mib:.1f} | {ref_secs:.2f} |")


if __name__ == "__main__":
    main()
