"""Python kernels for the ``neuron`` key: what CUDA has and the CPU kernels behind the boxed
fallback lack.

Every op without a neuron kernel runs its CPU kernel zero-copy (``csrc/backend/fallback.cpp``).
That covers what CPU supports; device-generic PyTorch code also reaches ops and dtypes that only
CUDA implements (integer ``histc``, the fused RNN cells, ...). The kernels here give neuron
CUDA's semantics for those, registered with ``torch.library`` for the PrivateUse1 key, and hand
the cases CPU covers back to the CPU kernel (:func:`cpu_kernel`), so those stay bit-identical.

Registration runs at import (inside ``import torch``): it must stay cheap, so kernel modules
import only torch.

These are kernels, below the dispatcher: TorchDynamo must not trace them. It would, since it
hooks every Python frame a compiled function's eager parts call (an ``nn.LSTM`` it declines to
trace runs eagerly and calls them) and would compile their insides into its graph, with the
tracing tools' view of ops (meta kernels) instead of the kernel's. Each kernel's code is marked
skipped, with everything it calls (``_KernelLibrary``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cpu_kernel", "never_traced", "on_cpu", "register"]

_LIB: torch.library.Library | None = None


def cpu_kernel(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Run ``op``'s CPU kernel zero-copy on neuron tensors (the boxed fallback), bypassing any
    Python kernel registered for neuron. Arguments are parsed against ``op``'s schema."""
    from .. import _C

    schema = op._schema
    return _C._cpu_kernel(schema.name, schema.overload_name, *args, **kwargs)


def on_cpu(name: str, fn: Any, *args: Any) -> Any:
    """Call ``fn(*args)`` with every neuron tensor in ``args`` (also inside lists and tuples)
    replaced by a zero-copy CPU alias, and map its CPU results back to neuron tensors without
    copies (``_C._on_cpu``). A kernel built from CPU torch ops then costs plain CPU calls instead
    of one boxed fallback per op. ``name`` names the kernel in ``get_executed_ops`` and the
    profiler. Devices are checked as for any op (one neuron device; CPU tensors only 0-dim)."""
    from .. import _C

    return _C._on_cpu(name, fn, *args)


def never_traced(fn: Any) -> Any:
    """Mark the Python function ``fn`` (a kernel) as one TorchDynamo runs without tracing, with
    every frame it calls; through ``torch._C`` alone, so that TorchDynamo need not be imported."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    return fn


class _KernelLibrary(torch.library.Library):
    """``torch.library.Library`` whose registered kernels TorchDynamo never traces."""

    def impl(self, op_name: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return super().impl(op_name, never_traced(fn), *args, **kwargs)


def register() -> None:
    """Register every kernel of this package for the neuron key (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    lib = _KernelLibrary("aten", "IMPL")
    from . import attention, dropout, dtypes, gemm_dtype, histc, pooling, rnn, sync_batch_norm

    for module in (attention, dropout, dtypes, gemm_dtype, histc, pooling, rnn, sync_batch_norm):
        module.register(lib)
    _LIB = lib
