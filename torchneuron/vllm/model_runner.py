"""``NeuronModelRunner``: vLLM's GPU model runner on ``neuron:N``.

vLLM's GPU runner is device-generic except for a few ``torch.cuda`` stream and event handles
it creates while it is constructed; those are made as ``torch.neuron`` streams and events
(the mapping is in place only during construction, then restored). Synchronisation goes to
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
    stream, set_stream}`` make and use ``torch.neuron`` objects; restored on exit."""
    names = {"Stream": torch.neuron.Stream, "Event": _neuron_event,
             "current_stream": torch.neuron.current_stream,
             "default_stream": torch.neuron.default_stream,
             "stream": torch.neuron.stream, "set_stream": torch.neuron.set_stream}
    saved = {name: getattr(torch.cuda, name) for name in names}
    try:
        for name, value in names.items():
            setattr(torch.cuda, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


class NeuronModelRunner(GPUModelRunner):
    """vLLM's model runner with weights, inputs, activations and KV cache on ``neuron:N``."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        if device.type != "neuron":
            raise ValueError(f"NeuronModelRunner needs a neuron device, got {device}")
        with neuron_streams_as_cuda():
            super().__init__(vllm_config, device)

    def _sync_device(self) -> None:
        torch.neuron.synchronize(self.device)
