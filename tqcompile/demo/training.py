"""The demo's training: the same small GPT once in bf16 and once per recipe, compiled with
`fullgraph=True`, in one training loop (`train_loop`) that the sharded runs share.

Every run starts from the same initial weights (the bf16 model's, loaded into each converted
model), sees the same batches in the same order, and reseeds torch's global generator (NVFP4's
stochastic rounding draws its seeds there). What differs between runs is only the recipe.

Precision: parameters and optimizer state are fp32 in every run and the model runs under
`torch.autocast(dtype=torch.bfloat16)`. The bf16 baseline is exactly that; a recipe run
additionally runs the GEMMs of the blocks' linears (attention, MLP, MoE experts) in the recipe's
formats, while the embeddings, norms, attention itself, router and lm_head stay as in the baseline.

What is compiled: the model's forward and loss, `torch.compile(model, fullgraph=True)` (its
backward is compiled with it by AOTAutograd), and the AdamW step, also with `fullgraph=True`
(`tq.optim.compile_optimizer_step`). The learning rate is a tensor so the schedule never recompiles.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

import tqcompile as tq
from tqcompile.demo.model import GPT, GPTConfig, quantize_model
from tqcompile.testing.compile import CompileCounter

__all__ = [
    "BASELINE",
    "DEFAULT_RECIPES",
    "DemoConfig",
    "RunResult",
    "final_window",
    "load_corpus",
    "batch_offsets",
    "fresh_model",
    "initial_state",
    "lr_schedule",
    "train_loop",
    "train",
    "run_demo",
]

BASELINE = "bf16"
DEFAULT_RECIPES = ("fp8_tensorwise", "mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """One demo run's settings (shared by every recipe in it)."""

    steps: int = 150
    batch_size: int = 2
    seq_len: int = 128
    n_layer: int = 2
    d_model: int = 128
    mlp_hidden: int = 512
    n_experts: int = 0
    lr: float = 1e-3
    warmup_steps: int = 10
    seed: int = 0
    device: str = "cpu"
    backend: str | None = "aot_eager"  # None: run eagerly, without torch.compile (the tests' fast path)
    log_every: int = 25

    def __post_init__(self) -> None:
        tokens = self.batch_size * self.seq_len
        if tokens % 128:
            raise ValueError(
                f"DemoConfig: batch_size * seq_len = {tokens} tokens per step; allowed: a multiple of 128 "
                "(the 1x128 blocks of fp8_blockwise run along the token dim in wgrad)"
            )
        if self.steps < 2:
            raise ValueError(f"DemoConfig: steps={self.steps}; allowed: >= 2 (the first step compiles, later ones are timed)")

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            seq_len=self.seq_len, n_layer=self.n_layer, d_model=self.d_model, mlp_hidden=self.mlp_hidden, n_experts=self.n_experts
        )


@dataclasses.dataclass
class RunResult:
    """What one training run (bf16 or one recipe) produced."""

    name: str
    losses: list[float] = dataclasses.field(default_factory=list)
    step_times_s: list[float] = dataclasses.field(default_factory=list)  # wall time
    step_cpu_times_s: list[float] = dataclasses.field(default_factory=list)  # the process's CPU time
    graph_breaks: int = 0
    graphs: int = 0
    recompiles: int = 0
    error: str | None = None  # why the run could not happen (e.g. a recipe the model cannot use)

    def final_loss(self) -> float:
        """Mean of the last `final_window(len(losses))` losses: smoother than the last step."""
        tail = self.losses[-final_window(len(self.losses)) :]
        return sum(tail) / len(tail)

    def step_ms(self) -> float:
        """Median step time after the first step (which compiles): robust to a busy machine."""
        return 1000 * statistics.median(self.step_times_s[1:])

    def step_cpu_ms(self) -> float | None:
        """Median CPU time of the process per step after the first, or None if not recorded.

        On a CPU run with one thread this is the work a step does: unlike wall time, it does not
        grow while the process waits for a core on a machine busy with other work."""
        return 1000 * statistics.median(self.step_cpu_times_s[1:]) if len(self.step_cpu_times_s) > 1 else None

    def first_step_s(self) -> float:
        return self.step_times_s[0]


