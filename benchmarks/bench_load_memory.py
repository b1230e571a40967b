"""Peak memory and time of `tq.load_exported` against model size: it fills the model in place,
one layer at a time, so its peak is the model's own size plus about one layer.

Builds the Llama-style models of bench_export_memory.py, calibrates each with `tq.configs.int8()`,
exports it (compressed-tensors), then, each in a fresh process, measures the peak resident memory
above the level before the call, and the time, of (a) building the bare float model from the
checkpoint's config (what any load must at least do) and (b) `tq.load_exported` of the checkpoint.

    PYTHONPATH=. python benchmarks/bench_load_memory.py [--sizes 512x4 1024x8]
    PYTHONPATH=. python benchmarks/bench_load_memory.py --deploy   # W4A16: load then compress, against compress=True
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
    bf16 = torch.bfloat16
    fn = {
        "build": lambda: _bare_model(path),
        "load": lambda: tq.load_exported(path),
        "load+compress": lambda: tq.compress(tq.load_exported(path, dtype=bf16)),
        "compressed load": lambda: tq.load_exported(path, dtype=bf16, compress=True),
    }[kind]
    kept = []
    peak, s = _peak_during(lambda: kept.append(fn()))
    resident = sum(_nbytes(t) for t in (*kept[0].parameters(), *kept[0].buffers())) if kind != "build" else 0
    queue.put((peak, s, resident))


def _nbytes(t: torch.Tensor) -> int:
    if isinstance(t, tq.QuantizedTensor):
        return sum(x.numel() * x.element_size() for x in t._inner().values())
    return t.numel() * t.element_size()


def _checkpoint(hidden: int, layers: int, config, path: str) -> tuple[int, int]:
    """Build the model, calibrate it with `config`, export it to `path`: (parameters, bytes written)."""
    warnings.simplefilter("ignore")
    model = _model(hidden, layers)
    n = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 8192, (1, 64))
    tq.calibrate(model, config, lambda m: m(ids), progress=False)
    return n, tq.export(model, path).bytes_written


def deploy(sizes) -> None:
    """`--deploy`: a W4A16 (INT4 g128) checkpoint made deployable, bf16 model, two ways: a plain
    load then `tq.compress`, and `tq.load_exported(..., compress=True)` (each quantized layer read
    and packed in turn): peak resident memory above the start, and what the result holds."""
    mib = 2**20
    print("\n| model (hidden x layers) | params | bf16 model MiB | packed model MiB | load then compress: peak MiB | s | "
          "load_exported(compress=True): peak MiB | s |")
    print("|---|---|---|---|---|---|---|---|")
    for size, hidden, layers in sizes:
        root = tempfile.mkdtemp()
        try:
            n, _ = _checkpoint(hidden, layers, tq.configs.int4_weight_only(), f"{root}/q")
            two = in_fresh_process(_measure, "load+compress", f"{root}/q")
            one = in_fresh_process(_measure, "compressed load", f"{root}/q")
        finally:
            shutil.rmtree(root)
        print(f"| {size} | {n / 1e6:.1f}M | {n * 2 / mib:.0f} | {one[2] / mib:.0f} | {two[0] / mib:.0f} | {two[1]:.2f} | "
              f"{one[0] / mib:.0f} | {one[1]:.2f} |")


def main() -> None:
    if "--deploy" in sys.argv:
        sys.argv.remove("--deploy")
        deploy(sizes_from_args(__doc__))
        return
    sizes = sizes_from_args(__doc__)
    mib = 2**20
    print("| model (hidden x layers) | params | fp32 model MiB | checkpoint MiB | build bare model: peak MiB | s | "
          "tq.load_exported: peak MiB | peak / model | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size, hidden, layers in sizes:
        root = tempfile.mkdtemp()
        try:
            n, written = _checkpoint(hidden, layers, tq.configs.int8(), f"{root}/q")
            build_peak, build_s, _ = in_fresh_process(_measure, "build", f"{root}/q")
            load_peak, load_s, _ = in_fresh_process(_measure, "load", f"{root}/q")
        finally:
            shutil.rmtree(root)
        print(f"| {size} | {n / 1e6:.1f}M | {n * 4 / mib:.0f} | {written / mib:.0f} | {build_peak / mib:.0f} | {build_s:.2f} | "
              f"{load_peak / mib:.0f} | {load_peak / (n * 4):.0%} | {load_s:.2f} |")


if __name__ == "__main__":
    main()
