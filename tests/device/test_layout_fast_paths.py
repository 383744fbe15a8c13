"""Copies and reductions that CPU walks in logical order through a transposed layout, done in
memory order on neuron (csrc/backend/transpose.cpp, csrc/backend/extrema.cpp): a copy between a
row-major and a column-major layout of the last two dims, and max/min/amax/amin over all
elements of a permuted dense tensor. The results are CPU's bit for bit, including the sign of a
zero extremum and a NaN (torch 2.13's CPU kernels give those regardless of order, so the
extrema kernel's fallback to CPU's own walk for them is a guarantee these tests cannot observe
today); what the fast paths do not cover (8-byte elements, overlap, conjugate
and negative views, partial reductions) takes CPU's kernel.
"""

import re

import pytest
import torch

import torchneuron  # noqa: F401

DEV = "neuron"
F8 = (torch.float8_e4m3fn, torch.float8_e5m2)
COPY_DTYPES = (torch.uint8, torch.int8, torch.bool, *F8, torch.bfloat16, torch.float16, torch.int16,
               torch.float32, torch.int32, torch.float64, torch.int64, torch.complex64)
# Tile edges (64), the 16-element minimum, stacked matrices, size-1 leading dims.
SHAPES = ((16, 16), (15, 300), (17, 100), (64, 64), (100, 300), (130, 65), (3, 70, 130), (2, 1, 65, 64),
          (1, 3, 16, 200))


def sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=g, dtype=torch.float32) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Identical sizes and element bytes (NaNs and signed zeros included), whatever the dtype."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=str)
def test_transposed_to_contiguous_copies_cpus_bytes(dtype, shape):
    x = sample(shape, dtype)
    got = x.to(DEV).transpose(-1, -2).contiguous()
    assert got.is_contiguous()
    assert same_bits(got, x.transpose(-1, -2).contiguous())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=str)
def test_contiguous_into_a_column_major_destination_copies_cpus_bytes(dtype, shape):
    x = sample(shape, dtype)
    dst = torch.empty(shape, dtype=dtype, device=DEV).transpose(-1, -2).contiguous().transpose(-1, -2)
    dst.copy_(x.to(DEV))
    assert dst.stride()[-2:] == (1, shape[-2])
    assert same_bits(dst, x)


PERMUTES = {
    "nchw to nhwc": lambda x: x.contiguous(memory_format=torch.channels_last),
    "nhwc to nchw": lambda x: x.contiguous(memory_format=torch.channels_last).contiguous(),
    "ncdhw to ndhwc": lambda x: x.unsqueeze(2).expand(-1, -1, 2, -1, -1).contiguous()
    .contiguous(memory_format=torch.channels_last_3d),
    "rotate (0,1,2,3) to (0,2,3,1)": lambda x: x.permute(0, 2, 3, 1).contiguous(),
    "rotate (0,1,2,3) to (2,3,0,1)": lambda x: x.permute(2, 3, 0, 1).contiguous(),
    "not a rotation: (0,2,1,3)": lambda x: x.permute(0, 2, 1, 3).contiguous(),
    "not a rotation: (3,2,1,0)": lambda x: x.permute(3, 2, 1, 0).contiguous(),
}


@pytest.mark.parametrize("shape", ((2, 32, 17, 20), (3, 16, 16, 1), (1, 64, 8, 8), (2, 3, 40, 40)), ids=str)
@pytest.mark.parametrize("how", PERMUTES)
@pytest.mark.parametrize("dtype", (torch.uint8, torch.float8_e5m2, torch.float16, torch.float32, torch.float64), ids=str)
def test_layout_changing_copies_of_4d_tensors_copy_cpus_bytes(dtype, how, shape):
    x = sample(shape, dtype)
    got, want = PERMUTES[how](x.to(DEV)), PERMUTES[how](x)
    assert got.stride() == want.stride()
    assert same_bits(got, want)


