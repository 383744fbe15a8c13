"""Parallelism APIs on neuron, each compared with single-process CPU training (the oracle)."""

import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

from models import D_IN, D_OUT, cpu_train, data, make_mlp, make_opt, shard_batch

DEV = torch.device("neuron")
STEPS = 3
TOL = dict(atol=1e-5, rtol=1e-4)


def assert_params_match(model, ref):
    from torch.distributed.tensor import DTensor

    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert full.device.type == "neuron", n
        assert_close(full.detach().cpu(), q.detach(), **TOL, msg=lambda m: f"{n}: {m}")


def dp_train(model, rank, size, steps=STEPS, opt="sgd", lr=0.1, optim=None):
    optim = optim or make_opt(model.parameters(), opt, lr)
    for s in range(steps):
        x, y = data(s)
        x, y = shard_batch(x, rank, size).to(DEV), shard_batch(y, rank, size).to(DEV)
        optim.zero_grad()
        F.mse_loss(model(x), y).backward()
        optim.step()
    return model


# ---- data parallel -------------------------------------------------------------------------

def case_ddp(rank, size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = make_mlp()
    model = DDP(copy.deepcopy(ref).to(DEV))
    dp_train(model, rank, size)
    assert_params_match(model.module, cpu_train(ref, STEPS))


def case_ddp_comm_hook(rank, size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    seen = []

    def hook(state, bucket):
        # Future-based hook: the Future's value must be the neuron bucket.
        buf = bucket.buffer().div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f):
            t = f.value()[0]
            seen.append(t.device.type)
            return t

        return fut.then(done)

    ref = make_mlp()
    model = DDP(copy.deepcopy(ref).to(DEV))
    model.register_comm_hook(None, hook)
    dp_train(model, rank, size)
    assert seen and set(seen) == {"neuron"}
    assert_params_match(model.module, cpu_train(ref, STEPS))


def case_ddp_builtin_fp16_hook(rank, size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = make_mlp()
    model = DDP(copy.deepcopy(ref).to(DEV))
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    dp_train(model, rank, size)
    for p, q in zip(model.module.parameters(), cpu_train(ref, STEPS).parameters()):
        assert_close(p.detach().cpu(), q.detach(), atol=2e-3, rtol=1e-2)  # fp16 wire format


def case_fsdp2(rank, size):
    from torch.distributed.fsdp import fully_shard

    ref = make_mlp()
    model = copy.deepcopy(ref).to(DEV)
    fully_shard(model.fc1)
    fully_shard(model.fc2)
    fully_shard(model)
    dp_train(model, rank, size, opt="adam")
    assert_params_match(model, cpu_train(ref, STEPS, opt="adam"))


def case_zero(rank, size):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = make_mlp()
    model = DDP(copy.deepcopy(ref).to(DEV))
    optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    dp_train(model, rank, size, optim=optim)
    # each rank holds the state of only part of the parameters
    owned = sum(1 for g in optim.optim.param_groups for _ in g["params"])
    assert 0 < owned < len(list(model.parameters()))
    assert_params_match(model.module, cpu_train(ref, STEPS, opt="adam"))


def case_simple_fsdp(rank, size):
    """SimpleFSDP: parameters are DTensors sharded on dim 0; a parametrization all-gathers them
    for compute (Shard -> Replicate) and the gradient flows back as Partial(avg) -> Shard
    (reduce-scatter with AVG)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.nn.utils import parametrize

    class ReplicateComputation(nn.Module):
        def forward(self, p):
            return p.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial("avg")])

    mesh = init_device_mesh("neuron", (size,))
    ref = make_mlp()
    model = copy.deepcopy(ref).to(DEV)
    for mod in (model.fc1, model.fc2):
        for name, p in list(mod.named_parameters()):
            mod.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
            parametrize.register_parametrization(mod, name, ReplicateComputation(), unsafe=True)
    dp_train(model, rank, size)
    want = cpu_train(ref, STEPS)
    for n in ("fc1", "fc2"):
        for pn in ("weight", "bias"):
            dt = getattr(getattr(model, n).parametrizations, pn).original
            assert dt.placements == (Shard(0),)
            assert_close(dt.full_tensor().detach().cpu(), getattr(getattr(want, n), pn).detach(), **TOL)


# ---- tensor / sequence parallel ------------------------------------------------------------

def case_tensor_parallel(rank, size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("neuron", (size,))
    ref = make_mlp()
    model = parallelize_module(copy.deepcopy(ref).to(DEV), mesh,
                               {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    optim = make_opt(model.parameters(), "sgd", 0.1)
    for s in range(STEPS):  # every rank sees the full batch
        x, y = data(s)
        optim.zero_grad()
        out = model(x.to(DEV))
        F.mse_loss(out, y.to(DEV)).backward()
        optim.step()
    assert_params_match(model, cpu_train(ref, STEPS))


class SPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D_IN)
        self.fc1 = nn.Linear(D_IN, 32)
        self.fc2 = nn.Linear(32, D_IN)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def case_sequence_parallel(rank, size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("neuron", (size,))
    torch.manual_seed(0)
    ref = SPBlock()
    model = parallelize_module(copy.deepcopy(ref).to(DEV), mesh, {
        "norm": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    })
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4 * size, D_IN, generator=g)
    seq = x.shape[1] // size
    x_local = x[:, rank * seq:(rank + 1) * seq].to(DEV).requires_grad_()
    out = model(x_local)  # sequence-sharded in, sequence-sharded out
    out.sum().backward()
    xr = x.clone().requires_grad_()
    want = ref(xr)
    want.sum().backward()
    assert_close(out.detach().cpu(), want.detach()[:, rank * seq:(rank + 1) * seq], **TOL)
    assert_close(x_local.grad.cpu(), xr.grad[:, rank * seq:(rank + 1) * seq], **TOL)
    for n, p in model.named_parameters():
        assert_close(p.grad.full_tensor().cpu(), dict(ref.named_parameters())[n].grad, **TOL)


def case_2d_fsdp_tp(rank, size):
    """4 ranks: mesh (dp=2, tp=2); TP inside each dp group, FSDP2 across dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("neuron", (2, size // 2), mesh_dim_names=("dp", "tp"))
    ref = make_mlp()
    model = parallelize_module(copy.deepcopy(ref).to(DEV), mesh["tp"],
                               {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    dp_train(model, dp_rank, 2)
    assert_params_match(model, cpu_train(ref, STEPS))


# ---- pipeline parallel ---------------------------------------------------------------------

def _pipeline(rank, size, schedule_name):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    ref = make_mlp()
    stage_mod = nn.Sequential(copy.deepcopy(ref.fc1), nn.ReLU()) if rank == 0 else copy.deepcopy(ref.fc2)
    stage = PipelineStage(stage_mod.to(DEV), rank, size, DEV)
    n_mb = 4
    sched_cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
    sched = sched_cls(stage, n_microbatches=n_mb, loss_fn=F.mse_loss)
    x, y = data(0)
    losses = []
    if rank == 0:
        sched.step(x.to(DEV))
    else:
        out = sched.step(target=y.to(DEV), losses=losses)
    # oracle: the schedule averages the per-microbatch losses' gradients (scale_grads), which
    # for equal microbatches is the full-batch gradient
    F.mse_loss(ref(x), y).backward()
    ref_mod = nn.Sequential(ref.fc1) if rank == 0 else ref.fc2
    got = [p.grad for p in stage_mod.parameters()]
    want = [p.grad for p in ref_mod.parameters()]
    for g_, w_ in zip(got, want):
        assert g_.device.type == "neuron"
        assert_close(g_.cpu(), w_, **TOL)
    if rank == size - 1:
        assert len(losses) == n_mb
        assert_close(out.cpu(), ref(x).detach(), **TOL)


def case_pipeline_gpipe(rank, size):
    _pipeline(rank, size, "gpipe")


def case_pipeline_1f1b(rank, size):
    _pipeline(rank, size, "1f1b")


# ---- functional collectives under torch.compile --------------------------------------------

def case_funcol_compiled(rank, size):
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD

    def f(x):
        a = funcol.all_reduce(x * 2, "sum", group)
        g = funcol.all_gather_tensor(a + 1, 0, group)
        r = funcol.reduce_scatter_tensor(g, "avg", 0, group)
        return a, g, r

    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    xs = [torch.arange(4.0) + r for r in range(size)]
    a, g, r = cf(xs[rank].to(DEV))
    a_cpu = sum(x * 2 for x in xs)
    g_cpu = torch.cat([a_cpu + 1] * size)
    assert a.device.type == "neuron"
    assert_close(a.cpu(), a_cpu)
    assert_close(g.cpu(), g_cpu)
    assert_close(r.cpu(), g_cpu.chunk(size)[rank])  # avg of identical g on every rank


def case_funcol_compiled_neuron_backend(rank, size):
    """The same kind of graph through torch.compile(backend="neuron") (Inductor for neuron)."""
    import torch.distributed._functional_collectives as funcol
    import torchneuron.compile as tnc

    tnc.register()
    group = dist.group.WORLD

    def f(x):
        a = funcol.all_reduce(x * 2, "sum", group)
        return funcol.all_gather_tensor(a + 1, 0, group)

    out = torch.compile(f, backend="neuron", fullgraph=True)(torch.arange(4.0, device=DEV) + rank)
    want = torch.cat([sum(torch.arange(4.0) * 2 + r * 2 for r in range(size)) + 1] * size)
    assert out.device.type == "neuron"
    assert_close(out.cpu(), want)


# ---- distributed checkpoint ----------------------------------------------------------------

def case_dcp_save_load_sharded(rank, size):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    ref = make_mlp()
    model = copy.deepcopy(ref).to(DEV)
    fully_shard(model)
    dp_train(model, rank, size, steps=1)
    saved = {k: v.full_tensor().cpu().clone() for k, v in model.state_dict().items()}
    obj = [os.path.join(tempfile.gettempdir(), f"tn_dcp_{os.environ['MASTER_PORT']}")]
    dist.broadcast_object_list(obj, src=0)
    dcp.save(model.state_dict(), checkpoint_id=obj[0])

    fresh = make_mlp(seed=1).to(DEV)  # different values, same structure
    fully_shard(fresh)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=obj[0])
    fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        assert v.to_local().device.type == "neuron"
        assert_close(v.full_tensor().cpu(), saved[k])
    # and the expected values: one CPU training step
    want = cpu_train(ref, 1).state_dict()
    for k in saved:
        assert_close(saved[k], want[k], **TOL)


# ---- tests ---------------------------------------------------------------------------------

def test_ddp_matches_cpu(world2): world2.run(case_ddp)
def test_ddp_future_comm_hook_sees_neuron_tensors(world2): world2.run(case_ddp_comm_hook)
def test_ddp_fp16_compress_hook(world2): world2.run(case_ddp_builtin_fp16_hook)
def test_fsdp2_fully_shard_matches_cpu(world2): world2.run(case_fsdp2)
def test_zero_redundancy_optimizer_matches_cpu(world2): world2.run(case_zero)
def test_simple_fsdp_dtensor_params_match_cpu(world2): world2.run(case_simple_fsdp)
def test_tensor_parallel_matches_cpu(world2): world2.run(case_tensor_parallel)
def test_sequence_parallel_matches_cpu(world2): world2.run(case_sequence_parallel)
def test_pipeline_gpipe_matches_cpu(world2): world2.run(case_pipeline_gpipe)
def test_pipeline_1f1b_matches_cpu(world2): world2.run(case_pipeline_1f1b)
def test_funcol_under_torch_compile_aot_eager(world2): world2.run(case_funcol_compiled, timeout_s=120)
def test_funcol_under_torch_compile_neuron_backend(world2): world2.run(case_funcol_compiled_neuron_backend, timeout_s=240)
def test_dcp_save_load_sharded_state(world2): world2.run(case_dcp_save_load_sharded)
def test_2d_mesh_fsdp_tp_4_ranks(world4): world4.run(case_2d_fsdp_tp)
def test_fsdp2_4_ranks(world4): world4.run(case_fsdp2)
