"""Every c10d op on neuron tensors, against the same computation on CPU (2 ranks, one World).

Inputs are a function of the rank, so each rank can compute every peer's input and therefore
the exact expected result on CPU."""

import torch
import torch.distributed as dist
from torch.testing import assert_close

DEV = "neuron"


def inp(rank, n=6, dtype=torch.float32):
    return (torch.arange(n, dtype=torch.float32) + 10 * rank + 1).to(dtype)


def on_dev(t):
    return t.to(DEV)


# ---- cases (run on every rank) -------------------------------------------------------------

def case_all_reduce_sum(rank, size):
    t = on_dev(inp(rank))
    dist.all_reduce(t)
    assert t.device.type == "neuron"
    assert_close(t.cpu(), sum(inp(r) for r in range(size)))


def case_all_reduce_avg_max(rank, size):
    t = on_dev(inp(rank))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert_close(t.cpu(), sum(inp(r) for r in range(size)) / size)
    m = on_dev(inp(rank))
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    assert_close(m.cpu(), inp(size - 1))


def case_all_reduce_dtypes(rank, size):
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
                  torch.complex64):
        t = on_dev(inp(rank, dtype=dtype))
        dist.all_reduce(t)
        assert_close(t.cpu(), sum(inp(r, dtype=dtype) for r in range(size)))


def case_all_reduce_non_contiguous(rank, size):
    base = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    t = on_dev(base).t()
    dist.all_reduce(t)
    assert_close(t.cpu(), sum(torch.arange(12.0).reshape(3, 4) * (r + 1) for r in range(size)).t())


def case_all_reduce_coalesced(rank, size):
    ts = [on_dev(inp(rank, 3)), on_dev(inp(rank, 5) * 2)]
    dist.all_reduce_coalesced(ts)
    assert_close(ts[0].cpu(), sum(inp(r, 3) for r in range(size)))
    assert_close(ts[1].cpu(), sum(inp(r, 5) * 2 for r in range(size)))


def case_broadcast(rank, size):
    t = on_dev(inp(rank))
    dist.broadcast(t, src=1)
    assert_close(t.cpu(), inp(1))


def case_reduce(rank, size):
    t = on_dev(inp(rank))
    dist.reduce(t, dst=0)
    if rank == 0:
        assert_close(t.cpu(), sum(inp(r) for r in range(size)))


def case_all_gather(rank, size):
    outs = [on_dev(torch.zeros(6)) for _ in range(size)]
    dist.all_gather(outs, on_dev(inp(rank)))
    for r in range(size):
        assert outs[r].device.type == "neuron"
        assert_close(outs[r].cpu(), inp(r))


def case_all_gather_into_tensor(rank, size):
    out = on_dev(torch.zeros(size * 6))
    dist.all_gather_into_tensor(out, on_dev(inp(rank)))
    assert_close(out.cpu(), torch.cat([inp(r) for r in range(size)]))


def case_all_gather_coalesced(rank, size):
    # Layout: outs[r] holds rank r's list of tensors.
    outs = [[on_dev(torch.zeros(3)), on_dev(torch.zeros(2))] for _ in range(size)]
    dist.all_gather_coalesced(outs, [on_dev(inp(rank, 3)), on_dev(inp(rank, 2))])
    for r in range(size):
        assert_close(outs[r][0].cpu(), inp(r, 3))
        assert_close(outs[r][1].cpu(), inp(r, 2))


def case_all_gather_into_tensor_coalesced(rank, size):
    # The coalescing manager path: FSDP2's all-gather goes through allgather_into_tensor_coalesced.
    outs = [on_dev(torch.zeros(size * 4)), on_dev(torch.zeros(size * 2))]
    ins = [on_dev(inp(rank, 4)), on_dev(inp(rank, 2))]
    with dist._coalescing_manager(device=torch.device(DEV)):
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    assert_close(outs[0].cpu(), torch.cat([inp(r, 4) for r in range(size)]))
    assert_close(outs[1].cpu(), torch.cat([inp(r, 2) for r in range(size)]))


def case_gather(rank, size):
    outs = [on_dev(torch.zeros(6)) for _ in range(size)] if rank == 0 else None
    dist.gather(on_dev(inp(rank)), outs, dst=0)
    if rank == 0:
        for r in range(size):
            assert_close(outs[r].cpu(), inp(r))


