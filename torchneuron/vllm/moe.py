"""Mixture-of-experts layers of vLLM models on ``neuron``.

vLLM leaves unquantized MoE to out-of-tree platforms (its kernels are Triton, CUDA or CPU
C++). :class:`NeuronUnquantizedFusedMoEMethod` replaces ``UnquantizedFusedMoEMethod`` (vLLM's
``register_oot``) with a sparse, grouped implementation in torch ops on the device: the
(token, expert) assignments are sorted by expert once, and each expert with work multiplies
only its own tokens (``w13`` gate/up, activation-and-multiply, ``w2``), then the results are
weighted and scattered back with ``index_add_``. Shared experts are run by vLLM's MoE runner
itself (no kernel-internal overlap is claimed), and the whole layer already sits inside vLLM's
opaque ``moe_forward`` custom op, so the data-dependent expert loop never reaches a compiled
graph. While a graph is captured (vLLM's decode graphs) the experts run in a formulation whose
shapes do not depend on the routing (:func:`_gathered_experts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import \
    UnquantizedFusedMoEMethod

__all__ = ["NeuronUnquantizedFusedMoEMethod", "grouped_experts", "register"]

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
                    apply_router_weight_on_input: bool = False,
                    expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """Routed-expert output of vLLM's fused-MoE contract.

    ``x`` [tokens, hidden]; ``w13`` [experts, 2 * inter, hidden] (gate rows, then up rows);
    ``w2`` [experts, hidden, inter]; ``topk_weights`` / ``topk_ids`` [tokens, k];
    ``expert_map`` (expert parallelism) maps global to local expert ids, -1 = not here.
    """
    act = _ACTIVATIONS.get(activation)
    if act is None:
        raise NotImplementedError(f"neuron MoE: activation {activation!r} is not implemented "
                                  f"(supported: {sorted(_ACTIVATIONS)}, each with a gate)")
    tokens, k = topk_ids.shape
    num_experts = w13.shape[0]
    ids = topk_ids.reshape(-1).to(torch.long)
    if expert_map is not None:
        ids = expert_map.to(torch.long)[ids]
    weights = topk_weights.reshape(-1).to(x.dtype)
    if torch.neuron.is_current_stream_capturing():
        return _gathered_experts(x, w13, w2, weights, ids, k, act, apply_router_weight_on_input)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids.clamp(min=-1) + 1, minlength=num_experts + 1).tolist()
    out = torch.zeros_like(x)
    start = counts[0]  # assignments to experts of other ranks (-1) sort first and are skipped
    for e in range(num_experts):
        n = counts[e + 1]
        if n == 0:
            continue
        pick = order[start:start + n]
        start += n
        rows = torch.div(pick, k, rounding_mode="floor")
        h = x.index_select(0, rows)
        w = weights.index_select(0, pick).unsqueeze(1)
        if apply_router_weight_on_input:
            h = h * w
        gate, up = F.linear(h, w13[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, w2[e])
        if not apply_router_weight_on_input:
            y = y * w
        out.index_add_(0, rows, y)
    return out


def _gathered_experts(x, w13, w2, weights, ids, k, act, apply_router_weight_on_input):
    """The same contract with shapes that do not depend on the routing, for graph capture
    (vLLM's decode graphs): each (token, expert) pair multiplies by its own gathered copy of the
    expert's weights (a batched matmul over the pairs), then each token sums its k results.
    The grouped path's per-expert token counts are host values, which a graph cannot hold; this
    one reads as much weight memory as the pairs name, twice (gather, then multiply), which is
    what a decode batch of a few tokens costs anyway."""
    tokens, hidden = x.shape
    valid = (ids >= 0).to(x.dtype)  # pairs routed to other ranks' experts contribute nothing
    safe = ids.clamp(min=0)
    w = weights * valid
    rows = x.unsqueeze(1).expand(tokens, k, hidden).reshape(tokens * k, hidden)
    if apply_router_weight_on_input:
        rows = rows * w.unsqueeze(1)
    gate_up = torch.bmm(w13.index_select(0, safe), rows.unsqueeze(2)).squeeze(2)
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.bmm(w2.index_select(0, safe), (act(gate) * up).unsqueeze(2)).squeeze(2)
    y = y * (valid if apply_router_weight_on_input else w).unsqueeze(1)
    return y.view(tokens, k, hidden).sum(dim=1)


class NeuronUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Unquantized MoE on neuron: vLLM's weights and routing, :func:`grouped_experts` math."""

    @property
    def is_monolithic(self) -> bool:
        return False  # routing (top-k) stays in vLLM's router; we get topk ids and weights

    def forward_oot(self, layer, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, shared_experts=None,
                    shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        activation = getattr(layer.activation, "value", layer.activation)
        return grouped_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                               activation=str(activation),
                               apply_router_weight_on_input=layer.apply_router_weight_on_input,
                               expert_map=layer.expert_map)


def _topk_route(topk_weights, topk_ids, token_expert_indices, scores, renormalize, bias):
    k = topk_ids.shape[1]
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    topk_weights.copy_(weights)
    topk_ids.copy_(ids)
    m = topk_ids.shape[0]
    # row of each (token, slot) pair in slot-major order, as vLLM's CUDA kernel reports it
    token_expert_indices.copy_(torch.arange(k, device=scores.device)[None, :] * m
                               + torch.arange(m, device=scores.device)[:, None])


def _topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize,
                  bias=None, is_padding=None):
    # padded rows are routed like the others; vLLM discards their outputs
    scores = torch.softmax(gating_output.float(), dim=-1)
    _topk_route(topk_weights, topk_ids, token_expert_indices, scores, renormalize, bias)


def _topk_sigmoid(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize,
                  bias=None, routed_scaling_factor=1.0, is_padding=None):
    scores = torch.sigmoid(gating_output.float())
    _topk_route(topk_weights, topk_ids, token_expert_indices, scores, renormalize, bias)
    if routed_scaling_factor != 1.0:
        topk_weights.mul_(routed_scaling_factor)


_SCHEMAS = {
    "topk_softmax": ("topk_softmax(Tensor(a!) topk_weights, Tensor(b!) topk_indices, "
                     "Tensor(c!) token_expert_indices, Tensor gating_output, bool renormalize, "
                     "Tensor? bias=None, Tensor? is_padding=None) -> ()", _topk_softmax),
    "topk_sigmoid": ("topk_sigmoid(Tensor(a!) topk_weights, Tensor(b!) topk_indices, "
                     "Tensor(c!) token_expert_indices, Tensor gating_output, bool renormalize, "
                     "Tensor? bias=None, float routed_scaling_factor=1.0, "
                     "Tensor? is_padding=None) -> ()", _topk_sigmoid),
}
_registered = False
_LIB = None


def register() -> None:
    """Make vLLM build :class:`NeuronUnquantizedFusedMoEMethod` for unquantized MoE layers, and
    give vLLM's router ops (``_moe_C::topk_softmax`` / ``topk_sigmoid``, which the CPU build of
    vLLM does not ship) neuron kernels. Idempotent."""
    global _registered, _LIB
    if _registered:
        return
    UnquantizedFusedMoEMethod.register_oot(NeuronUnquantizedFusedMoEMethod)
    _LIB = torch.library.Library("_moe_C", "FRAGMENT")
    for name, (schema, fn) in _SCHEMAS.items():
        try:
            getattr(torch.ops._moe_C, name)
        except AttributeError:
            _LIB.define(schema)
        _LIB.impl(name, fn, "PrivateUse1")
    _registered = True
