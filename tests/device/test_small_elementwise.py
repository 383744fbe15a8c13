"""Small elementwise ops (csrc/backend/ops.cpp, small_binary): +, -, *, / and the comparisons
over contiguous float and double operands of up to 2048 elements, same-shaped or a Python number, computed by a
loop over the device bytes instead of ATen's TensorIterator over CPU aliases. Their results are
ATen's bit for bit, run synchronously or queued on the execution engine; everything the loop does
not cover (alpha, broadcasting, overlap, other dtypes) takes the general path and behaves as CPU.
"""

import math

import pytest
import torch

import torchneuron

DEV = "neuron"
engine = torch.neuron.engine
OPS = (torch.add, torch.sub, torch.mul, torch.div)
COMPARISONS = (torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge)
IN_PLACE = ("add_", "sub_", "mul_", "div_")
# Across the loop's vector width (8 floats, 4 doubles), its remainder and the 2048 limit.
SIZES = (1, 3, 4, 7, 8, 9, 16, 33, 2048, 2049)
NUMBERS = (0.5, 3, -7, 0.1, -0.0, 1e40, 1e-320, 2**53 + 1, 2**63 - 1, True, math.inf, math.nan)


@pytest.fixture(params=["sync", "engine"], autouse=True)
def small_path_mode(request):
    was = engine.is_enabled()
    engine.set_enabled(request.param == "engine")
    yield request.param
    try:
        engine.synchronize()
    finally:
        engine.set_enabled(was)


def queue_slow_work() -> None:
    """A few milliseconds of work (large, so not the small path) ahead in the queue."""
    big = torch.ones(1 << 22, device=DEV)
    for _ in range(5):
        big.mul_(1.0001)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def assert_same_bits(neuron: torch.Tensor, cpu: torch.Tensor) -> None:
    assert neuron.device.type == DEV
    assert neuron.dtype == cpu.dtype and neuron.shape == cpu.shape
    assert torch.equal(bits(neuron), bits(cpu)), (neuron.cpu(), cpu)


