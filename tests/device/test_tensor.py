"""Tensor semantics on neuron: zero-copy, views and aliases, in-place, out=, conj/neg bits,
copies across devices, device checks, op tracking."""

import pytest
import torch

import torchneuron


def test_ops_run_zero_copy_over_device_memory():
    x = torch.zeros(16, device="neuron")
    ptr = x.data_ptr()
    x.add_(1)
    torch.mul(x, 2, out=x)
    assert x.data_ptr() == ptr
    assert torch.equal(x.cpu(), torch.full((16,), 2.0))


def test_view_shares_storage_and_in_place_on_view_updates_base():
    base = torch.zeros(4, 4, device="neuron")
    view = base[1:3, ::2]
    view.add_(5)
    expected = torch.zeros(4, 4)
    expected[1:3, ::2] += 5
    assert torch.equal(base.cpu(), expected)
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert view._base is base


def test_view_ops_keep_aliasing():
    x = torch.arange(12.0, device="neuron")
    for v in (x.view(3, 4), x.reshape(4, 3), x.view(3, 4).t(), x.unflatten(0, (2, 6)), x[::3],
              x.as_strided((2, 2), (1, 3)), x.view(3, 4).diagonal(), x.unfold(0, 4, 2)):
        assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_out_variant_resizes_the_device_output():
    a = torch.randn(3, 5)
    out = torch.empty(0, device="neuron")
    torch.cumsum(a.to("neuron"), 0, out=out)
    assert out.shape == (3, 5) and out.device.type == "neuron"
    torch.testing.assert_close(out.cpu(), torch.cumsum(a, 0))


def test_out_variant_resize_is_seen_by_other_views_of_the_storage():
    out = torch.empty(2, device="neuron")
    torch.arange(10, out=out)
    assert torch.equal(out.cpu(), torch.arange(10.0))


def test_non_contiguous_inputs_match_cpu():
    a = torch.randn(6, 8)
    d = a.to("neuron")
    torch.testing.assert_close((d.t() @ d).cpu(), a.t() @ a)
    torch.testing.assert_close(d[:, ::2].exp().cpu(), a[:, ::2].exp())


def test_conj_and_neg_bits_are_respected():
    z = torch.randn(5, dtype=torch.complex64)
    dz = z.to("neuron")
    assert dz.conj().is_conj()
    torch.testing.assert_close(dz.conj().cpu(), z.conj())
    torch.testing.assert_close((dz.conj() * dz).cpu(), z.conj() * z)
    torch.testing.assert_close(dz.conj().imag.cpu(), z.conj().imag)  # neg bit
    torch.testing.assert_close(torch.view_as_real(dz.conj().resolve_conj()).cpu(),
                               torch.view_as_real(z.conj().resolve_conj()))
    back = z.conj().to("neuron")  # copy with the conj bit set: no recursion
    torch.testing.assert_close(back.cpu(), z.conj())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool,
                                   torch.complex64, torch.float8_e4m3fn])
def test_copies_round_trip_every_dtype(dtype):
    x = torch.randn(7, 3).to(dtype)
    assert torch.equal(x.to("neuron").cpu().view(torch.uint8) if dtype.is_floating_point and dtype.itemsize == 1
                       else x.to("neuron").cpu(), x.view(torch.uint8) if dtype.is_floating_point and dtype.itemsize == 1 else x)


def test_copy_between_devices_and_dtypes():
    x = torch.randn(4, 4)
    a = x.to("neuron:0")
    b = a.to("neuron:1")
    assert b.device == torch.device("neuron:1")
    assert torch.equal(b.cpu(), x)
    c = torch.empty(4, 4, device="neuron:0", dtype=torch.float64)
    c.copy_(b)
    assert torch.equal(c.cpu(), x.double())
    d = torch.empty(4, 4)
    d.copy_(a.t())
    assert torch.equal(d, x.t())


def test_mixed_neuron_devices_are_rejected():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(2, device="neuron:0") + torch.ones(2, device="neuron:1")


def test_neuron_with_cpu_tensor_is_rejected_but_cpu_scalar_is_fine():
    with pytest.raises(RuntimeError, match="neuron:0 and cpu|cpu and neuron:0"):
        torch.ones(2, device="neuron") + torch.ones(2)
    with pytest.raises(RuntimeError, match="same device"):
        torch.mm(torch.ones(2, 2), torch.ones(2, 2, device="neuron"))
    out = torch.ones(2, device="neuron") + torch.tensor(3.0)
    assert torch.equal(out.cpu(), torch.full((2,), 4.0))


