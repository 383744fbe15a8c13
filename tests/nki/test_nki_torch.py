"""PyTorch integration: kernels on torch tensors, nki_op custom ops, torch.compile, autograd."""

import pytest

import torch

import nki  # noqa: E402
import nki.language as nl  # noqa: E402
from nki_kernels import softmax_kernel  # noqa: E402
from torchneuron.nki import torch_ops  # noqa: E402
from torchneuron.nki.torch_ops import nki_op  # noqa: E402


@nki.jit
def _scale(x, factor):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.multiply(nl.load(x), factor))
    return out


def test_jit_kernel_called_on_torch_tensors_returns_torch_tensors():
    x = torch.randn(64, 32)
    y = _scale(x, 3.0)
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype
    torch.testing.assert_close(y, x * 3)


def test_kernel_call_fills_the_specialisation_cache():
    x = torch.randn(8, 16)
    _scale(x, 2.0)
    key = torch_ops.specialization_key(_scale, 1, (x, 2.0), {})
    assert torch_ops._spec_cache[key][1] == (8, 16)
    other = torch_ops.specialization_key(_scale, 1, (x, 5.0), {})
    assert other != key  # constants are part of the key


def test_kernels_on_fake_tensors_infer_output_shapes_without_numerics():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(16, 24)
        y = _scale(x, 1.5)
    assert y.shape == (16, 24) and y.dtype == torch.float32


@nki_op("nkitest::softmax", mutates_args=())
def nki_softmax(x: torch.Tensor) -> torch.Tensor:
    return softmax_kernel(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return y * (grad - (grad * y).sum(-1, keepdim=True))


nki_softmax.register_autograd(_backward, setup_context=_setup)


def test_nki_op_registers_a_torch_library_custom_op():
    x = torch.randn(32, 40)
    torch.testing.assert_close(torch.ops.nkitest.softmax(x), torch.softmax(x, -1))


def test_nki_op_stays_one_node_under_torch_compile():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    @torch.compile(backend=backend, fullgraph=True)
    def f(x):
        return nki_softmax(x * 2) + 1

    x = torch.randn(16, 64)
    torch.testing.assert_close(f(x), torch.softmax(x * 2, -1) + 1)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.nkitest.softmax.default) == 1


def test_nki_op_register_autograd_gives_correct_gradients():
    x = torch.randn(8, 16, requires_grad=True)
    nki_softmax(x)[:, 0].sum().backward()
    x2 = x.detach().clone().requires_grad_()
    torch.softmax(x2, -1)[:, 0].sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_kernel_on_neuron_device_tensors_returns_neuron_tensors():
    x = torch.randn(16, 8).to("neuron")
    y = _scale(x, 2.0)
    assert y.device.type == "neuron"
    torch.testing.assert_close(y.cpu(), x.cpu() * 2)


@nki.jit
def _scale_in_place(x):
    nl.store(x, nl.multiply(nl.load(x), 2.0))


@nki_op("nkitest::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor) -> None:
    _scale_in_place(x)


def test_nki_op_with_mutated_arguments_updates_them_in_place():
    x = torch.randn(8, 8)
    ref = x * 2
    scale_(x)
    torch.testing.assert_close(x, ref)


def test_mutating_nki_op_under_torch_compile():
    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        y = x + 1
        scale_(y)
        return y

    x = torch.randn(8, 8)
    torch.testing.assert_close(f(x), (x + 1) * 2)
