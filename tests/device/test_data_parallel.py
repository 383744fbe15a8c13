"""torch.nn.DataParallel and torch.nn.parallel.comm across neuron devices, against CPU PyTorch.

PyTorch defines the device-copy primitives behind them (torch._C._scatter, ...) only in CUDA
builds; torchneuron.neuron.comm defines them for neuron devices.
"""

import copy

import pytest
import torch
from torch.nn.parallel import comm

N = torch.neuron.device_count()
pytestmark = pytest.mark.skipif(N < 2, reason="needs two neuron devices")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Linear(16, 3))


@pytest.mark.filterwarnings("ignore:PyTorch is not compiled with NCCL support")
def test_data_parallel_trains_as_the_module_on_cpu():
    ref = model()
    dp = torch.nn.DataParallel(copy.deepcopy(ref).to("neuron:0"))
    assert dp.device_ids == list(range(N))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, dp)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, t = torch.randn(2 * N + 1, 12, generator=gen), torch.randn(2 * N + 1, 3, generator=gen)  # uneven chunks
        for m, opt, dev in ((ref, opts[0], "cpu"), (dp, opts[1], "neuron:0")):
            opt.zero_grad()
            out = m(x.to(dev))
            assert out.device == torch.device(dev)
            torch.nn.functional.mse_loss(out, t.to(dev)).backward()
            opt.step()
        torch.testing.assert_close(dp(x.to("neuron:0")).cpu(), ref(x), rtol=1e-5, atol=1e-6)
    for p, q in zip(ref.parameters(), dp.module.parameters()):
        assert q.device == torch.device("neuron:0")
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-6)


def test_data_parallel_takes_cpu_inputs():
    ref = model()
    dp = torch.nn.DataParallel(copy.deepcopy(ref).to("neuron:0"), device_ids=[0, 1])
    x = torch.randn(5, 12)
    out = dp(x)
    assert out.device == torch.device("neuron:0")
    torch.testing.assert_close(out.cpu(), ref(x), rtol=1e-5, atol=1e-6)


def test_scatter_splits_into_chunks_on_each_device():
    x = torch.arange(24.0).reshape(6, 4)
    parts = comm.scatter(x, devices=[1, 0], chunk_sizes=[4, 2], dim=0)
    assert [p.device for p in parts] == [torch.device("neuron:1"), torch.device("neuron:0")]
    assert torch.equal(torch.cat([p.cpu() for p in parts]), x)
    cols = comm.scatter(x.to("neuron:0"), devices=[0, 1], dim=1)
    assert cols[0].data_ptr() == x.to("neuron:0").data_ptr() or cols[0].device == torch.device("neuron:0")
    assert torch.equal(torch.cat([c.cpu() for c in cols], 1), x)
    outs = [torch.empty(3, 4, device="neuron:0"), torch.empty(3, 4, device="neuron:1")]
    assert comm.scatter(x, out=outs)[1] is outs[1]
    assert torch.equal(outs[1].cpu(), x[3:])


def test_a_chunk_already_on_its_device_is_a_view_not_a_copy():
    x = torch.randn(4, 3, device="neuron:0")
    parts = comm.scatter(x, devices=[0, 1])
    assert parts[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_gather_concatenates_onto_the_destination():
    parts = [torch.full((2, 3), float(i), device=f"neuron:{i}") for i in range(2)]
    want = torch.cat([torch.full((2, 3), 0.0), torch.full((2, 3), 1.0)])
    assert comm.gather(parts, 0, destination=1).device == torch.device("neuron:1")
    assert torch.equal(comm.gather(parts, 0, destination=1).cpu(), want)
    assert torch.equal(comm.gather(parts, 0, destination="cpu"), want)
    out = torch.empty(2, 6, device="neuron:0")
    assert comm.gather(parts, 1, out=out) is out
    assert torch.equal(out.cpu(), torch.cat([torch.full((2, 3), 0.0), torch.full((2, 3), 1.0)], 1))


def test_broadcast_coalesced_keeps_the_sources_and_copies_to_the_others():
    ts = [torch.randn(3, device="neuron:0"), torch.randn(2, 2, device="neuron:0")]
    per_device = comm.broadcast_coalesced(ts, [0, 1])
    assert per_device[0][0] is ts[0] and per_device[0][1] is ts[1]
    for a, b in zip(ts, per_device[1]):
        assert b.device == torch.device("neuron:1") and torch.equal(a.cpu(), b.cpu())
    copies = comm.broadcast(ts[0], devices=[1, 0])
    assert copies[1] is ts[0] or copies[1].data_ptr() == ts[0].data_ptr()
    assert torch.equal(copies[0].cpu(), ts[0].cpu()) and copies[0].device == torch.device("neuron:1")


def test_reduce_add_sums_onto_the_destination():
    parts = [torch.full((4,), float(i + 1), device=f"neuron:{i}") for i in range(2)]
    with pytest.warns(UserWarning, match="NCCL"):  # PyTorch's own probe for NCCL (torch/cuda/nccl.py)
        total = comm.reduce_add(parts, destination=1)
    assert total.device == torch.device("neuron:1") and torch.equal(total.cpu(), torch.full((4,), 3.0))


@pytest.mark.parametrize("call,match", [
    (lambda x: comm.scatter(x, devices=[0, 99]), "99 is not a neuron device index"),
    (lambda x: comm.scatter(x, devices=[0, 1], chunk_sizes=[1, 1]), "do not sum"),
    (lambda x: comm.scatter(x, devices=[0, 1], chunk_sizes=[4]), "1 chunk sizes for 2 devices"),
    (lambda x: comm.gather([x.to("neuron:0"), torch.zeros(4, 5, device="neuron:1")], 0), "does not match"),
    (lambda x: comm.gather([], 0), "at least one tensor"),
    (lambda x: comm.broadcast_coalesced([x.to("neuron:1")], [0, 1]), r"on devices\[0\]"),
])
def test_bad_arguments_raise_naming_the_problem(call, match):
    with pytest.raises(RuntimeError, match=match):
        call(torch.randn(4, 3))


def test_torch_neuron_comm_mirrors_torch_cuda_comm():
    for name in ("broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced", "scatter", "gather"):
        assert getattr(torch.neuron.comm, name) is getattr(comm, name)
