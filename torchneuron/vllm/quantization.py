"""FP8 quantized serving on neuron: vLLM's FP8 W8A8 methods (online ``quantization="fp8"`` /
``fp8_per_tensor``, ``fp8_per_channel``, ``fp8_per_block``; serialized FP8 checkpoints with
per-tensor, per-channel or 128x128 block weight scales) through ``torch._scaled_mm``, TensorE's
FP8 GEMM (products exact, fp32 accumulation, one rounding).

vLLM picks a linear layer's kernel from per-platform tables (``_POSSIBLE_FP8_KERNELS``,
``_POSSIBLE_FP8_BLOCK_KERNELS``), which have no row for out-of-tree platforms, and quantizes
weights and activations with ``vllm._custom_ops.scaled_fp8_quant``, whose ``_C`` ops the CPU
build of vLLM declares without arguments (placeholders). :func:`register` fills the gaps:

- :class:`NeuronFP8ScaledMMLinearKernel`: one ``torch._scaled_mm`` per layer call with the bias
  in its epilogue; tensor-wise scales when activation and weight scales are both per tensor,
  row-wise (activation ``[M, 1]`` x weight ``[1, N]``) otherwise, a per-tensor side broadcast;
- :class:`NeuronBlockFP8ScaledMMLinearKernel`: vLLM's own ``torch._scaled_mm`` block kernel
  (1x128 activation groups, 128x128 weight blocks), allowed on neuron, whose ``_scaled_mm``
  takes torch's block-scaled configurations;
- ``scaled_fp8_quant`` on neuron tensors: :func:`scaled_fp8_quant`, the quantization vLLM's
  CUDA kernels compute (static per tensor, per channel/token or per group; dynamic per tensor
  or per token with ``scale_ub``), in torch ops on the device. Other devices keep vLLM's code.

Not implemented: FP8 MoE experts, int8 and 4-bit formats. (The FP8 KV cache is the attention
backend's: ``attention.py``.)
"""

from __future__ import annotations

import math

import torch

__all__ = ["NeuronBlockFP8ScaledMMLinearKernel", "NeuronFP8ScaledMMLinearKernel", "register",
           "scaled_fp8_quant"]

_registered = False


def _fp8_limits() -> tuple[float, float, float]:
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max

    lo, hi = get_fp8_min_max()
    return lo, hi, 1.0 / (hi * 512.0)  # vLLM's smallest dynamic scale (input_quant_fp8.py)


def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None,
                     num_token_padding: int | None = None, scale_ub: torch.Tensor | None = None,
                     use_per_token_if_dynamic: bool = False, output: torch.Tensor | None = None,
                     group_shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``vllm._custom_ops.scaled_fp8_quant`` for neuron tensors (same arguments and results):
    ``input`` [M, N] to ``float8_e4m3fn`` with a given (static) or computed (dynamic) scale, in
    fp32, rounding as vLLM's CUDA kernels do: static and dynamic per-tensor scales multiply by
    the scale's reciprocal, dynamic per-token scales divide. Dynamic scales are
    ``amax / fp8_max`` (per tensor, or per row clamped to ``scale_ub``), at least
    ``1 / (fp8_max * 512)`` (an all-zero input quantizes to zeros, not NaN). Padding rows (``num_token_padding``) are zero."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape, group_broadcast, prep_scale_for_group_broadcast)

    if input.ndim != 2:
        raise ValueError(f"scaled_fp8_quant: input must be 2-D [tokens, hidden], got {tuple(input.shape)}")
    lo, hi, min_scale = _fp8_limits()
    rows = input.shape[0]
    shape = (max(num_token_padding, rows), input.shape[1]) if num_token_padding else tuple(input.shape)
    if output is None:
        output = torch.empty(shape, device=input.device, dtype=torch.float8_e4m3fn)
    elif num_token_padding is not None:
        raise ValueError("scaled_fp8_quant: padding is not supported when output is passed in")
    x = input.to(torch.float32)
    if scale is None and use_per_token_if_dynamic:
        amax = x.abs().amax(dim=-1, keepdim=True)
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub.to(torch.float32))
        scale = (amax / hi).clamp(min=min_scale)
        q = x / scale
    else:
        if scale is None:
            scale = (x.abs().amax() / hi).clamp(min=min_scale).reshape(1)
            full = scale
        else:
            gs = None if group_shape is None else GroupShape(*group_shape)
            full = prep_scale_for_group_broadcast(scale, input, gs).to(torch.float32)
            full = group_broadcast(full, input.shape) if full.ndim == 2 else full
        q = x * full.reciprocal()
    output[:rows].copy_(q.clamp(lo, hi))
    if output.shape[0] > rows:
        output[rows:].zero_()
    return output, scale


