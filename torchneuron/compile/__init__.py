"""torch.compile backend ``"neuron"``.

``torch.compile(model, backend="neuron")`` works right after ``import torch`` (entry point
group ``torch_dynamo_backends``); ``torch.compiler.set_default_backend("neuron")`` makes it the
default. Graphs are lowered by Inductor with a registered ``neuron`` device: fused C++ kernels
over neuron memory plus extern ATen calls (see docs/compile.md).

This package is imported by the backend entry point and by ``torch.neuron`` metrics: it must
not import Dynamo or Inductor at import time; everything heavy is loaded on first compile.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

__all__ = ["neuron_backend", "register", "NeuronCompileError", "install_import_hooks"]


def neuron_backend(gm: "Any", example_inputs: Sequence[Any], mode: Optional[str] = None,
                   options: Optional[dict] = None) -> Callable:
    """Dynamo backend compiling an FX graph for the ``neuron`` device.

    Args:
        gm: the graph captured by Dynamo.
        example_inputs: its (fake) example inputs.
        mode: torch.compile mode: ``"default"``, ``"max-autotune-no-cudagraphs"``, or
            ``"reduce-overhead"`` / ``"max-autotune"``, which replay the compiled graphs from
            neuron graphs as CUDA graphs do (:mod:`torchneuron.compile.graphs`).
        options: Inductor config overrides, plus ``fallback_execution`` (bool) overriding
            ``TORCHNEURON_COMPILE_FALLBACK``.

    Returns:
        A callable running the compiled graph.

    Raises:
        NeuronCompileError: the graph cannot be compiled (names the op and the graph location),
            unless eager fallback is enabled.
    """
    from .backend import compile_graph

    return compile_graph(gm, example_inputs, mode=mode, options=options)


def register() -> None:
    """Register the Dynamo backend name ``"neuron"``, the Dynamo device interface, the Inductor
    ``neuron`` device and the FlexAttention patches (idempotent). ``torch.compile`` does this
    on demand; call it to use Inductor APIs for neuron directly."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    from . import inductor

    if "neuron" not in _COMPILER_FNS:
        register_backend(neuron_backend, name="neuron")
    inductor.register()


def __getattr__(name: str) -> Any:
    if name == "NeuronCompileError":
        from .backend import NeuronCompileError

        return NeuronCompileError
    raise AttributeError(name)


from ._hooks import install_import_hooks  # noqa: E402  (light: no Dynamo import)
