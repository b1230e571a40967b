"""Perplexity of PTQ algorithms, tq against llmcompressor 0.14 on the same model and calibration data.

    PYTHONPATH=. python benchmarks/bench_ptq_algorithms.py --llmc-python /path/to/llmc/bin/python [--json out.json]
    PYTHONPATH=. python benchmarks/bench_ptq_algorithms.py --llmc-python ... --quick    # smoke check: 6 rows, small model

llmcompressor 0.14 needs transformers <= 5.17, so it runs in its own environment (as in
tests/data/llmcompressor/make_fixtures.py):

    python -m venv llmc && llmc/bin/pip install torch==2.13.0 && \
        llmc/bin/pip install "llmcompressor==0.14.*" "transformers<=5.17" torch==2.13.0

What it does:

1. builds a Hugging Face `LlamaForCausalLM` from a config (byte-level vocabulary of 256, hidden 256,
   intermediate 768, 2 layers, head_dim 64: every GEMM's input dim is a multiple of 128, so INT4
   groups of 128 and 32 apply to all of them) and trains it on the bytes of Python's help texts
   (`pydoc_data.topics`, shipped with Python), the first 90% of them; the last 10% are held out for
   perplexity. The trained model and its byte-level tokenizer (built with `tokenizers`; llmcompressor's
   `oneshot` insists on a processor when given a dataset) are cached in --workdir: a rerun skips training.
2. picks the calibration rows (64 windows of 256 tokens from the training split, fixed seed) and the
   held-out windows (256 tokens each), and writes both to --workdir/data.pt: both tools get these rows.
3. per table row, in a fresh process each (time and peak RSS are that run's own): tq loads the float
   model, `tq.calibrate(model, config, forward_loop, algorithm=A)`, and scores the fake-quantized model;
   llmcompressor (`llmc_ptq_worker.py` in --llmc-python) runs `oneshot` with the matching modifiers,
   writes its compressed checkpoint, loads it back with transformers (compressed-tensors
   decompresses the weights to ``q * scale``, and its quantized forward quantizes W8A8 inputs per
   token; the worker checks both) and scores it with the same function (`ptq_eval.scores`:
   perplexity, and the KL divergence of its next-token distributions from the float model's).
   The llmcompressor checkpoint is also read by `tq.load_exported` and scored in tq ("llmc ckpt in tq":
   the same weights under tq's symmetric integer range, see the footnote).
4. prints three markdown tables (INT4 weight-only, groups of 128 and of 32; W8A8 INT8 with per-channel
   weights and dynamic per-token activations, the scheme vLLM serves), with the unigram baseline and
   the float model's perplexity, and the whole run's wall time.

An algorithm this tq does not offer yet (`tq.calibrate` refuses its name, or its module is missing) is
shown as n/a, with the reason under the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling benchmark scripts, imported for their helpers

from bench_export_memory import in_fresh_process  # noqa: E402
from ptq_eval import paired_difference, peak_rss_mib, scores, windows  # noqa: E402
from serve_with_vllm import text_bytes  # noqa: E402

import tqcompile as tq  # noqa: E402
from tqcompile.calibration.algorithms import AWQ, GPTQ  # noqa: E402

FOOTNOTE = (
    "Integer grids: tq's presets quantize weights on the FULL grid (INT4 in [-8, 7] with scale amax/7.5, INT8 "
    "in [-128, 127] with amax/127.5), llmcompressor's symmetric observer's grid; the 'SYMMETRIC grid' table is "
    "tq's grid before (INT4 in [-7, 7], amax/7). 'llmc ckpt in tq' is llmcompressor's checkpoint read by "
    "tq.load_exported and scored in tq (its codes, -8 included, as they are). Defaults as shipped: llmcompressor's GPTQ uses static "
    "activation order (actorder='static'), as tq's GPTQ() (act_order=True); llmcompressor's AWQ has no weight-"
    "clipping search, tq's AWQ() clips (clip=True; the clip=False row is like for like). Times are each run's calibration wall seconds (tq.calibrate; "
    "llmcompressor's oneshot); peak RSS is the run's process high-water mark right after it (imports and the "
    "fp32 model included; in brackets the mark before calibrating). 'tq − llmc': tq's log perplexity minus "
    "llmcompressor's (negative: tq lower), ± its standard error paired over the held-out windows (adjacent "
    "windows of one text are not independent, so read it as a rough scale)."
)


# --------------------------------------------------------------------------------------------------
# The model, its tokenizer and the data
# --------------------------------------------------------------------------------------------------


def split_text() -> tuple[torch.Tensor, torch.Tensor]:
    """The byte ids of Python's help texts: the first 90% for training and calibration, the last 10% held out."""
    data = text_bytes()
    cut = data.numel() * 9 // 10
    return data[:cut], data[cut:]


