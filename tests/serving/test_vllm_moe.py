"""The neuron MoE method's expert math (torchneuron/vllm/moe.py) against a per-token loop on CPU:
the grouped path (eager) and the routing-independent path a graph capture takes (vLLM's decode
graphs replay it with each step's routing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

from torchneuron.vllm.moe import grouped_experts  # noqa: E402

E, H, I, K = 6, 16, 12, 2


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 4


def _reference(x, w13, w2, weights, ids, on_input, expert_map=None):
    """Each token: the sum over its k experts of weight * expert(x), float64 on CPU."""
    x, w13, w2, weights = (t.double() for t in (x, w13, w2, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) if expert_map is None else int(expert_map[ids[t, j]])
            if e < 0:
                continue
            h = x[t] * weights[t, j] if on_input else x[t]
            gate, up = (w13[e] @ h).chunk(2)
            y = w2[e] @ (F.silu(gate) * up)
            out[t] += y if on_input else weights[t, j] * y
    return out.float()


def _routing(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int32)
    return torch.rand(tokens, K, generator=g), ids


@pytest.mark.parametrize("on_input", [False, True], ids=["weights_on_output", "weights_on_input"])
def test_grouped_experts_equal_a_per_token_loop(on_input):
    w13, w2 = _weights()
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    weights, ids = _routing(5, 2)
    got = grouped_experts(x.to("neuron"), w13.to("neuron"), w2.to("neuron"), weights.to("neuron"),
                          ids.to("neuron"), apply_router_weight_on_input=on_input)
    torch.testing.assert_close(got.cpu(), _reference(x, w13, w2, weights, ids, on_input),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("on_input", [False, True], ids=["weights_on_output", "weights_on_input"])
def test_captured_experts_replay_each_steps_routing(on_input):
    w13, w2 = _weights(3)
    # expert parallelism: experts 4 and 5 live on another rank (-1): they contribute nothing
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1], dtype=torch.int32)
    n = 4
    x = torch.zeros(n, H, device="neuron")
    weights = torch.zeros(n, K, device="neuron")
    ids = torch.zeros(n, K, dtype=torch.int32, device="neuron")
    args, local = (w13.to("neuron"), w2.to("neuron")), expert_map.to("neuron")
    graph = torch.neuron.NeuronGraph()
    with torch.neuron.graph(graph):
        out = grouped_experts(x, *args, weights, ids, apply_router_weight_on_input=on_input,
                              expert_map=local)
    for step in range(3):
        x_new = torch.randn(n, H, generator=torch.Generator().manual_seed(10 + step))
        w_new, ids_new = _routing(n, 20 + step)
        x.copy_(x_new)
        weights.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        want = _reference(x_new, w13, w2, w_new, ids_new, on_input, expert_map=expert_map)
        torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)
