"""Device checks with CUDA's rules: an op's outputs (out=, self of an in-place op) live on its
device, 0-dim or not; CPU 0-dim tensors are accepted as inputs only; generators and streams
must be the op's device type. Plus ops whose CPU kernels neuron must reach (one test each)."""

import warnings

import pytest
import torch


def n(x):
    return x.to("neuron")


def test_out_on_cpu_is_refused_for_a_0dim_neuron_input():
    out = torch.empty(())
    with pytest.raises(RuntimeError, match="Expected out tensor to have device neuron:0, but got cpu"):
        torch.exp(n(torch.tensor(1.0)), out=out)
    assert out.device.type == "cpu"


def test_out_on_cpu_is_refused_for_a_neuron_input():
    with pytest.raises(RuntimeError, match="device"):
        torch.exp(n(torch.ones(3)), out=torch.empty(3))


def test_0dim_out_on_cpu_is_refused_for_a_reduction():
    with pytest.raises(RuntimeError, match="Expected out tensor to have device neuron:0"):
        torch.sum(n(torch.ones(3)), 0, out=torch.empty(()))


def test_cpu_0dim_self_of_an_inplace_op_is_refused():
    x = torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x.add_(n(torch.tensor(2.0)))
    assert x.item() == 1.0


def test_cpu_0dim_input_is_still_accepted():
    got = n(torch.arange(3.0)) * torch.tensor(2.0)
    assert got.device.type == "neuron"
    assert got.cpu().tolist() == [0.0, 2.0, 4.0]


def test_cpu_0dim_input_with_a_neuron_out_is_accepted():
    out = n(torch.empty(()))
    torch.exp(torch.tensor(0.0), out=out)
    assert out.item() == 1.0


def test_cpu_generator_for_a_neuron_op_is_refused():
    with pytest.raises(RuntimeError, match="Expected a 'neuron' device type for generator but found 'cpu'"):
        torch.randn(3, device="neuron", generator=torch.Generator())


def test_neuron_generator_for_a_cpu_op_is_refused():
    g = torch.Generator(device="neuron")
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'neuron'"):
        torch.randn(3, generator=g)


def test_neuron_generator_for_a_neuron_op_is_accepted():
    g = torch.Generator(device="neuron").manual_seed(3)
    a = torch.randn(3, device="neuron", generator=g)
    g.manual_seed(3)
    assert torch.equal(torch.randn(3, device="neuron", generator=g).cpu(), a.cpu())


def test_record_stream_with_a_cpu_stream_is_refused():
    x = n(torch.ones(4))
    with pytest.raises(RuntimeError, match="expected a neuron stream"):
        x.record_stream(torch.Stream(device="cpu"))


def test_stream_on_a_missing_device_is_refused():
    with pytest.raises((RuntimeError, ValueError), match="99"):
        torch.neuron.Stream(device=99)


def test_mode_out_runs_the_cpu_kernel():
    x = torch.tensor([[1.0, 2.0, 2.0], [3.0, 3.0, 1.0]])
    values, indices = n(torch.empty(0)), n(torch.empty(0, dtype=torch.long))
    torch.mode(n(x), 1, out=(values, indices))
    expected = torch.mode(x, 1)
    assert torch.equal(values.cpu(), expected.values) and torch.equal(indices.cpu(), expected.indices)


def test_conj_physical_complex64_matches_cpu():
    x = torch.randn(5, dtype=torch.complex64)
    assert torch.equal(torch.conj_physical(n(x)).cpu(), torch.conj_physical(x))
    y = n(x.clone())
    y.conj_physical_()
    assert torch.equal(y.cpu(), x.conj_physical())


def test_ldexp_inplace_refuses_to_resize_self():
    x = n(torch.ones(3))
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        x.ldexp_(n(torch.ones(2, 3, dtype=torch.long)))
    assert x.shape == (3,)


def test_same_tensor_as_input_and_out_is_one_tensor_for_the_kernel():
    x = n(torch.arange(4.0))
    torch.add(x, x, out=x)
    assert x.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


def test_randn_out_fills_the_neuron_buffer():
    out = n(torch.empty(0))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = torch.randn(4, 5, out=out)
    assert res is out and out.shape == (4, 5) and out.device.type == "neuron"


def test_avg_pool3d_out_matches_cpu():
    x = torch.randn(1, 2, 4, 4, 4)
    out = n(torch.empty(0))
    torch._C._nn.avg_pool3d(n(x), 2, out=out)
    torch.testing.assert_close(out.cpu(), torch._C._nn.avg_pool3d(x, 2))


def test_avg_pool3d_into_a_strided_out_writes_through_its_strides():
    # CPU's kernel ignores out's strides (wrong values, silently); CUDA's respects them.
    from torch.testing import make_tensor

    x = torch.randn(2, 2, 4, 4, 4)
    expected = torch._C._nn.avg_pool3d(x, 2)
    out = make_tensor(expected.shape, dtype=torch.float32, device="neuron", noncontiguous=True)
    strides, ptr = out.stride(), out.data_ptr()
    torch._C._nn.avg_pool3d(n(x), 2, out=out)
    assert out.stride() == strides and out.data_ptr() == ptr
    torch.testing.assert_close(out.cpu(), expected)


def test_layer_norm_with_a_cpu_weight_is_refused():
    # native_layer_norm runs unboxed (ops.cpp): its optional tensors get the device check too.
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.nn.functional.layer_norm(n(torch.randn(4, 8)), (8,), torch.ones(8))


def test_layer_norm_backward_with_a_cpu_bias_is_refused():
    x, g = n(torch.randn(4, 8)), n(torch.randn(4, 8))
    mean, rstd = n(torch.zeros(4, 1)), n(torch.ones(4, 1))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ops.aten.native_layer_norm_backward(g, x, [8], mean, rstd, n(torch.ones(8)), torch.zeros(8),
                                                  [True, True, True])


def test_group_norm_with_a_cpu_weight_is_refused():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.nn.functional.group_norm(n(torch.randn(2, 4, 3, 3)), 2, torch.ones(4))