def _row_scales(s: torch.Tensor, n: int) -> torch.Tensor:
    """A scale as ``[n, 1]`` fp32: per tensor (one element) broadcast, per row as given."""
    s = s.to(torch.float32).reshape(-1, 1)
    return s.expand(n, 1).contiguous() if s.shape[0] == 1 and n != 1 else s


def _on_neuron() -> tuple[bool, str | None]:
    """The ``is_supported`` answer of the neuron kernels: yes on the neuron platform only."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "neuron":
        return False, "runs on the neuron platform only"
    return True, None


def _kernel_class():
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
        FP8ScaledMMLinearKernel)

    class NeuronFP8ScaledMMLinearKernel(FP8ScaledMMLinearKernel):
        """vLLM's FP8 linear (W8A8, per-tensor or per-channel weights, static or dynamic
        per-tensor or per-token activations) as one ``torch._scaled_mm`` on neuron."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return _on_neuron()

        @classmethod
        def can_implement(cls, c) -> tuple[bool, str | None]:
            for what, key in (("activation", c.activation_quant_key), ("weight", c.weight_quant_key)):
                g = key.scale.group_shape
                if not (g.is_per_tensor() or g.is_per_token() or g.is_per_channel()):
                    return False, (f"takes per-tensor, per-token and per-channel scales, not {what} "
                                   f"groups {tuple(g)} (block-scaled layers: "
                                   "NeuronBlockFP8ScaledMMLinearKernel)")
            return True, None

        def apply_scaled_mm(self, *, A: torch.Tensor, B: torch.Tensor, out_dtype: torch.dtype,
                            As: torch.Tensor, Bs: torch.Tensor, bias: torch.Tensor | None,
                            output_shape: list) -> torch.Tensor:
            m, n = A.shape[0], B.shape[1]
            if As.numel() == 1 and Bs.numel() == 1:
                scale_a, scale_b = As.reshape(1).to(torch.float32), Bs.reshape(1).to(torch.float32)
            else:  # row-wise: [M, 1] x [1, N]
                scale_a, scale_b = _row_scales(As, m), _row_scales(Bs, n).t()
            if bias is not None and bias.dtype != out_dtype:
                bias = bias.to(out_dtype)
            out = torch._scaled_mm(A, B, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
            return out[:math.prod(output_shape[:-1])].view(*output_shape)

    return NeuronFP8ScaledMMLinearKernel


def _block_kernel_class():
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import (
        BlockWiseTorchFP8ScaledMMLinearKernel)

    class NeuronBlockFP8ScaledMMLinearKernel(BlockWiseTorchFP8ScaledMMLinearKernel):
        """vLLM's block-scaled FP8 linear (128x128 weight blocks, dynamic 1x128 activation
        groups: DeepSeek-style checkpoints, ``fp8_per_block``) as one ``torch._scaled_mm``
        with block scales on neuron: each 128-wide K block's product summed in fp32, scaled by
        its activation and weight block scales, added in fp32 (csrc/backend/scaled_mm.cpp)."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return _on_neuron()

    return NeuronBlockFP8ScaledMMLinearKernel


_BUILDERS = {"NeuronFP8ScaledMMLinearKernel": _kernel_class,
             "NeuronBlockFP8ScaledMMLinearKernel": _block_kernel_class}


def __getattr__(name: str):
    if name in _BUILDERS:  # built on first use: they subclass vLLM's kernels
        cls = _BUILDERS[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def register() -> None:
    """Give vLLM the neuron FP8 linear kernel (its table row for out-of-tree platforms) and
    route ``scaled_fp8_quant`` on neuron tensors to :func:`scaled_fp8_quant`. Idempotent."""
    global _registered
    if _registered:
        return
    import vllm._custom_ops as ops
    import vllm.model_executor.kernels.linear as linear
    from vllm.platforms import PlatformEnum

    linear._POSSIBLE_FP8_KERNELS[PlatformEnum.OOT] = [__getattr__("NeuronFP8ScaledMMLinearKernel")]
    linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.OOT] = [__getattr__("NeuronBlockFP8ScaledMMLinearKernel")]
    def dispatch(input: torch.Tensor, *args, **kwargs):
        if input.device.type == "neuron":
            return scaled_fp8_quant(input, *args, **kwargs)
        return dispatch.__wrapped__(input, *args, **kwargs)

    dispatch.__wrapped__ = ops.scaled_fp8_quant
    dispatch.__doc__ = ops.scaled_fp8_quant.__doc__
    ops.scaled_fp8_quant = dispatch
    _registered = True
