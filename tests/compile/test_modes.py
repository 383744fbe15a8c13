"""torch.compile modes on neuron (no CUDA graphs)."""

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


def test_reduce_overhead_warns_and_compiles_without_cudagraphs():
    torch._dynamo.reset()
    from torchneuron.compile import backend

    backend._warned.discard("mode:reduce-overhead")
    with pytest.warns(UserWarning, match="no CUDA graphs"):
        _check(torch.compile(_f, backend="neuron", mode="reduce-overhead"))


def test_unknown_mode_is_rejected():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown mode 'fastest'"):
        _check(torch.compile(_f, backend="neuron", mode="fastest"))
