"""Peak memory of quantizing a checkpoint on disk: `tq.quantize_checkpoint` (the model never
loaded) against loading it, `tq.calibrate(..., None)` and `tq.export`, at Llama-3-8B widths.

    PYTHONPATH=. python benchmarks/bench_quantize_checkpoint.py [--layers 4,8,16] [--in-memory 4,8]
    PYTHONPATH=. python benchmarks/bench_quantize_checkpoint.py --algorithm gptq --data 4x256 --layers 2,4,8 --in-memory 2,4
    PYTHONPATH=. python benchmarks/bench_quantize_checkpoint.py --algorithm gptq --data 4x256 --layers 8 --in-memory '' --llmc-python ... --side-by-side

For each depth it writes a bfloat16 Llama checkpoint (hidden 4096, intermediate 14336, 32 heads,
8 KV heads, vocabulary 32000, random weights) shard by shard, without holding the model (so the
checkpoint can exceed the machine's memory), then, each in a fresh process: INT4 weight-only
groups of 128 (`tq.configs.int4_weight_only()`, data-free round to nearest) with
`tq.quantize_checkpoint`, and, for the depths in --in-memory, the same through the loaded model.
It prints the checkpoint's size, the output's size, the run's wall seconds and its peak RSS (the
process high-water mark, `ru_maxrss`; imports included).

With ``--algorithm gptq --data ROWSxTOKENS`` (or any `tq.calibrate` algorithm) both runs calibrate
on that many random token rows (one batch a row): `tq.quantize_checkpoint(..., data=...)` reads one
decoder layer at a time, the in-memory run loads the model and calls `tq.calibrate` with the rows.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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


def _rows(data: str | None) -> list[torch.Tensor] | None:
    if not data:
        return None
    n, tokens = (int(v) for v in data.split("x"))
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, WIDTHS["vocab_size"], (1, tokens), generator=g) for _ in range(n)]


def _streamed(src: str, out: str, algorithm: str, data: str | None, queue) -> None:
    import tqcompile as tq

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tq.quantize_checkpoint(src, out, tq.configs.int4_weight_only(), data=_rows(data), algorithm=algorithm, overwrite=True, progress=False)
    queue.put({"seconds": time.perf_counter() - t0, "peak_mib": _peak_mib()})


def _in_memory(src: str, out: str, algorithm: str, data: str | None, queue) -> None:
    import warnings

    from transformers import AutoModelForCausalLM

    import tqcompile as tq

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = _rows(data)
        loop = None if rows is None else (lambda m: [m(r) for r in rows])
        tq.calibrate(model, tq.configs.int4_weight_only(), loop, algorithm=algorithm, progress=False)
    tq.export(model, out, overwrite=True)
    queue.put({"seconds": time.perf_counter() - t0, "peak_mib": _peak_mib()})


def run_llmc(src: str, out: str, data: str) -> dict:
    """llmcompressor 0.14's GPTQ W4A16 (groups of 128) of the same checkpoint on the same rows, in
    its own environment: load (bf16), `oneshot`, save compressed; peak RSS of the process."""
    import tempfile

    from bench_ptq_algorithms import byte_tokenizer  # oneshot insists on a processor when given a dataset
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    rows = torch.cat(_rows(data))
    ds = Dataset.from_dict({"input_ids": rows.tolist(), "attention_mask": torch.ones_like(rows).tolist()})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tok:
        byte_tokenizer().save_pretrained(tok)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        oneshot(model=model, dataset=ds, processor=tok, recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
                num_calibration_samples=rows.shape[0], max_seq_length=rows.shape[1], shuffle_calibration_samples=False)
        model.save_pretrained(out, save_compressed=True)
    return {"seconds": time.perf_counter() - t0, "peak_mib": _peak_mib()}


def _llmc_child(python: str, src: str, out: str, data: str) -> dict:
    import subprocess

    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import bench_quantize_checkpoint as b; "
            f"print('@@' + json.dumps(b.run_llmc({src!r}, {out!r}, {data!r})))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@")), None)
    if line is None:
        raise RuntimeError(f"llmcompressor run failed: {(proc.stderr.strip().splitlines() or [proc.returncode])[-1]}")
    return json.loads(line[2:])


def _bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="4,8,16")
    p.add_argument("--in-memory", default="4,8", help="depths also run through the loaded model ('' for none)")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "tq_bench_stream"))
    p.add_argument("--keep", action="store_true", help="keep the float checkpoints (they are rewritten otherwise each run)")
    p.add_argument("--algorithm", default="max", help="tq.calibrate's algorithm (with --data for anything but 'max')")
    p.add_argument("--data", default=None, help="calibration rows x tokens, e.g. 4x256 (default: data-free)")
    p.add_argument("--llmc-python", default=None, help="with --algorithm gptq: also llmcompressor 0.14 (its venv's python)")
    p.add_argument("--side-by-side", action="store_true",
                   help="run a depth's variants at once, one thread each (the same load on every one; peak RSS is still each process's own)")
    args = p.parse_args()
    work = Path(args.workdir)
    in_memory = {int(v) for v in args.in_memory.split(",") if v}
    rows = []
    for layers in (int(v) for v in args.layers.split(",")):
        src = work / f"llama_{layers}l"
        t0 = time.perf_counter()
        size = write_checkpoint(src, layers)
        print(f"{layers} layers: checkpoint {size / 2**30:.2f} GiB (written in {time.perf_counter() - t0:.0f} s)", flush=True)
        runs = [("tq.quantize_checkpoint", _streamed), ("load + calibrate + export", _in_memory)]
        if args.llmc_python and args.algorithm == "gptq" and args.data:
            runs.append(("llmcompressor 0.14 (load + oneshot + save)", None))
        runs = [(k, how, fn) for k, (how, fn) in enumerate(runs) if fn is not _in_memory or layers in in_memory]

        def run(k, how, fn, src=src, layers=layers, size=size):
            out = str(work / f"out_{layers}l_{k}")
            if fn is None:
                r = _llmc_child(args.llmc_python, str(src), out, args.data)
            else:
                r = in_fresh_process(fn, str(src), out, args.algorithm, args.data)
            r.update(layers=layers, how=how, checkpoint_gib=size / 2**30, output_gib=_bytes(out) / 2**30)
            print(f"   {how}: {r}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            return r

        if args.side_by_side:
            with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
                rows += list(pool.map(lambda a: run(*a), runs))
        else:
            rows += [run(*a) for a in runs]
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
    how = "data-free" if not args.data else f"{args.algorithm}, {args.data} calibration tokens"
    print(f"\nINT4 weight-only g128 ({how}) of a bf16 Llama at Llama-3-8B widths, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, one thread:\n")
    print("| layers | checkpoint GiB | how | output GiB | peak RSS MiB | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['checkpoint_gib']:.2f} | {r['how']} | {r['output_gib']:.2f} | {r['peak_mib']:.0f} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
