"""What torch.compile (fake tensors) predicts for the layout of a neuron convolution.

ATen sends convolutions on out-of-tree devices to its "Overrideable" backend, for which
``torch._C._conv_determine_backend_memory_format`` answers "contiguous": fake tensors, and so
Inductor's plans, would make every neuron convolution's result and gradients contiguous and
convert channels-last inputs before each call. Neuron gives CPU's layouts instead
(channels-last when the input or the weight suggests it; ``gemm.h``, ``conv_memory_format``),
and a compiled graph must plan with what eager returns: Inductor checks an extern kernel's
strides against its plan. This wraps the function for neuron tensors only.
"""

from __future__ import annotations

import torch

__all__: list[str] = []


def install() -> None:
    original = torch._C._conv_determine_backend_memory_format
    if getattr(original, "_torchneuron", False):
        return
    from . import _C

    overrideable = torch._C._ConvBackend.Overrideable

    def _conv_determine_backend_memory_format(input, weight, backend):  # noqa: A002 (ATen's names)
        if backend == overrideable and input.device.type == "neuron":
            return _C._conv_memory_format(input, weight)
        return original(input, weight, backend)

    _conv_determine_backend_memory_format._torchneuron = True
    torch._C._conv_determine_backend_memory_format = _conv_determine_backend_memory_format
