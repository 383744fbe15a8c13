"""vLLM platform plugin for the ``neuron`` device (``pip install torchneuron[vllm]``).

vLLM finds :func:`register` through the ``vllm.platform_plugins`` entry point and calls it in
every process (API server, engine core, workers). It activates
:class:`torchneuron.vllm.platform.NeuronPlatform` only when a neuron device is visible, so a
machine without one keeps vLLM's own platform detection. The rest of this package (platform,
worker, model runner, attention backend) is imported by vLLM through the qualified names the
platform returns; importing ``torchneuron`` alone never imports vLLM.

See ``docs/serving.md``.
"""

from __future__ import annotations

__all__ = ["register", "ATTENTION_BACKEND"]

#: Name of torchneuron's paged-attention backend in vLLM's registry
#: (``LLM(..., attention_backend="NEURON_ATTN")``; it is also the default on neuron).
ATTENTION_BACKEND = "NEURON_ATTN"


def register() -> str | None:
    """Entry point of ``vllm.platform_plugins``: the platform's qualified name, or None.

    None (inactive) when no neuron device is visible, e.g. ``NEURON_RT_VISIBLE_CORES`` names
    no core, or the topology variables are invalid (then ``torch.neuron`` reports why on use).
    """
    import torch

    import torchneuron  # noqa: F401  (registers torch.neuron when autoload is off)

    if not torch.neuron.is_available():
        return None
    return "torchneuron.vllm.platform.NeuronPlatform"
