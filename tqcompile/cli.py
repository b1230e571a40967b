"""The `tqcompile` command.

    tqcompile -V | --version
    tqcompile demo [--recipes fp8_tensorwise,mxfp8,nvfp4 | all] [--steps N] [--device cpu|cuda|auto]
                   [--fsdp N] [--tp M] [--moe] [--backend aot_eager|inductor] [--plot PATH | --plot none]
                   [--threads T] [--seed S]

`demo` trains a small byte-level GPT in bf16 and with each recipe, compiled with
`torch.compile(fullgraph=True)`, prints a table of losses, step times, graph breaks and
recompiles, and draws a picture of them (see `tqcompile.demo`). Progress goes to stderr from the
start, so the command is never silent while it starts processes or compiles.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "build_parser"]


def _recipe_list(value: str) -> list[str]:
    from tqcompile.recipes import RECIPES

    if value.strip() == "all":
        return list(RECIPES)
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown recipe(s) {', '.join(map(repr, unknown)) or repr(value)}; allowed: {', '.join(RECIPES)} "
            "(comma-separated), or all"
        )
    return names


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"{value!r} is not allowed; allowed: an integer >= 2")
    return n


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `tqcompile` command."""
    import tqcompile
    from tqcompile.demo import DEFAULT_RECIPES, DemoConfig
    from tqcompile.recipes import RECIPES

    defaults = DemoConfig()
    recipes = f"recipes: {', '.join(RECIPES)}"  # --help lists them: a new user has nowhere else to look
    parser = argparse.ArgumentParser(
        prog="tqcompile", description="tqcompile: quantization for torch.compile(fullgraph=True).", epilog=recipes
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {tqcompile.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a small GPT in bf16 and per recipe, compiled, and compare",
        description="Train a small byte-level GPT once in bf16 and once per recipe, each compiled with "
        "torch.compile(fullgraph=True), print losses, step times, graph breaks and recompiles, and draw them.",
        epilog=recipes,
    )
    demo.add_argument(
        "--recipes",
        type=_recipe_list,
        default=list(DEFAULT_RECIPES),
        help=f"comma-separated recipe names from: {', '.join(RECIPES)}; or 'all' (default: {','.join(DEFAULT_RECIPES)})",
    )
    demo.add_argument(
        "--steps", type=_positive_int, default=defaults.steps, help=f"training steps per run (default: {defaults.steps})"
    )
    demo.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu", help="auto: cuda if available (default: cpu)")
    demo.add_argument("--fsdp", type=int, default=1, help="FSDP2 degree: shard over N processes (default: 1); see docs/demo.md")
    demo.add_argument("--tp", type=int, default=1, help="tensor (+ sequence) parallel degree M; N x M processes (default: 1)")
    demo.add_argument("--moe", action="store_true", help="use an expert-choice MoE MLP (4 experts) instead of the dense MLP")
    demo.add_argument(
        "--backend",
        choices=("aot_eager", "inductor"),
        default=None,
        help="torch.compile backend (default: aot_eager on cpu, inductor on cuda)",
    )
    demo.add_argument(
        "--plot",
        default="tqcompile_demo_loss.png",
        help="PNG to write: loss, loss gap to bf16 and step time per recipe; 'none' to skip (default: %(default)s)",
    )
    demo.add_argument(
        "--results",
        default=None,
        help="also write the runs' losses, step times and compile counts to this JSON file (docs/demo.md's figures "
        "come from one: --plot docs/img/demo.png --results docs/img/demo_run.json)",
    )
    demo.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default on cpu: 1; the demo's tensors are small, and on a busy machine OpenMP's "
        "waiting threads can make 2-thread steps many times slower than 1-thread ones)",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help=f"seed for the initial weights and the data order (default: {defaults.seed})",
    )
    return parser


def _resolve_device(choice: str, parser: argparse.ArgumentParser) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available; use --device cpu or auto")
    return choice


