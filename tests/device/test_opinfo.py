"""Every ATen op that runs on CPU runs on neuron with identical results.

PyTorch's own OpInfo database (sample inputs for ~700 ops) is the battery; CPU is the oracle.
Random ops (those that run one of neuron's random kernels) draw from neuron's Philox
generator, whose numbers differ from CPU's by design, as CUDA's do: for them the oracle is
CPU's shapes and dtypes, and the same seed must give the same result again (their values are
tested in test_random.py).
"""

import pytest
import torch
import torchneuron
from support import ran_random_kernel
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_map


# Ops whose result is undefined by design (uninitialised memory), or that need inputs to stay
# on the CPU (tensor_split's index tensor), move data to another device (to: tested in
# test_tensor.py).
SKIP = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
        "tensor_split", "to"}
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.bool]
# On hosts without AVX-512, bf16 GEMMs and convolutions leave CPU's (scalar) kernels for the exact
# TensorE route (docs/architecture.md, Precision). Where CPU's bf16 kernel rounds intermediate
# results (transposed convolution: 56 % of its outputs are the once-rounded exact value, neuron's
# 100 %), neuron is compared with the float64 result rounded once to bf16 instead of with CPU.
ROUTED_BF16_DIFFER = {"nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d",
                      "nn.functional.conv_transpose3d"}


def _name(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _cases():
    for op in op_db:
        if op.name in SKIP or _name(op) in SKIP:
            continue
        for dtype in DTYPES:
            if dtype in op.supported_dtypes("cpu"):
                yield pytest.param(op, dtype, id=f"{_name(op)}-{str(dtype)[6:]}")


def _assert_same_random_result(rerun, got, expected):
    """A random op: CPU's shapes and dtypes, and the same values again from the same seed."""
    got_cpu = tree_map(_cpu, got)
    for g, e in zip(torch.utils._pytree.tree_leaves(got_cpu), torch.utils._pytree.tree_leaves(expected)):
        if isinstance(e, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.shape == e.shape and g.dtype == e.dtype, (g, e)
    torch.manual_seed(0)
    torch.testing.assert_close(tree_map(_cpu, rerun()), got_cpu, equal_nan=True, atol=0, rtol=0)


def _first_sample(op, dtype, requires_grad=False):
    torch.manual_seed(0)
    for sample in op.sample_inputs("cpu", dtype, requires_grad=requires_grad):
        return sample
    pytest.skip("no sample input")


@pytest.mark.parametrize("op,dtype", list(_cases()))
def test_op_matches_cpu(op, dtype):
    sample = _first_sample(op, dtype)
    torch.manual_seed(0)
    try:
        expected = op(sample.input, *sample.args, **sample.kwargs)
    except Exception as exc:  # the sample is invalid on CPU too: nothing to compare
        pytest.skip(f"CPU raises: {type(exc).__name__}")
    moved = tree_map(lambda x: _to(x, "neuron"), (sample.input, sample.args, dict(sample.kwargs)))
    if "device" in moved[2]:  # factory functions: ask for the neuron device instead
        moved[2]["device"] = "neuron"
    on_device = "device" in moved[2] or any(
        isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(moved))
    torch.manual_seed(0)
    torchneuron.clear_op_tracking()
    got = op(moved[0], *moved[1], **moved[2])
    for t in torch.utils._pytree.tree_leaves(got):
        if isinstance(t, torch.Tensor) and on_device:
            assert t.device.type == "neuron", f"{_name(op)} returned a tensor on {t.device}"
    if ran_random_kernel():
        _assert_same_random_result(lambda: op(moved[0], *moved[1], **moved[2]), got, expected)
        return
    import torchneuron._C as _C
    if (dtype == torch.bfloat16 and _name(op) in ROUTED_BF16_DIFFER
            and not _C._precision_routes()["bf16_cpu_kernels"]):
        dbl = tree_map(lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                       (sample.input, sample.args, dict(sample.kwargs)))
        exact = op(dbl[0], *dbl[1], **dbl[2]).to(torch.bfloat16)
        assert torch.equal(got.cpu(), exact) or (got.cpu() == exact).float().mean() >= 0.99
        return
    torch.testing.assert_close(tree_map(_cpu, got), expected, equal_nan=True, check_device=False,
                               atol=1e-5, rtol=1e-5)


def _grad_cases():
    for op in op_db:
        if op.name in SKIP or _name(op) in SKIP or not op.supports_autograd:
            continue
        if torch.float32 in op.supported_backward_dtypes("cpu"):
            yield pytest.param(op, id=_name(op))


@pytest.mark.parametrize("op", list(_grad_cases()))
def test_op_gradient_matches_cpu(op):
    sample = _first_sample(op, torch.float32, requires_grad=True)
    inputs = [t for t in torch.utils._pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.manual_seed(0)
    try:
        out = op(sample.input, *sample.args, **sample.kwargs)
        outs = [o for o in torch.utils._pytree.tree_leaves(out)
                if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
        if not outs or not inputs:
            pytest.skip("no differentiable output")
        expected = torch.autograd.grad([o.sum() for o in outs], inputs, allow_unused=True)
    except Exception as exc:
        pytest.skip(f"CPU raises: {type(exc).__name__}")
    dev = tree_map(lambda x: x.detach().to("neuron").requires_grad_(x.requires_grad)
                   if isinstance(x, torch.Tensor) else x, (sample.input, sample.args, sample.kwargs))
    dev_inputs = [t for t in torch.utils._pytree.tree_leaves(dev) if isinstance(t, torch.Tensor) and t.requires_grad]
    def grads():
        out = op(dev[0], *dev[1], **dev[2])
        outs = [o for o in torch.utils._pytree.tree_leaves(out)
                if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
        return torch.autograd.grad([o.sum() for o in outs], dev_inputs, allow_unused=True)

    torch.manual_seed(0)
    torchneuron.clear_op_tracking()
    got = grads()
    if ran_random_kernel():
        _assert_same_random_result(grads, got, expected)
        return
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
            continue
        assert g.device.type == "neuron"
        torch.testing.assert_close(g.cpu(), e, equal_nan=True, atol=1e-4, rtol=1e-4)