def case_scatter(rank, size):
    out = on_dev(torch.zeros(6))
    ins = [on_dev(inp(r) * 3) for r in range(size)] if rank == 0 else None
    dist.scatter(out, ins, src=0)
    assert_close(out.cpu(), inp(rank) * 3)


def case_reduce_scatter(rank, size):
    out = on_dev(torch.zeros(3))
    ins = [on_dev(inp(rank, 3) + r) for r in range(size)]
    dist.reduce_scatter(out, ins)
    assert_close(out.cpu(), sum(inp(q, 3) + rank for q in range(size)))


def case_reduce_scatter_tensor(rank, size):
    out = on_dev(torch.zeros(3))
    dist.reduce_scatter_tensor(out, on_dev(inp(rank, 3 * size)))
    full = sum(inp(q, 3 * size) for q in range(size))
    assert_close(out.cpu(), full[3 * rank:3 * rank + 3])


def case_reduce_scatter_tensor_avg(rank, size):
    out = on_dev(torch.zeros(3))
    dist.reduce_scatter_tensor(out, on_dev(inp(rank, 3 * size)), op=dist.ReduceOp.AVG)
    full = sum(inp(q, 3 * size) for q in range(size)) / size
    assert_close(out.cpu(), full[3 * rank:3 * rank + 3])


def case_reduce_scatter_tensor_coalesced(rank, size):
    outs = [on_dev(torch.zeros(2)), on_dev(torch.zeros(3))]
    ins = [on_dev(inp(rank, 2 * size)), on_dev(inp(rank, 3 * size) * 2)]
    with dist._coalescing_manager(device=torch.device(DEV)):
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i)
    f0 = sum(inp(q, 2 * size) for q in range(size))
    f1 = sum(inp(q, 3 * size) * 2 for q in range(size))
    assert_close(outs[0].cpu(), f0[2 * rank:2 * rank + 2])
    assert_close(outs[1].cpu(), f1[3 * rank:3 * rank + 3])


def case_all_to_all(rank, size):
    ins = [on_dev(inp(rank, 2) + 100 * d) for d in range(size)]
    outs = [on_dev(torch.zeros(2)) for _ in range(size)]
    dist.all_to_all(outs, ins)
    for s in range(size):
        assert_close(outs[s].cpu(), inp(s, 2) + 100 * rank)


def case_all_to_all_single_uneven(rank, size):
    # rank r sends (d + 1) elements to rank d.
    send = torch.cat([torch.full((d + 1,), float(10 * rank + d)) for d in range(size)])
    out = on_dev(torch.zeros(size * (rank + 1)))
    dist.all_to_all_single(out, on_dev(send), output_split_sizes=[rank + 1] * size,
                           input_split_sizes=[d + 1 for d in range(size)])
    want = torch.cat([torch.full((rank + 1,), float(10 * s + rank)) for s in range(size)])
    assert_close(out.cpu(), want)


def case_send_recv(rank, size):
    if rank == 0:
        dist.send(on_dev(inp(0) * 7), dst=1)
    elif rank == 1:
        t = on_dev(torch.zeros(6))
        dist.recv(t, src=0)
        assert_close(t.cpu(), inp(0) * 7)


def case_recv_any_source(rank, size):
    if rank == 1:
        t = on_dev(torch.zeros(6))
        src = dist.recv(t)  # no src: recvAnysource
        assert src == 0
        assert_close(t.cpu(), inp(0))
    elif rank == 0:
        dist.send(on_dev(inp(0)), dst=1)


def case_isend_irecv_futures(rank, size):
    # gloo's p2p Works have no Future; ours completes it (watchdog poll or wait()).
    peer = 1 - rank
    t = on_dev(torch.zeros(6))
    works = [dist.isend(on_dev(inp(rank)), dst=peer), dist.irecv(t, src=peer)]
    fut = works[1].get_future()
    vals = fut.wait()
    assert vals[0].device.type == "neuron"
    for w in works:
        w.wait()
    assert_close(t.cpu(), inp(peer))


