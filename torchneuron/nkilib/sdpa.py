"""Route ``F.scaled_dot_product_attention`` on ``neuron`` tensors through the NKI kernels.

``enable()`` registers an override of ``aten::scaled_dot_product_attention`` for the
``AutogradPrivateUse1`` dispatch key (the op is CompositeImplicitAutograd, so an autograd-key
kernel takes precedence for ``neuron`` tensors): supported calls run ``attention_cte``
forward and ``attention_bwd`` backward (through the differentiable ``nkilib::attention_fwd``
custom op); anything else -- an explicit ``attn_mask``, dropout, head dim > 128, non-4-D
inputs -- falls back to the decomposed math implementation, as before. CPU tensors are never
affected. torchneuron calls ``enable()`` at import when ``TORCHNEURON_NKI_SDPA=1``.
"""

from __future__ import annotations

import math

import torch

_LIB = None
_CALLS = {"nki": 0, "fallback": 0}


def _fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    _CALLS["fallback"] += 1
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # SDPA converts boolean masks (True = keep) to additive ones before its math kernel
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device
                                ).masked_fill(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    from .ops import attention_fwd
    ok = (attn_mask is None and dropout_p == 0.0 and query.dim() == 4 and key.dim() == 4
          and value.shape == key.shape and query.shape[-1] <= 128
          and query.shape[-1] == key.shape[-1] and query.shape[0] == key.shape[0]
          and query.shape[1] % key.shape[1] == 0
          and (enable_gqa or query.shape[1] == key.shape[1])
          and query.dtype == key.dtype == value.dtype
          and query.dtype in (torch.float32, torch.bfloat16, torch.float16))
    if not ok:
        return _fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    _CALLS["nki"] += 1
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return attention_fwd(query, key, value, s, bool(is_causal), None)[0]


def _traced(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
    # With the Python dispatcher on (tracing, once Inductor's decompositions are loaded), a
    # CompositeImplicitAutograd op can be decomposed before its autograd-key kernel is reached;
    # this Python kernel keeps neuron SDPA on the NKI path there too.
    if query.device.type == "neuron":
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    from torch._C import DispatchKey

    return torch.ops.aten.scaled_dot_product_attention.default._op_dk(
        DispatchKey.CompositeImplicitAutograd, query, key, value, attn_mask, dropout_p, is_causal,
        scale=scale, enable_gqa=enable_gqa)


def enable() -> None:
    """Make SDPA on ``neuron`` tensors use the NKI attention kernels (idempotent)."""
    global _LIB
    if _LIB is not None:
        return
    from torch._C import DispatchKey

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    op = torch.ops.aten.scaled_dot_product_attention.default
    if DispatchKey.CompositeImplicitAutograd not in op.py_kernels:
        op.py_impl(DispatchKey.CompositeImplicitAutograd)(_traced)
    _LIB = lib


def disable() -> None:
    """Undo :func:`enable` (the host kernel path is used again)."""
    global _LIB
    if _LIB is not None:
        from torch._C import DispatchKey

        _LIB._destroy()
        _LIB = None
        op = torch.ops.aten.scaled_dot_product_attention.default
        if op.py_kernels.get(DispatchKey.CompositeImplicitAutograd) is _traced:
            del op.py_kernels[DispatchKey.CompositeImplicitAutograd]
            op._dispatch_cache.clear()


def enabled() -> bool:
    return _LIB is not None


def calls() -> dict:
    """How many SDPA calls took the NKI path / the fallback since import (for tests)."""
    return dict(_CALLS)
