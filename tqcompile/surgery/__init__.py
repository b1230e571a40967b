"""Model surgery: how tqcompile names, plans, changes and reads the layers of a user's model.

One layer below `tqcompile.nn` (`tq.convert`) and `tqcompile.calibration` (`tq.calibrate`,
`tq.restore`), used by both and by export and DCP checkpoints:

- `names`: canonical module names, wrappers' components removed (`canonical_modules`), and
  `unwrap`, the user's model inside DDP / torch.compile / checkpoint / FSDP1 wrappers;
- `plan`: a plan is a list of per-layer `Decision`s; `apply` converts in place and returns an
  `Undo` that puts back exactly what it changed;
- `classes`: the one factory of generated classes (``Quantized<Class>``, ``FakeQuant<Class>``)
  and their pickling;
- `checks`: not sharded, not meta, and the registry of modules that read a child's weight
  themselves instead of calling it;
- `specs`: `LayerSpec`, what a quantized layer does whichever language configured it, and
  `layer_specs(model)`.

See docs/surgery.md.
"""

from tqcompile.surgery.names import canonical_modules, unwrap
from tqcompile.surgery.specs import LayerSpec, OperandSpec, layer_specs