def byte_tokenizer():
    """A byte-level tokenizer whose id of each byte is the byte's value (what `text_bytes` yields), as
    a transformers tokenizer that `save_pretrained` writes beside the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # ByteLevel pre-tokenization maps each byte to a printable character (GPT-2's table: printable
    # Latin-1 bytes stand for themselves, the others for 256 + their rank); map that character back to the byte.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def model_config(layers: int, seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )


def fit(model, train_ids: torch.Tensor, *, steps: int, seq: int, lr: float = 3e-3, warmup: int = 50, batch: int = 8, seed: int = 0,
        log: str = "train") -> float:
    """AdamW (warm-up, then cosine decay) on random windows of the training split; the model is left
    in eval mode. Returns the seconds it took."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, train_ids.numel() - seq, (batch,), generator=gen).tolist()
        x = torch.stack([train_ids[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"  {log} step {step:4d}  loss {loss.item():.3f}  ({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    return time.perf_counter() - start


def train(model_dir: Path, train_ids: torch.Tensor, *, layers: int, steps: int, seq: int, batch: int = 8, seed: int = 0) -> None:
    """Train the Llama with AdamW (cosine decay) on random windows of the training split and save it,
    with the byte-level tokenizer, to `model_dir`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(layers, seq))
    seconds = fit(model, train_ids, steps=steps, seq=seq, batch=batch, seed=seed)
    model.save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    (model_dir / "train_seconds.txt").write_text(f"{seconds:.1f}\n")


def unigram_perplexity(train_ids: torch.Tensor, rows: torch.Tensor) -> float:
    """Perplexity of the byte frequencies of the training split (add-one smoothed) on the positions
    `ptq_eval.scores` scores (every token of each row but its first)."""
    counts = torch.bincount(train_ids, minlength=256).double() + 1
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[rows[:, 1:].reshape(-1)].mean().item())


# --------------------------------------------------------------------------------------------------
# The table's rows
# --------------------------------------------------------------------------------------------------

# (table, row label, tq algorithm or None, llmcompressor recipe name or None)
INT4_ROWS = (
    ("RTN (tq `max`; llmc QuantizationModifier)", "max", "rtn"),
    ("GPTQ", "gptq", "gptq"),
    # Both GPTQs order columns by the Hessian's diagonal by default (llmcompressor "static", tq act_order=True).
    ("GPTQ, act_order=False (tq only)", GPTQ(act_order=False), None),
    ("AWQ", "awq", "awq"),
    # llmcompressor's AWQ has no clipping search: tq's without it, like for like.
    ("AWQ, clip=False (tq only)", AWQ(clip=False), None),
    # Candidates scored by the attention's / MLP's output error, as llmcompressor scores them.
    ("AWQ, loss='output'", AWQ(loss="output"), "awq"),
)
W8A8_ROWS = (
    ("naive (tq `max`; llmc QuantizationModifier W8A8)", "max", "w8a8"),
    ("SmoothQuant 0.5", "smoothquant", "sq"),
    ("SmoothQuant 0.5 + GPTQ", ("smoothquant", "gptq"), "sq_gptq"),
)
# Round to nearest and GPTQ on the other integer schemes: INT3, asymmetric INT4 (zero points), and
# tq's INT4 on the SYMMETRIC grid (-7..7; tq only) to show what the grid alone does.
GRID_ROWS = (
    ("RTN (tq `max`; llmc QuantizationModifier)", "max", "rtn"),
    ("GPTQ", "gptq", "gptq"),
)
QUICK = {("int4", 128, "max"), ("int4", 128, "gptq"), ("int3", 128, "max"), ("int4_asym", 128, "max"), ("w8a8", 0, "max"), ("w8a8", 0, ("smoothquant", "gptq"))}
# scheme -> (weight bits, asymmetric) of the llmcompressor side; None: no llmcompressor column.
LLMC_SCHEMES = {"int4": (4, False), "int3": (3, False), "int4_asym": (4, True), "int4_symmetric": None, "w8a8": (8, False)}


def tq_config(scheme: str, group: int):
    """Integer weight-only groups of `group` (INT4 and INT3 on the presets' FULL grid, INT4 on the
    SYMMETRIC grid or asymmetric); or W8A8 INT8 with per-channel weights and dynamic per-token
    activations (llmcompressor's W8A8, `tq.configs.int8_dynamic()`; tq.configs.int8() quantizes
    activations per tensor, statically)."""
    if scheme == "int4":
        return tq.configs.int4_weight_only(group)
    if scheme == "int3":
        return tq.configs.int_weight_only(3, group)
    if scheme == "int4_asym":
        return tq.configs.int4_weight_only(group, grid=tq.IntGrid.ASYMMETRIC)
    if scheme == "int4_symmetric":
        return tq.configs.int4_weight_only(group, grid=tq.IntGrid.SYMMETRIC)
    return tq.configs.int8_dynamic()


def tq_run(model_dir: str, data_path: str, config, algorithm, threads: int, extra, queue, calibrate_kwargs: dict | None = None,
           finetune=None) -> None:
    """In a fresh process: calibrate the float model with tq's `config` and score it; a result dict
    on `queue` (never nothing: the parent waits on it). `extra(model)`, where not None: more entries
    for it (a module-level function: it crosses to the spawned process). `calibrate_kwargs`: more
    arguments of `tq.calibrate` (bench_kv_cache.py's ``kv_scale_search``; bind them with functools.partial).
    `finetune(model, reference)`, where not None: trains the calibrated model before it is scored
    (bench_kv_cache.py's QAT rows) and returns more entries for the result."""
    try:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        data = torch.load(data_path)
        calib = data["calib"]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        rss_before = peak_rss_mib()
        start = time.perf_counter()
        try:
            with torch.no_grad():
                tq.calibrate(
                    model,
                    config,
                    lambda m: [m(input_ids=calib[i : i + 8]) for i in range(0, calib.shape[0], 8)],
                    algorithm=algorithm,
                    progress=False,
                    **(calibrate_kwargs or {}),
                )
        except (ValueError, ImportError) as e:
            # Not offered by this tq (yet): tq.calibrate refuses the name, or its module is not there.
            if isinstance(e, ValueError) and "algorithm" not in str(e):
                raise
            queue.put({"na": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
            return
        seconds = time.perf_counter() - start
        rss = peak_rss_mib()
        more = {} if extra is None else extra(model)
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        if finetune is not None:
            more.update(finetune(model, reference))
        queue.put({**scores(model, data["eval"], reference), "seconds": seconds, "peak_rss_mib": rss, "rss_before_mib": rss_before, **more})
    except Exception as e:  # noqa: BLE001 - a benchmark reports the failed row and goes on
        queue.put({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})


def _llmc_run(llmc_python: str, model_dir: Path, data_path: Path, recipe: str, group: int, workdir: Path, threads: int, reference,
              scheme: str = "int4") -> dict:
    """llmcompressor's row in its own environment (llmc_ptq_worker.py); then its checkpoint read by tq."""
    bits, asym = LLMC_SCHEMES[scheme]
    out = workdir / f"llmc_{recipe}_g{group}_{scheme}"
    result_path = out.with_suffix(".json")
    log_path = out.with_suffix(".log")
    result_path.unlink(missing_ok=True)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # llmcompressor's environment must not pick up this one's packages
    cmd = [llmc_python, str(HERE / "llmc_ptq_worker.py"), "--model", str(model_dir), "--data", str(data_path),
           "--recipe", recipe, "--group", str(group), "--out", str(out), "--result", str(result_path), "--threads", str(threads),
           "--bits", str(bits), *(["--asym"] if asym else [])]
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    if not result_path.exists():
        tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
        return {"error": f"llmcompressor run exited with {proc.returncode}: {tail[0][:200]} (log: {log_path})"}
    result = json.loads(result_path.read_text())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # load_exported warns about scales with no exact tq amax: the footnote says it
            result["in_tq"] = scores(tq.load_exported(str(out)), torch.load(data_path)["eval"], reference)
    except Exception as e:  # noqa: BLE001
        result["in_tq_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return result


# --------------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------------


def _cell_ppl(r: dict | None) -> str:
    if r is None:
        return "–"
    if "na" in r:
        return "n/a"
    if "error" in r:
        return f"error: {r['error']}"
    return f"{r['ppl']:.4f} ({r['kl'] * 1e3:.3g})"


def _cell_cost(r: dict | None) -> str:
    if r is None or "ppl" not in r:
        return ""
    return f"{r['seconds']:.1f} s, {r['peak_rss_mib']:.0f} ({r['rss_before_mib']:.0f}) MiB"


def _cell_difference(a: dict | None, b: dict | None) -> str:
    """tq's log-perplexity minus llmcompressor's, ± its paired standard error, 10⁻³ nats."""
    if a is None or b is None or "row_nll" not in a or "row_nll" not in b:
        return ""
    mean, se = paired_difference(a["row_nll"], b["row_nll"])
    return f"{mean * 1e3:+.2f} ± {se * 1e3:.2f}"


def print_table(title: str, float_ppl: float, rows: list[dict]) -> None:
    print(f"\n**{title}**: perplexity (KL from float, 10⁻³ nats)\n")
    print("| method | tq | llmcompressor | tq − llmc, log ppl (10⁻³) | llmc ckpt in tq | tq time, peak RSS | llmc time, peak RSS |")
    print("|---|---|---|---|---|---|---|")
    print(f"| float | {float_ppl:.4f} | {float_ppl:.4f} | | | | |")
    for row in rows:
        tq_r, llmc = row["tq"], row["llmc"]
        in_tq = "" if llmc is None else _cell_ppl(llmc["in_tq"]) if "in_tq" in llmc else llmc.get("in_tq_error", "")
        print(f"| {row['label']} | {_cell_ppl(tq_r)} | {_cell_ppl(llmc)} | {_cell_difference(tq_r, llmc)} | {in_tq} | "
              f"{_cell_cost(tq_r)} | {_cell_cost(llmc)} |")
    for row in rows:
        if row["tq"] is not None and "na" in row["tq"]:
            print(f"\nn/a: tq {row['label']}: {row['tq']['na']}")


def add_anchor_args(p: argparse.ArgumentParser) -> None:
    """The arguments of the anchor model and data (this benchmark's, and bench_kv_cache.py's)."""
    p.add_argument("--llmc-python", default=None, help="the python of a venv with llmcompressor 0.14 (none: tq columns only)")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "tq_bench_ptq"), help="cache of the trained model and checkpoints")
    p.add_argument("--steps", type=int, default=1600, help="training steps (batch 8 x 256 tokens)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="training seed (another seed: another model to check a result on)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of every run (default: torch's)")
    p.add_argument("--calib", default="64x256", help="calibration rows x tokens")
    p.add_argument("--quick", action="store_true", help="smoke check: 2 layers, 150 steps, 16x128 calibration, 6 rows")
    p.add_argument("--json", default=None, help="also write the results here")


def anchor(args: argparse.Namespace, data_name: str = "data.pt") -> dict:
    """The trained anchor model (trained once into the workdir), the calibration rows and held-out
    windows (written to `data_name` there, for the fresh processes), the float reference and its
    perplexity, the unigram baseline: what every table row is measured against."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    n_calib, seq = (int(v) for v in args.calib.split("x"))
    layers, steps = args.layers, args.steps
    if args.quick:
        layers, steps, n_calib, seq = 2, 150, 16, 128
    workdir = Path(args.workdir) / ("quick" if args.quick else "full")
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / (f"float_{layers}l_{steps}steps_seq{seq}" + (f"_seed{args.seed}" if args.seed else ""))
    train_ids, held_out = split_text()
    if not (model_dir / "config.json").exists():
        print(f"training the {layers}-layer Llama ({steps} steps of 8 x {seq} tokens) into {model_dir} ...", flush=True)
        train(model_dir, train_ids, layers=layers, steps=steps, seq=seq, seed=args.seed)
    train_s = float((model_dir / "train_seconds.txt").read_text())

    gen = torch.Generator().manual_seed(1)
    starts = torch.randint(0, train_ids.numel() - seq, (n_calib,), generator=gen).tolist()
    calib = torch.stack([train_ids[s : s + seq] for s in starts])
    eval_rows = windows(held_out, seq)[: 32 if args.quick else None]
    data_path = workdir / data_name
    torch.save({"calib": calib, "eval": eval_rows}, data_path)

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    float_ppl = scores(reference, eval_rows)["ppl"]
    unigram = unigram_perplexity(train_ids, eval_rows)
    print(f"model: {layers} layers, trained {steps} steps ({train_s:.0f} s when built); held-out {eval_rows.numel()} tokens; "
          f"calibration {n_calib} x {seq} tokens; float perplexity {float_ppl:.3f}, unigram baseline {unigram:.3f}", flush=True)
    return dict(workdir=workdir, model_dir=model_dir, data_path=data_path, eval_rows=eval_rows, reference=reference, float_ppl=float_ppl,
                unigram=unigram, train_s=train_s, layers=layers, steps=steps, n_calib=n_calib, seq=seq)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_anchor_args(p)
    p.add_argument("--only", action="append", default=None, metavar="TEXT",
                   help="run only the rows whose 'table title: row label' contains TEXT (case-insensitive; repeatable), "
                        "e.g. --only 'W8A8 INT8 (per-channel weights, dynamic per-token activations): SmoothQuant 0.5'")
    args = p.parse_args()
    begin = time.perf_counter()
    a = anchor(args)
    workdir, model_dir, data_path, eval_rows, reference = a["workdir"], a["model_dir"], a["data_path"], a["eval_rows"], a["reference"]
    float_ppl, unigram, train_s, layers, steps, n_calib, seq = (a[k] for k in ("float_ppl", "unigram", "train_s", "layers", "steps", "n_calib", "seq"))

    tables = [
        ("INT4 weight-only, groups of 128", "int4", 128, INT4_ROWS),
        ("INT4 weight-only, groups of 32", "int4", 32, INT4_ROWS),
        ("INT3 weight-only, groups of 128", "int3", 128, GRID_ROWS),
        ("INT4 weight-only asymmetric (zero points), groups of 128", "int4_asym", 128, GRID_ROWS),
        ("INT4 weight-only on tq's SYMMETRIC grid (-7..7), groups of 128 (tq only)", "int4_symmetric", 128, GRID_ROWS),
        ("W8A8 INT8 (per-channel weights, dynamic per-token activations)", "w8a8", 0, W8A8_ROWS),
    ]
    results = []
    for title, scheme, group, specs in tables:
        rows = []
        for label, algorithm, recipe in specs:
            if args.quick and (scheme, group, algorithm) not in QUICK:
                continue
            if args.only and not any(o.lower() in f"{title}: {label}".lower() for o in args.only):
                continue
            print(f"== {title}: {label}", flush=True)
            tq_r = in_fresh_process(tq_run, str(model_dir), str(data_path), tq_config(scheme, group), algorithm, args.threads, None)
            print(f"   tq   {tq_r}", flush=True)
            llmc_r = None
            if args.llmc_python and recipe is not None and LLMC_SCHEMES[scheme] is not None:
                llmc_r = _llmc_run(args.llmc_python, model_dir, data_path, recipe, group, workdir, args.threads, reference, scheme)
                print(f"   llmc {llmc_r}", flush=True)
            rows.append({"label": label, "algorithm": algorithm, "llmc_recipe": recipe, "tq": tq_r, "llmc": llmc_r})
        if rows:
            results.append({"title": title, "rows": rows})

    print(f"\nModel: LlamaForCausalLM, {layers} layers, hidden 256, intermediate 768, byte vocabulary; held-out perplexity "
          f"(last 10% of pydoc_data.topics, {eval_rows.shape[0]} windows of {seq} bytes): float {float_ppl:.3f}, unigram "
          f"baseline {unigram:.3f}. Calibration: the same {n_calib} windows of {seq} bytes for both tools. torch threads: {args.threads}.")
    for t in results:
        print_table(t["title"], float_ppl, t["rows"])
    total = time.perf_counter() - begin
    print(f"\n{FOOTNOTE}\n\nWhole run: {total:.0f} s (training, cached, took {train_s:.0f} s when built).")
    if args.json:
        meta = {"layers": layers, "steps": steps, "calib": [n_calib, seq], "eval_tokens": eval_rows.numel(), "float_ppl": float_ppl,
                "unigram_ppl": unigram, "train_seconds": train_s, "threads": args.threads, "total_seconds": total, "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({"meta": meta, "tables": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
