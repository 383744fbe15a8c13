"""Backend strings other than plain "neuron": the mixed "cpu:gloo,neuron:neuron" and a bare
init_process_group() (which picks the accelerator's registered backend)."""

import torch
import torch.distributed as dist
from torch.testing import assert_close


def case_mixed_routes_by_device(rank, size):
    pg = dist.group.WORLD
    assert type(pg._get_backend(torch.device("neuron"))).__name__ == "ProcessGroupNeuron"
    assert type(pg._get_backend(torch.device("cpu"))).__name__ == "ProcessGroupGloo"
    c = torch.full((4,), float(rank + 1))
    n = torch.full((4,), float(rank + 1), device="neuron")
    dist.all_reduce(c)
    dist.all_reduce(n)
    want = torch.full((4,), float(sum(range(1, size + 1))))
    assert_close(c, want)
    assert n.device.type == "neuron"
    assert_close(n.cpu(), want)


def case_mixed_object_and_barrier(rank, size):
    objs = [None] * size
    dist.all_gather_object(objs, rank)
    assert objs == list(range(size))
    dist.barrier()


def case_mixed_ddp(rank, size):
    import copy

    import torch.nn.functional as F
    from models import cpu_train, data, make_mlp, shard_batch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = make_mlp()
    model = DDP(copy.deepcopy(ref).to("neuron"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(2):
        x, y = data(s)
        opt.zero_grad()
        F.mse_loss(model(shard_batch(x, rank, size).to("neuron")),
                   shard_batch(y, rank, size).to("neuron")).backward()
        opt.step()
    for p, q in zip(model.module.parameters(), cpu_train(ref, 2).parameters()):
        assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-4)


def case_bare_init_uses_neuron_backend(rank, size):
    pg = dist.group.WORLD
    assert type(pg._get_backend(torch.device("neuron"))).__name__ == "ProcessGroupNeuron"
    n = torch.full((3,), float(rank), device="neuron")
    dist.all_reduce(n)
    assert_close(n.cpu(), torch.full((3,), float(sum(range(size)))))


def test_mixed_string_routes_cpu_to_gloo_and_neuron_to_neuron(world2_mixed):
    world2_mixed.run(case_mixed_routes_by_device)


def test_mixed_string_object_collectives_and_barrier(world2_mixed):
    world2_mixed.run(case_mixed_object_and_barrier)


def test_mixed_string_ddp_matches_cpu(world2_mixed):
    world2_mixed.run(case_mixed_ddp)


def test_bare_init_process_group_uses_neuron_backend(world2_bare):
    world2_bare.run(case_bare_init_uses_neuron_backend)
