"""DTensor random ops on a neuron mesh (torch/distributed/tensor/_random.py's OffsetBasedRNGTracker
over the Philox (seed, offset) generators): sharded random ops give the same full tensor as the
unsharded op on one device, and leave the generator where the unsharded op leaves it."""

import torch
import torch.nn.functional as F

SHAPE = (8, 16)  # row shards of 2 and 4 ranks hold multiples of 4 elements (DTensor's alignment)

INITS = {
    "normal_": lambda t: torch.nn.init.normal_(t, 0.0, 0.02),
    "uniform_": lambda t: torch.nn.init.uniform_(t, -1.0, 1.0),
    "trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, std=0.02),
    "bernoulli_": lambda t: t.bernoulli_(0.3),
}


def _mesh(size):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("neuron", (size,))


def _dev():
    return torch.device("neuron", torch.neuron.current_device())


def _state():
    return torch.neuron.get_rng_state().view(torch.int64).tolist()


def case_sharded_init_equals_the_unsharded_op(rank, size):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh(size)
    for name, init in INITS.items():
        for placement in (Shard(0), Replicate()):
            torch.manual_seed(7)
            dt = distribute_tensor(torch.zeros(SHAPE, device=_dev()), mesh, [placement])
            init(dt)
            full, after = dt.full_tensor().cpu(), _state()
            torch.manual_seed(7)
            ref = init(torch.zeros(SHAPE, device=_dev())).cpu()
            assert torch.equal(full, ref), (name, placement)
            assert after == _state(), (name, placement)


def case_column_shards_are_consecutive_offset_ranges(rank, size):
    # Shard(1): shard k is the op at offset k * (local numel), laid out as the local shard.
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(size)
    torch.manual_seed(3)
    dt = distribute_tensor(torch.zeros(SHAPE, device=_dev()), mesh, [Shard(1)])
    torch.nn.init.normal_(dt)
    full = dt.full_tensor().cpu()
    rows, cols = SHAPE[0], SHAPE[1] // size
    torch.manual_seed(3)
    flat = torch.randn(size * rows * cols, device=_dev()).cpu()
    for k in range(size):
        assert torch.equal(full[:, k * cols:(k + 1) * cols], flat[k * rows * cols:(k + 1) * rows * cols].view(rows, cols))


def case_sharded_dropout_equals_the_unsharded_op(rank, size):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(size)
    x = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32, device=_dev()).view(SHAPE) + 1
    dt = distribute_tensor(x, mesh, [Shard(0)])
    torch.manual_seed(5)
    out = F.dropout(dt, 0.4, training=True).full_tensor().cpu()
    torch.manual_seed(5)
    ref = F.dropout(x, 0.4, training=True).cpu()
    assert torch.equal(out, ref)
    assert 0 < (out == 0).sum().item() < out.numel()


def test_sharded_init_equals_unsharded_on_2_ranks(world2): world2.run(case_sharded_init_equals_the_unsharded_op)
def test_sharded_init_equals_unsharded_on_4_ranks(world4): world4.run(case_sharded_init_equals_the_unsharded_op)
def test_column_shards_are_offset_ranges(world2): world2.run(case_column_shards_are_consecutive_offset_ranges)
def test_sharded_dropout_equals_unsharded(world2): world2.run(case_sharded_dropout_equals_the_unsharded_op)