def final_window(n_steps: int) -> int:
    """How many of the last losses "final loss" averages: a tenth of the run, at least 5 steps, and
    never more steps than ran."""
    return min(n_steps, max(5, n_steps // 10))


def load_corpus() -> torch.Tensor:
    """The packaged training text (`tqcompile/demo/data/corpus.txt`) as a 1-D uint8 tensor of bytes."""
    raw = importlib.resources.files("tqcompile.demo").joinpath("data/corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def batch_offsets(n_bytes: int, cfg: DemoConfig) -> torch.Tensor:
    """(steps, batch_size) start offsets of each training window, from `cfg.seed` only, so every
    run sees the same data in the same order."""
    g = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(0, n_bytes - cfg.seq_len - 1, (cfg.steps, cfg.batch_size), generator=g)


def _batch(data: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + torch.arange(seq_len + 1)
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]


def lr_schedule(opt: torch.optim.Optimizer, cfg: DemoConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over `cfg.warmup_steps`, then cosine decay to a tenth of `cfg.lr`: without
    warmup, AdamW's first steps at full lr can spike the loss of a freshly initialised model."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_model(cfg: DemoConfig, init_state: dict, recipe: tq.Recipe | None) -> tuple[GPT, str | None]:
    """The demo GPT with `init_state`, converted with `recipe` (None: left in bf16), and the reason
    the recipe cannot take it (None when it can): every run, sharded or not, starts from this."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config())
    model.load_state_dict(init_state)
    if recipe is not None:
        try:
            quantize_model(model, recipe)
        except ValueError as e:
            return model, str(e)
    return model, None


def initial_state(cfg: DemoConfig) -> dict[str, torch.Tensor]:
    """The weights every run of a demo starts from: a GPT built from `cfg.seed`."""
    torch.manual_seed(cfg.seed)
    return {k: v.clone() for k, v in GPT(cfg.model_config()).state_dict().items()}


def _progress_line(result: RunResult, step: int, cfg: DemoConfig) -> str:
    # Step 0 compiles (forward, backward, optimizer step): its seconds are not a step time.
    seconds = result.step_times_s[-1]
    timing = (
        f"compile + step {seconds:7.1f} s" if step == 0 and cfg.backend is not None else f"step time {1000 * seconds:8.1f} ms"
    )
    return f"[{result.name:>20}] step {step:4d}/{cfg.steps}  loss {result.losses[-1]:.4f}  {timing}"


def train_loop(
    result: RunResult,
    step_fn: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
    cfg: DemoConfig,
    data: torch.Tensor,
    offsets: torch.Tensor,
    counter: CompileCounter,
    *,
    rows: slice = slice(None),
    loss_value: Callable[[torch.Tensor], float] = lambda loss: loss.item(),
    cpu_time: bool = True,
    progress: Callable[[str], None] | None = None,
) -> RunResult:
    """The demo's training loop, one-process and sharded alike: for each row of `offsets`, take
    rows `rows` of the batch, run `step_fn(step, x, y)` (forward, backward, optimizer and schedule
    steps; returns the loss), and record into `result` the loss (`loss_value`: `.item()`, or a
    mean over ranks), the wall time of the step (and the process's CPU time with `cpu_time`), and
    at the end what `counter` saw compiled. A graph break (`fullgraph=True` raises it) or a loss
    that is not finite ends the run with `result.error` saying which. `progress` gets a line when
    the run starts, then every `cfg.log_every` steps and at the last."""
    device = torch.device(cfg.device)
    if progress is not None and cfg.backend is not None:
        progress(f"[{result.name:>20}] compiling (the first step compiles forward, backward and the optimizer step) ...")
    for step, offs in enumerate(offsets):
        x, y = (t[rows].to(device) for t in _batch(data, offs, cfg.seq_len))
        _sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            loss = step_fn(step, x, y)
        except torch._dynamo.exc.Unsupported as e:  # fullgraph=True turns a graph break into this error
            result.error = f"graph break: {str(e).splitlines()[0]}"
            result.graph_breaks = max(1, counter.graph_breaks)
            return result
        value = loss_value(loss)  # also waits for the device, so the time covers the whole step
        result.step_times_s.append(time.perf_counter() - start)
        if cpu_time:
            result.step_cpu_times_s.append(time.process_time() - cpu_start)
        result.losses.append(value)
        if progress is not None and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            progress(_progress_line(result, step, cfg))
        if not math.isfinite(value):
            result.error = f"loss became {value} at step {step}"
            break
    result.graph_breaks, result.graphs, result.recompiles = counter.graph_breaks, counter.frame_count, counter.recompiles
    return result


def train(
    recipe: tq.Recipe | None,
    cfg: DemoConfig,
    init_state: dict[str, torch.Tensor],
    data: torch.Tensor,
    offsets: torch.Tensor,
    progress: Callable[[str], None] | None = None,
) -> RunResult:
    """Train a fresh GPT from `init_state` with `recipe` (None: the bf16 baseline), compiled."""
    name = BASELINE if recipe is None else recipe.name
    result = RunResult(name)
    device = torch.device(cfg.device)
    model, result.error = fresh_model(cfg, init_state, recipe)
    if result.error is not None:
        return result
    model.to(device)
    lr = torch.tensor(cfg.lr) if cfg.backend is not None else cfg.lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = lr_schedule(opt, cfg)

    counter = CompileCounter("eager")  # counts nothing when nothing is compiled
    compiled, opt_step = model, opt.step
    if cfg.backend is not None:
        # Dynamo's caches and counters are process-global: reset so that each run compiles afresh
        # and its counts are its own. One counter sees both graphs (model, optimizer step).
        torch.compiler.reset()
        counter = CompileCounter(cfg.backend)
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        opt_step = tq.optim.compile_optimizer_step(opt, backend=counter, fullgraph=True)

    def step_fn(step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = compiled(x, y)
        loss.backward()
        opt_step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return train_loop(result, step_fn, cfg, data, offsets, counter, progress=progress)


def run_demo(recipes: Sequence[str], cfg: DemoConfig, progress: Callable[[str], None] | None = None) -> list[RunResult]:
    """The bf16 baseline, then one run per recipe name in `recipes`; results in that order."""
    recipe_objs = [tq.recipes.get(name) for name in recipes]  # fail on a bad name before training anything
    data = load_corpus()
    offsets = batch_offsets(data.numel(), cfg)
    init_state = initial_state(cfg)
    return [train(r, cfg, init_state, data, offsets, progress) for r in (None, *recipe_objs)]