def case_batch_isend_irecv(rank, size):
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    t = on_dev(torch.zeros(6))
    ops = [dist.P2POp(dist.isend, on_dev(inp(rank)), nxt), dist.P2POp(dist.irecv, t, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert_close(t.cpu(), inp(prv))


def case_barrier_and_monitored_barrier(rank, size):
    from datetime import timedelta

    import torchneuron.distributed as tnd

    dist.barrier()
    tnd.monitored_barrier(timeout=timedelta(seconds=10), wait_all_ranks=True)
    dist.monitored_barrier(timeout=timedelta(seconds=10), wait_all_ranks=True)  # the standard API


def case_async_work_future_holds_neuron_tensors(rank, size):
    t = on_dev(inp(rank))
    work = dist.all_reduce(t, async_op=True)
    vals = work.get_future().wait()
    assert work.is_completed() and work.is_success()
    assert len(vals) == 1 and vals[0].device == t.device
    assert vals[0].data_ptr() == t.data_ptr()
    assert work.result()[0].device.type == "neuron"
    assert_close(vals[0].cpu(), sum(inp(r) for r in range(size)))


def case_fp8_moves_as_bytes(rank, size):
    x = (inp(rank) / 8).to(torch.float8_e4m3fn)
    outs = [on_dev(torch.zeros(6).to(torch.float8_e4m3fn)) for _ in range(size)]
    dist.all_gather(outs, on_dev(x))
    for r in range(size):
        assert outs[r].dtype == torch.float8_e4m3fn
        assert torch.equal(outs[r].cpu().view(torch.uint8), (inp(r) / 8).to(torch.float8_e4m3fn).view(torch.uint8))
    b = on_dev(x)
    dist.broadcast(b, src=0)
    assert torch.equal(b.cpu().view(torch.uint8), (inp(0) / 8).to(torch.float8_e4m3fn).view(torch.uint8))


def case_fp8_reduction_is_rejected_clearly(rank, size):
    t = on_dev(inp(rank).to(torch.float8_e5m2))
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        assert "upcast" in str(e), str(e)
    else:
        raise AssertionError("fp8 all_reduce should be rejected")
    dist.barrier()  # the group is still usable


def case_group_names_and_ranks(rank, size):
    pg = dist.group.WORLD
    assert dist.get_backend(pg) == "neuron"
    assert dist.get_rank() == rank and dist.get_world_size() == size
    be = pg._get_backend(torch.device(DEV))
    assert be.name() == "neuron"
    sub = dist.new_group([1])
    if rank == 1:
        assert dist.get_rank(sub) == 0 and dist.get_world_size(sub) == 1
        assert dist.get_global_rank(sub, 0) == 1
        t = on_dev(inp(rank))
        dist.all_reduce(t, group=sub)
        assert_close(t.cpu(), inp(rank))
    if rank == 1:
        assert pg.group_name and sub.group_name != pg.group_name
    else:
        assert sub == dist.GroupMember.NON_GROUP_MEMBER
    assert torch.neuron.current_device() == rank  # LOCAL_RANK -> neuron:LOCAL_RANK


def case_object_collectives(rank, size):
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(size)]
    lst = [rank * 5]
    dist.broadcast_object_list(lst, src=1)
    assert lst == [5]


def case_flight_recorder_records_ops(rank, size):
    import json

    import torchneuron.distributed as tnd

    dist.all_reduce(on_dev(torch.ones(7)))
    recs = [json.loads(line) for line in tnd.dump_flight_recorder().splitlines()]
    last = recs[-1]
    assert last["op"] == "allreduce" and "[7]" in last["shapes"] and last["state"] == "completed"


# ---- tests ---------------------------------------------------------------------------------

def test_all_reduce_sum(world2): world2.run(case_all_reduce_sum)
def test_all_reduce_avg_and_max(world2): world2.run(case_all_reduce_avg_max)
def test_all_reduce_dtypes(world2): world2.run(case_all_reduce_dtypes)
def test_all_reduce_non_contiguous(world2): world2.run(case_all_reduce_non_contiguous)
def test_all_reduce_coalesced(world2): world2.run(case_all_reduce_coalesced)
def test_broadcast(world2): world2.run(case_broadcast)
def test_reduce(world2): world2.run(case_reduce)
def test_all_gather(world2): world2.run(case_all_gather)
def test_all_gather_into_tensor(world2): world2.run(case_all_gather_into_tensor)
def test_all_gather_coalesced(world2): world2.run(case_all_gather_coalesced)
def test_all_gather_into_tensor_coalesced(world2): world2.run(case_all_gather_into_tensor_coalesced)
def test_gather(world2): world2.run(case_gather)
def test_scatter(world2): world2.run(case_scatter)
def test_reduce_scatter(world2): world2.run(case_reduce_scatter)
def test_reduce_scatter_tensor(world2): world2.run(case_reduce_scatter_tensor)
def test_reduce_scatter_tensor_avg(world2): world2.run(case_reduce_scatter_tensor_avg)
def test_reduce_scatter_tensor_coalesced(world2): world2.run(case_reduce_scatter_tensor_coalesced)
def test_all_to_all(world2): world2.run(case_all_to_all)
def test_all_to_all_single_uneven(world2): world2.run(case_all_to_all_single_uneven)
def test_send_recv(world2): world2.run(case_send_recv)
def test_recv_any_source(world2): world2.run(case_recv_any_source)
def test_isend_irecv_futures_complete(world2): world2.run(case_isend_irecv_futures)
def test_batch_isend_irecv(world2): world2.run(case_batch_isend_irecv)
def test_barrier_and_monitored_barrier(world2): world2.run(case_barrier_and_monitored_barrier)
def test_async_work_future_holds_neuron_tensors(world2): world2.run(case_async_work_future_holds_neuron_tensors)
def test_fp8_moves_as_bytes(world2): world2.run(case_fp8_moves_as_bytes)
def test_fp8_reduction_is_rejected_clearly(world2): world2.run(case_fp8_reduction_is_rejected_clearly)
def test_group_names_ranks_and_device_binding(world2): world2.run(case_group_names_and_ranks)
def test_object_collectives(world2): world2.run(case_object_collectives)
def test_flight_recorder_records_ops(world2): world2.run(case_flight_recorder_records_ops)
def test_all_reduce_4_ranks(world4): world4.run(case_all_reduce_sum)
def test_reduce_scatter_tensor_4_ranks(world4): world4.run(case_reduce_scatter_tensor)
def test_all_to_all_single_uneven_4_ranks(world4): world4.run(case_all_to_all_single_uneven)


def case_collective_on_side_stream(rank, size):
    # Issued on a non-default neuron stream; wait() orders the current stream after it.
    s = torch.neuron.Stream()
    with torch.neuron.stream(s):
        t = on_dev(inp(rank)) * 2
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        u = t + 1
    torch.neuron.synchronize()
    assert_close(u.cpu(), sum(inp(r) * 2 for r in range(size)) + 1)


def test_collective_on_side_stream(world2): world2.run(case_collective_on_side_stream)


def case_repeated_ops_complete_in_order(rank, size):
    # Works complete on the waiting thread (polling first, unless TORCH_NEURON_WAIT_SPIN_US=0);
    # gloo's reduce-scatter Work has no Future, which the backend remembers after the first
    # call: later calls, and a Future asked for explicitly, must still complete correctly.
    src = torch.arange(2.0 * size)
    for i in range(20):
        t = on_dev(inp(rank) + i)
        dist.all_reduce(t)
        assert_close(t.cpu(), sum(inp(r) + i for r in range(size)))
        out = on_dev(torch.empty(2))
        dist.reduce_scatter_tensor(out, on_dev(src * (rank + 1) + i))
        assert_close(out.cpu(), sum(src[2 * rank:2 * rank + 2] * (r + 1) + i for r in range(size)))
    out = on_dev(torch.empty(2))
    work = dist.reduce_scatter_tensor(out, on_dev(src), async_op=True)
    vals = work.get_future().wait()
    assert vals[0].device.type == "neuron"
    assert_close(out.cpu(), src[2 * rank:2 * rank + 2] * size)


def test_repeated_ops_complete_in_order(world2): world2.run(case_repeated_ops_complete_in_order)


def test_repeated_ops_complete_without_spin_wait():
    from world import World

    w = World(2, extra_env={"TORCH_NEURON_WAIT_SPIN_US": "0"})
    w.start()
    try:
        w.run(case_repeated_ops_complete_in_order)
    finally:
        w.stop()
