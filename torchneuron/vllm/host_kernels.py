"""vLLM's host-code kernels on neuron memory, run after the device's queued work.

vLLM's CPU build registers some of its C++ kernels as catch-all (CompositeImplicitAutograd)
kernels: CPU_ATTN's attention and KV-cache write, the slot mapping and rejection-sampling
replacements of its Triton kernels, and more. Such a kernel is host code over the tensors' data
pointers and never reaches a backend, which is why it runs unchanged on neuron tensors (their
memory is host memory). With the execution engine on (the default) that
also means it runs at the call, before the kernels still queued for its inputs: vLLM's slot
mapping then read positions not yet copied, and every decoded token after the first differed
from Hugging Face's. So each of those kernels gets a neuron kernel that runs the device queue
first and then the catch-all kernel itself; likewise vLLM's pure-Python replacements of Triton
kernels (``vllm.utils.cpu_triton_utils``), one of which moves bytes with ``ctypes.memmove``.

A device queue that is empty costs one check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["order_after_queue"]

_NAMESPACE = "_C"  # vLLM's kernel library
_LIBRARY: torch.library.Library | None = None
_ORDERED: list[str] = []


def _takes_tensors(schema: torch._C.FunctionSchema) -> bool:
    return any("Tensor" in str(arg.type) for arg in schema.arguments)


def _after_queue_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    # The catch-all kernel fills the CPU slot of the dispatch table (no CPU kernel of its own).
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        torch.neuron.engine.synchronize()
        return op.redispatch(cpu, *args, **kwargs)

    return kernel


def _after_queue_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.neuron.engine.synchronize()
        return fn(*args, **kwargs)

    wrapper.__torchneuron_after_queue__ = True  # type: ignore[attr-defined]
    return wrapper


def order_after_queue() -> list[str]:
    """Give every catch-all C++ kernel of vLLM's ``_C`` library that takes tensors a neuron
    kernel that first runs the device queue; wrap vLLM's Python replacements of its Triton
    kernels the same way. Idempotent; returns the operators ordered so far."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library(_NAMESPACE, "IMPL")
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith(_NAMESPACE + "::") or qualified in _ORDERED:
            continue
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"):
            continue
        if any(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key) for key in ("CPU", "PrivateUse1")):
            continue
        local = qualified[len(_NAMESPACE) + 2:]  # "name" or "name.overload"
        name, _, overload = local.partition(".")
        op = getattr(getattr(getattr(torch.ops, _NAMESPACE), name), overload or "default")
        if not _takes_tensors(op._schema):
            continue
        _LIBRARY.impl(local, _after_queue_kernel(op), "PrivateUse1")
        _ORDERED.append(qualified)
    _wrap_python_replacements()
    return list(_ORDERED)


def _wrap_python_replacements() -> None:
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # a vLLM without them: nothing to wrap
        return
    for attr, fn in list(vars(cpu_triton_utils).items()):
        if attr.endswith("_impl") and callable(fn) and not getattr(fn, "__torchneuron_after_queue__", False):
            setattr(cpu_triton_utils, attr, _after_queue_function(fn))
