"""2-D parallel training on emulated Trainium: FSDP2 across data-parallel groups, tensor parallel
(with sequence parallel norms) inside each group.

    torchrun --nproc-per-node 4 examples/train_fsdp_tp.py --steps 20

One process per logical NeuronCore (the backend binds LOCAL_RANK to neuron:LOCAL_RANK). The mesh
is (dp, tp) = (world/tp, tp). ``--check`` also trains the same model single-process on CPU and
asserts the sharded result matches it.
"""

import argparse
import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import torchneuron.distributed as tnd


class Block(nn.Module):
    """Pre-norm feed-forward block with a residual connection."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim=32, hidden=64, layers=2, out=8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def batch(step, n, seq, dim, out, teacher):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, seq, dim, generator=g)
    return x, teacher(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--check", action="store_true", help="compare with CPU training at the end")
    args = ap.parse_args()

    tnd.register()
    dist.init_process_group("neuron", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world % args.tp == 0, "world size must be a multiple of --tp"
    mesh = init_device_mesh("neuron", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()

    torch.manual_seed(0)
    ref = Model()
    teacher = nn.Linear(32, 8)
    model = copy.deepcopy(ref).to("neuron")
    for b in model.blocks:
        # Sequence parallel norm: activations between blocks are sharded on the sequence dim.
        parallelize_module(b, mesh["tp"], {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        })
        fully_shard(b, mesh=mesh["dp"])
    parallelize_module(model.head, mesh["tp"], ColwiseParallel(input_layouts=Shard(1),
                                                               output_layouts=Replicate()))
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    per_dp = args.batch // dp_size
    with torch.no_grad():
        make = lambda s: batch(s, args.batch, args.seq, 32, 8, teacher)  # noqa: E731
    seq_local = args.seq // args.tp
    tp_rank = mesh["tp"].get_local_rank()
    for step in range(args.steps):
        with torch.no_grad():
            x, y = make(step)
        x = x[dp_rank * per_dp:(dp_rank + 1) * per_dp]
        y = y[dp_rank * per_dp:(dp_rank + 1) * per_dp]
        # each TP rank feeds its sequence shard; the head returns the full sequence
        x_local = x[:, tp_rank * seq_local:(tp_rank + 1) * seq_local].to("neuron")
        opt.zero_grad()
        loss = F.mse_loss(model(x_local), y.to("neuron"))
        loss.backward()
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step:3d}  loss {lt.item():.5f}", flush=True)

    if args.check:
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
        for step in range(args.steps):
            with torch.no_grad():
                x, y = make(step)
            ref_opt.zero_grad()
            # the mean over dp groups of per-group mean losses == the global-batch mean loss
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
        worst = 0.0
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            worst = max(worst, (p.full_tensor().detach().cpu() - q.detach()).abs().max().item())
        if rank == 0:
            print(f"max |param - cpu param| = {worst:.3e}", flush=True)
        assert worst < 1e-4, f"sharded training diverged from CPU: {worst}"
        if rank == 0:
            print("match CPU: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
