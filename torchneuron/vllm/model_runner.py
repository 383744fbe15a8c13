"""``NeuronModelRunner``: vLLM's GPU model runner on ``neuron:N``.

vLLM's GPU runner is device-generic except for a few ``torch.cuda`` stream and event handles
it creates while it is constructed, and the ``torch.cuda`` graph calls of its decode-graph
capture (vLLM's ``CUDAGraphWrapper``, ``graph_capture``); those are made as ``torch.neuron``
streams, events and graphs (the mapping is in place only during construction and capture,
then restored). Synchronisation goes to
``torch.neuron.synchronize``. Unlike vLLM's CPU runner, nothing here turns
``torch.accelerator.synchronize`` / ``empty_cache`` into process-wide no-ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from vllm.config import VllmConfig
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

__all__ = ["NeuronModelRunner"]


def _neuron_event(*args, blocking: bool | None = None, **kwargs) -> torch.neuron.Event:
    # torch.neuron.Event has no `blocking` flag: its synchronize() always blocks
    return torch.neuron.Event(*args, **kwargs)


@contextlib.contextmanager
def neuron_streams_as_cuda() -> Iterator[None]:
    """Within the block, ``torch.cuda.{Stream, Event, current_stream, default_stream,
    stream, set_stream, CUDAGraph, graph}`` make and use ``torch.neuron`` objects; restored on
    exit."""
    names = {"Stream": torch.neuron.Stream, "Event": _neuron_event,
             "current_stream": torch.neuron.current_stream,
             "default_stream": torch.neuron.default_stream,
             "stream": torch.neuron.stream, "set_stream": torch.neuron.set_stream,
             "CUDAGraph": torch.neuron.NeuronGraph, "graph": torch.neuron.graph}
    saved = {name: getattr(torch.cuda, name) for name in names}
    try:
        for name, value in names.items():
            setattr(torch.cuda, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


_WEAK_REF_LIBRARY: torch.library.Library | None = None


def provide_weak_ref_tensor() -> None:
    """Give vLLM's ``_C::weak_ref_tensor`` (defined by its CUDA build only) a neuron kernel: a
    tensor over the same memory that does not own it, which vLLM keeps for the outputs of its
    captured graphs. Idempotent."""
    global _WEAK_REF_LIBRARY
    if _WEAK_REF_LIBRARY is not None:
        return
    exists = hasattr(torch.ops._C, "weak_ref_tensor")
    if exists and torch._C._dispatch_has_kernel_for_dispatch_key("_C::weak_ref_tensor",
                                                                 "PrivateUse1"):
        return
    _WEAK_REF_LIBRARY = torch.library.Library("_C", "IMPL" if exists else "FRAGMENT")
    if not exists:
        _WEAK_REF_LIBRARY.define("weak_ref_tensor(Tensor input) -> Tensor")
    _WEAK_REF_LIBRARY.impl("weak_ref_tensor", torch.ops.torchneuron.weak_ref_tensor.default,
                           "PrivateUse1")


class NeuronModelRunner(GPUModelRunner):
    """vLLM's model runner with weights, inputs, activations and KV cache on ``neuron:N``."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        if device.type != "neuron":
            raise ValueError(f"NeuronModelRunner needs a neuron device, got {device}")
        with neuron_streams_as_cuda():
            super().__init__(vllm_config, device)

    def capture_model(self) -> int:
        """vLLM's decode-graph capture (docs/serving.md, *Graphs*) with NeuronGraphs."""
        provide_weak_ref_tensor()
        with neuron_streams_as_cuda():
            return super().capture_model()

    def _sync_device(self) -> None:
        torch.neuron.synchronize(self.device)
