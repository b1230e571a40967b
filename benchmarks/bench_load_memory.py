"""Peak memory and time of `tq.load_exported` against model size: it fills the model in place,
one layer at a time, so its peak is the model's own size plus about one layer.

Builds the Llama-style models of bench_export_memory.py, calibrates each with `tq.configs.int8()`,
exports it (compressed-tensors), then, each in a fresh process, measures the peak resident memory
above the level before the call, and the time, of (a) building the bare float model from the
checkpoint's config (what any load must at least do) and (b) `tq.load_exported` of the checkpoint.

    PYTHONPATH=. python benchmarks/bench_load_memory.py [--sizes 512x4 1024x8]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_export_memory import _model, _peak_during, in_fresh_process, sizes_from_args  # noqa: E402  (the sibling script's)

import tqcompile as tq  # noqa: E402


def _bare_model(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    return AutoModelForCausalLM.from_config(config)


def _measure(kind: str, path: str, queue) -> None:
    warnings.simplefilter("ignore")
    fn = {"build": lambda: _bare_model(path), "load": lambda: tq.load_exported(path)}[kind]
    queue.put(_peak_during(fn))


def main() -> None:
    sizes = sizes_from_args(__doc__)
    mib = 2**20
    print("| model (hidden x layers) | params | fp32 model MiB | checkpoint MiB | build bare model: peak MiB | s | "
          "tq.load_exported: peak MiB | peak / model | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size, hidden, layers in sizes:
        root = tempfile.mkdtemp()
        try:
            warnings.simplefilter("ignore")
            model = _model(hidden, layers)
            n = sum(p.numel() for p in model.parameters())
            ids = torch.randint(0, 8192, (1, 64))
            tq.calibrate(model, tq.configs.int8(), lambda m, ids=ids: m(ids), progress=False)
            written = tq.export(model, f"{root}/q").bytes_written
            del model
            build_peak, build_s = in_fresh_process(_measure, "build", f"{root}/q")
            load_peak, load_s = in_fresh_process(_measure, "load", f"{root}/q")
        finally:
            shutil.rmtree(root)
        print(f"| {size} | {n / 1e6:.1f}M | {n * 4 / mib:.0f} | {written / mib:.0f} | {build_peak / mib:.0f} | {build_s:.2f} | "
              f"{load_peak / mib:.0f} | {load_peak / (n * 4):.0%} | {load_s:.2f} |")


if __name__ == "__main__":
    main()
