"""Scaled-dot-product attention inside neuron graphs.

Eagerly, neuron's ``_fused_sdp_choice`` picks a backend for the device and the device's own
kernel runs. Under compile, AOTAutograd would trace the same choice with FakeTensors, so the
compiled graph bakes in the output shapes/strides of that kernel's *meta* function; any gap
between a device kernel and the CUDA-shaped meta functions (e.g. the padded logsumexp of
``_scaled_dot_product_efficient_attention``) breaks the compiled graph's stride checks.

:func:`legalize` therefore pins SDPA calls on neuron to kernels whose meta functions describe
exactly what runs: the CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``,
with its own backward), which neuron executes zero-copy on device memory, or the math
decomposition (fused by Inductor) when flash does not apply (dropout in training, GQA with
unequal heads, a mask that requires grad, other ranks/dtypes).
"""

from __future__ import annotations

import torch
import torch.fx

_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _sdpa_neuron(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    """``F.scaled_dot_product_attention`` with a compile-stable kernel choice."""
    flash_ok = (query.dim() == 4 and key.dim() == 4 and value.dim() == 4
                and query.dtype in _FLASH_DTYPES
                and query.size(1) == key.size(1) == value.size(1)
                and (dropout_p == 0.0 or not torch.is_grad_enabled())
                and not (attn_mask is not None and is_causal)
                # the flash kernel has no gradient for the mask (a learned bias: Swin's
                # relative positions); the math kernel has
                and not (attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # Both kernels below take additive masks: F.scaled_dot_product_attention converts a
        # boolean one before choosing a kernel, and the math kernel would add True as 1.0.
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
            ~attn_mask, float("-inf"))
    if flash_ok and dropout_p == 0.0:
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
        return out
    out, _ = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
        enable_gqa=enable_gqa)
    return out


def _on_neuron(node: torch.fx.Node) -> bool:
    q = node.args[0] if node.args else node.kwargs.get("query")
    val = q.meta.get("example_value") if isinstance(q, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.device.type == "neuron"


def legalize(gm: torch.fx.GraphModule) -> int:
    """Point neuron SDPA calls in a Dynamo graph at :func:`_sdpa_neuron` (in place).
    Returns the number of calls rewritten."""
    n = 0
    for node in gm.graph.find_nodes(op="call_function",
                                    target=torch._C._nn.scaled_dot_product_attention):
        if _on_neuron(node):
            node.target = _sdpa_neuron
            n += 1
    if n:
        gm.recompile()
    return n
