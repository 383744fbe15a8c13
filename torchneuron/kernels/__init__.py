"""Python kernels for the ``neuron`` key: what CUDA has and the CPU kernels behind the boxed
fallback lack.

Every op without a neuron kernel runs its CPU kernel zero-copy (``csrc/backend/fallback.cpp``).
That covers what CPU supports; device-generic PyTorch code also reaches ops and dtypes that only
CUDA implements (integer ``histc``, the fused RNN cells, ...). The kernels here give neuron
CUDA's semantics for those, registered with ``torch.library`` for the PrivateUse1 key, and hand
the cases CPU covers back to the CPU kernel (:func:`cpu_kernel`), so those stay bit-identical.

Registration runs at import (inside ``import torch``): it must stay cheap, so kernel modules
import only torch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cpu_kernel", "register"]

_LIB: torch.library.Library | None = None


def cpu_kernel(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Run ``op``'s CPU kernel zero-copy on neuron tensors (the boxed fallback), bypassing any
    Python kernel registered for neuron. Arguments are parsed against ``op``'s schema."""
    from .. import _C

    schema = op._schema
    return _C._cpu_kernel(schema.name, schema.overload_name, *args, **kwargs)


def register() -> None:
    """Register every kernel of this package for the neuron key (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    from . import histc

    histc.register(lib)
    _LIB = lib
