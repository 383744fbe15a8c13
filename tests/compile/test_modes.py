"""torch.compile modes on neuron (the graph-replaying ones: test_graph_replay.py)."""

import warnings

import pytest
import torch

from compile_models import DEV


def _f(x, w):
    return (x @ w).tanh() + 1


def _check(f):
    x, w = torch.randn(16, 16, device=DEV), torch.randn(16, 16, device=DEV)
    torch.testing.assert_close(f(x, w).cpu(), _f(x.cpu(), w.cpu()), atol=1e-4, rtol=1e-4)


def test_max_autotune_no_cudagraphs_is_accepted():
    torch._dynamo.reset()
    _check(torch.compile(_f, backend="neuron", mode="max-autotune-no-cudagraphs"))


def test_reduce_overhead_replays_neuron_graphs_without_a_warning():
    torch._dynamo.reset()
    torch.neuron.reset_dynamo_metrics()
    f = torch.compile(_f, backend="neuron", mode="reduce-overhead")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no CUDA graphs" warning any more
        for _ in range(3):
            _check(f)
    assert torch.neuron.get_dynamo_metrics()["graph_replays"] == 2


def test_unknown_mode_is_rejected():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown mode 'fastest'"):
        _check(torch.compile(_f, backend="neuron", mode="fastest"))
