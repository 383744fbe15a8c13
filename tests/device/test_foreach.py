"""In-place ``_foreach_*_`` ops on neuron: one kernel over the whole list (csrc/backend/foreach.cpp),
bit for bit what CPU's per-tensor slow path computes. The oracle is the same call on CPU."""

import pytest
import torch

import torchneuron

SIZES = (3, 17, 64, 1)


def lists(k: int, seed: int = 0, dtype=torch.float32, positive: bool = False):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        ts = [torch.randn(n, generator=gen, dtype=dtype) for n in SIZES]
        out.append([t.abs() + 0.5 for t in ts] if positive else ts)
    return out


def on_neuron(ts):
    return [t.to("neuron") for t in ts]


# name -> (call(lists, device), number of lists, positive inputs)
CASES = {
    "add_.List alpha": (lambda ls, d: torch._foreach_add_(ls[0], ls[1], alpha=0.5), 2, False),
    "add_.Scalar": (lambda ls, d: torch._foreach_add_(ls[0], 1.25), 1, False),
    "add_.ScalarList": (lambda ls, d: torch._foreach_add_(ls[0], [0.5, -1.0, 2.0, 3.0]), 1, False),
    "add_.Tensor": (lambda ls, d: torch._foreach_add_(ls[0], torch.tensor(0.75, device=d), alpha=2), 1, False),
    "sub_.List": (lambda ls, d: torch._foreach_sub_(ls[0], ls[1]), 2, False),
    "mul_.List": (lambda ls, d: torch._foreach_mul_(ls[0], ls[1]), 2, False),
    "mul_.Scalar": (lambda ls, d: torch._foreach_mul_(ls[0], 0.999), 1, False),
    "mul_.Tensor": (lambda ls, d: torch._foreach_mul_(ls[0], torch.tensor(1.5, device=d)), 1, False),
    "div_.ScalarList": (lambda ls, d: torch._foreach_div_(ls[0], [3.0, 7.0, 0.5, 9.0]), 1, False),
    "div_.List": (lambda ls, d: torch._foreach_div_(ls[0], ls[1]), 2, True),
    "addcmul_.Scalar": (lambda ls, d: torch._foreach_addcmul_(ls[0], ls[1], ls[2], value=0.1), 3, False),
    "addcmul_.ScalarList": (lambda ls, d: torch._foreach_addcmul_(ls[0], ls[1], ls[2], [0.1, 0.2, 0.3, 0.4]), 3, False),
    "addcdiv_.ScalarList": (lambda ls, d: torch._foreach_addcdiv_(ls[0], ls[1], ls[2], [-1e-3, 2e-3, 1.0, 5.0]), 3, True),
    "lerp_.Scalar": (lambda ls, d: torch._foreach_lerp_(ls[0], ls[1], 0.1), 2, False),
    "lerp_.List": (lambda ls, d: torch._foreach_lerp_(ls[0], ls[1], ls[2]), 3, False),
    "sqrt_": (lambda ls, d: torch._foreach_sqrt_(ls[0]), 1, True),
    "exp_": (lambda ls, d: torch._foreach_exp_(ls[0]), 1, False),
    "neg_": (lambda ls, d: torch._foreach_neg_(ls[0]), 1, False),
    "zero_": (lambda ls, d: torch._foreach_zero_(ls[0]), 1, False),
    "clamp_min_.Scalar": (lambda ls, d: torch._foreach_clamp_min_(ls[0], 0.0), 1, False),
    "maximum_.List": (lambda ls, d: torch._foreach_maximum_(ls[0], ls[1]), 2, False),
    "copy_": (lambda ls, d: torch._foreach_copy_(ls[0], ls[1]), 2, False),
    "pow_.Scalar": (lambda ls, d: torch._foreach_pow_(ls[0], 2.0), 1, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inplace_foreach_op_matches_cpu_bit_for_bit(name):
    call, k, positive = CASES[name]
    cpu = lists(k, positive=positive)
    dev = [on_neuron(ts) for ts in cpu]
    call(cpu, "cpu")
    call(dev, "neuron")
    for want, got in zip(cpu[0], dev[0]):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_a_foreach_op_runs_as_one_kernel_not_one_per_tensor():
    a, b = (on_neuron(ts) for ts in lists(2))
    torchneuron.clear_op_tracking()
    torch._foreach_add_(a, b, alpha=0.5)
    ops = torchneuron.get_executed_ops()
    assert ops.get("aten::_foreach_add_.List") == 1
    assert "aten::add_.Tensor" not in ops


def test_bf16_lists_match_cpu():
    cpu = lists(3, dtype=torch.bfloat16)
    dev = [on_neuron(ts) for ts in cpu]
    for ls in (cpu, dev):
        torch._foreach_addcmul_(ls[0], ls[1], ls[2], value=0.5)
        torch._foreach_lerp_(ls[0], ls[1], 0.25)
    for want, got in zip(cpu[0], dev[0]):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_a_list_spanning_two_devices_takes_the_per_tensor_path():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices")
    cpu = lists(2)
    devs = [[t.to(f"neuron:{i % 2}") for i, t in enumerate(ts)] for ts in cpu]
    torch._foreach_add_(cpu[0], cpu[1])
    torchneuron.clear_op_tracking()
    torch._foreach_add_(devs[0], devs[1])
    assert torchneuron.get_executed_ops().get("aten::add_.Tensor") == len(SIZES)
    for want, got in zip(cpu[0], devs[0]):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_copying_a_list_of_cpu_tensors_into_neuron_ones_works():
    src = lists(1)[0]
    dst = [torch.zeros_like(t, device="neuron") for t in src]
    torch._foreach_copy_(dst, src)
    for want, got in zip(src, dst):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_a_device_mismatch_between_lists_raises_as_on_cpu():
    a = on_neuron(lists(1)[0])
    b = lists(1, seed=1)[0]
    with pytest.raises(RuntimeError):
        torch._foreach_add_(a, b)


def test_every_inplace_foreach_op_has_a_neuron_kernel():
    names = ["aten::_foreach_add_.List", "aten::_foreach_addcdiv_.ScalarList", "aten::_foreach_lerp_.Scalar",
             "aten::_foreach_sqrt_", "aten::_foreach_zero_"]
    for name in names:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1"), name
    # functional foreach ops keep the per-tensor path (each result queued on its own), except
    # _foreach_sqrt (below)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_foreach_exp", "PrivateUse1")


# ---- functional _foreach_sqrt: one kernel, results from the device pool ----------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_foreach_sqrt_matches_cpu_bit_for_bit(dtype):
    # Sizes below and above ATen's 2,048-element grain, one empty; negative values give NaN.
    gen = torch.Generator().manual_seed(4)
    cpu = [torch.randn(n, generator=gen).to(dtype) for n in (1, 256, 5000, 0, 40003)]
    want = torch._foreach_sqrt(cpu)
    got = torch._foreach_sqrt(on_neuron(cpu))
    for w, g in zip(want, got):
        assert g.device.type == "neuron" and g.dtype == dtype and g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0, equal_nan=True)


def test_foreach_sqrt_runs_as_one_kernel_and_leaves_its_inputs():
    x = on_neuron(lists(1, positive=True)[0])
    before = [t.cpu() for t in x]
    torchneuron.clear_op_tracking()
    out = torch._foreach_sqrt(x)
    ops = torchneuron.get_executed_ops()
    assert ops.get("aten::_foreach_sqrt") == 1 and "aten::sqrt" not in ops
    for t, b, o in zip(x, before, out):
        assert torch.equal(t.cpu(), b) and o.data_ptr() != t.data_ptr()


def test_foreach_sqrt_of_strided_or_integer_elements_matches_cpu():
    # Not the one-kernel case: the per-tensor path, with CPU's result layouts and dtypes.
    base = torch.rand(6, 8) + 0.5
    dev_base = base.to("neuron")
    ints = [torch.arange(5), torch.arange(3)]
    for cpu, dev in (([base.t(), base[:, ::2], base], [dev_base.t(), dev_base[:, ::2], dev_base]),
                     (ints, [t.to("neuron") for t in ints])):
        want = torch._foreach_sqrt(cpu)
        got = torch._foreach_sqrt(dev)
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and g.stride() == w.stride()
            torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


def test_foreach_sqrt_of_an_empty_list_raises_as_on_cpu():
    with pytest.raises(RuntimeError, match="at least one tensor"):
        torch._foreach_sqrt([])


def test_foreach_sqrt_of_a_list_mixing_devices_computes_each_on_its_own():
    # as the per-tensor path does on any device
    a, b = torch.rand(3) + 0.5, torch.rand(4) + 0.5
    got = torch._foreach_sqrt([a.to("neuron"), b])
    assert got[0].device.type == "neuron" and got[1].device.type == "cpu"
    torch.testing.assert_close(got[0].cpu(), a.sqrt(), rtol=0, atol=0)
    torch.testing.assert_close(got[1], b.sqrt(), rtol=0, atol=0)


def test_foreach_sqrt_queued_reads_its_inputs_in_stream_order():
    engine = torch.neuron.engine
    was = engine.is_enabled()
    engine.set_enabled(True)
    try:
        x = on_neuron(lists(1, positive=True)[0])
        want = torch._foreach_sqrt([t.cpu() * 4.0 for t in x])
        torch._foreach_mul_(x, 4.0)    # queued before the sqrt
        out = torch._foreach_sqrt(x)
        torch._foreach_add_(x, 100.0)  # queued behind it
        for w, o in zip(want, out):
            torch.testing.assert_close(o.cpu(), w, rtol=0, atol=0)
    finally:
        torch.neuron.synchronize()
        engine.set_enabled(was)


def test_foreach_sqrt_backward_matches_cpu():
    cpu = [t.requires_grad_() for t in lists(1, positive=True)[0]]
    dev = [t.detach().to("neuron").requires_grad_() for t in cpu]
    for ts in (cpu, dev):
        sum(o.sum() for o in torch._foreach_sqrt(ts)).backward()
    for c, d in zip(cpu, dev):
        torch.testing.assert_close(d.grad.cpu(), c.grad, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_adamw_foreach_step_matches_cpu_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    twin.load_state_dict(model.state_dict())
    twin.to("neuron")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (model, twin)]
    x = torch.randn(8, 16)
    for _ in range(3):
        for m, opt, inp in ((model, opts[0], x), (twin, opts[1], x.to("neuron"))):
            opt.zero_grad()
            # Small GELUs on neuron run ATen's kernel, as CPU does with oneDNN off
            # (tests/device/test_gelu_route.py).
            with torch.backends.mkldnn.flags(enabled=False):
                m(inp).square().mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q.cpu(), p, rtol=0, atol=0)


