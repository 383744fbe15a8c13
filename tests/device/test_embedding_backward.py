"""embedding's weight gradient on neuron (csrc/backend/embedding_backward.cpp) is written into the
device's pooled result by CPU's own walk: CPU's bits in every dtype, without CPU's fresh
allocation and a copy."""

import pytest
import torch

DEV = "neuron"


def bwd(g, i, rows, padding_idx=-1, scale=False):
    return torch.ops.aten.embedding_dense_backward(g, i, rows, padding_idx, scale)


def both(g, i, rows, padding_idx=-1, scale=False):
    return bwd(g, i, rows, padding_idx, scale), bwd(g.to(DEV), i.to(DEV), rows, padding_idx, scale).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_weight_gradient_equals_cpu_bit_for_bit(dtype):
    # 3,000 rows (three of CPU's 1,000-row ranges, so both threads walk), 37 columns (a vector
    # tail), 600 tokens over 40 distinct rows: each row sums ~15 gradients, where the order of
    # the additions shows in bf16's and fp16's bits
    torch.manual_seed(0)
    rows = 3000
    idx = torch.randint(0, 40, (20, 30)) * 73
    g = torch.randn(20, 30, 37).to(dtype)
    expected, got = both(g, idx, rows)
    assert got.dtype == dtype and got.shape == (rows, 37) and got.is_contiguous()
    assert torch.equal(got, expected)


def test_padding_rows_and_int32_indices_and_indices_past_the_table_are_cpus():
    torch.manual_seed(1)
    idx = torch.tensor([[3, 0, 3, 7, 12, 3], [0, 0, 5, 9, 3, 1]], dtype=torch.int32)  # 9, 12: past 8 rows
    g = torch.randn(2, 6, 16, dtype=torch.bfloat16)
    expected, got = both(g, idx, 8, padding_idx=3)
    assert torch.equal(got, expected)
    assert not got[3].any()  # the padding row gets nothing


@pytest.mark.parametrize("case", ["scaled_by_frequency", "strided_gradient"])
def test_other_arguments_take_cpus_kernel(case):
    torch.manual_seed(2)
    idx = torch.randint(0, 10, (50,))
    if case == "scaled_by_frequency":
        expected, got = both(torch.randn(50, 8), idx, 10, padding_idx=2, scale=True)
    else:
        g = torch.randn(8, 50)
        expected = bwd(g.t(), idx, 10)
        got = bwd(g.to(DEV).t(), idx.to(DEV), 10).cpu()
    assert torch.equal(got, expected)


def test_result_is_zeroed_in_reused_device_memory():
    # the pooled block may hold a freed tensor's bytes: rows no index names must still be zero
    dirty = torch.full((500, 64), 7.0, device=DEV)
    del dirty
    g = torch.randn(4, 64, device=DEV)
    got = bwd(g, torch.tensor([1, 2, 2, 400], device=DEV), 500).cpu()
    assert not got[0].any() and not got[3:400].any() and torch.equal(got[400], g[3].cpu())


def test_embedding_layer_trains_like_cpu():
    torch.manual_seed(3)
    cpu = torch.nn.Embedding(1500, 24, dtype=torch.bfloat16)
    dev = torch.nn.Embedding(1500, 24, dtype=torch.bfloat16).to(DEV)
    dev.load_state_dict(cpu.state_dict())
    idx = torch.randint(0, 1500, (8, 64))
    for m, i in ((cpu, idx), (dev, idx.to(DEV))):
        m(i).float().square().sum().backward()
    assert torch.equal(dev.weight.grad.cpu(), cpu.weight.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_inf_minus_inf_row_has_cpus_nan_bits(dtype):
    # inf + -inf is x86's default NaN (sign bit set); CPU's bf16 conversion writes 0x7FC0 for
    # any NaN, fp16's keeps the hardware's bits: the same here, bit for bit
    g = torch.stack([torch.full((20,), float("inf")), torch.full((20,), float("-inf"))]).to(dtype)
    expected, got = both(g, torch.tensor([1, 1]), 3)
    assert got[1].isnan().all()
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
