"""vLLM custom ops with neuron kernels (``register_oot``): rotary embedding.

vLLM's ``RotaryEmbedding`` runs its ``forward_native`` torch code on out-of-tree platforms:
about 25 small ops per layer and step (``index_select`` of the cos/sin rows, chunks,
multiplies, ``cat``) for a few kilobytes of data, each paying the device's per-op dispatch.
:class:`NeuronRotaryEmbedding` applies it in place with one kernel call
(``torchneuron::rotary_embedding_``, ``csrc/backend/paged_attention.cpp``), on the device,
computing in fp32 like the native code does for fp32 models. Inside a ``torch.compile`` trace
it keeps the native code (the compiler fuses those ops itself).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

__all__ = ["NeuronRotaryEmbedding", "register"]

_registered = False


class NeuronRotaryEmbedding(RotaryEmbedding):
    """vLLM's rotary embedding (neox and GPT-J styles, partial rotary dims) in one in-place
    neuron kernel call per layer."""

    def forward_oot(self, positions: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if torch.compiler.is_compiling() or query.device.type != "neuron":
            return self.forward_native(positions, query, key)
        cache = self._match_cos_sin_cache_dtype(query)
        torch.ops.torchneuron.rotary_embedding_(positions.flatten(), query, key,
                                                self.head_size, cache, self.is_neox_style)
        return query, key


def register() -> None:
    """Make vLLM build :class:`NeuronRotaryEmbedding` for ``RotaryEmbedding`` layers
    (subclasses with their own cache formulas keep vLLM's code). Idempotent."""
    global _registered
    if _registered:
        return
    RotaryEmbedding.register_oot(NeuronRotaryEmbedding)
    # register_oot names the op after the class it replaces; keep vLLM's op name, so that
    # `custom_ops=["-rotary_embedding"]` still selects the native code
    NeuronRotaryEmbedding.name = "rotary_embedding"
    _registered = True
