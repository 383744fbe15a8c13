"""Graph breaks and fullgraph."""

import pytest
import torch

from compile_models import DEV


def _with_break(x):
    y = x.sin() * 2
    torch._dynamo.graph_break()
    return y.cos() + 1


def test_graph_break_compiles_both_sides_and_matches_eager(metrics):
    torch._dynamo.reset()
    x = torch.randn(32, device=DEV)
    out = torch.compile(_with_break, backend="neuron")(x)
    torch.testing.assert_close(out.cpu(), _with_break(x.cpu()))
    m = metrics()
    assert m["graph_breaks"] >= 1
    assert m["compilations"] == 2


def test_fullgraph_raises_on_graph_break():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="graph_break|Graph break|graph break"):
        torch.compile(_with_break, backend="neuron", fullgraph=True)(torch.randn(4, device=DEV))


def test_fullgraph_single_graph_for_data_dependent_free_code(metrics):
    torch._dynamo.reset()

    def f(x):
        return torch.where(x > 0, x, 0.1 * x).cumsum(0)

    x = torch.randn(16, device=DEV)
    torch.testing.assert_close(torch.compile(f, backend="neuron", fullgraph=True)(x).cpu(), f(x.cpu()))
    m = metrics()
    assert m["compilations"] == 1 and m["graph_breaks"] == 0
