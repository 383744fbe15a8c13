"""Neuron tensors across processes (torch.multiprocessing), zero-copy, with CUDA's rules.

The test process is the producer; a consumer process per start method (spawn, forkserver)
receives tensors and answers with CPU data (ipc_consumer.py). CPU tensors are the oracle.
"""

import multiprocessing
import os
import pickle
import sys
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.utils.data import DataLoader

import torchneuron

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ipc_consumer import Consumer, NeuronRows  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")


PROCESS_ARGUMENT = torch.arange(6.0).reshape(2, 3)


@pytest.fixture(scope="module", params=["spawn", "forkserver"])
def consumer(request):
    c = Consumer(request.param, PROCESS_ARGUMENT.to("neuron:1"))
    yield c
    c.stop()


@pytest.fixture
def key(request):
    return request.node.name


def allocated() -> int:
    torch.neuron.ipc_collect()
    return torch.neuron.memory_allocated()


# ---- sharing ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex64])
def test_tensor_arrives_on_the_same_device_with_its_values(consumer, key, dtype):
    x = (torch.arange(24) - 7).reshape(4, 6).to(dtype)
    device, got = consumer.call("hold", key, x.to("neuron"))
    assert device == "neuron:0"
    torch.testing.assert_close(got, x)
    consumer.call("release", key)


def test_views_arrive_with_their_offset_and_strides(consumer, key):
    x = torch.arange(48.0).reshape(6, 8)
    view = x.to("neuron")[1:5:2, 3:].t()
    device, got = consumer.call("hold", key, view)
    torch.testing.assert_close(got, x[1:5:2, 3:].t())
    consumer.call("release", key)


def test_tensor_on_another_device_index_arrives_there(consumer, key):
    device, got = consumer.call("hold", key, torch.arange(5.0, device="neuron:2"))
    assert device == "neuron:2"
    torch.testing.assert_close(got, torch.arange(5.0))
    consumer.call("release", key)


def test_process_arguments_carry_neuron_tensors(consumer):
    device, got = consumer.call("read", "argument")
    assert device == "neuron:1"
    torch.testing.assert_close(got, PROCESS_ARGUMENT)


def test_untyped_storage_crosses_too(consumer, key):
    x = torch.arange(6, dtype=torch.uint8)
    device, got = consumer.call("hold", key, x.to("neuron").untyped_storage())
    assert device == "neuron:0" and got == bytes(x.tolist())
    consumer.call("release", key)


def test_empty_tensor_crosses(consumer, key):
    device, got = consumer.call("hold", key, torch.empty(0, 3, device="neuron"))
    assert device == "neuron:0" and got.shape == (0, 3)
    consumer.call("release", key)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_sparse_tensors_cross(consumer, key, layout):
    x = torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 4.0]])
    device, got = consumer.call("hold", key, x.to("neuron").to_sparse(layout=layout))
    assert device == "neuron:0" and got.layout == layout
    torch.testing.assert_close(got.to_dense(), x)
    consumer.call("release", key)


def test_pipe_carries_tensors(consumer, key):
    x = torch.arange(10.0)
    consumer.pipe.send(x.to("neuron"))
    device, got = consumer.call("hold_from_pipe", key)
    torch.testing.assert_close(got, x)
    consumer.call("release", key)


def test_consumer_writes_are_seen_by_the_producer(consumer, key):
    x = torch.arange(8.0, device="neuron")
    consumer.call("hold", key, x)
    consumer.call("add_", key, 100.0)
    torch.testing.assert_close(x.cpu(), torch.arange(8.0) + 100)
    consumer.call("release", key)


def test_producer_writes_are_seen_by_the_consumer(consumer, key):
    x = torch.zeros(8, device="neuron")
    consumer.call("hold", key, x)
    x[2:5] = 7.0
    torch.neuron.synchronize()  # the consumer reads it next (as on CUDA, with the engine on)
    torch.testing.assert_close(consumer.call("read", key)[1], x.cpu())
    consumer.call("release", key)


def test_a_storage_sent_twice_is_one_storage_in_the_consumer(consumer, key):
    x = torch.arange(8.0, device="neuron")
    consumer.call("hold", key + "a", x[:4])
    consumer.call("hold", key + "b", x[2:])
    assert consumer.call("same_memory", key + "a", key + "b")
    consumer.call("release", key + "a")
    consumer.call("release", key + "b")


# ---- lifetime and memory stats --------------------------------------------------------------

def test_data_stays_valid_after_the_producer_drops_it(consumer, key):
    """CUDA's rule: the producer keeps a shared block until its consumers release it, so the
    caching allocator cannot hand it out again while a consumer reads it."""
    x = torch.arange(1024.0, device="neuron")
    consumer.call("hold", key, x)
    del x
    # Same-sized allocations would reuse the block if the producer had freed it.
    reuse = [torch.full((1024,), -1.0, device="neuron") for _ in range(8)]
    device, got = consumer.call("read", key)
    torch.testing.assert_close(got, torch.arange(1024.0))
    consumer.call("release", key)
    del reuse