@pytest.mark.parametrize("dtype", (torch.float8_e4m3fn, torch.bfloat16, torch.float32), ids=str)
def test_a_transposed_copy_into_an_offset_view_leaves_its_neighbours(dtype):
    x = sample((40, 70), dtype)
    big = torch.zeros(3, 70, 40, dtype=dtype)
    want = big.clone()
    want[1].copy_(x.t())
    got = big.to(DEV)
    got[1].copy_(x.to(DEV).t())
    assert same_bits(got, want)


def test_a_copy_into_its_own_transpose_raises_cpus_overlap_error():
    x = sample((64, 64), torch.float32)
    with pytest.raises(RuntimeError, match="single memory location"):
        x.copy_(x.t())
    y = x.to(DEV)
    with pytest.raises(RuntimeError, match="single memory location"):
        y.copy_(y.t())
    assert same_bits(y, x)  # nothing written


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_a_negative_view_is_resolved_by_the_transposed_copy(dtype):
    x = sample((64, 96), dtype)
    got = torch._neg_view(x.to(DEV)).t().contiguous()
    assert same_bits(got, torch._neg_view(x).t().contiguous())


def test_a_conjugate_view_is_resolved_by_the_transposed_copy():
    x = sample((64, 96), torch.complex64)
    got = x.to(DEV).conj().t().contiguous()
    assert torch.equal(got.cpu(), x.conj().t().contiguous())


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("dtype", (torch.float8_e4m3fn, torch.bfloat16, torch.float32), ids=str)
def test_transposed_copies_are_the_same_bytes_on_any_number_of_threads(dtype, threads):
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = sample((4, 300, 520), dtype)
        assert same_bits(x.to(DEV).transpose(-1, -2).contiguous(), x.transpose(-1, -2).contiguous())
    finally:
        torch.set_num_threads(was)


# ---- whole-tensor extrema -------------------------------------------------------------------

REDUCTIONS = {"max": torch.max, "min": torch.min, "amax": torch.amax, "amin": torch.amin}
RED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.uint8,
              torch.int8, torch.bool)


