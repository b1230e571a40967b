"""Peak memory of quantizing a checkpoint on disk: `tq.quantize_checkpoint` (the model never
loaded) against loading it, `tq.calibrate(..., None)` and `tq.export`, at Llama-3-8B widths.

    PYTHONPATH=. python benchmarks/bench_quantize_checkpoint.py [--layers 4,8,16] [--in-memory 4,8]

For each depth it writes a bfloat16 Llama checkpoint (hidden 4096, intermediate 14336, 32 heads,
8 KV heads, vocabulary 32000, random weights) shard by shard, without holding the model (so the
checkpoint can exceed the machine's memory), then, each in a fresh process: INT4 weight-only
groups of 128 (`tq.configs.int4_weight_only()`, data-free round to nearest) with
`tq.quantize_checkpoint`, and, for the depths in --in-memory, the same through the loaded model.
It prints the checkpoint's size, the output's size, the run's wall seconds and its peak RSS (the
process high-water mark, `ru_maxrss`; imports included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_export_memory import in_fresh_process  # noqa: E402

WIDTHS = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, torch_dtype="bfloat16", **WIDTHS)


def write_checkpoint(path: Path, layers: int) -> int:
    """A random bf16 Llama checkpoint of `layers` layers in `path`, one shard a layer (plus one for
    the embedding, norm and head), written without holding the model. Returns its bytes."""
    from safetensors.torch import save_file

    if (path / "model.safetensors.index.json").exists():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    path.mkdir(parents=True, exist_ok=True)
    _config(layers).save_pretrained(path)
    h, i, kv = WIDTHS["hidden_size"], WIDTHS["intermediate_size"], WIDTHS["num_key_value_heads"] * 128
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shards = [{"model.embed_tokens.weight": rand(WIDTHS["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": rand(WIDTHS["vocab_size"], h)}]
    weight_map, total, n = {}, 0, layers + 1
    for s in range(n):
        if s > 0:
            p = f"model.layers.{s - 1}."
            shards = [{p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                       p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                       p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h), p + "mlp.down_proj.weight": rand(h, i),
                       p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                       p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}]
        name = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        save_file(shards[0], str(path / name), metadata={"format": "pt"})
        for k, t in shards[0].items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
        shards = None
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _streamed(src: str, out: str, queue) -> None:
    import tqcompile as tq

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tq.quantize_checkpoint(src, out, tq.configs.int4_weight_only(), overwrite=True)
    queue.put({"seconds": time.perf_counter() - t0, "peak_mib": _peak_mib()})


def _in_memory(src: str, out: str, queue) -> None:
    import warnings

    from transformers import AutoModelForCausalLM

    import tqcompile as tq

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.calibrate(model, tq.configs.int4_weight_only(), None, progress=False)
    tq.export(model, out, overwrite=True)
    queue.put({"seconds": time.perf_counter() - t0, "peak_mib": _peak_mib()})


def _bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="4,8,16")
    p.add_argument("--in-memory", default="4,8", help="depths also run through the loaded model ('' for none)")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "tq_bench_stream"))
    p.add_argument("--keep", action="store_true", help="keep the float checkpoints (they are rewritten otherwise each run)")
    args = p.parse_args()
    work = Path(args.workdir)
    in_memory = {int(v) for v in args.in_memory.split(",") if v}
    rows = []
    for layers in (int(v) for v in args.layers.split(",")):
        src = work / f"llama_{layers}l"
        t0 = time.perf_counter()
        size = write_checkpoint(src, layers)
        print(f"{layers} layers: checkpoint {size / 2**30:.2f} GiB (written in {time.perf_counter() - t0:.0f} s)", flush=True)
        for how, fn in (("tq.quantize_checkpoint", _streamed), ("load + calibrate + export", _in_memory)):
            if fn is _in_memory and layers not in in_memory:
                continue
            out = str(work / f"out_{layers}l")
            r = in_fresh_process(fn, str(src), out)
            r.update(layers=layers, how=how, checkpoint_gib=size / 2**30, output_gib=_bytes(out) / 2**30)
            print(f"   {how}: {r}", flush=True)
            rows.append(r)
            shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
    print(f"\nINT4 weight-only g128 (data-free) of a bf16 Llama at Llama-3-8B widths, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, one thread:\n")
    print("| layers | checkpoint GiB | how | output GiB | peak RSS MiB | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['checkpoint_gib']:.2f} | {r['how']} | {r['output_gib']:.2f} | {r['peak_mib']:.0f} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
