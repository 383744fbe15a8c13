"""Functional ops whose result CPU's out= kernel writes into the device pool (ops.cpp, Pooled):
silu, softmax, log_softmax, the backward of silu and relu (threshold_backward), sqrt and twelve
unary elementwise ops (neg, exp, log, tanh, sigmoid, ...). Each
result is CPU's, bit for bit, with CPU's shape, strides and dtype, for contiguous arguments (the
pooled route) and others (CPU's functional kernel); errors are CPU's. The oracle is the same call
on CPU."""

import copy

import pytest
import torch

import torchneuron  # noqa: F401

aten = torch.ops.aten

# name -> (call(args), number of tensor arguments)
OPS = {
    "silu": (lambda a: aten.silu(a[0]), 1),
    "silu_backward": (lambda a: aten.silu_backward(a[0], a[1]), 2),
    "threshold_backward": (lambda a: aten.threshold_backward(a[0], a[1], 0.25), 2),
    "_softmax": (lambda a: aten._softmax(a[0], -1, False), 1),
    "_log_softmax": (lambda a: aten._log_softmax(a[0], 1, False), 1),
    "sqrt": (lambda a: aten.sqrt(a[0]), 1),
}
UNARY = ["neg", "exp", "log", "tanh", "sigmoid", "rsqrt", "reciprocal", "erf", "sin", "cos", "log1p",
         "expm1"]
for _name in UNARY:
    OPS[_name] = ((lambda op: lambda a: op(a[0]))(getattr(aten, _name)), 1)
OPS["clamp"] = (lambda a: aten.clamp(a[0], -0.5, 0.75), 1)
OPS["clamp_min"] = (lambda a: aten.clamp(a[0], None, 0.3), 1)
SHAPES = [(8, 256), (3, 1000, 7), (0, 5), (17,)]


def args(k: int, shape, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(k)]


def check(name, cpu_args, dev_args):
    call = OPS[name][0]
    want = call(cpu_args)
    got = call(dev_args)
    assert got.device.type == "neuron"
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(OPS))
def test_pooled_op_matches_cpu_bit_for_bit(name, dtype):
    for shape in SHAPES:
        if name.endswith("softmax") and len(shape) < 2:
            continue
        cpu = args(OPS[name][1], shape, dtype)
        check(name, cpu, [t.to("neuron") for t in cpu])


@pytest.mark.parametrize("name", sorted(OPS))
def test_strided_arguments_take_cpus_functional_kernel_with_its_layout(name):
    cpu = [t.transpose(0, 1) for t in args(OPS[name][1], (64, 48), torch.float32)]
    dev = [t.to("neuron").transpose(0, 1) for t in args(OPS[name][1], (64, 48), torch.float32)]
    check(name, cpu, dev)


@pytest.mark.parametrize("name", sorted(OPS))
def test_results_come_from_the_device_pool(name):
    # An adopted result (CPU's functional kernel) brings a segment of its own to the device
    # allocator on every call; a pooled one is a block of the caching allocator's segments.
    x = [t.to("neuron") for t in args(OPS[name][1], (8, 256), torch.float32)]
    call = OPS[name][0]
    call(x)
    before = torch.neuron.memory_stats().get("segment.all.allocated", 0)
    for _ in range(3):
        call(x)
    assert torch.neuron.memory_stats().get("segment.all.allocated", 0) == before


def test_mixed_dtypes_match_cpu():
    g, s = torch.randn(8, 256).bfloat16(), torch.randn(8, 256)
    want = aten.silu_backward(g, s)
    got = aten.silu_backward(g.to("neuron"), s.to("neuron"))
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_integer_input_raises_as_on_cpu():
    with pytest.raises(RuntimeError) as cpu_err:
        aten.silu(torch.arange(6))
    with pytest.raises(RuntimeError) as dev_err:
        aten.silu(torch.arange(6, device="neuron"))
    assert str(dev_err.value) == str(cpu_err.value)


def test_half_to_float_softmax_raises_as_on_cpu():
    x = torch.randn(4, 8).half()
    with pytest.raises(RuntimeError, match="not supported on CPU") as cpu_err:
        aten._softmax(x, -1, True)
    with pytest.raises(RuntimeError) as dev_err:
        aten._softmax(x.to("neuron"), -1, True)
    assert str(dev_err.value) == str(cpu_err.value)


def test_an_argument_on_the_cpu_is_refused():
    with pytest.raises(RuntimeError, match="device"):
        aten.silu_backward(torch.randn(8, device="neuron"), torch.randn(8))


def test_silu_and_relu_training_step_matches_cpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    twin = copy.deepcopy(model).to("neuron")
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    for m, xx, yy in ((model, x, y), (twin, x.to("neuron"), y.to("neuron"))):
        torch.nn.functional.cross_entropy(m(xx), yy).backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["silu_backward", "threshold_backward"])
def test_broadcast_arguments_match_cpu(name):
    # not the pooled route (shapes differ): CPU's functional kernel broadcasts
    g = torch.Generator().manual_seed(1)
    small, big = torch.randn(256, generator=g), torch.randn(8, 256, generator=g)
    for a, b in ((small, big), (big, small)):
        check(name, [a, b], [a.to("neuron"), b.to("neuron")])


@pytest.mark.parametrize("name", UNARY)
def test_unary_op_of_integers_matches_cpu(name):
    # not the pooled route: an integer input gives a float result (or CPU's error)
    x = torch.arange(-3, 5)
    try:
        want = OPS[name][0]([x])
    except RuntimeError as e:
        with pytest.raises(RuntimeError) as err:
            OPS[name][0]([x.to("neuron")])
        assert str(err.value) == str(e)
        return
    got = OPS[name][0]([x.to("neuron")])
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


def test_clamp_without_bounds_raises_as_on_cpu():
    with pytest.raises(RuntimeError) as cpu_err:
        aten.clamp(torch.randn(4), None, None)
    with pytest.raises(RuntimeError) as dev_err:
        aten.clamp(torch.randn(4, device="neuron"), None, None)
    assert str(dev_err.value) == str(cpu_err.value)


@pytest.mark.parametrize("queued", [False, True], ids=["synchronous", "queued"])
@pytest.mark.parametrize("op", [torch.add, torch.sub, torch.mul, torch.div], ids=lambda f: f.__name__)
def test_broadcast_and_strided_arithmetic_takes_cpus_layouts(op, queued):
    # ops.cpp, pooled_broadcast: the result's layout is TensorIterator's (a transposed operand's,
    # channels-last's), synchronously as queued; the bits are CPU's.
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    a, t, s, row = r(4, 6), r(6, 4).t(), r(4, 12)[:, ::2], r(6)
    cl, bias = r(2, 3, 4, 5).to(memory_format=torch.channels_last), r(1, 3, 1, 1)
    engine = torch.neuron.engine
    was = engine.is_enabled()
    engine.set_enabled(queued)
    try:
        for x, y in ((a, row), (t, row), (row, t), (s, row), (t, a), (cl, bias), (bias, cl), (t, 2.5)):
            want = op(x, y)
            got = op(x.to("neuron"), y.to("neuron") if isinstance(y, torch.Tensor) else y)
            assert got.shape == want.shape and got.stride() == want.stride(), (x.stride(), getattr(y, "shape", y))
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    finally:
        engine.set_enabled(was)
