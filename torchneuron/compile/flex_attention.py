"""FlexAttention on neuron under torch.compile.

Two routes, chosen per ``flex_attention`` call in the Dynamo graph:

* **Inference** (the frontend did not request the logsumexp: no grad, no ``return_lse``): the
  HOP is left in the graph and Inductor lowers it with its C++ FlexAttention template
  (``flex_cpu.lower_cpu``: block-sparse, ``score_mod``/``mask_mod`` fused), see
  :func:`.inductor_patches.patch_flex_lowering`.
* **Training / logsumexp** (that template is forward-only): :func:`legalize` replaces the HOP by
  its math definition (:func:`torch._higher_order_ops.flex_attention.math_attention`:
  ``QK^T*scale``, vmapped ``score_mod``, ``mask_mod`` as a ``where``, safe softmax, ``@V``;
  GQA by head repetition). AOTAutograd then traces it into ATen ops and derives the backward,
  and Inductor fuses both into C++ kernels. Scores are materialised (B*H*Lq*Lkv in fp32/fp64),
  so memory grows with sequence length squared; block sparsity is not exploited on this path.
  Where one score matrix would exceed ``TORCHNEURON_FLEX_CHUNK_BYTES`` (64 MiB), the call goes
  to :mod:`.flex_chunked` instead: query chunks and a recomputing flash backward, O(chunk*L)
  memory, unfused.

Eager FlexAttention needs only the device allow-list patch (the HOP's dense implementation runs
forward and backward on neuron).
"""

from __future__ import annotations

import torch
import torch.fx


def _flex_attention_math(query, key, value, score_mod, block_mask, scale, kernel_options,
                         score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """Same contract as ``torch.ops.higher_order.flex_attention`` (returns out, lse, max)."""
    from torch._higher_order_ops.flex_attention import _permute_strides, math_attention

    out, lse, max_scores = math_attention(query, key, value, score_mod, block_mask, scale,
                                          kernel_options, tuple(score_mod_other_buffers),
                                          tuple(mask_mod_other_buffers))
    return _permute_strides(out, query.stride()), lse, max_scores


def _flex_attention_training(query, key, value, score_mod, block_mask, scale, kernel_options,
                             score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """Training route, decided when AOTAutograd traces the call (static shapes are known)."""
    from . import flex_chunked

    fn = flex_chunked.flex_attention_chunked if flex_chunked.applies(query, key) else \
        _flex_attention_math
    return fn(query, key, value, score_mod, block_mask, scale, kernel_options,
              score_mod_other_buffers, mask_mod_other_buffers)


def _preregister_chunked(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    # A compile-cache hit in a later process skips tracing, so the mods the chunked ops look up
    # by key must be registered here, on every compilation, not only when tracing.
    from . import flex_chunked

    q, k = (a.meta.get("example_value") for a in node.args[:2])
    score_mod, block_mask = node.args[3], node.args[4]
    mask_mod = block_mask[-1] if isinstance(block_mask, (tuple, list)) else None
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and flex_chunked.applies(q, k)):
        return
    if not all(isinstance(m, torch.fx.Node) and m.op == "get_attr" for m in (score_mod, mask_mod)):
        return
    flex_chunked.register(gm.get_submodule(score_mod.target), gm.get_submodule(mask_mod.target))


def _needs_math(node: torch.fx.Node) -> bool:
    kernel_options = node.args[6] if len(node.args) > 6 else node.kwargs.get("kernel_options", {})
    if isinstance(kernel_options, dict) and kernel_options.get("OUTPUT_LOGSUMEXP", True):
        return True
    # Captured buffers or q/k/v requiring grad also need a backward.
    for arg in node.args[:3]:
        val = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.requires_grad:
            return True
    return False


def _on_neuron(node: torch.fx.Node) -> bool:
    q = node.args[0]
    val = q.meta.get("example_value") if isinstance(q, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.device.type == "neuron"


def legalize(gm: torch.fx.GraphModule) -> int:
    """Rewrite neuron FlexAttention calls that need a backward or the logsumexp into their
    math definition (in place). Returns the number of calls rewritten."""
    hop = torch.ops.higher_order.flex_attention
    n = 0
    for node in gm.graph.find_nodes(op="call_function", target=hop):
        if _on_neuron(node) and _needs_math(node):
            _preregister_chunked(gm, node)
            node.target = _flex_attention_training
            n += 1
    if n:
        gm.graph.lint()
        gm.recompile()
    return n
