"""SyncBatchNorm across 2 ranks on neuron against single-process BatchNorm over the whole batch,
and the all_gather_into_tensor shapes it relies on (NCCL's rule: any contiguous output holding
world_size times the input's elements)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

DEV = "neuron"
C, N_PER_RANK = 3, 4


def _global_batch(size):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(size * N_PER_RANK, C, 5, 5, dtype=torch.double, generator=g)
    w = torch.randn(C, dtype=torch.double, generator=g)
    b = torch.randn(C, dtype=torch.double, generator=g)
    grad = torch.randn(x.shape, dtype=torch.double, generator=g)
    return x, w, b, grad


# ---- cases (run on every rank) -------------------------------------------------------------

def case_sync_batch_norm_matches_batch_norm_over_the_whole_batch(rank, size):
    x, w, b, grad = _global_batch(size)
    # Oracle: one BatchNorm over the concatenated batch, on the CPU.
    xc, wc, bc = (t.clone().requires_grad_() for t in (x, w, b))
    rmc, rvc = torch.zeros(C, dtype=torch.double), torch.ones(C, dtype=torch.double)
    yc = F.batch_norm(xc, rmc, rvc, wc, bc, training=True, momentum=0.1, eps=1e-5)
    yc.backward(grad)

    sl = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    bn = torch.nn.SyncBatchNorm(C, eps=1e-5, momentum=0.1).double().to(DEV)
    with torch.no_grad():
        bn.weight.copy_(w)
        bn.bias.copy_(b)
    xd = x[sl].to(DEV).requires_grad_()
    yd = bn(xd)
    assert yd.device.type == "neuron"
    yd.backward(grad[sl].to(DEV))

    assert_close(yd.detach().cpu(), yc.detach()[sl])
    assert_close(bn.running_mean.cpu(), rmc)
    assert_close(bn.running_var.cpu(), rvc)
    assert_close(xd.grad.cpu(), xc.grad[sl])
    # Parameter gradients are per-rank partial sums (DDP all-reduces them): their sum is the
    # whole batch's gradient.
    gw, gb = bn.weight.grad.clone(), bn.bias.grad.clone()
    dist.all_reduce(gw)
    dist.all_reduce(gb)
    assert_close(gw.cpu(), wc.grad)
    assert_close(gb.cpu(), bc.grad)


def case_all_gather_into_tensor_accepts_any_output_of_world_times_the_input(rank, size):
    inp = (torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank).to(DEV)
    expected = torch.stack([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(size)])
    for shape in ([size * 6], [size, 6], [1, size * 6], [size * 2, 3], [size, 2, 3]):
        out = torch.zeros(shape, device=DEV)
        dist.all_gather_into_tensor(out, inp)
        assert_close(out.cpu().reshape(-1), expected.reshape(-1))


def case_all_gather_into_tensor_rejects_a_wrong_element_count_naming_the_rule(rank, size):
    inp = torch.ones(3, device=DEV)
    with pytest.raises(ValueError, match="world_size times the input's elements"):
        dist.all_gather_into_tensor(torch.zeros(size * 3 + 1, device=DEV), inp)
    with pytest.raises(TypeError, match="same dtype"):
        dist.all_gather_into_tensor(torch.zeros(size * 3, device=DEV, dtype=torch.double), inp)
    # The group still works after the refusals.
    out = torch.zeros(size * 3, device=DEV)
    dist.all_gather_into_tensor(out, inp)
    assert_close(out.cpu(), torch.ones(size * 3))


# ---- tests ---------------------------------------------------------------------------------

def test_sync_batch_norm_two_ranks_matches_batch_norm_forward_and_backward(world2):
    world2.run(case_sync_batch_norm_matches_batch_norm_over_the_whole_batch)


def test_all_gather_into_tensor_accepts_nccl_output_shapes(world2):
    world2.run(case_all_gather_into_tensor_accepts_any_output_of_world_times_the_input)


def test_all_gather_into_tensor_rejects_wrong_element_count(world2):
    world2.run(case_all_gather_into_tensor_rejects_a_wrong_element_count_naming_the_rule)
