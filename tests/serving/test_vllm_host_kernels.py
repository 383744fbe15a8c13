"""vLLM's host-code kernels (catch-all C++ kernels and Python replacements of its Triton kernels)
on neuron tensors run after the device's queued kernels (torchneuron/vllm/host_kernels.py)."""

import pytest
import torch

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def ordered():
    import vllm._C  # noqa: F401  (registers vLLM's CPU kernels)

    from torchneuron.vllm.host_kernels import order_after_queue

    return order_after_queue()


def _pending() -> bool:
    stats = torch.neuron.engine.stats()
    return stats["enqueued"] > stats["executed"]


def test_slot_mapping_reads_positions_that_queued_kernels_write(ordered, engine_on):
    block_size = 4
    query_start = torch.tensor([0, 3, 5], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 5, 6], dtype=torch.int64)
    block_table = torch.tensor([[7, 8], [2, 9]], dtype=torch.int32)
    expected = torch.full((8,), -7, dtype=torch.int64)
    torch.ops._C.compute_slot_mapping_kernel_impl(query_start, positions, block_table, expected, block_size)

    dev_positions = torch.zeros(5, dtype=torch.int64, device="neuron")
    source = positions.to("neuron")
    dev_start, dev_table = query_start.to("neuron"), block_table.to("neuron")
    slots = torch.full((8,), -7, dtype=torch.int64, device="neuron")
    torch.neuron.synchronize()
    dev_positions.copy_(source)  # a device-to-device copy: queued
    assert _pending()
    torch.ops._C.compute_slot_mapping_kernel_impl(dev_start, dev_positions, dev_table, slots, block_size)
    assert torch.equal(slots.cpu(), expected)


def test_python_replacements_of_triton_kernels_run_after_the_queue(ordered, engine_on):
    from vllm.utils import cpu_triton_utils

    src = torch.zeros(64, device="neuron")
    dst = torch.zeros(64, device="neuron")
    new = torch.arange(64.0, device="neuron")
    torch.neuron.synchronize()
    src.copy_(new)  # queued
    assert _pending()
    pointers = lambda t: torch.tensor([t.data_ptr()], dtype=torch.int64)  # noqa: E731
    cpu_triton_utils._batch_memcpy_impl(pointers(src), pointers(dst), torch.tensor([256]))
    assert torch.equal(dst.cpu(), torch.arange(64.0))


def test_only_catch_all_kernels_over_tensors_get_a_neuron_kernel(ordered):
    from torchneuron.vllm.host_kernels import order_after_queue

    assert {"_C::compute_slot_mapping_kernel_impl", "_C::cpu_attention_with_kv_cache",
            "_C::cpu_attn_reshape_and_cache"} <= set(ordered)
    assert "_C::rms_norm" not in ordered  # a CPU kernel: reaches the neuron fallback, which waits
    assert "_C::cpu_attn_has_isa" not in ordered  # no tensors
    assert order_after_queue() == ordered  # idempotent
