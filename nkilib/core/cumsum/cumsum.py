"""``cumsum`` with AWS NKI-lib's signature (``nkilib.core.cumsum.cumsum``): inclusive prefix
sum along the last axis of an N-D HBM tensor (fp32 accumulation, output in x's dtype), by
:func:`torchneuron.nkilib.cumsum` on the tensor folded to 2-D."""

import nki
from ..._support import unsupported
from torchneuron.nkilib.scan import cumsum as _cumsum

__all__ = ["cumsum"]


@nki.jit
def cumsum(x, axis=-1):
    """Cumulative sum of ``x`` along ``axis`` (only the last axis)."""
    rank = len(x.shape)
    ax = axis + rank if axis < 0 else axis
    if ax != rank - 1:
        unsupported("cumsum", f"axis={axis} (not the last axis)", "move the axis last first")
    outer = 1
    for s in x.shape[:-1]:
        outer *= s
    out = _cumsum(x.reshape((outer, x.shape[-1])))
    return out.reshape(tuple(x.shape))
