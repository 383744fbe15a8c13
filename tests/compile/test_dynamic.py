"""Dynamic shapes: no recompilation per shape."""

import torch

from compile_models import DEV


def _f(x, w):
    return torch.nn.functional.gelu(x @ w).sum(dim=-1) + x.mean()


def test_dynamic_true_compiles_once_for_three_sizes(metrics):
    torch._dynamo.reset()
    w = torch.randn(8, 8, device=DEV)
    f = torch.compile(_f, backend="neuron", dynamic=True)
    for n in (3, 7, 12):
        x = torch.randn(n, 8, device=DEV)
        torch.testing.assert_close(f(x, w).cpu(), _f(x.cpu(), w.cpu()), atol=1e-4, rtol=1e-4)
    m = metrics()
    assert m["compilations"] == 1 and m["recompilations"] == 0


def test_automatic_dynamic_recompiles_once_then_generalises(metrics):
    torch._dynamo.reset()
    w = torch.randn(8, 8, device=DEV)

    def g(x, w):  # distinct code object from _f: its own frame cache
        return _f(x, w) * 2

    f = torch.compile(g, backend="neuron")
    for n in (4, 9, 17):
        x = torch.randn(n, 8, device=DEV)
        torch.testing.assert_close(f(x, w).cpu(), g(x.cpu(), w.cpu()), atol=1e-4, rtol=1e-4)
    m = metrics()
    assert m["compilations"] == 2 and m["recompilations"] == 1


def test_dynamic_training_step_matches_eager(metrics):
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    dev_lin = torch.nn.Linear(8, 4).to(DEV)
    dev_lin.load_state_dict(lin.state_dict())
    f = torch.compile(lambda m, x: m(x).relu().square().mean(), backend="neuron", dynamic=True)
    for n in (2, 5, 11):
        x = torch.randn(n, 8)
        lin.zero_grad(), dev_lin.zero_grad()
        lin(x).relu().square().mean().backward()
        f(dev_lin, x.to(DEV)).backward()
        torch.testing.assert_close(dev_lin.weight.grad.cpu(), lin.weight.grad, atol=1e-5, rtol=1e-4)
    assert metrics()["compilations"] == 1


def test_attention_block_dynamic_sequence_length_compiles_once(metrics):
    from compile_models import GPTBlock, assert_close, clone_to

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = GPTBlock()
    compiled = torch.compile(clone_to(ref, DEV), backend="neuron", dynamic=True)
    with torch.no_grad():
        for T in (5, 8, 13):
            x = torch.randn(2, T, 32)
            assert_close(compiled(x.to(DEV)), ref(x))
    assert metrics()["compilations"] == 1
