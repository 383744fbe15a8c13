"""``ReduceOp.PREMUL_SUM`` (NCCL's multiply-then-sum; FSDP2 uses it whenever a gradient divide
factor is set, as TorchTitan does) on the neuron process group, against CPU arithmetic."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from models import cpu_train, data, make_mlp, make_opt, shard_batch

DEV = "neuron"


def inp(rank, n=6):
    return torch.arange(n, dtype=torch.float32) + 10 * rank + 1


def factor(rank):
    return 0.5 + rank  # a different factor on every rank: each input is scaled by its own


def case_all_reduce_premul_sum(rank, size):
    t = inp(rank).to(DEV)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor(rank)))
    assert_close(t.cpu(), sum(factor(r) * inp(r) for r in range(size)))


def case_all_reduce_premul_sum_tensor_factor(rank, size):
    t = inp(rank).to(DEV)
    f = torch.tensor(factor(rank), device=DEV)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(f))
    assert_close(t.cpu(), sum(factor(r) * inp(r) for r in range(size)))


def case_reduce_scatter_premul_sum_leaves_input_untouched(rank, size):
    x = inp(rank, 3 * size).to(DEV)
    out = torch.zeros(3, device=DEV)
    dist.reduce_scatter_tensor(out, x, op=dist._make_nccl_premul_sum(factor(rank)))
    full = sum(factor(r) * inp(r, 3 * size) for r in range(size))
    assert_close(out.cpu(), full[3 * rank:3 * rank + 3])
    assert_close(x.cpu(), inp(rank, 3 * size))


def case_reduce_scatter_list_premul_sum(rank, size):
    ins = [inp(rank, 2).to(DEV) + q for q in range(size)]
    out = torch.zeros(2, device=DEV)
    dist.reduce_scatter(out, ins, op=dist._make_nccl_premul_sum(factor(rank)))
    assert_close(out.cpu(), sum(factor(r) * (inp(r, 2) + rank) for r in range(size)))
    assert_close(ins[0].cpu(), inp(rank, 2))


def case_fsdp2_with_gradient_divide_factor_matches_cpu(rank, size):
    # TorchTitan's scheme: each rank's loss is its sum normalised by the *global* element count
    # and FSDP2's divide factor is 1 (PREMUL_SUM(1.0) instead of AVG): the same update as CPU
    # full-batch mean-loss training.
    from torch.distributed.fsdp import fully_shard

    ref = make_mlp()
    model = copy.deepcopy(ref).to(DEV)
    fully_shard(model.fc1)
    fully_shard(model.fc2)
    fully_shard(model)
    for m in (model.fc1, model.fc2, model):
        m.set_gradient_divide_factor(1.0)
    optim = make_opt(model.parameters(), "sgd", 0.1)
    for s in range(3):
        x, y = data(s)
        x, y = shard_batch(x, rank, size).to(DEV), shard_batch(y, rank, size).to(DEV)
        optim.zero_grad()
        (F.mse_loss(model(x), y, reduction="sum") / (8 * 8)).backward()  # batch 8 x 8 outputs
        optim.step()
    expected = cpu_train(ref, 3)
    for (n, p), q in zip(model.named_parameters(), expected.parameters()):
        assert_close(p.full_tensor().detach().cpu(), q.detach(), atol=1e-5, rtol=1e-4)


def test_all_reduce_premul_sum(world2): world2.run(case_all_reduce_premul_sum)
def test_all_reduce_premul_sum_tensor_factor(world2): world2.run(case_all_reduce_premul_sum_tensor_factor)
def test_reduce_scatter_premul_sum_leaves_input_untouched(world2): world2.run(case_reduce_scatter_premul_sum_leaves_input_untouched)
def test_reduce_scatter_list_premul_sum(world2): world2.run(case_reduce_scatter_list_premul_sum)
def test_fsdp2_with_gradient_divide_factor_matches_cpu(world2): world2.run(case_fsdp2_with_gradient_divide_factor_matches_cpu)
