"""Integer ``torch.histc`` on neuron follows CUDA's kernel (CPU has floating types only).

Oracle: CPU ``histc`` on the values converted to float64 (the same bins for integers), and the
exact CUDA formula where CUDA's integer conversions differ from float arithmetic."""

import pytest
import torch

INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def _cpu_reference(x: torch.Tensor, bins: int, lo, hi) -> torch.Tensor:
    return torch.histc(x.double(), bins=bins, min=lo, max=hi).to(x.dtype)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: str(d)[6:])
def test_integer_histc_matches_float_histogram(dtype):
    x = torch.randint(0, 100, (257,), dtype=dtype)
    got = torch.histc(x.to("neuron"), bins=7, min=3, max=90)
    assert got.device.type == "neuron" and got.dtype == dtype
    assert torch.equal(got.cpu(), _cpu_reference(x, 7, 3, 90))


def test_moe_expert_count_as_hugging_face_calls_it():
    # transformers/integrations/moe.py: histc(ids.int(), bins=E, min=0, max=E-1), with an
    # expert-parallel sentinel E that must not be counted.
    num_experts = 8
    ids = torch.randint(0, num_experts + 1, (64,))
    got = torch.histc(ids.int().to("neuron"), bins=num_experts, min=0, max=num_experts - 1)
    expected = torch.bincount(ids[ids < num_experts], minlength=num_experts).int()
    assert torch.equal(got.cpu(), expected)


def test_equal_bounds_use_the_data_range():
    x = torch.tensor([4, 9, 6, 6, 5], dtype=torch.int32)
    got = torch.histc(x.to("neuron"), bins=5)
    assert torch.equal(got.cpu(), _cpu_reference(x, 5, 4, 9))


def test_constant_input_widens_the_range_by_one():
    x = torch.full((3,), 5, dtype=torch.int64)
    # range [4, 6] in three bins: 5 lands in the middle one (CUDA's and CPU's rule)
    assert torch.histc(x.to("neuron"), bins=3).tolist() == [0, 3, 0]


def test_bounds_wrap_into_the_input_dtype_as_on_cuda():
    # CUDA converts the int64 bounds to uint8 with C++ narrowing: max=257 becomes 1.
    x = torch.tensor([0, 1, 1, 200], dtype=torch.uint8)
    got = torch.histc(x.to("neuron"), bins=2, min=0, max=257)
    assert got.tolist() == [1, 2]


def test_counts_accumulate_in_the_input_dtype():
    x = torch.zeros(300, dtype=torch.uint8)  # 300 counts wrap to 44 in uint8, as on CUDA
    assert torch.histc(x.to("neuron"), bins=1, min=0, max=1).tolist() == [44]


def test_out_variant_resizes_and_fills_the_output():
    x = torch.tensor([0, 1, 2, 7, 7, 3, 9, -1], dtype=torch.int32)
    out = torch.empty(0, dtype=torch.int32, device="neuron")
    result = torch.histc(x.to("neuron"), bins=4, min=0, max=8, out=out)
    assert result is out
    assert out.tolist() == [2, 2, 0, 2]


def test_out_on_another_device_is_rejected():
    x = torch.tensor([1, 2], dtype=torch.int32, device="neuron")
    with pytest.raises(RuntimeError, match="Expected out tensor to have device neuron:0, but got cpu"):
        torch.histc(x, bins=2, min=0, max=2, out=torch.empty(2, dtype=torch.int32))


def test_floating_input_uses_the_cpu_kernel_bit_for_bit():
    x = torch.randn(1000)
    got = torch.histc(x.to("neuron"), bins=13, min=-2, max=2)
    assert torch.equal(got.cpu(), torch.histc(x, bins=13, min=-2, max=2))


@pytest.mark.parametrize("bins,lo,hi,match", [(0, 0, 1, "bins must be > 0"),
                                              (3, 5, 2, "max must be larger than min")])
def test_invalid_arguments_raise_cudas_errors(bins, lo, hi, match):
    with pytest.raises(RuntimeError, match=match):
        torch.histc(torch.arange(4, device="neuron"), bins=bins, min=lo, max=hi)