def _output_path_error(path: str) -> str | None:
    """Why the demo could not write an output (its picture, its results) to `path` (None if it can). Checked by writing
    there (a temporary file in its directory; an existing picture opened without truncating it),
    which also catches read-only file systems, and leaves nothing behind."""
    target = Path(path)
    if target.is_dir():
        return "is a directory; give a file name such as loss.png"
    directory = target.parent
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        return f"its directory {directory} {what}"
    try:
        if target.exists():
            with open(target, "r+b"):
                pass
        else:
            fd, probe = tempfile.mkstemp(dir=directory, prefix=".tqcompile_output_check_")
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        return f"cannot write there ({e.strerror or e})"
    return None


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    device = _resolve_device(args.device, parser)
    # Before any run: the picture and the results are written after every run has trained.
    plot_error = None if args.plot.lower() == "none" else _output_path_error(args.plot)
    if plot_error is not None:
        parser.error(f"--plot {args.plot}: {plot_error}; pass a writable path, or --plot none")
    results_error = None if args.results is None else _output_path_error(args.results)
    if results_error is not None:
        parser.error(f"--results {args.results}: {results_error}; pass a writable path, or leave --results out")
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else None)
    if threads is not None and threads < 1:
        parser.error(f"--threads {threads} is not allowed; allowed: an integer >= 1")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run_sharded(args, device, threads) if (args.fsdp, args.tp) != (1, 1) else _run(args, device)
    finally:
        torch.set_num_threads(previous_threads)


def _demo_config(args: argparse.Namespace, device: str):
    """The DemoConfig both the single-process and the sharded demo run with."""
    from tqcompile.demo import DemoConfig

    return DemoConfig(
        steps=args.steps,
        n_experts=4 if args.moe else 0,
        seed=args.seed,
        device=device,
        backend=args.backend or ("inductor" if device == "cuda" else "aot_eager"),
        log_every=max(1, args.steps // 6),
    )


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _report(args: argparse.Namespace, results, table: str, cfg, layout: str | None = None) -> int:
    """Print the table and draw the picture (unless --plot none); the exit status: 1 if a run broke its graph."""
    from tqcompile.demo import plot_losses, save_results

    print(table)
    if args.plot.lower() != "none":
        print(plot_losses(results, args.plot, cfg, layout=layout))
    if args.results is not None:
        save_results(results, cfg, args.results, plot=None if args.plot.lower() == "none" else args.plot)
        print(f"results written to {args.results}")
    return 1 if any(r.error is not None and r.graph_breaks for r in results) else 0


def _run_sharded(args: argparse.Namespace, device: str, threads: int | None) -> int:
    """`--fsdp N --tp M`: the same runs over N x M processes (started here, or by torchrun)."""
    from tqcompile.demo import format_sharded_table
    from tqcompile.demo.sharded import check_layout, layout_name, process_group_backend, run, under_torchrun

    cfg = _demo_config(args, device)
    try:
        check_layout(cfg, args.fsdp, args.tp)
    except ValueError as e:  # a layout the model cannot take: a usage error, before any process starts
        print(f"tqcompile demo: error: {e}", file=sys.stderr)
        return 2
    layout = layout_name(args.fsdp, args.tp)
    if not under_torchrun():
        _progress(
            f"tqcompile demo: bf16 + {', '.join(args.recipes)} over {layout} ({process_group_backend(cfg)}, {device}), "
            f"{cfg.steps} steps each, backend {cfg.backend}; starting {args.fsdp * args.tp} processes ..."
        )
    try:
        results = run(args.recipes, cfg, args.fsdp, args.tp, threads=threads, progress=_progress)
    except ValueError as e:
        print(f"tqcompile demo: error: {e}", file=sys.stderr)
        return 2
    if results is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    return _report(args, results, format_sharded_table(results, cfg, args.fsdp, args.tp), cfg, layout)


def _run(args: argparse.Namespace, device: str) -> int:
    from tqcompile.demo import format_table, run_demo

    cfg = _demo_config(args, device)
    _progress(f"tqcompile demo: bf16 + {', '.join(args.recipes)} on {device}, {cfg.steps} steps each, backend {cfg.backend}")
    results = run_demo(args.recipes, cfg, progress=_progress)
    return _report(args, results, format_table(results, cfg), cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tqcompile` command; returns the exit status.

    Example:
        >>> main(["demo", "--recipes", "mxfp8", "--steps", "20", "--plot", "none"])
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args, parser)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
