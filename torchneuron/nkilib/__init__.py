"""NKI-lib for torchneuron: production-style NKI kernels with PyTorch references.

Kernels (``@nki.jit``; run them with ``nki.simulate(kernel)(...)``, ``kernel[2](...)`` for
LNC=2, ``nki.benchmark(kernel, platform=...)(...)``, or call them on torch tensors), each
with a PyTorch reference (``*_ref``) beside it:

* :func:`attention_cte` -- flash-attention prefill forward (GQA, causal, sliding window)
* :func:`attention_bwd` -- flash-attention backward (dq, dk, dv)
* :func:`rmsnorm` / :func:`rmsnorm_bwd`, :func:`rope`, :func:`mlp` / :func:`mlp_bwd` (SwiGLU),
  :func:`moe_cte` / :func:`moe_cte_bwd` (blockwise MoE),
  :func:`router_topk`, :func:`cross_entropy_fwd` / :func:`cross_entropy_bwd`,
  :func:`cumsum`, :func:`grouped_mm` / :func:`grouped_mm_wgrad` (``torch._grouped_mm``)

PyTorch custom ops (autograd, ``torch.compile``) live in :mod:`torchneuron.nkilib.ops`
(imports torch; this package does not). ``torchneuron.nkilib.sdpa.enable()`` routes
``F.scaled_dot_product_attention`` on ``neuron`` tensors through the NKI attention kernels;
``torchneuron.nkilib.gmm_routing.enable()`` does the same for ``torch._grouped_mm``.
Layouts, limits, numerics and modelled performance: docs/nkilib.md.
"""

import importlib as _importlib

# Kernels load on first use (PEP 562) so that `import torchneuron.nkilib.sdpa` -- run while
# torchneuron itself is imported when TORCHNEURON_NKI_SDPA=1 -- stays cheap.
_WHERE = {
    "attention_cte": "attention", "attention_ref": "attention",
    "attention_bwd": "attention_backward", "attention_bwd_ref": "attention_backward",
    "cross_entropy_fwd": "cross_entropy", "cross_entropy_bwd": "cross_entropy",
    "cross_entropy_ref": "cross_entropy", "cross_entropy_bwd_ref": "cross_entropy",
    "cumsum": "scan", "cumsum_ref": "scan", "mlp": "gated_mlp", "mlp_ref": "gated_mlp",
    "mlp_bwd": "gated_mlp", "mlp_bwd_ref": "gated_mlp",
    "moe_cte": "moe", "moe_cte_ref": "moe", "make_blocks": "moe",
    "moe_cte_bwd": "moe", "moe_cte_bwd_ref": "moe",
    "rmsnorm": "norm", "rmsnorm_ref": "norm", "rmsnorm_bwd": "norm",
    "rmsnorm_bwd_ref": "norm", "rope": "rotary", "rope_ref": "rotary",
    "router_topk": "router", "router_topk_ref": "router",
    "grouped_mm": "grouped_matmul", "grouped_mm_ref": "grouped_matmul",
    "grouped_mm_wgrad": "grouped_matmul", "grouped_mm_wgrad_ref": "grouped_matmul",
    "rope_dbhs": "rotary", "rope_dbhs_ref": "rotary", "rmsnorm_tkg": "norm_tkg",
    "rmsnorm_tkg_kernel": "norm_tkg", "rmsnorm_tkg_ref": "norm_tkg",
    "rmsnorm_quant": "norm_quant", "rmsnorm_quant_ref": "norm_quant",
    "moe_cte_shard_on_i": "moe",
}

__all__ = list(_WHERE)


def __getattr__(name):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'torchneuron.nkilib' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value  # cache (kernel modules are named unlike their kernels)
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