def test_indexing_with_cpu_indices_is_allowed():
    x = torch.arange(10.0, device="neuron")
    assert torch.equal(x[torch.tensor([1, 3])].cpu(), torch.tensor([1.0, 3.0]))
    x[torch.tensor([0])] = -1
    assert x[0].item() == -1


def test_indexing_and_scatter_match_cpu():
    x = torch.randn(8, 5)
    idx = torch.tensor([[0, 1, 2, 1, 0]] * 2)
    d = x.to("neuron")
    torch.testing.assert_close(d[d > 0].cpu(), x[x > 0])
    torch.testing.assert_close(d.gather(0, idx.to("neuron")).cpu(), x.gather(0, idx))
    torch.testing.assert_close(torch.zeros(3, 5, device="neuron").scatter_add_(0, idx.to("neuron"), d[:2]).cpu(),
                               torch.zeros(3, 5).scatter_add_(0, idx, x[:2]))
    d[:, 1] = 7
    x[:, 1] = 7
    assert torch.equal(d.cpu(), x)


def test_item_and_tolist_synchronize_values():
    x = torch.tensor([1.5, 2.5], device="neuron")
    assert x.sum().item() == 4.0
    assert x.tolist() == [1.5, 2.5]
    assert bool(x[0] > 1)


def test_autograd_through_the_device():
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(3, 2, requires_grad=True)
    xd = x.detach().to("neuron").requires_grad_()
    wd = w.detach().to("neuron").requires_grad_()
    (torch.tanh(x @ w) ** 2).mean().backward()
    (torch.tanh(xd @ wd) ** 2).mean().backward()
    torch.testing.assert_close(xd.grad.cpu(), x.grad)
    torch.testing.assert_close(wd.grad.cpu(), w.grad)


def test_inference_mode_views():
    with torch.inference_mode():
        x = torch.ones(4, 4, device="neuron")
        y = x[1:]
        y.mul_(2)
        assert x.sum().item() == 28


_TRAIN_AFTER_INFERENCE = """
import torch, torchneuron
import torch.nn.functional as F
q = torch.randn(1, 2, 4, 8).to("neuron").requires_grad_()
x = torch.randn(4, 8, device="neuron")
with torch.inference_mode():
    for _ in range(4):
        (x.sum(0) > 0).nonzero()  # a synchronous kernel: its aliases are made here
F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
print("GRAD", tuple(q.grad.shape))
"""


def test_training_after_inference_mode_work_in_the_same_thread():
    # kernels reuse their CPU alias tensors; one made under inference_mode is an inference
    # tensor for good, and SDPA's backend choice marks its aliases requires_grad (a process that
    # generated with vLLM, then trained: TRL's GRPO). A fresh process: the aliases are then the
    # ones made inside the inference_mode block.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _TRAIN_AFTER_INFERENCE], capture_output=True,
                          text=True, timeout=120)
    assert "GRAD (1, 2, 4, 8)" in proc.stdout, proc.stderr[-2000:]


def test_executed_ops_are_tracked_and_cleared():
    torchneuron.clear_op_tracking()
    a = torch.ones(3, device="neuron")
    (a + a).cumprod(0)
    ops = torchneuron.get_executed_ops()
    assert ops["aten::add.Tensor"] == 1
    assert "aten::cumprod.out" in ops
    assert "aten::cumprod.out" in torchneuron.get_fallback_ops()
    assert "aten::add.Tensor" not in torchneuron.get_fallback_ops()  # a hot op with its own kernel
    torchneuron.clear_op_tracking()
    assert torchneuron.get_executed_ops() == {}


def test_module_to_keeps_tied_weights_tied():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head}).to("neuron")
    assert model["emb"].weight is model["head"].weight
    assert model["emb"].weight.device.type == "neuron"


def test_param_data_assignment_across_devices():
    p = torch.nn.Parameter(torch.zeros(3))
    p.data = torch.ones(3, device="neuron")
    assert p.device.type == "neuron" and isinstance(p, torch.nn.Parameter)
    p.data = torch.full((3,), 2.0)
    assert p.device.type == "cpu" and p.sum().item() == 6
