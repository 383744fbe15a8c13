"""A neuron convolution's result and gradients have CPU's layouts, and torch.compile plans with them.

CPU's rule for 2-d (and 1-d, viewed as 2-d) convolutions, in every dtype: channels-last when the
input or the weight suggests it. 3-d convolutions follow the same rule with channels_last_3d
(CPU's oneDNN path and CUDA's; CPU's slow 3-d kernels return contiguous results). Values are
CPU's either way (the fp16/bf16 routes have their own tests in test_precision.py).
"""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

DEV = "neuron"
CL = {4: torch.channels_last, 5: torch.channels_last_3d}


@pytest.fixture(params=["queued", "synchronous"])
def path(request):
    """Both ways a convolution runs: queued by the engine, or synchronously."""
    engine = torch.neuron.engine
    was = engine.is_enabled()
    engine.set_enabled(request.param == "queued")
    yield request.param
    try:
        engine.synchronize()
    finally:
        engine.set_enabled(was)


def significant_strides(t):
    """Strides of the dimensions longer than one (the others do not address memory)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n != 1)


def operands(nd, dtype, input_cl, weight_cl, transposed=False, k=3):
    torch.manual_seed(0)
    x = torch.randn(2, 6, *([7] * nd), dtype=dtype)
    w = torch.randn(6, 4, *([k] * nd), dtype=dtype) if transposed else torch.randn(4, 6, *([k] * nd), dtype=dtype)
    if input_cl:
        x = x.contiguous(memory_format=CL[nd + 2])
    if weight_cl:
        w = w.contiguous(memory_format=CL[nd + 2])
    return x, w


def conv_args(nd, transposed):
    return ([1] * nd, [1] * nd, [1] * nd, transposed, [0] * nd, 1)


CASES_2D = list(itertools.product([torch.float32, torch.float64, torch.bfloat16, torch.float16],
                                  [False, True], [False, True], [False, True], [1, 3]))


@pytest.mark.parametrize("dtype,input_cl,weight_cl,transposed,k", CASES_2D,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_conv2d_result_and_gradients_have_cpus_layout(path, dtype, input_cl, weight_cl, transposed, k):
    x, w = operands(2, dtype, input_cl, weight_cl, transposed, k)
    b = torch.randn(w.shape[1] if transposed else w.shape[0], dtype=dtype)
    args = conv_args(2, transposed)
    want = torch.convolution(x, w, b, *args)
    got = torch.convolution(x.to(DEV), w.to(DEV), b.to(DEV), *args)
    assert significant_strides(got) == significant_strides(want)
    g = torch.randn_like(want)
    grads = torch.ops.aten.convolution_backward(g.to(DEV), x.to(DEV), w.to(DEV), [b.numel()], *args, [True] * 3)
    wants = torch.ops.aten.convolution_backward(g, x, w, [b.numel()], *args, [True] * 3)
    for gt, wt in zip(grads, wants):
        assert significant_strides(gt) == significant_strides(wt)
    if dtype in (torch.float32, torch.float64):  # (fp16/bf16 values: test_precision.py)
        torch.testing.assert_close(got.cpu(), want)
        for gt, wt in zip(grads, wants):
            torch.testing.assert_close(gt.cpu(), wt)


@pytest.mark.parametrize("weight", ["contiguous", "permuted"])
def test_conv1d_takes_the_layout_cpu_gives_its_2d_view(path, weight):
    # ATen runs a 1-d convolution as a 2-d one of height 1 over a contiguous input: a weight
    # whose 2-d view suggests channels-last gives a result with the channels innermost.
    torch.manual_seed(1)
    x = torch.randn(2, 8, 10).transpose(1, 2).contiguous().transpose(1, 2)  # strided input
    w = torch.randn(4, 3, 8).permute(0, 2, 1) if weight == "permuted" else torch.randn(4, 8, 3)
    want = F.conv1d(x, w)
    got = F.conv1d(x.to(DEV), w.to(DEV))
    assert got.stride() == want.stride()
    torch.testing.assert_close(got.cpu(), want)
    args = ([1], [0], [1], False, [0], 1, [True, True, False])
    g = torch.randn_like(want)
    grads = torch.ops.aten.convolution_backward(g.to(DEV), x.to(DEV), w.to(DEV), None, *args)
    wants = torch.ops.aten.convolution_backward(g, x, w, None, *args)
    for gt, wt in zip(grads[:2], wants[:2]):
        assert significant_strides(gt) == significant_strides(wt)
        torch.testing.assert_close(gt.cpu(), wt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("input_cl,weight_cl", [(False, False), (True, False), (False, True)])
def test_conv3d_is_channels_last_3d_when_an_operand_is(path, dtype, input_cl, weight_cl):
    x, w = operands(3, dtype, input_cl, weight_cl)
    got = F.conv3d(x.to(DEV), w.to(DEV), padding=1)
    expect_cl = input_cl or weight_cl
    assert got.is_contiguous(memory_format=torch.channels_last_3d if expect_cl else torch.contiguous_format)
    assert got.is_contiguous() != expect_cl
    if dtype != torch.float16:
        torch.testing.assert_close(got.cpu(), F.conv3d(x, w, padding=1))
    grads = torch.ops.aten.convolution_backward(torch.ones_like(got), x.to(DEV), w.to(DEV), None, [1] * 3, [1] * 3,
                                                [1] * 3, False, [0] * 3, 1, [True, True, False])
    fmt = torch.channels_last_3d if expect_cl else torch.contiguous_format
    assert grads[0].is_contiguous(memory_format=fmt) and grads[1].is_contiguous(memory_format=fmt)


FAKE_CASES = [(2, False, False), (2, True, False), (2, False, True), (3, False, False), (3, True, False),
              (1, False, False), (1, False, "permuted")]


@pytest.mark.parametrize("nd,input_cl,weight_cl", FAKE_CASES, ids=str)
@pytest.mark.parametrize("transposed", [False, True])
def test_fake_tensors_predict_eagers_layouts(nd, input_cl, weight_cl, transposed):
    # What torch.compile plans with: Inductor checks an extern convolution's strides against it.
    x, w = operands(nd, torch.float32, input_cl, weight_cl is True, transposed)
    if weight_cl == "permuted":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    x, w = x.to(DEV), w.to(DEV)
    args = conv_args(nd, transposed)
    out = torch.convolution(x, w, None, *args)
    grads = torch.ops.aten.convolution_backward(torch.ones_like(out), x, w, None, *args, [True, True, False])
    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        fout = torch.convolution(fx, fw, None, *args)
        fgrads = torch.ops.aten.convolution_backward(torch.ones_like(fout), fx, fw, None, *args, [True, True, False])
    assert fout.device == out.device
    assert significant_strides(fout) == significant_strides(out)
    for f, e in zip(fgrads[:2], grads[:2]):
        assert significant_strides(f) == significant_strides(e)


def test_other_devices_keep_pytorchs_prediction():
    x = torch.randn(2, 3, 8, 8, device="meta").contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3, device="meta")
    with FakeTensorMode() as mode:
        out = torch.convolution(mode.from_tensor(x), mode.from_tensor(w), None, *conv_args(2, False))
    assert out.is_contiguous()  # PyTorch's answer for the meta device's "Overrideable" backend


def test_compiled_channels_last_network_keeps_layouts_and_matches_cpu():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.SiLU(),
                                torch.nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    ref = model(x.clone().requires_grad_())
    dev_model = copy.deepcopy(model).to(DEV)
    torch._dynamo.reset()
    compiled = torch.compile(dev_model, backend="neuron")
    xd = x.to(DEV).requires_grad_()
    out = compiled(xd)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    out.sum().backward()
    xr = x.clone().requires_grad_()
    model(xr).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xd.grad.cpu(), xr.grad, atol=1e-5, rtol=1e-5)
    assert xd.grad.stride() == xr.grad.stride()