def operands(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    # Magnitudes over the whole range, so rounding, overflow and subnormals all occur.
    a = torch.randn(n, generator=gen, dtype=dtype) * torch.exp(torch.randn(n, generator=gen, dtype=dtype) * 20)
    b = torch.randn(n, generator=gen, dtype=dtype) * torch.exp(torch.randn(n, generator=gen, dtype=dtype) * 20)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-40, 3.4e38], dtype=dtype)
    k = min(n, len(specials))
    a[:k], b[:k] = specials[:k], specials.flip(0)[:k]
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_a_small_op_matches_cpu_bit_for_bit(op, n, dtype):
    a, b = operands(n, dtype)
    assert_same_bits(op(a.to(DEV), b.to(DEV)), op(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("method", IN_PLACE)
def test_a_small_in_place_op_matches_cpu_bit_for_bit(method, n, dtype):
    a, b = operands(n, dtype)
    x = a.to(DEV)
    ret = getattr(x, method)(b.to(DEV))
    assert ret is x
    assert_same_bits(x, getattr(a.clone(), method)(b))


@pytest.mark.parametrize("n", [3, 16])  # the loop's remainder, then its vectors
@pytest.mark.parametrize("number", NUMBERS, ids=repr)
@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_a_python_number_is_cast_to_the_dtype_as_cpu_casts_it(op, number, n):
    if number is True and op is torch.sub:
        pytest.skip("CPU refuses to subtract a bool")
    a, _ = operands(n, torch.float32)
    assert_same_bits(op(a.to(DEV), number), op(a, number))


@pytest.mark.parametrize("number", NUMBERS, ids=repr)
@pytest.mark.parametrize("method", IN_PLACE)
def test_an_in_place_op_with_a_python_number_matches_cpu(method, number):
    if number is True and method == "sub_":
        pytest.skip("CPU refuses to subtract a bool")
    a, _ = operands(16, torch.float64)
    x = a.to(DEV)
    getattr(x, method)(number)
    assert_same_bits(x, getattr(a.clone(), method)(number))


def test_an_operand_may_be_the_tensor_written():
    a, _ = operands(16, torch.float32)
    x = a.to(DEV)
    x.mul_(x)
    flat = x.view(4, 4).view(-1)  # another tensor over the same bytes
    x.add_(flat)
    expected = a * a
    expected += expected
    assert_same_bits(x, expected)


def test_an_operand_may_be_passed_twice():
    a, _ = operands(33, torch.float32)
    x = a.to(DEV)
    assert_same_bits(x - x, a - a)


@pytest.mark.parametrize("alpha", [2, 0.5, -3])
def test_alpha_other_than_one_matches_cpu(alpha):
    a, b = operands(16, torch.float32)
    assert_same_bits(torch.add(a.to(DEV), b.to(DEV), alpha=alpha), torch.add(a, b, alpha=alpha))
    assert_same_bits(torch.sub(a.to(DEV), b.to(DEV), alpha=alpha), torch.sub(a, b, alpha=alpha))
    x = a.to(DEV)
    x.add_(b.to(DEV), alpha=alpha)
    assert_same_bits(x, a.clone().add_(b, alpha=alpha))


def test_broadcasting_and_strided_operands_match_cpu():
    a = torch.randn(4, 4)
    row = torch.randn(4)
    assert_same_bits(a.to(DEV) * row.to(DEV), a * row)
    an = a.to(DEV)
    assert_same_bits(an.t() + an, a.t() + a)
    assert_same_bits(an + an.t(), a + a.t())
    x = torch.randn(4, 4)
    xn = x.to(DEV)
    xn.mul_(an.t())
    assert_same_bits(xn, x * a.t())


def test_a_partially_overlapping_in_place_operand_raises_as_on_cpu():
    x = torch.randn(16)
    with pytest.raises(RuntimeError, match="unsupported operation") as on_cpu:
        x[1:].add_(x[:-1])
    xn = torch.randn(16, device=DEV)
    with pytest.raises(RuntimeError, match="unsupported operation"):
        xn[1:].add_(xn[:-1])
    assert "single memory location" in str(on_cpu.value)


def test_a_cpu_operand_raises_a_device_mismatch():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.randn(16, device=DEV) + torch.randn(16)


def test_operands_on_two_neuron_devices_raise_a_device_mismatch():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.randn(16, device="neuron:0") * torch.randn(16, device="neuron:1")


def test_the_result_is_on_its_operands_device():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    a = torch.randn(16, device="neuron:1")
    with torch.neuron.device(0):
        r = a + a
    assert r.device == torch.device("neuron:1")
    assert_same_bits(r, a.cpu() + a.cpu())


def test_small_ops_are_counted_as_executed():
    a = torch.randn(16, device=DEV)
    torch.neuron.synchronize()
    torchneuron.clear_op_tracking()
    _ = a + a
    a.mul_(2)
    torch.neuron.synchronize()
    ops = torchneuron.get_executed_ops()
    assert ops.get("aten::add.Tensor") == 1 and ops.get("aten::mul_.Tensor") == 1


def test_a_queued_small_op_reads_what_earlier_queued_work_wrote(small_path_mode):
    y = torch.ones(16, device=DEV)
    queue_slow_work()
    y.mul_(3)
    z = y + 1
    if small_path_mode == "engine":
        assert not torch.neuron.current_stream().query()  # z returned before its kernel ran
    assert_same_bits(z, torch.full((16,), 4.0))


def test_a_complex_number_promotes_as_on_cpu():
    a, _ = operands(16, torch.float32)
    r = a.to(DEV) * 2j
    assert r.dtype == torch.complex64
    torch.testing.assert_close(r.cpu(), a * 2j, rtol=0, atol=0, equal_nan=True)


def test_gradients_through_small_ops_match_cpu_bit_for_bit():
    def run(device):
        gen = torch.Generator().manual_seed(3)
        a = torch.randn(16, generator=gen).to(device).requires_grad_()
        b = (torch.rand(16, generator=gen) + 0.5).to(device).requires_grad_()
        y = ((a * b - a) / b + 2.5) * a
        y.backward(torch.ones(16, device=device))
        return y.detach(), a.grad, b.grad

    for got, want in zip(run(DEV), run("cpu")):
        assert_same_bits(got, want)


def test_an_in_place_op_on_a_tensor_saved_for_backward_is_detected():
    a = torch.randn(16, device=DEV, requires_grad=True)
    h = a * 2
    y = h * h  # saves h for backward
    h.add_(1)  # bumps h's version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 16, 2048, 2049])
@pytest.mark.parametrize("op", COMPARISONS, ids=lambda f: f.__name__)
def test_a_small_comparison_matches_cpu(op, n, dtype):
    a, b = operands(n, dtype)
    b[8:] = a[8:].where(torch.arange(n - 8 if n > 8 else 0) % 3 == 0, b[8:])  # some equal pairs
    got, want = op(a.to(DEV), b.to(DEV)), op(a, b)
    assert got.device.type == DEV and got.dtype == torch.bool
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("number", NUMBERS, ids=repr)
@pytest.mark.parametrize("op", COMPARISONS, ids=lambda f: f.__name__)
def test_a_comparison_with_a_python_number_casts_it_to_the_dtype_first(op, number):
    a, _ = operands(16, torch.float32)
    a[10] = 0.1  # float32(0.1) == 0.1 on CPU: the number is cast to float32 before comparing
    got, want = op(a.to(DEV), number), op(a, number)
    assert got.dtype == torch.bool and torch.equal(got.cpu(), want)


def test_comparisons_the_loop_does_not_take_match_cpu():
    i = torch.arange(16)
    assert torch.equal((i.to(DEV) > 7).cpu(), i > 7)  # integers
    x = torch.randn(4, 4)
    assert torch.equal((x.to(DEV) < x[0].to(DEV)).cpu(), x < x[0])  # broadcasting
    assert torch.equal((x.to(DEV) == 1j).cpu(), x == 1j)  # a complex number promotes
    assert torch.equal((x.to(DEV) >= x.double().to(DEV)).cpu(), x >= x.double())  # mixed dtypes


# ---- small device-to-device copies (ops.cpp, small_copy) ----------------------------------------

COPY_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool,
               torch.complex64]


def filled(n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=gen, dtype=dtype)
    return torch.randint(-100, 100, (n,), generator=gen, dtype=dtype)


@pytest.mark.parametrize("n", [1, 7, 1000, 32768, 32769])  # 32768 float32 = the 128 KiB limit
@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=str)
def test_a_device_to_device_copy_is_exact(dtype, n):
    x = filled(n, dtype)
    src = x.to(DEV)
    dst = torch.zeros(n, dtype=dtype, device=DEV)
    assert dst.copy_(src) is dst
    assert torch.equal(dst.cpu(), x)
    c = src.clone()
    assert c.data_ptr() != src.data_ptr() and torch.equal(c.cpu(), x)


