"""The demo's tables: `format_table` (one process) and `format_sharded_table` (FSDP2 / TP), each
with the setting it was measured in (model, device or layout, torch version) and what its
columns mean."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
from collections.abc import Sequence

import torch

from tqcompile.demo.sharded import ShardedRunResult, layout_name, process_group_backend
from tqcompile.demo.training import BASELINE, DemoConfig, RunResult, final_window

__all__ = ["format_table", "format_sharded_table", "save_results", "load_results"]


def _fmt_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def _ms_or_dash(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def format_table(results: Sequence[RunResult], cfg: DemoConfig) -> str:
    """The comparison table, with the setting it was measured in (model, device, torch version)."""
    mc = cfg.model_config()
    mlp = f"expert-choice MoE, {mc.n_experts} experts, capacity factor {mc.capacity_factor}" if mc.n_experts else "dense MLP"
    n_threads = torch.get_num_threads()
    threads = f", {n_threads} thread{'s' if n_threads != 1 else ''}" if cfg.device == "cpu" else ""
    device_name = torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else "cpu"
    head = [
        f"model: GPT {mc.n_layer} layers, d_model {mc.d_model}, {mlp}, byte vocab {mc.vocab_size}; "
        f"{cfg.batch_size}x{cfg.seq_len} tokens/step, {cfg.steps} steps, AdamW lr {cfg.lr} (warmup {cfg.warmup_steps}, cosine), seed {cfg.seed}",
        f"device: {device_name}{threads}; torch {torch.__version__}; torch.compile(fullgraph=True, backend={cfg.backend!r})",
        "bf16 = fp32 weights + bf16 autocast; recipes quantize the blocks' linears "
        + ("(lm_head and router stay bf16 autocast)" if mc.n_experts else "(lm_head stays bf16 autocast)"),
        "",
    ]
    base = next((r for r in results if r.name == BASELINE and r.error is None and r.losses), None)
    cpu_col = cfg.device == "cpu"  # on CUDA the host's CPU time says little about the step
    header = (
        "recipe",
        "final loss",
        "vs bf16",
        "step ms",
        *(("cpu ms",) if cpu_col else ()),
        "1st step s",
        "graph breaks",
        "recompiles",
    )
    rows, notes = [], []
    for r in results:
        if r.error is not None and not r.losses and not r.graph_breaks:
            # Refused before training (the recipe cannot serve this model): a row would be all dashes.
            notes.append(f"{r.name}: not run: {r.error}")
            continue
        if r.error is not None:
            rows.append((r.name, "-", "-", "-", *(("-",) if cpu_col else ()), "-", str(r.graph_breaks), "-"))
            notes.append(f"{r.name}: not run to the end: {r.error}")
            continue
        gap = "-" if base is None or r is base else f"{r.final_loss() - base.final_loss():+.4f}"
        rows.append(
            (
                r.name,
                f"{r.final_loss():.4f}",
                gap,
                f"{r.step_ms():.1f}",
                *((_ms_or_dash(r.step_cpu_ms()),) if cpu_col else ()),
                f"{r.first_step_s():.1f}",
                str(r.graph_breaks),
                str(r.recompiles),
            )
        )
    foot = [
        "",
        f"final loss: mean of the last {final_window(cfg.steps)} step{'s' if final_window(cfg.steps) != 1 else ''}; "
        "step ms: median wall time after the first step; "
        + (
            "cpu ms: median CPU time of the process per step (unlike wall time, it does not grow on a busy machine); "
            if cpu_col
            else ""
        )
        + "1st step: includes compiling forward, backward and the optimizer step",
    ]
    return "\n".join(head + [_fmt_table(header, rows)] + foot + notes)


def format_sharded_table(results: Sequence[ShardedRunResult], cfg: DemoConfig, fsdp: int, tp: int) -> str:
    """The demo's table for a sharded run, with the bytes all-gathered per step against bf16."""
    mc = cfg.model_config()
    head = [
        f"model: GPT {mc.n_layer} layers, d_model {mc.d_model}; {cfg.batch_size}x{cfg.seq_len} tokens/step (global), "
        f"{cfg.steps} steps, AdamW lr {cfg.lr} (warmup {cfg.warmup_steps}, cosine), seed {cfg.seed}",
        f"layout: {layout_name(fsdp, tp)}, {process_group_backend(cfg)}, {cfg.device}; torch {torch.__version__}; "
        + ("TP styles, then " if tp > 1 else "")
        + f"blocks compiled fullgraph=True (backend={cfg.backend!r})"
        # Only an FSDP2 layout shards and gathers weights: a TP-only run must not claim it does.
        + ("; then fully_shard: FSDP2 gathers in bf16 unless the recipe gathers quantized" if fsdp > 1 else ""),
        "",
    ]
    base = next((r for r in results if r.name == BASELINE and r.error is None and r.losses), None)
    header = (
        "recipe",
        "final loss",
        "vs bf16",
        "step ms",
        "1st step s",
        "gathered MB/step",
        "vs bf16 bytes",
        "graph breaks",
        "recompiles",
    )
    rows, notes = [], []
    for r in results:
        if r.error is not None:
            rows.append((r.name, "-", "-", "-", "-", "-", "-", str(r.graph_breaks), "-"))
            notes.append(f"{r.name}: not run: {r.error}")
            continue
        gap = "-" if base is None or r is base else f"{r.final_loss() - base.final_loss():+.4f}"
        ratio = "-" if base is None or not base.all_gather_bytes else f"{r.all_gather_bytes / base.all_gather_bytes:.2f}x"
        step_ms = f"{r.step_ms():.1f}" if len(r.step_times_s) > 1 else "-"
        rows.append(
            (
                r.name,
                f"{r.final_loss():.4f}",
                gap,
                step_ms,
                f"{r.first_step_s():.1f}",
                f"{r.all_gather_bytes / 1e6:.3f}",
                ratio,
                str(r.graph_breaks),
                str(r.recompiles),
            )
        )
    window = final_window(cfg.steps)
    foot = [
        "",
        f"final loss: mean of the last {window} step{'s' if window != 1 else ''}; step ms: median wall time after the first "
        "step; 1st step: includes compiling forward, backward and the optimizer step",
        "gathered MB/step: bytes all-gathered by rank 0 in step 2 (forward + backward; FSDP2 weights, TP activations), "
        "counted at the collective; vs bf16 bytes: that over the bf16 run's",
    ]
    return "\n".join(head + [_fmt_table(header, rows)] + foot + notes)


def save_results(results: Sequence[RunResult], cfg: DemoConfig, path: str, plot: str | None = None) -> None:
    """Write a run's results to `path` (JSON): the config, where it ran, every run's losses, step
    times and compile counts, and the SHA-256 of the picture drawn from it (`plot`). docs/demo.md's
    figures come from such a record (``tqcompile demo --plot docs/img/demo.png --results
    docs/img/demo_run.json``), and `tests/test_demo_record.py` holds the page to it."""
    record = {
        "config": dataclasses.asdict(cfg),
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "date": datetime.date.today().isoformat(),
        },
        "runs": [dataclasses.asdict(r) for r in results],
    }
    if plot is not None and os.path.isfile(plot):
        record["plot"] = {"file": os.path.basename(plot), "sha256": hashlib.sha256(open(plot, "rb").read()).hexdigest()}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def load_results(path: str) -> tuple[DemoConfig, list[RunResult], dict]:
    """(config, runs, the whole record) of a file `save_results` wrote."""
    with open(path) as f:
        record = json.load(f)
    return DemoConfig(**record["config"]), [RunResult(**r) for r in record["runs"]], record
