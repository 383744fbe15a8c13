"""Nested neuron tensors (torch.nested) over CPU nested kernels; CPU is the oracle."""

import pytest
import torch

import torchneuron

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")


def components(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 8, generator=g, dtype=dtype), torch.randn(5, 8, generator=g, dtype=dtype),
            torch.randn(3, 8, generator=g, dtype=dtype)]


def strided(device, seed=0):
    return torch.nested.nested_tensor(components(seed), device=device)


def assert_same_nested(neuron, cpu):
    assert neuron.is_nested and neuron.device.type == "neuron"
    got, want = neuron.cpu().unbind(), cpu.unbind()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_transformer_encoder_fast_path_with_padding_mask_is_cpus():
    """nn.TransformerEncoder in inference with a key padding mask packs the batch as a nested
    tensor (its fast path) and unpacks it with to_padded_tensor."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 5, 16)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 2 + [True] * 3])
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=mask)
        got = enc.to("neuron")(x.to("neuron"), src_key_padding_mask=mask.to("neuron"))
    assert got.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-6)


def test_to_padded_tensor_is_cpus():
    got = strided("neuron").to_padded_tensor(-1.0)
    assert got.device.type == "neuron"
    assert torch.equal(got.cpu(), strided("cpu").to_padded_tensor(-1.0))


def test_nested_from_mask_and_padded_roundtrip():
    x = torch.randn(3, 4, 6)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    got = torch._nested_tensor_from_mask(x.to("neuron"), mask.to("neuron"))
    assert_same_nested(got, torch._nested_tensor_from_mask(x, mask))
    assert torch.equal(got.to_padded_tensor(0.0).cpu(), torch._nested_tensor_from_mask(x, mask).to_padded_tensor(0.0))


def test_pointwise_and_reduction_results_are_cpus():
    a, b = strided("neuron", 0), strided("neuron", 1)
    ca, cb = strided("cpu", 0), strided("cpu", 1)
    assert_same_nested(a + b * 2, ca + cb * 2)
    assert_same_nested(torch.nn.functional.gelu(a).sin(), torch.nn.functional.gelu(ca).sin())
    assert_same_nested(a.softmax(-1), ca.softmax(-1))
    assert_same_nested(a.sum(-1, keepdim=True), ca.sum(-1, keepdim=True))


def test_matmul_and_linear_are_cpus():
    """matmul and linear have NestedTensorCPU kernels that override their decomposition."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    w = torch.randn(8, 3)
    ca = strided("cpu")
    a = ca.to("neuron")
    assert_same_nested(lin.to("neuron")(a), lin.cpu()(ca))
    wn = torch.nested.nested_tensor([w, w, w], device="neuron")
    assert_same_nested(torch.matmul(a, wn), torch.matmul(ca, torch.nested.nested_tensor([w, w, w])))


@pytest.mark.parametrize("inference", [False, True], ids=["grad_mode", "inference_mode"])
def test_in_place_op_returns_the_argument_and_writes_device_memory(inference):
    """A boxed call under inference mode (no autograd or view kernel above the neuron one)
    returns what the kernel returns."""
    with torch.inference_mode(inference):
        a = strided("neuron")
        ptr = a.untyped_storage().data_ptr()
        r = torch.ops.aten.mul_.Scalar(a, 3.0)
    assert r is a
    assert a.untyped_storage().data_ptr() == ptr
    assert_same_nested(a, strided("cpu").mul_(3.0))


def test_views_share_the_device_storage():
    a = strided("neuron")
    t = a.transpose(1, 2)
    assert t.is_nested and t.device.type == "neuron"
    assert t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    first = a.unbind()[0]  # a dense view of the nested storage
    assert first.device.type == "neuron"
    first.fill_(7.0)
    assert torch.equal(a.to_padded_tensor(0.0)[0, :2].cpu(), torch.full((2, 8), 7.0))
    assert torch.equal(t.unbind()[0].cpu(), torch.full((8, 2), 7.0))


def test_to_moves_between_devices_and_dtypes():
    a = strided("neuron")
    back = a.to("cpu")
    assert back.is_nested and back.device.type == "cpu"
    assert_same_nested(a, back)
    half = a.to(torch.float64)
    assert half.device.type == "neuron" and half.dtype == torch.float64
    assert_same_nested(half, strided("cpu").to(torch.float64))


def test_copy_from_a_cpu_nested_tensor():
    a = strided("neuron", 0)
    a.copy_(strided("cpu", 1))
    assert_same_nested(a, strided("cpu", 1))