def test_copies_the_memmove_does_not_take_match_cpu():
    x = torch.randn(8, 8)
    xn = x.to(DEV)
    assert torch.equal(torch.empty(8, 8, device=DEV).copy_(xn.t()).cpu(), x.t().contiguous())  # strided
    assert torch.equal(torch.empty(8, 8, dtype=torch.float64, device=DEV).copy_(xn).cpu(), x.double())  # cast
    z = torch.randn(16, dtype=torch.complex64)
    out = torch.empty(16, dtype=torch.complex64, device=DEV).copy_(z.to(DEV).conj())  # a conjugate view
    assert torch.equal(out.cpu(), z.conj().resolve_conj())


def test_a_copy_onto_itself_changes_nothing():
    x = torch.randn(16)
    xn = x.to(DEV)
    xn.copy_(xn)
    xn.copy_(xn.view(4, 4).view(16))
    assert torch.equal(xn.cpu(), x)


def test_a_partially_overlapping_copy_raises_as_on_cpu():
    x = torch.randn(16)
    with pytest.raises(RuntimeError, match="unsupported operation"):
        x[1:].copy_(x[:-1])
    xn = torch.randn(16, device=DEV)
    with pytest.raises(RuntimeError, match="unsupported operation"):
        xn[1:].copy_(xn[:-1])


def test_a_queued_copy_reads_what_earlier_queued_work_wrote(small_path_mode):
    x = torch.ones(16, device=DEV)
    queue_slow_work()
    x.mul_(3)
    y = x.clone()
    if small_path_mode == "engine":
        assert not torch.neuron.current_stream().query()  # the copy did not wait for the queue
    x.zero_()  # after the copy: y keeps 3
    assert torch.equal(y.cpu(), torch.full((16,), 3.0))


# ---- zero_ (ops.cpp, zero_) -----------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 1000, 32768, 32769])  # 32768 float32 = the 128 KiB limit
@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=str)
def test_zero__and_zeros_write_zeros_of_every_dtype(dtype, n):
    x = filled(n, dtype).to(DEV)
    assert x.zero_() is x
    assert torch.equal(x.cpu(), torch.zeros(n, dtype=dtype))
    assert torch.equal(torch.zeros(n, dtype=dtype, device=DEV).cpu(), torch.zeros(n, dtype=dtype))


def test_zero__of_views_matches_cpu():
    x = torch.randn(8, 8)
    xn = x.to(DEV)
    x[:, 2].zero_()  # strided: the boxed fallback
    xn[:, 2].zero_()
    x[3].zero_()  # a contiguous row inside a larger storage
    xn[3].zero_()
    assert torch.equal(xn.cpu(), x)
    z = torch.randn(16, dtype=torch.complex64)
    zn = z.to(DEV)
    torch._neg_view(z).zero_()  # a negative view: CPU stores -0.0
    torch._neg_view(zn).zero_()
    assert torch.equal(torch.view_as_real(zn.cpu()).view(torch.int32), torch.view_as_real(z).view(torch.int32))
    w = torch.randn(16, dtype=torch.complex64)
    wn = w.to(DEV)
    w.conj().zero_()  # a conjugate view: CPU stores an imaginary -0.0
    wn.conj().zero_()
    assert torch.equal(torch.view_as_real(wn.cpu()).view(torch.int32), torch.view_as_real(w).view(torch.int32))


def test_a_queued_zero__runs_after_earlier_queued_work(small_path_mode):
    x = torch.ones(16, device=DEV)
    queue_slow_work()
    x.mul_(3)
    x.zero_()
    if small_path_mode == "engine":
        assert not torch.neuron.current_stream().query()  # zero_ did not wait for the queue
    assert torch.equal(x.cpu(), torch.zeros(16))
