"""index_select on neuron (csrc/backend/ops.cpp, index_select_hot) writes its result from the
device pool through CPU's out= kernel: the same values, shape, layout, dtype and errors as CPU's
functional kernel, which `embedding` also reaches."""

import pytest
import torch

DEV = "neuron"


def both(fn, *tensors):
    return fn(*tensors), fn(*(t.to(DEV) for t in tensors))


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_matches_cpu_along_each_dim(dim):
    x = torch.randn(5, 6, 7)
    idx = torch.tensor([4, 0, 0, 2])
    expected, got = both(lambda a, i: a.index_select(dim, i), x, idx)
    assert got.shape == expected.shape and got.stride() == expected.stride()
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool])
def test_matches_cpu_for_each_dtype(dtype):
    x = (torch.randn(40, 9) * 10).to(dtype)
    idx = torch.randint(0, 40, (100,), dtype=torch.int32)
    expected, got = both(lambda a, i: a.index_select(0, i), x, idx)
    assert got.dtype == expected.dtype and torch.equal(got.cpu(), expected)


def test_strided_self_empty_index_and_0dim_index_match_cpu():
    x = torch.randn(8, 10)
    for fn, idx in ((lambda a, i: a.t().index_select(0, i), torch.tensor([3, 1])),
                    (lambda a, i: a.index_select(1, i), torch.tensor([], dtype=torch.long)),
                    (lambda a, i: a.index_select(0, i), torch.tensor(5))):
        expected, got = both(fn, x, idx)
        assert got.shape == expected.shape and torch.equal(got.cpu(), expected)


def test_embedding_forward_and_backward_match_cpu():
    w = torch.randn(100, 16, requires_grad=True)
    idx = torch.randint(0, 100, (4, 12))
    wn = w.detach().to(DEV).requires_grad_()
    torch.nn.functional.embedding(idx, w).square().sum().backward()
    out = torch.nn.functional.embedding(idx.to(DEV), wn)
    out.square().sum().backward()
    assert torch.equal(out.detach().cpu(), torch.nn.functional.embedding(idx, w.detach()))
    assert torch.equal(wn.grad.cpu(), w.grad)


@pytest.mark.parametrize("index, match", [(torch.tensor([0.0]), "int32 or int64"),
                                          (torch.tensor([7]), "out of range"),
                                          (torch.tensor([[0]]), "supposed to be a vector")])
def test_bad_index_is_refused_as_on_cpu(index, match):
    x = torch.randn(3, 4)
    with pytest.raises((RuntimeError, IndexError), match=match):
        x.index_select(0, index)
    with pytest.raises((RuntimeError, IndexError), match=match):
        x.to(DEV).index_select(0, index.to(DEV))
        # With the execution engine on, an index out of range is found by the queued kernel and
        # reported at the next synchronization (as CUDA's device-side assert); shapes and dtypes
        # still raise at the call.
        torch.neuron.synchronize()


def test_bad_dim_and_cpu_index_are_refused():
    x = torch.randn(3, 4, device=DEV)
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.index_select(2, torch.tensor([0], device=DEV))
    with pytest.raises(RuntimeError, match="same device"):
        x.index_select(0, torch.tensor([0, 1]))
