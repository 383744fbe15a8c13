"""How ops reach the neuron device: every op has a route, and none takes a slower or
numerically different path than on CPU."""

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


def test_boxed_fallback_is_registered_for_every_op():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::cumsum", "PrivateUse1") is False
    # The fallback serves ops without a kernel: cumsum runs and matches CPU.
    x = torch.arange(10.0)
    assert torch.equal(torch.cumsum(x.to("neuron"), 0).cpu(), torch.cumsum(x, 0))


def test_layer_norm_bf16_is_bit_identical_to_cpu():
    x = torch.randn(4, 8, 16, dtype=torch.bfloat16)
    w = torch.randn(16, dtype=torch.bfloat16)
    expected = torch.nn.functional.layer_norm(x, (16,), w)
    got = torch.nn.functional.layer_norm(x.to("neuron"), (16,), w.to("neuron"))
    assert torch.equal(got.cpu(), expected)