@pytest.mark.parametrize("engine_on", [True, False], ids=["queued", "synchronous"])
def test_long_lists_of_views_of_one_buffer_and_repeated_tensors_match_cpu(engine_on):
    # 40 views of 20 buffers (their first halves, then their second halves: each storage met
    # again after 20 others, as flattened parameters are) and a list given twice: past 16
    # tensors the alias lookups go through an index (zero_copy.h), which must still give each
    # storage one alias and each tensor one (x.addcmul_(g, g) reads g twice).
    def run(device):
        gen = torch.Generator().manual_seed(5)
        flats = [torch.randn(66, generator=gen).to(device) for _ in range(20)]
        views = [f[:33] for f in flats] + [f[33:] for f in flats]
        grads = [torch.randn(33, generator=gen).to(device) for _ in range(40)]
        torch._foreach_mul_(views, 0.9)
        torch._foreach_addcmul_(views, grads, grads, value=0.5)
        torch._foreach_add_(grads, grads, alpha=-0.25)
        torch._foreach_lerp_(views, grads, 0.3)
        return torch.cat([f.cpu() for f in flats]), torch.cat([g.cpu() for g in grads])

    was = torch.neuron.engine.is_enabled()
    torch.neuron.engine.set_enabled(engine_on)
    try:
        got = run("neuron")
    finally:
        torch.neuron.engine.set_enabled(was)
    want = run("cpu")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_partial_overlap_inside_a_long_list_raises_as_on_cpu():
    # Element 20 + k adds f_k[32:65] into f_k[33:66]: CPU's per-tensor op refuses the partial
    # overlap; neuron must see it too although the buffer is met again past the alias index's
    # threshold (one alias storage per device storage, zero_copy.h).
    def run(device):
        gen = torch.Generator().manual_seed(6)
        flats = [torch.randn(66, generator=gen).to(device) for _ in range(20)]
        fresh = [torch.randn(33, generator=gen).to(device) for _ in range(20)]
        selfs = [f[:33] for f in flats] + [f[33:] for f in flats]
        others = fresh + [f[32:65] for f in flats]
        torch._foreach_add_(selfs, others)

    with pytest.raises(RuntimeError, match="single memory location"):
        run("cpu")
    with pytest.raises(RuntimeError, match="single memory location"):
        run("neuron")
        torch.neuron.synchronize()