LAYOUTS = {
    "transposed": lambda x: x.transpose(-1, -2),
    "permuted": lambda x: x.permute(2, 0, 1),
    "channels_last": lambda x: x.unsqueeze(0).contiguous(memory_format=torch.channels_last).squeeze(0),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", REDUCTIONS)
@pytest.mark.parametrize("dtype", RED_DTYPES, ids=str)
def test_whole_tensor_extrema_of_permuted_tensors_are_cpus(name, dtype, layout):
    fn, view = REDUCTIONS[name], LAYOUTS[layout]
    x = sample((7, 40, 50), dtype)
    assert same_bits(fn(view(x.to(DEV))), fn(view(x)))


@pytest.mark.parametrize("keepdim", (False, True))
@pytest.mark.parametrize("dim", ((), (0, 1, 2), (-1, 0, 1), (0, 2), (1,)), ids=str)
@pytest.mark.parametrize("name", ("amax", "amin"))
def test_amax_amin_over_all_or_some_dims_of_a_permuted_tensor(name, dim, keepdim):
    fn = REDUCTIONS[name]
    x = sample((6, 40, 50), torch.float32)
    got = fn(x.to(DEV).permute(2, 0, 1), dim=dim, keepdim=keepdim)
    assert same_bits(got, fn(x.permute(2, 0, 1), dim=dim, keepdim=keepdim))


@pytest.mark.parametrize("dim", ((0, 0, 1), (0, 1, 2, 3), (0, 1, -3)), ids=str)
@pytest.mark.parametrize("name", ("amax", "amin"))
def test_amax_amin_reject_a_repeated_or_missing_dim_as_cpu_does(name, dim):
    fn = REDUCTIONS[name]
    x = sample((6, 40, 50), torch.float32)
    with pytest.raises((RuntimeError, IndexError)) as cpu:
        fn(x.permute(2, 0, 1), dim=dim)
    with pytest.raises(type(cpu.value), match=re.escape(str(cpu.value).split("\n")[0])):
        fn(x.to(DEV).permute(2, 0, 1), dim=dim)


@pytest.mark.parametrize("name", REDUCTIONS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_a_zero_extremum_has_the_sign_cpus_walk_gives(name, dtype):
    # All zeros of random signs: max and min are zeros whose sign depends on which one the
    # reduction meets first, so memory order and CPU's logical order can disagree.
    fn = REDUCTIONS[name]
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        signs = torch.rand(96, 80, generator=g) > 0.5
        x = torch.where(signs, torch.tensor(0.0), torch.tensor(-0.0)).to(dtype)
        assert same_bits(fn(x.to(DEV).t()), fn(x.t())), seed


@pytest.mark.parametrize("where", ("first", "last"))
@pytest.mark.parametrize("name", REDUCTIONS)
def test_an_extremum_at_the_first_or_last_address_is_found(name, where):
    fn = REDUCTIONS[name]
    x = sample((96, 80), torch.float32)
    x.view(-1)[0 if where == "first" else -1] = 1e6 if name in ("max", "amax") else -1e6
    assert same_bits(fn(x.to(DEV).t()), fn(x.t()))
    assert fn(x.to(DEV).t()).abs().item() == 1e6


@pytest.mark.parametrize("name", REDUCTIONS)
def test_the_extremum_of_a_transposed_slice_reads_only_the_slice(name):
    fn = REDUCTIONS[name]
    big = sample((3, 96, 80), torch.float32)
    big[0].fill_(1e6)
    big[2].fill_(-1e6)  # the neighbours hold the extremes; the slice must not see them
    assert same_bits(fn(big.to(DEV)[1].t()), fn(big[1].t()))


@pytest.mark.parametrize("name", REDUCTIONS)
def test_a_nan_extremum_is_cpus_nan(name):
    fn = REDUCTIONS[name]
    base = sample((96, 80), torch.float32)
    base[5, 7] = float("nan")
    base[60, 3] = -float("nan")
    assert same_bits(fn(base.to(DEV).t()), fn(base.t()))


@pytest.mark.parametrize("name", ("max", "min"))
def test_the_extremum_of_an_empty_tensor_raises_cpus_error(name):
    fn = REDUCTIONS[name]
    with pytest.raises(RuntimeError) as cpu:
        fn(torch.empty(0, 5).t())
    with pytest.raises(RuntimeError, match=re.escape(str(cpu.value).split("\n")[0])):
        fn(torch.empty(0, 5, device=DEV).t())


def test_the_extremum_of_a_complex_tensor_raises_cpus_error():
    with pytest.raises(RuntimeError) as cpu:
        torch.max(torch.zeros(80, 80, dtype=torch.complex64).t())
    with pytest.raises(RuntimeError, match=re.escape(str(cpu.value).split("\n")[0])):
        torch.max(torch.zeros(80, 80, dtype=torch.complex64, device=DEV).t())


def test_extrema_keep_autograd():
    x = sample((64, 80), torch.float32).to(DEV).requires_grad_()
    torch.max(x.t()).backward()
    want = sample((64, 80), torch.float32).requires_grad_()
    torch.max(want.t()).backward()
    assert torch.equal(x.grad.cpu(), want.grad)


@pytest.mark.parametrize("engine_on", (False, True))
def test_non_blocking_transposed_copies_with_pinned_memory_arrive_whole(engine_on):
    # With the engine on, these copies are queued and run the transposer on the executor thread.
    engine = torch.neuron.engine
    was = engine.is_enabled()
    engine.set_enabled(engine_on)
    try:
        x = sample((300, 200), torch.float32).pin_memory()
        d = torch.empty(200, 300, device=DEV)
        d.copy_(x.t(), non_blocking=True)
        h = torch.empty(300, 200).pin_memory()
        h.t().copy_(d, non_blocking=True)  # device row-major into a host column-major view
        torch.neuron.synchronize()
        assert same_bits(d, x.t().contiguous())
        assert same_bits(h, x)
    finally:
        engine.set_enabled(was)