def test_empty_like_and_ones_like_stay_on_the_device_or_go_where_asked():
    a = strided("neuron")
    assert torch.ones_like(a).device.type == "neuron"
    assert_same_nested(torch.ones_like(a), torch.ones_like(strided("cpu")))
    moved = torch.empty_like(a, device="cpu")
    assert moved.is_nested and moved.device.type == "cpu"


def test_metadata_accessors_return_cpu_tensors_as_on_cuda():
    a = strided("neuron")
    sizes = a._nested_tensor_size()
    assert sizes.device.type == "cpu"
    assert sizes.tolist() == [[2, 8], [5, 8], [3, 8]]
    assert a._nested_tensor_storage_offsets().tolist() == [0, 16, 56]


def nested_dropout(neuron_seed, cpu_seed):
    a = torch.nested.nested_tensor([torch.ones(3, 4), torch.ones(5, 4)], device="neuron")
    torch.neuron.manual_seed(neuron_seed)
    torch.default_generator.manual_seed(cpu_seed)  # CPU's generator alone
    out = torch.nn.functional.dropout(a, 0.5, training=True)
    return torch.cat([t.reshape(-1) for t in out.cpu().unbind()])


def test_dropout_draws_from_the_neuron_generator():
    """The nested dropout drops the buffer's elements as the dense neuron kernel does with
    the same seed, whatever CPU's generator holds."""
    torch.neuron.manual_seed(7)
    want = torch.nn.functional.dropout(torch.ones(32, device="neuron"), 0.5, training=True).cpu()
    assert torch.equal(nested_dropout(7, 1), want)
    assert torch.equal(nested_dropout(7, 2), want)
    assert not torch.equal(nested_dropout(8, 1), want)


def test_normal_draws_from_the_neuron_generator():
    a = torch.nested.nested_tensor([torch.zeros(3, 4), torch.zeros(5, 4)], device="neuron")
    torch.neuron.manual_seed(3)
    a.normal_()
    torch.neuron.manual_seed(3)
    want = torch.empty(32, device="neuron").normal_()
    assert torch.equal(torch.cat([t.reshape(-1) for t in a.cpu().unbind()]), want.cpu())


def test_autograd_through_nested_ops_matches_cpu():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    grads = {}
    for device in ("cpu", "neuron"):
        comps = [c.to(device).requires_grad_() for c in components()]
        nt = torch.nested.as_nested_tensor(comps)
        m = lin.to(device)
        m.zero_grad()
        out = torch.nn.functional.relu(m(nt)).to_padded_tensor(0.0).sum()
        out.backward()
        grads[device] = [t.to("cpu", copy=True) for t in [*(c.grad for c in comps), m.weight.grad]]
    for a, b in zip(grads["neuron"], grads["cpu"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_jagged_attention_through_the_strided_layout_is_cpus():
    """The jagged layout's math attention converts to the strided layout on the way."""
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(2, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g)]
    out = {}
    for device in ("cpu", "neuron"):
        q = torch.nested.nested_tensor([t.to(device) for t in qs], layout=torch.jagged).transpose(1, 2)
        out[device] = torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2)
    for a, b in zip(out["neuron"].unbind(), out["cpu"].unbind()):
        assert a.device.type == "neuron"
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=1e-6)


def test_nested_ops_see_queued_writes():
    """A nested op over a buffer that queued kernels write reads their results (the engine's
    queue runs before the CPU kernel reads the aliases)."""
    buf = torch.zeros(40, device="neuron")
    for _ in range(5):
        buf.add_(1.0)
    nt = torch._nested_view_from_buffer(buf, torch.tensor([[2, 8], [3, 8]]), torch.tensor([[8, 1], [8, 1]]),
                                        torch.tensor([0, 16]))
    assert nt.device.type == "neuron"
    assert torch.equal(nt.to_padded_tensor(0.0).cpu()[1, :3], torch.full((3, 8), 5.0))


def test_a_cpu_nested_operand_is_rejected():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        strided("neuron") + strided("cpu")


def test_every_nested_cpu_kernel_has_a_neuron_route():
    """Registered per op, not only through the key's fallback: a nested key gets an op's
    CompositeImplicitAutograd kernel before the fallback, where CPU has its own nested one."""
    missing = [name for name in torch._C._dispatch_get_all_op_names()
               if name.startswith("aten::")
               and torch._C._dispatch_has_kernel_for_dispatch_key(name, "NestedTensorCPU")
               and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "NestedTensorPrivateUse1")]
    assert missing == []


def test_generic_nested_ops_are_nested_cpu_ops():
    for name in torchneuron._C._nested_generic_ops():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "NestedTensorCPU"), name
