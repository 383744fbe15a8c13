"""vLLM's device communicator for neuron tensor parallelism.

vLLM's base communicator already issues plain ``torch.distributed`` collectives on the device
group; on the neuron platform that group is a ``neuron`` c10d group (see
``torchneuron.distributed``), so all-reduce / all-gather / reduce-scatter of ``neuron:N``
tensors run in torchneuron's backend, ordered with the device streams. The CPU communicator's
shared-memory fast path is deliberately not used: it would bypass the device backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

__all__ = ["NeuronCommunicator"]


class NeuronCommunicator(DeviceCommunicatorBase):
    """Collectives of ``neuron`` tensors over the group's ``neuron`` c10d backend."""

    def __init__(self, cpu_group, device: torch.device | None = None, device_group=None,
                 unique_name: str = "", *args, **kwargs):
        super().__init__(cpu_group, device, device_group, unique_name, *args, **kwargs)
        if device_group is not None and self.world_size > 1:
            backend = dist.get_backend(device_group)
            if backend != "neuron":
                raise RuntimeError(
                    f"neuron: vLLM's device group {unique_name!r} uses backend {backend!r}; "
                    "the neuron platform needs torchneuron's 'neuron' c10d backend "
                    "(is torchneuron.distributed importable in the worker?)")