def test_producer_counts_shared_memory_until_consumers_release_it(consumer, key):
    base = allocated()
    x = torch.ones(4096, device="neuron")
    size = torch.neuron.memory_allocated() - base
    consumer.call("hold", key, x)
    del x
    assert allocated() - base == size  # still allocated: the consumer holds it
    consumer.call("release", key)
    assert allocated() == base


def test_consumer_does_not_count_memory_it_received(consumer, key):
    before = consumer.call("memory_allocated")
    consumer.call("hold", key, torch.ones(4096, device="neuron"))
    assert consumer.call("memory_allocated") == before
    consumer.call("release", key)


def test_producer_result_of_a_cpu_kernel_is_shared_too(consumer, key):
    """Fresh CPU-kernel results are adopted host memory; sharing moves them into device
    memory once, in place, and the producer's tensor keeps seeing the shared bytes."""
    x = torch.arange(16.0, device="neuron").cumsum(0)
    consumer.call("hold", key, x)
    consumer.call("add_", key, 1.0)
    torch.testing.assert_close(x.cpu(), torch.arange(16.0).cumsum(0) + 1)
    consumer.call("release", key)


# ---- errors -------------------------------------------------------------------------------

def test_sending_a_received_tensor_on_is_refused_at_the_receiver(consumer, key):
    consumer.call("hold", key, torch.ones(3, device="neuron"))
    with pytest.raises(RuntimeError, match="received from another process.*Consider cloning"):
        consumer.call("send_back", key)
    consumer.call("release", key)


def test_received_storage_cannot_grow(consumer, key):
    consumer.call("hold", key, torch.ones(3, device="neuron"))
    with pytest.raises(AssertionError, match="not resizable"):
        consumer.call("resize", key, 1 << 20)
    consumer.call("release", key)


def test_queue_feeder_errors_reach_the_receiver_instead_of_hanging():
    q = multiprocessing.get_context("spawn").Queue()
    q.put(torch.ones(2, device="neuron", requires_grad=True) * 2)  # pickled in the feeder thread
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor"):
        q.get(timeout=30)
    q.close()


def _receive_in_forked_child(conn):
    try:
        conn.recv()
        conn.send("received")
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")


def test_forked_child_of_an_initialised_parent_cannot_receive():
    torch.ones(1, device="neuron")  # the parent has initialised the device
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_receive_in_forked_child, args=(child,))
    p.start()
    parent.send(torch.ones(3, device="neuron"))
    assert parent.poll(60)
    msg = parent.recv()
    p.join(timeout=30)
    assert msg.startswith("RuntimeError") and "forked subprocess" in msg and "spawn" in msg


def test_receiver_without_the_device_index_gets_a_clear_error():
    """A consumer that sees fewer devices (NEURON_RT_VISIBLE_CORES) than the producer."""
    missing = torch.neuron.device_count()
    with pytest.raises(RuntimeError, match=f"Cannot receive a tensor on neuron:{missing} from "
                                           f"another process: Invalid device index"):
        torchneuron._C._ipc_import(missing, 0, 0, 8, 0)  # checked before anything is mapped


# ---- same process: the mechanism without a second interpreter ------------------------------

def test_neuron_tensors_report_shared_memory_as_cuda_tensors_do():
    assert torch.ones(2, device="neuron").is_shared()
    assert torch.ones(2, device="neuron").share_memory_().is_shared()
    assert not torch.ones(2).is_shared()  # CPU unchanged: not in shared memory until shared



def test_round_trip_in_one_process_maps_the_same_memory():
    x = torch.arange(4.0, device="neuron")
    y = pickle.loads(bytes(ForkingPickler.dumps(x)))
    assert y.data_ptr() != x.data_ptr()  # a second mapping of the same pages
    y.add_(1)
    torch.testing.assert_close(x.cpu(), torch.arange(4.0) + 1)


def test_limbo_empties_when_the_last_consumer_releases():
    x = torch.arange(4.0, device="neuron")
    y = pickle.loads(bytes(ForkingPickler.dumps(x)))
    torch.neuron.ipc_collect()
    waiting = torchneuron._C._ipc_limbo_size()
    del x
    torch.neuron.ipc_collect()
    assert torchneuron._C._ipc_limbo_size() == waiting + 1
    del y
    torch.neuron.ipc_collect()
    assert torchneuron._C._ipc_limbo_size() == waiting


# ---- DataLoader workers --------------------------------------------------------------------

def test_spawned_dataloader_workers_may_return_neuron_tensors():
    loader = DataLoader(NeuronRows(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    batches = list(loader)
    assert [b.device.type for b in batches] == ["neuron", "neuron"]
    torch.testing.assert_close(torch.cat([b.cpu() for b in batches]),
                               torch.arange(4.0).repeat_interleave(3).reshape(4, 3))


def test_forked_dataloader_workers_cannot_use_an_initialised_device():
    torch.ones(1, device="neuron")
    loader = DataLoader(NeuronRows(), batch_size=2, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match="forked subprocess"):
        list(loader)
