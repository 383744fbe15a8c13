"""How ops reach the neuron device: every op has a route, and none takes a slower or
numerically different path than on CPU."""

import pytest
import torch


def _has(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


def test_no_op_silently_uses_a_math_composite_instead_of_its_cpu_kernel():
    # An op with a CPU kernel and a CompositeExplicitAutograd kernel would run the composite on
    # PrivateUse1 (e.g. math_native_layer_norm) unless neuron registers it explicitly.
    offenders = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        if (_has(name, "CPU") and _has(name, "CompositeExplicitAutograd")
                and not _has(name, "CompositeExplicitAutogradNonFunctional")
                and not _has(name, "PrivateUse1")):
            offenders.append(name)
    assert offenders == []


def test_no_op_silently_decomposes_in_autograd_instead_of_running_its_cpu_kernel():
    # An op with a CPU kernel and a CompositeImplicitAutograd kernel (silu_backward's
    # math_silu_backward) runs the composite under AutogradPrivateUse1 unless neuron has a
    # kernel of its own: the fallback is not one.
    offenders = [name for name in torch._C._dispatch_get_all_op_names()
                 if name.startswith("aten::") and _has(name, "CPU") and _has(name, "CompositeImplicitAutograd")
                 and not _has(name, "PrivateUse1")]
    assert offenders == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_backward_is_cpus_kernel_bit_for_bit(dtype):
    x = torch.randn(64, 300).to(dtype)
    xn = x.to("neuron").requires_grad_()
    torch.nn.functional.silu(xn).sum().backward()
    xc = x.clone().requires_grad_()
    torch.nn.functional.silu(xc).sum().backward()
    assert torch.equal(xn.grad.cpu(), xc.grad)


def test_mish_backward_and_channel_shuffle_are_cpus_kernels_bit_for_bit():
    x = torch.randn(2, 6, 5, 5)
    xn = x.to("neuron").requires_grad_()
    torch.nn.functional.mish(xn).sum().backward()
    xc = x.clone().requires_grad_()
    torch.nn.functional.mish(xc).sum().backward()
    assert torch.equal(xn.grad.cpu(), xc.grad)
    assert torch.equal(torch.native_channel_shuffle(x.to("neuron"), 3).cpu(), torch.native_channel_shuffle(x, 3))


def test_boxed_fallback_is_registered_for_every_op():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::cumprod", "PrivateUse1") is False
    # The fallback serves ops without a kernel: cumprod runs and matches CPU.
    x = torch.arange(1.0, 11.0)
    assert torch.equal(torch.cumprod(x.to("neuron"), 0).cpu(), torch.cumprod(x, 0))


def test_layer_norm_bf16_is_bit_identical_to_cpu():
    x = torch.randn(4, 8, 16, dtype=torch.bfloat16)
    w = torch.randn(16, dtype=torch.bfloat16)
    expected = torch.nn.functional.layer_norm(x, (16,), w)
    got = torch.nn.functional.layer_norm(x.to("neuron"), (16,), w.to("neuron"))
    assert torch.equal(got.cpu(), expected)


def test_group_norm_forward_and_backward_are_cpus_kernels_bit_for_bit():
    x, w, b = torch.randn(4, 8, 5, 5), torch.randn(8), torch.randn(8)
    cpu = [t.clone().requires_grad_() for t in (x, w, b)]
    dev = [t.to("neuron").requires_grad_() for t in (x, w, b)]
    out_c = torch.nn.functional.group_norm(cpu[0], 4, cpu[1], cpu[2])
    out_n = torch.nn.functional.group_norm(dev[0], 4, dev[1], dev[2])
    assert torch.equal(out_n.cpu(), out_c)
    out_c.square().sum().backward()
    out_n.square().sum().backward()
    for c, d in zip(cpu, dev):
        assert torch.equal(d.grad.cpu(), c.grad)
