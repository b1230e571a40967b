"""`tqcompile demo`: train a small GPT once in bf16 and once per recipe, compiled with
`fullgraph=True`, and compare losses, step times and what the compiler did; in one process, or
sharded over FSDP2 x TP processes.

The demo is an example of using tqcompile, not part of it: the library never imports this
package (only the `tqcompile` command, the tests, the benchmarks and the docs do).

- `model`: the GPT (nanoGPT style), `quantize_model` (the blocks' linears; lm_head and routers
  stay high precision); `data/corpus.txt`: the training text.
- `training`: `DemoConfig`, the one training loop (`train_loop`), `train` and `run_demo` (one process).
- `parallel` and `sharded`: the GPT's FSDP2 / TP plan (`parallelize`) and the sharded runs.
- `report` and `plot`: the tables and the picture.
"""

from tqcompile.demo.model import GPT, GPTConfig, is_quantized_layer, quantize_model
from tqcompile.demo.parallel import parallelize, parallelize_gpt
from tqcompile.demo.plot import ema, plot_losses
from tqcompile.demo.report import format_sharded_table, format_table, load_results, save_results
from tqcompile.demo.training import (
    BASELINE,
    DEFAULT_RECIPES,
    DemoConfig,
    RunResult,
    batch_offsets,
    final_window,
    load_corpus,
    run_demo,
    train,
)

