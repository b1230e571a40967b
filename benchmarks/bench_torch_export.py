"""Where an exported quantized model runs, and how fast: one table per run.

For a calibrated MLP (PTQ presets) and a converted one (training recipes, eval, no_grad), each row
exports the model, lifts its quantizers (`tq.lift_quantizers`), saves and loads the `.pt2`, and
compiles it with AOTInductor; it prints the size of the `.pt2`, whether the loaded program and the
AOTInductor package equal eager bit for bit, AOTInductor's compile time, and the median forward
time of eager, the loaded program (`.module()`) and the package, all run in turn so that a busy
machine slows each alike.

    python benchmarks/bench_torch_export.py                  # every format, 512-wide MLP, batch 64
    python benchmarks/bench_torch_export.py --formats int8,mxfp8 --width 256 --repeats 20
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time

import torch
from torch import nn

import tqcompile as tq

PTQ = ("int8", "fp8", "int4_weight_only", "mxfp8", "nvfp4")  # tq.configs presets; INT4 in groups of 32
RECIPES = ("fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4")


def build(kind: str, name: str, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)).eval()
    if kind == "ptq":
        config = tq.configs.int4_weight_only(32) if name == "int4_weight_only" else getattr(tq.configs, name)()
        return tq.calibrate(model, config, lambda m: m(torch.randn(64, width)), progress=False)
    return tq.convert(model, tq.recipes.get(name))


def median_ms(fns: dict[str, object], x: torch.Tensor, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn(x)  # warm up
        for _ in range(repeats):
            for k, fn in fns.items():
                t = time.perf_counter()
                fn(x)
                times[k].append(time.perf_counter() - t)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def row(kind: str, name: str, width: int, batch: int, repeats: int, tmp: str) -> str:
    model = build(kind, name, width)
    x = torch.randn(batch, width)
    with torch.no_grad():
        program = torch.export.export(model, (x,))
        expected = model(x)
    buf = io.BytesIO()
    torch.export.save(tq.lift_quantizers(program), buf)
    size_mb = len(buf.getvalue()) / 2**20
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    fns = {"eager": model, "loaded": loaded}
    with torch.no_grad():
        same = torch.equal(loaded(x), expected)
    t = time.perf_counter()
    try:
        path = torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(tmp, f"{kind}_{name}.pt2"))
        compile_s = f"{time.perf_counter() - t:.1f}"
        fns["aoti"] = torch._inductor.aoti_load_package(path)
        with torch.no_grad():
            aoti_same = str(torch.equal(fns["aoti"](x), expected))
    except Exception as e:  # noqa: BLE001  (a table row reports whatever AOTInductor refuses)
        compile_s, aoti_same = "-", f"fails: {str(e).splitlines()[0][:70]}"
    ms = median_ms(fns, x, repeats)
    times = " | ".join(f"{ms[k]:.2f}" if k in ms else "-" for k in ("eager", "loaded", "aoti"))
    return f"| {kind} {name} | {size_mb:.1f} | {same} | {aoti_same} | {compile_s} | {times} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="", help="comma-separated PTQ preset or recipe names (default: all)")
    parser.add_argument("--width", type=int, default=512, help="MLP width; hidden is 4x (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=64, help="rows per forward (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=30, help="timed forwards of each (default: %(default)s)")
    args = parser.parse_args()
    wanted = {n for n in args.formats.split(",") if n}
    cases = [("ptq", n) for n in PTQ] + [("convert", n) for n in RECIPES]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, MLP {args.width}-{4 * args.width}-{args.width}, batch {args.batch}")
    print("| model | .pt2 MB | loaded == eager | AOTI == eager | AOTI compile s | eager ms | loaded ms | AOTI ms |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind, name in cases:
            if not wanted or name in wanted:
                print(row(kind, name, args.width, args.batch, args.repeats, tmp), flush=True)


if __name__ == "__main__":
    main()
