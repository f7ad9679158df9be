"""How the Cells of this package take part in MindSpore's mixed precision (AMP).

MindSpore lowers precision in two ways, and neither fits operators whose dtypes are part of their
contract (float32 routing weights and scales, a float32 router):
- `Cell.to_float(dtype)`, which `auto_mixed_precision` O2/O3 apply to the whole network, flags
  every Cell so that MindSpore casts every float input of every operator inside it (PyNative) or
  every input and Parameter of its graph (GRAPH) to that dtype;
- O1 (and `custom_mixed_precision`) rewrites the source of every Cell and inlines the functions
  it calls, to put casts around the white-listed primitives; the operators here are primitives
  built when first called, which cannot be inlined, and are not on that list.

So these Cells cast for themselves: a mixed-precision flag (from `to_float` or O2/O3) is taken as
the dtype the experts compute in (`compute_dtype`) and MindSpore's own casting is switched off
inside them; the router always computes in float32. For O1's rewrite they are single, opaque
Cells (as MindSpore's own Cell containers are): O1 leaves them in float32, as it leaves every
operator outside its white list, unless the MoE Cell itself was given a dtype with `to_float`.
"""
import mindspore as ms
from mindspore import nn

from .._compat import NO_AUTOMATIC_CASTS, register_opaque_to_rewrite  # noqa: F401 (re-exported)

_FLAGS = {"fp16": ms.float16, "bf16": ms.bfloat16, "fp32": ms.float32}


def _take_precision(flags):
    """Removes MindSpore's mixed-precision flags from flags: the dtype they ask for, or None."""
    dtype = None
    for name, flag_dtype in _FLAGS.items():
        if flags.pop(name, False):
            dtype = flag_dtype
    return dtype


class SelfCastingCell(nn.Cell):
    """A Cell that does its own casts: `compute_dtype` is the dtype a mixed-precision flag asked
    for (None: none asked), and MindSpore inserts no casts inside it or its sub-cells."""

    def __init__(self):
        super().__init__()
        self.compute_dtype = None
        # NOTSET pushed while this Cell runs: no automatic casts inside it (PyNative)
        self.mixed_precision_type = NO_AUTOMATIC_CASTS

    def add_flags(self, **flags):
        dtype = _take_precision(flags)
        if dtype is not None:
            self.compute_dtype = dtype
        return super().add_flags(**flags)

    def add_flags_recursive(self, **flags):
        # the flags stop here; the Cells of this package inside take the dtype
        dtype = _take_precision(flags)
        if dtype is not None:
            for _, cell in self.cells_and_names():
                if isinstance(cell, SelfCastingCell):
                    cell.compute_dtype = dtype
        return super().add_flags_recursive(**flags)
