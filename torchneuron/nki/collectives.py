"""``nki.collectives``: collective communication between ranks inside a kernel.

A *rank* is a logical NeuronCore: one process of a ``torch.distributed`` job (rank 0 of a
world of 1 when no process group is initialised). Every core of an LNC=2 launch takes part in
each collective on its own data, paired with the same core of the other ranks (as AWS's
kernels shard tiles over the LNC's cores and call the collective on each).

* Groups of one rank (e.g. ``ReplicaGroup([[0]])`` in a single process) are simulated locally:
  all_gather / all_reduce copy, a ring permute sends a core's data to itself.
* Groups that span several ranks run over ``torch.distributed`` -- the ``neuron`` process group
  when the default group has that backend (payloads go through neuron tensors), else the
  default backend on CPU tensors. Every rank must run the kernel. Each (sub-group, core) pair
  gets its own process group, so the two cores' collectives never interleave.

Performance model (U: no public collective-latency figures): a collective is a DMA moving the
bytes each rank sends on the ring algorithm -- all_gather ``(n - 1) / n`` of the output,
all_reduce ``2 (n - 1) / n`` of the data, a permute the source -- plus the DMA fixed cost per
step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import dtypes as dt
from .checks import Call
from .errors import NKIArgumentError, NKIBufferError, NKIShapeError
from .isa import VirtualRegister, _op, _write
from .language import NKIObject
from .tensor import NkiTensor
from .tracer import Instr, current, user_frame

__all__ = ["ReplicaGroup", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
           "collective_permute", "collective_permute_implicit",
           "collective_permute_implicit_reduce",
           "collective_permute_implicit_current_processing_rank_id", "rank_id",
           "all_gather_v", "all_to_all_v"]


@dataclass
class ReplicaGroup(NKIObject):
    """Groups of ranks that run a collective together; sub-groups must not overlap.
    ``ReplicaGroup([[0, 1, 2, 3]])`` or ``ReplicaGroup([[0, 1], [2, 3]])``."""

    replica_groups: list = field(default_factory=list)

    def group_of(self, rank: int) -> tuple:
        for g in self.replica_groups:
            g = tuple(int(r) for r in g)
            if rank in g:
                return g
        raise NKIArgumentError(f"rank {rank} is in none of the replica groups "
                               f"{self.replica_groups}", fix="list every participating rank",
                               location=None)


def _world() -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:  # the simulator runs without torch
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_groups: dict = {}
_groups_lock = threading.Lock()


def _process_group(rg: ReplicaGroup, mine: tuple, pid: int, lnc: int):
    """The torch.distributed group of sub-group ``mine`` for core ``pid`` (all sub-groups and
    cores are created together, in the same order on every rank)."""
    import torch.distributed as dist
    key = (tuple(tuple(int(r) for r in g) for g in rg.replica_groups), lnc)
    with _groups_lock:
        made = _groups.get(key)
        if made is None:
            made = {}
            for g in key[0]:
                for p in range(lnc):
                    made[(g, p)] = dist.new_group(list(g))
            _groups[key] = made
    return made[(mine, pid)]


def _torch_of(a: np.ndarray, group):
    import torch
    import torch.distributed as dist

    from .simulator import numpy_to_torch
    t = numpy_to_torch(np.ascontiguousarray(a))
    backend = str(dist.get_backend(group))
    if "neuron" in backend:
        t = t.to("neuron")
    return t


def _numpy_of(t) -> np.ndarray:
    import torch
    t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dt.bfloat16)
    return t.numpy()


class _Coll:
    """One collective call: checks, the cost record, and where the data comes from."""

    def __init__(self, name: str, rg: ReplicaGroup):
        self.ctx = current()
        self.c = Call(name, self.ctx, user_frame())
        if not isinstance(rg, ReplicaGroup):
            self.c.fail(NKIArgumentError, f"replica_group must be a nki.collectives.ReplicaGroup, "
                        f"got {type(rg).__name__}", fix="pass ReplicaGroup([[0, 1, ...]])")
        self.rank, self.world = _world()
        self.group = rg.group_of(self.rank)
        bad = [r for r in self.group if r >= self.world]
        if bad:
            self.c.fail(NKIArgumentError, f"replica group {list(self.group)} includes rank(s) "
                        f"{bad} but this process is rank {self.rank} of a world of {self.world}",
                        fix="run the kernel on every rank of a torch.distributed job "
                            "(init_process_group('neuron')) or use a group of this rank only")
        self.rg = rg
        self.n = len(self.group)
        self.pos = self.group.index(self.rank)

    def tensors(self, xs, arg: str) -> list:
        if not isinstance(xs, (list, tuple)) or not xs:
            self.c.fail(NKIArgumentError, f"`{arg}` must be a non-empty list of tensors",
                        fix=f"pass {arg}=[tile]")
        out = [self.c.tensor(x, f"{arg}[{i}]") for i, x in enumerate(xs)]
        kinds = {x.buffer.is_hbm for x in out}
        if len(kinds) > 1:
            self.c.fail(NKIBufferError, f"`{arg}` mixes HBM and SBUF tensors",
                        fix="keep all collective operands in HBM or all in SBUF",
                        rule="buffer-kind")
        for x in out:
            if x.buffer.name == "psum":
                self.c.fail(NKIBufferError, f"`{arg}` {x._desc()} is in PSUM; collectives use "
                            "HBM or SBUF", fix="copy it to SBUF", rule="buffer-kind")
        return out

    def emit(self, reads: list, writes: list, nbytes: int, steps: int) -> None:
        plat = self.ctx.platform
        hbm = sum(t.size * t.itemsize for t in reads + writes if t.buffer.is_hbm)
        # steps x fixed DMA cost expressed as bytes at queue speed, added to the payload
        extra = int(max(steps - 1, 0) * plat.dma_fixed_cost_s * plat.dma_queue_bytes_per_ns * 1e9)
        self.ctx.instructions.append(Instr(self.c.op, "dma", 0.0, [t.region() for t in reads],
                                           [t.region() for t in writes], nbytes=nbytes + extra,
                                           hbm_bytes=hbm, loc=self.c.loc))
        for t in writes:
            if t.storage.external:
                t.storage.dirty = True

    @property
    def compute(self) -> bool:
        return True  # collectives move data even in timing-only runs (peers need it)

    def remote(self):
        """The torch.distributed group of this sub-group and core, or None when local."""
        if self.n == 1:
            return None
        return _process_group(self.rg, self.group, self.ctx.program_id, self.ctx.num_programs)


def _values(t: NkiTensor) -> np.ndarray:
    return np.ascontiguousarray(t.data)


def all_gather(srcs, dsts, replica_group: ReplicaGroup, collective_dim: int, priority=None,
               name=None) -> None:
    """``dsts[i]`` = the ``srcs[i]`` of every rank of the group, concatenated along
    ``collective_dim`` in group order."""
    k = _Coll("all_gather", replica_group)
    ss, ds = k.tensors(srcs, "srcs"), k.tensors(dsts, "dsts")
    if len(ss) != len(ds):
        k.c.fail(NKIArgumentError, "srcs and dsts differ in length", fix="pair every src with a dst")
    dim = int(collective_dim)
    for s, d in zip(ss, ds):
        exp = list(s.shape)
        if not 0 <= dim < s.ndim:
            k.c.fail(NKIArgumentError, f"collective_dim={dim} is not a dimension of {s._desc()}",
                     fix="pick an existing dimension")
        exp[dim] *= k.n
        if d.shape != tuple(exp) or d.dtype != s.dtype:
            k.c.fail(NKIShapeError, f"dst {d._desc()} must be {tuple(exp)} {dt.name(s.dtype)} "
                     f"(src {s._desc()} gathered from {k.n} ranks along dim {dim})",
                     fix=f"allocate dst with shape {tuple(exp)}")
    k.emit(ss, ds, sum(d.size * d.itemsize for d in ds) * (k.n - 1) // max(k.n, 1), k.n)
    grp = k.remote()
    for s, d in zip(ss, ds):
        v = _values(s)
        if grp is None:
            parts = [v]
        else:
            import torch
            import torch.distributed as dist
            inp = _torch_of(v, grp)
            outs = [torch.empty_like(inp) for _ in range(k.n)]
            dist.all_gather(outs, inp, group=grp)
            parts = [_numpy_of(o) for o in outs]
        _write(d, np.concatenate(parts, axis=dim))


def _reduce_parts(op, parts: list) -> np.ndarray:
    acc = parts[0].astype(np.float32)
    for p in parts[1:]:
        acc = op.fn(acc, p.astype(np.float32))
    return acc


def all_reduce(srcs, dsts, replica_group: ReplicaGroup, op, priority=None, name=None) -> None:
    """``dsts[i]`` = ``op`` (nl.add, nl.minimum, nl.maximum) over the group's ``srcs[i]``."""
    k = _Coll("all_reduce", replica_group)
    ss, ds = k.tensors(srcs, "srcs"), k.tensors(dsts, "dsts")
    o = _op(k.c, op, "op", ("binary",))
    if o.name not in ("add", "minimum", "maximum"):
        k.c.fail(NKIArgumentError, f"op={o!r}: all_reduce supports nl.add, nl.minimum, nl.maximum",
                 fix="pick one of those")
    for s, d in zip(ss, ds):
        if s.size != d.size:
            k.c.fail(NKIShapeError, f"src {s._desc()} and dst {d._desc()} differ in size",
                     fix="reduce into a tensor like src")
    k.emit(ss, ds, 2 * sum(s.size * s.itemsize for s in ss) * (k.n - 1) // max(k.n, 1), 2 * k.n - 1)
    grp = k.remote()
    for s, d in zip(ss, ds):
        v = _values(s)
        if grp is None:
            r = v
        else:
            import torch
            import torch.distributed as dist
            inp = _torch_of(v, grp)
            outs = [torch.empty_like(inp) for _ in range(k.n)]
            dist.all_gather(outs, inp, group=grp)  # reduce here: exact op semantics in fp32
            r = _reduce_parts(o, [_numpy_of(x) for x in outs])
        _write(d, np.asarray(r).reshape(d.shape))


def reduce_scatter(srcs, dsts, replica_group: ReplicaGroup, collective_dim: int, op,
                   priority=None, name=None) -> None:
    """``dsts[i]`` = this rank's slice (along ``collective_dim``) of ``op`` over the group's
    ``srcs[i]``."""
    k = _Coll("reduce_scatter", replica_group)
    ss, ds = k.tensors(srcs, "srcs"), k.tensors(dsts, "dsts")
    o = _op(k.c, op, "op", ("binary",))
    dim = int(collective_dim)
    for s, d in zip(ss, ds):
        exp = list(s.shape)
        if exp[dim] % k.n:
            k.c.fail(NKIShapeError, f"{s._desc()} dim {dim} is not divisible by {k.n} ranks",
                     fix="pad the tensor")
        exp[dim] //= k.n
        if d.shape != tuple(exp):
            k.c.fail(NKIShapeError, f"dst {d._desc()} must be {tuple(exp)}", fix="allocate it so")
    k.emit(ss, ds, sum(s.size * s.itemsize for s in ss) * (k.n - 1) // max(k.n, 1), k.n)
    grp = k.remote()
    for s, d in zip(ss, ds):
        v = _values(s)
        if grp is None:
            r = v
        else:
            import torch
            import torch.distributed as dist
            inp = _torch_of(v, grp)
            outs = [torch.empty_like(inp) for _ in range(k.n)]
            dist.all_gather(outs, inp, group=grp)
            r = _reduce_parts(o, [_numpy_of(x) for x in outs])
        _write(d, np.split(np.asarray(r), k.n, axis=dim)[k.pos])


def all_to_all(srcs, dsts, replica_group: ReplicaGroup, collective_dim: int, priority=None,
               name=None) -> None:
    """Split ``srcs[i]`` into n chunks along ``collective_dim``; chunk j goes to the group's
    j-th rank; ``dsts[i]`` concatenates the chunks received, in group order."""
    k = _Coll("all_to_all", replica_group)
    ss, ds = k.tensors(srcs, "srcs"), k.tensors(dsts, "dsts")
    dim = int(collective_dim)
    for s, d in zip(ss, ds):
        if s.shape != d.shape or s.shape[dim] % k.n:
            k.c.fail(NKIShapeError, f"src {s._desc()} and dst {d._desc()} must match, dim {dim} "
                     f"divisible by {k.n}", fix="allocate dst like src")
    k.emit(ss, ds, sum(s.size * s.itemsize for s in ss) * (k.n - 1) // max(k.n, 1), k.n)
    grp = k.remote()
    for s, d in zip(ss, ds):
        v = _values(s)
        if grp is None:
            r = v
        else:
            import torch
            import torch.distributed as dist
            chunks = [_torch_of(np.ascontiguousarray(c), grp) for c in np.split(v, k.n, axis=dim)]
            outs = [torch.empty_like(chunks[0]) for _ in range(k.n)]
            dist.all_to_all(outs, chunks, group=grp)
            r = np.concatenate([_numpy_of(x) for x in outs], axis=dim)
        _write(d, r)


def _permute(k: _Coll, ss: list, ds: list, send_to: int, recv_from: int) -> None:
    grp = k.remote()
    for s, d in zip(ss, ds):
        v = _values(s)
        if grp is None or send_to == k.rank:
            r = v
        else:
            import torch
            import torch.distributed as dist
            inp = _torch_of(v, grp)
            out = torch.empty_like(inp)
            ops = [dist.P2POp(dist.isend, inp, send_to, group=grp),
                   dist.P2POp(dist.irecv, out, recv_from, group=grp)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            r = _numpy_of(out)
        _write(d, np.asarray(r).reshape(d.shape))


def collective_permute(srcs, dsts, source_target_pairs, priority=None, name=None) -> None:
    """Send ``srcs[0]`` to this rank's target and receive its source's into ``dsts[0]``
    (``source_target_pairs`` lists (source, target) rank pairs; HBM tensors)."""
    rank, world = _world()
    pairs = [(int(a), int(b)) for a, b in source_target_pairs]
    ranks = sorted({r for p in pairs for r in p} | {rank})
    k = _Coll("collective_permute", ReplicaGroup([ranks]))
    ss, ds = k.tensors(srcs, "srcs"), k.tensors(dsts, "dsts")
    if len(ss) != 1 or len(ds) != 1:
        k.c.fail(NKIArgumentError, "collective_permute moves exactly one tensor",
                 fix="pass srcs=[t], dsts=[u]")
    to = [b for a, b in pairs if a == rank]
    frm = [a for a, b in pairs if b == rank]
    if len(to) != 1 or len(frm) != 1:
        k.c.fail(NKIArgumentError, f"rank {rank} must appear once as a source and once as a "
                 f"target in {pairs}", fix="list a complete permutation")
    k.emit(ss, ds, ss[0].size * ss[0].itemsize, 1)
    _permute(k, ss, ds, to[0], frm[0])


def _ring_neighbours(k: _Coll) -> tuple[int, int]:
    return k.group[(k.pos + 1) % k.n], k.group[(k.pos - 1) % k.n]


def collective_permute_implicit(srcs_by_channel, dsts_by_channel, replica_group: ReplicaGroup,
                                channel_ids=(0,), priority=None, name=None) -> None:
    """Ring step: every rank sends each channel's source to its successor in its replica group
    and receives its predecessor's into the channel's destination."""
    k = _Coll("collective_permute_implicit", replica_group)
    ss = [k.tensors(x, "srcs_by_channel[...]")[0] for x in srcs_by_channel]
    ds = [k.tensors(x, "dsts_by_channel[...]")[0] for x in dsts_by_channel]
    if len(ss) != len(ds) or len(ss) != len(list(channel_ids)):
        k.c.fail(NKIArgumentError, "one source, one destination and one channel id per channel",
                 fix="pass matching lists")
    if list(channel_ids) != list(range(len(ss))) or len(ss) > 4:
        k.c.fail(NKIArgumentError, f"channel_ids={list(channel_ids)} must be 0..n-1 (n <= 4)",
                 fix="number channels from 0")
    for s, d in zip(ss, ds):
        if s.size != d.size or s.dtype != d.dtype:
            k.c.fail(NKIShapeError, f"src {s._desc()} and dst {d._desc()} must match",
                     fix="allocate dst like src")
    k.emit(ss, ds, sum(s.size * s.itemsize for s in ss), 1)
    to, frm = _ring_neighbours(k)
    _permute(k, ss, ds, to, frm)


def collective_permute_implicit_reduce(srcs0_by_channel, srcs1_by_channel, dsts_by_channel,
                                       replica_group: ReplicaGroup, op, channel_ids=(0,),
                                       priority=None, name=None) -> None:
    """Ring step of ``op(srcs0, srcs1)``: each rank reduces its two sources and sends the result
    to its successor; the predecessor's result lands in the destination."""
    k = _Coll("collective_permute_implicit_reduce", replica_group)
    a = [k.tensors(x, "srcs0_by_channel[...]")[0] for x in srcs0_by_channel]
    b = [k.tensors(x, "srcs1_by_channel[...]")[0] for x in srcs1_by_channel]
    ds = [k.tensors(x, "dsts_by_channel[...]")[0] for x in dsts_by_channel]
    o = _op(k.c, op, "op", ("binary",))
    k.emit(a + b, ds, sum(s.size * s.itemsize for s in a), 1)
    to, frm = _ring_neighbours(k)
    grp = k.remote()
    for x, y, d in zip(a, b, ds):
        v = o.fn(_values(x).astype(np.float32), _values(y).astype(np.float32))
        if grp is None:
            r = v
        else:
            import torch
            import torch.distributed as dist
            inp = _torch_of(dt.cast(v, d.dtype), grp)
            out = torch.empty_like(inp)
            ops = [dist.P2POp(dist.isend, inp, to, group=grp),
                   dist.P2POp(dist.irecv, out, frm, group=grp)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            r = _numpy_of(out)
        _write(d, np.asarray(r).reshape(d.shape))


def collective_permute_implicit_current_processing_rank_id(iteration_id, replica_group:
                                                           ReplicaGroup, channel_id: int = 0,
                                                           name=None) -> VirtualRegister:
    """Rank whose data a ring step ``iteration_id`` processes: this rank at step 0, then the
    predecessors in ring order (a register)."""
    rank, _ = _world()
    g = replica_group.group_of(rank)
    it = iteration_id.read() if isinstance(iteration_id, VirtualRegister) else int(iteration_id)
    return VirtualRegister(g[(g.index(rank) - it) % len(g)])


def rank_id(name=None) -> VirtualRegister:
    """This rank (a register): the torch.distributed rank, 0 without a process group."""
    current()
    return VirtualRegister(_world()[0])


def all_gather_v(*args: Any, **kwargs: Any) -> None:
    raise NotImplementedError("nki.collectives.all_gather_v: the metadata_tensor layout is not "
                              "specified in AWS's public reference")


def all_to_all_v(*args: Any, **kwargs: Any) -> None:
    raise NotImplementedError("nki.collectives.all_to_all_v: the metadata_tensor layout is not "
                              "specified in AWS's public reference")

