"""vLLM ops with neuron kernels: rotary embedding (``register_oot``) and RMSNorm (vLLM IR).

vLLM's ``RotaryEmbedding`` runs its ``forward_native`` torch code on out-of-tree platforms:
about 25 small ops per layer and step (``index_select`` of the cos/sin rows, chunks,
multiplies, ``cat``) for a few kilobytes of data, each paying the device's per-op dispatch.
:class:`NeuronRotaryEmbedding` applies it in place with one kernel call
(``torchneuron::rotary_embedding_``, ``csrc/backend/vllm_kernels.cpp``), on the device,
computing in fp32 like the native code does for fp32 models. Inside a ``torch.compile`` trace
it keeps the native code (the compiler fuses those ops itself).

vLLM's RMSNorm layers call the IR ops ``vllm.ir.ops.rms_norm`` / ``fused_add_rms_norm``, whose
native code is ~6 small torch ops per call. :func:`register_ir_kernels` adds the provider
``"torchneuron"`` for both (one ``torchneuron::rms_norm`` / ``fused_add_rms_norm_`` kernel call,
``csrc/backend/vllm_kernels.cpp``, same rounding steps as the native code); the neuron platform
puts it first in the IR op priority (``--ir-op-priority`` overrides), and arguments it does not
take (a ``variance_size``, mixed dtypes, rows that are not dense) fall through to native.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

__all__ = ["NeuronRotaryEmbedding", "register", "register_ir_kernels", "IR_PROVIDER"]

#: vLLM IR provider name of the neuron RMSNorm kernels
IR_PROVIDER = "torchneuron"

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


# ---- vLLM IR: RMSNorm ---------------------------------------------------------------------
def _rows(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(1) == 1 and x.device.type == "neuron"


def _rms_args(x, weight, epsilon, variance_size=None) -> bool:
    return (variance_size is None and _rows(x)
            and (weight is None or (weight.dtype == x.dtype and weight.is_contiguous())))


def _add_rms_args(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return (_rms_args(x, weight, epsilon, variance_size) and _rows(x_residual)
            and x_residual.shape == x.shape and x_residual.dtype == x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
              variance_size: int | None = None) -> torch.Tensor:
    return torch.ops.torchneuron.rms_norm(x, weight, epsilon)


def _fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None,
                        epsilon: float, variance_size: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    torch.ops.torchneuron.fused_add_rms_norm_(x, x_residual, weight, epsilon)
    return x, x_residual


_ir_registered = False


def register_ir_kernels() -> None:
    """Register the ``"torchneuron"`` implementations of vLLM's IR ops ``rms_norm`` and
    ``fused_add_rms_norm`` (and fake kernels of the ops they call, for traces). Idempotent."""
    global _ir_registered
    if _ir_registered:
        return
    from vllm import ir

    ir.ops.rms_norm.register_impl(IR_PROVIDER, supports_args=_rms_args)(_rms_norm)
    ir.ops.fused_add_rms_norm.register_impl(IR_PROVIDER, supports_args=_add_rms_args,
                                            inplace=True)(_fused_add_rms_norm)
    _ir_registered = True


@torch.library.register_fake("torchneuron::rms_norm")
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("torchneuron::fused_add_rms_norm_")
def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return None
