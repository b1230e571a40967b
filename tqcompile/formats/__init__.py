"""Number formats: what each element or scale format is.

`Format` (an Enum: a constant for torch.compile) names a format; the `ElementCodec` registered
for it (`Format.codec`) says what it is: width, range, ``encode`` / ``decode`` between fp32
values and codes, and ``pack`` / ``unpack`` of codes into payload bytes by bit width
(`tqcompile.formats.codec`). One module per kind of element registers the codecs: `floats` (FP8
by a cast, small floats such as E2M1 on their grid), `ints` (INT8, INT4), `scales` (E8M0).
docs/adding_a_format.md says how to add one.
"""

from tqcompile.formats import floats, fp6, ints, scales  # noqa: F401  (importing them registers their codecs)
from tqcompile.formats.floats import E2M1_VALUES
from tqcompile.formats.format import Format

__all__ = ["Format"]
