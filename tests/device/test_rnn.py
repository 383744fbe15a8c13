"""nn.LSTM / nn.GRU / nn.RNN / nn.LSTMCell / nn.GRUCell on neuron, CPU as the oracle, forward and
backward: the cells through neuron's fused-cell kernels (``_thnn_fused_lstm_cell``,
``_thnn_fused_gru_cell`` and their backward, ATen's route for non-CPU inputs), the layers
through CPU's algorithms (torchneuron/kernels/rnn.py)."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from engine_steps import trains_without_waiting


def _pair(module):
    torch.manual_seed(0)
    cpu = module.double()
    dev = copy.deepcopy(cpu).to("neuron")
    return cpu, dev


def _grads(module):
    return {n: p.grad.cpu() for n, p in module.named_parameters()}


def _check_module(cpu, dev, x, hx=None, atol=1e-10):
    xc = x.clone().requires_grad_()
    xd = x.to("neuron").requires_grad_()
    if hx is None:
        oc, hc = cpu(xc)
        od, hd = dev(xd)
    else:
        hxd = tuple(h.to("neuron") for h in hx) if isinstance(hx, tuple) else hx.to("neuron")
        oc, hc = cpu(xc, hx)
        od, hd = dev(xd, hxd)
    assert od.device.type == "neuron"
    torch.testing.assert_close(od.cpu(), oc, atol=atol, rtol=1e-9)
    hc_list = hc if isinstance(hc, tuple) else (hc,)
    hd_list = hd if isinstance(hd, tuple) else (hd,)
    for a, b in zip(hd_list, hc_list):
        torch.testing.assert_close(a.cpu(), b, atol=atol, rtol=1e-9)
    loss_c = oc.square().sum() + sum(h.sum() for h in hc_list)
    loss_d = od.square().sum() + sum(h.sum() for h in hd_list)
    loss_c.backward()
    loss_d.backward()
    torch.testing.assert_close(xd.grad.cpu(), xc.grad, atol=atol, rtol=1e-9)
    gc, gd = _grads(cpu), _grads(dev)
    for name in gc:
        torch.testing.assert_close(gd[name], gc[name], atol=atol, rtol=1e-9, msg=name)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_lstm_forward_backward_match_cpu(num_layers, bidirectional):
    cpu, dev = _pair(nn.LSTM(5, 7, num_layers=num_layers, bidirectional=bidirectional))
    _check_module(cpu, dev, torch.randn(4, 3, 5, dtype=torch.double))


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_gru_forward_backward_match_cpu(num_layers, bidirectional):
    cpu, dev = _pair(nn.GRU(5, 7, num_layers=num_layers, bidirectional=bidirectional))
    _check_module(cpu, dev, torch.randn(4, 3, 5, dtype=torch.double))


def test_lstm_batch_first_with_initial_state_and_projection_matches_cpu():
    cpu, dev = _pair(nn.LSTM(5, 7, num_layers=2, batch_first=True, proj_size=3))
    hx = (torch.randn(2, 4, 3, dtype=torch.double), torch.randn(2, 4, 7, dtype=torch.double))
    _check_module(cpu, dev, torch.randn(4, 6, 5, dtype=torch.double), hx)


def test_gru_without_bias_matches_cpu():
    cpu, dev = _pair(nn.GRU(5, 7, bias=False, num_layers=2))
    _check_module(cpu, dev, torch.randn(4, 3, 5, dtype=torch.double), torch.randn(2, 3, 7, dtype=torch.double))


def test_lstm_without_bias_matches_cpu():
    cpu, dev = _pair(nn.LSTM(5, 7, bias=False))
    _check_module(cpu, dev, torch.randn(4, 3, 5, dtype=torch.double))


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_packed_sequences_match_cpu(kind):
    cpu, dev = _pair(kind(5, 6, num_layers=2, bidirectional=True))
    lengths = torch.tensor([5, 3, 2])
    x = torch.randn(5, 3, 5, dtype=torch.double)
    xc, xd = x.clone().requires_grad_(), x.to("neuron").requires_grad_()
    oc, _ = cpu(pack_padded_sequence(xc, lengths))
    od, _ = dev(pack_padded_sequence(xd, lengths))
    pc, _ = pad_packed_sequence(oc)
    pd, _ = pad_packed_sequence(od)
    torch.testing.assert_close(pd.cpu(), pc, atol=1e-10, rtol=1e-9)
    pc.sum().backward()
    pd.sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), xc.grad, atol=1e-10, rtol=1e-9)
    for (name, a), (_, b) in zip(cpu.named_parameters(), dev.named_parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-10, rtol=1e-9, msg=name)


@pytest.mark.parametrize("kind", [nn.LSTMCell, nn.GRUCell])
def test_cells_forward_backward_match_cpu(kind):
    torch.manual_seed(0)
    cpu = kind(4, 6).double()
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(3, 4, dtype=torch.double)
    xc, xd = x.clone().requires_grad_(), x.to("neuron").requires_grad_()
    outc, outd = cpu(xc), dev(xd)
    outc = outc if isinstance(outc, tuple) else (outc,)
    outd = outd if isinstance(outd, tuple) else (outd,)
    for a, b in zip(outd, outc):
        torch.testing.assert_close(a.cpu(), b, atol=1e-12, rtol=1e-10)
    sum(o.sin().sum() for o in outc).backward()
    sum(o.sin().sum() for o in outd).backward()
    torch.testing.assert_close(xd.grad.cpu(), xc.grad, atol=1e-12, rtol=1e-10)
    for (name, a), (_, b) in zip(cpu.named_parameters(), dev.named_parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-12, rtol=1e-10, msg=name)


def test_lstm_cell_runs_the_fused_neuron_kernels():
    # The route ATen takes for non-CPU inputs: the fused cell forward and its backward.
    cell = nn.LSTMCell(4, 6).to("neuron")
    x = torch.randn(3, 4, device="neuron", requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        h, c = cell(x)
        (h.sum() + c.sum()).backward()
    names = {e.name for e in prof.events()}
    assert "aten::_thnn_fused_lstm_cell" in names
    assert "aten::_thnn_fused_lstm_cell_backward_impl" in names


def test_gru_cell_runs_the_fused_neuron_kernels():
    cell = nn.GRUCell(4, 6).to("neuron")
    x = torch.randn(3, 4, device="neuron", requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cell(x).sum().backward()
    names = {e.name for e in prof.events()}
    assert "aten::_thnn_fused_gru_cell" in names
    assert "aten::_thnn_fused_gru_cell_backward" in names


def test_double_backward_through_lstm_cell_matches_cpu():
    # create_graph: autograd differentiates _thnn_differentiable_lstm_cell_backward instead.
    torch.manual_seed(0)
    cpu = nn.LSTMCell(3, 4).double()
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(2, 3, dtype=torch.double)
    res = []
    for m, xx in ((cpu, x.clone().requires_grad_()), (dev, x.to("neuron").requires_grad_())):
        h, c = m(xx)
        (g,) = torch.autograd.grad(h.sum() + c.sum(), xx, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), xx)
        res.append((g.detach().cpu(), gg.cpu()))
    torch.testing.assert_close(res[1], res[0], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lstm_low_precision_computes_in_fp32_and_rounds_once(dtype):
    # CUDA's acc_type: gate math in fp32, hy/cy/workspace rounded once to the input dtype.
    torch.manual_seed(0)
    n, h = 3, 5
    ig, hg, cx = (torch.randn(n, 4 * h).to(dtype), torch.randn(n, 4 * h).to(dtype), torch.randn(n, h).to(dtype))
    b1, b2 = torch.randn(4 * h).to(dtype), torch.randn(4 * h).to(dtype)
    hy, cy, ws = torch.ops.aten._thnn_fused_lstm_cell(*(t.to("neuron") for t in (ig, hg, cx, b1, b2)))
    g = (ig.float() + hg.float() + b1.float() + b2.float()).view(n, 4, h)
    i, f, c, o = g[:, 0].sigmoid(), g[:, 1].sigmoid(), g[:, 2].tanh(), g[:, 3].sigmoid()
    cy_ref = f * cx.float() + i * c
    hy_ref = o * cy_ref.tanh()
    assert hy.dtype == dtype and ws.shape == (n, 4 * h)
    torch.testing.assert_close(hy.cpu(), hy_ref.to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(cy.cpu(), cy_ref.to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(ws.cpu().view(n, 4, h), torch.stack((i, f, c, o), 1).to(dtype), atol=0, rtol=0)


def test_gru_workspace_has_cuda_layout():
    # [r, z, n, hx, hn + b_hn]: the backward reads it back, so the layout is the contract.
    torch.manual_seed(0)
    n, h = 2, 3
    ig, hg, hx = torch.randn(n, 3 * h), torch.randn(n, 3 * h), torch.randn(n, h)
    b1, b2 = torch.randn(3 * h), torch.randn(3 * h)
    hy, ws = torch.ops.aten._thnn_fused_gru_cell(*(t.to("neuron") for t in (ig, hg, hx, b1, b2)))
    gi, gh = (ig + b1).view(n, 3, h), (hg + b2).view(n, 3, h)
    r, z = (gi[:, 0] + gh[:, 0]).sigmoid(), (gi[:, 1] + gh[:, 1]).sigmoid()
    nn_ = (gi[:, 2] + r * gh[:, 2]).tanh()
    expected = torch.stack((r, z, nn_, hx, gh[:, 2]), 1).view(n, 5 * h)
    torch.testing.assert_close(ws.cpu(), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hy.cpu(), nn_ + z * (hx - nn_), atol=1e-6, rtol=1e-6)


def test_fused_cell_rejects_mismatched_gate_shapes():
    a = torch.randn(2, 8, device="neuron")
    with pytest.raises(RuntimeError, match="hidden_gates"):
        torch.ops.aten._thnn_fused_lstm_cell(a, torch.randn(2, 4, device="neuron"), torch.randn(2, 2, device="neuron"))


def test_fused_cell_rejects_wrong_hidden_state_shape():
    a = torch.randn(2, 8, device="neuron")
    with pytest.raises(RuntimeError, match="prev_hidden"):
        torch.ops.aten._thnn_fused_lstm_cell(a, a, torch.randn(2, 3, device="neuron"))


def test_fused_cell_rejects_integer_gates():
    a = torch.ones(2, 8, dtype=torch.int64, device="neuron")
    with pytest.raises(NotImplementedError, match="Long"):
        torch.ops.aten._thnn_fused_lstm_cell(a, a, torch.ones(2, 2, dtype=torch.int64, device="neuron"))


def test_fused_lstm_backward_without_gradients_returns_undefined():
    cx = torch.randn(2, 3, device="neuron")
    out = torch.ops.aten._thnn_fused_lstm_cell_backward_impl(None, None, cx, cx, torch.randn(2, 12, device="neuron"),
                                                             True)
    assert all(t is None for t in out)



# ---- nn.LSTM through oneDNN, as on CPU ------------------------------------------------------------
# Where CPU runs oneDNN's LSTM (fp32; bf16 where the host has it), neuron runs the same
# mkldnn_rnn_layer kernels layer by layer: results and gradients equal CPU's bit for bit.

def _lstm_step(module, x, hx=None):
    out, (h, c) = module(x, hx) if hx is not None else module(x)
    (out.square().sum() + h.sum() + c.sum()).backward()
    return out.detach(), h.detach(), c.detach()


def _assert_same_step(step, cpu, dev, x, hx=None, lengths=None):
    """One training step (`step(module, input, hx)`) on each: results, the input's and the
    parameters' gradients equal bit for bit. `lengths` packs the input."""
    xc, xd = x.clone().requires_grad_(), x.to("neuron").requires_grad_()
    hxd = None if hx is None else tuple(t.to("neuron") for t in hx) if isinstance(hx, tuple) else hx.to("neuron")
    ic, idev = (xc, xd) if lengths is None else (pack_padded_sequence(xc, lengths), pack_padded_sequence(xd, lengths))
    for a, b in zip(step(dev, idev, hxd), step(cpu, ic, hx)):
        assert a.device.type == "neuron"
        assert torch.equal(a.cpu(), b)
    assert torch.equal(xd.grad.cpu(), xc.grad)
    for (name, a), (_, b) in zip(cpu.named_parameters(), dev.named_parameters()):
        assert torch.equal(b.grad.cpu(), a.grad), name


def _assert_same_lstm_step(cpu, dev, x, hx=None):
    _assert_same_step(_lstm_step, cpu, dev, x, hx)


def _fp32_pair(kind=nn.LSTM, **kwargs):
    torch.manual_seed(0)
    cpu = kind(5, 7, **kwargs)
    return cpu, copy.deepcopy(cpu).to("neuron")


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_fp32_lstm_equals_cpu_bit_for_bit(num_layers, bidirectional):
    cpu, dev = _fp32_pair(num_layers=num_layers, bidirectional=bidirectional)
    _assert_same_lstm_step(cpu, dev, torch.randn(6, 3, 5))


def test_fp32_lstm_batch_first_with_initial_state_equals_cpu_bit_for_bit():
    cpu, dev = _fp32_pair(num_layers=2, batch_first=True)
    hx = (torch.randn(2, 4, 7), torch.randn(2, 4, 7))
    _assert_same_lstm_step(cpu, dev, torch.randn(4, 6, 5), hx)


def test_fp32_lstm_without_bias_equals_cpu_bit_for_bit():
    cpu, dev = _fp32_pair(num_layers=2, bias=False)
    _assert_same_lstm_step(cpu, dev, torch.randn(6, 3, 5))


def test_bf16_lstm_equals_cpu_bit_for_bit():
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this host's oneDNN has no bf16 LSTM: CPU and neuron take ATen's composite")
    cpu, dev = _fp32_pair(num_layers=2)
    cpu, dev = cpu.bfloat16(), dev.bfloat16()
    _assert_same_lstm_step(cpu, dev, torch.randn(6, 3, 5, dtype=torch.bfloat16))


def _lstm_kernels(module, x):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _lstm_step(module, x)
    return {e.name for e in prof.events()}


def test_fp32_lstm_runs_onednn_layers_not_per_step_cells():
    _, dev = _fp32_pair(num_layers=2)
    names = _lstm_kernels(dev, torch.randn(6, 3, 5, device="neuron"))
    assert {"aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward"} <= names
    assert "aten::_thnn_fused_lstm_cell" not in names


def test_lstm_with_onednn_disabled_takes_the_fused_cells():
    _, dev = _fp32_pair()
    with torch.backends.mkldnn.flags(enabled=False):
        names = _lstm_kernels(dev, torch.randn(6, 3, 5, device="neuron"))
    assert "aten::_thnn_fused_lstm_cell" in names and "aten::mkldnn_rnn_layer" not in names


def test_fp32_lstm_with_projections_takes_the_fused_cells_and_matches_cpu():
    # oneDNN has no projections (CPU warns and takes the composite too).
    cpu, dev = _fp32_pair(proj_size=3)
    x = torch.randn(6, 3, 5)
    assert "aten::_thnn_fused_lstm_cell" in _lstm_kernels(dev, x.to("neuron"))
    oc, od = cpu(x)[0], dev(x.to("neuron"))[0]
    torch.testing.assert_close(od.cpu(), oc, atol=1e-6, rtol=1e-5)


def test_double_backward_through_fp32_lstm_matches_cpu():
    cpu, dev = _fp32_pair()
    x = torch.randn(4, 2, 5)
    res = []
    for m, xx in ((cpu, x.clone().requires_grad_()), (dev, x.to("neuron").requires_grad_())):
        out = m(xx)[0]
        (g,) = torch.autograd.grad(out.square().sum(), xx, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), xx)
        res.append((g.detach().cpu(), gg.cpu()))
    torch.testing.assert_close(res[1], res[0], atol=1e-6, rtol=1e-5)


def test_lstm_with_too_few_hidden_states_raises_a_clear_error():
    # Malformed arguments take ATen's composite, which checks them (CPU's oneDNN path indexes
    # past the end instead: an IndexError from select).
    _, dev = _fp32_pair(num_layers=2)
    bad = (torch.zeros(1, 3, 7, device="neuron"), torch.zeros(1, 3, 7, device="neuron"))
    with pytest.raises(RuntimeError, match="hidden states"):
        torch._VF.lstm(torch.randn(6, 3, 5, device="neuron"), bad, dev._flat_weights, True, 2, 0.0, True, False, False)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
def test_rnn_under_torch_compile_equals_eager_bit_for_bit(kind):
    # Dynamo declines RNN modules and runs them eagerly: the neuron kernels they reach are run,
    # not traced and compiled into the graph (kernels.never_traced).
    torch.manual_seed(0)
    dev = kind(5, 7, num_layers=2).to("neuron")
    x = torch.randn(4, 3, 5, device="neuron")
    expected = dev(x)[0]
    torch._dynamo.reset()
    got = torch.compile(dev, backend="neuron")(x)[0]
    assert torch.equal(got.cpu(), expected.cpu())


# ---- nn.RNN / nn.GRU: CPU's algorithm, the input projection of all steps in one GEMM -------------

def _one_hidden_step(module, x, hx=None):
    out, h = module(x, hx) if hx is not None else module(x)
    packed = isinstance(out, nn.utils.rnn.PackedSequence)
    out = pad_packed_sequence(out)[0] if packed else out
    (out.square().sum() + h.sum()).backward()
    return out.detach(), h.detach()


def _assert_same_one_hidden_step(cpu, dev, x, hx=None, lengths=None):
    _assert_same_step(_one_hidden_step, cpu, dev, x, hx, lengths)


def _rnn_pair(**kwargs):
    return _fp32_pair(nn.RNN, **kwargs)


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_fp32_rnn_equals_cpu_bit_for_bit(bidirectional, nonlinearity):
    cpu, dev = _rnn_pair(num_layers=2, bidirectional=bidirectional, nonlinearity=nonlinearity)
    _assert_same_one_hidden_step(cpu, dev, torch.randn(6, 3, 5))


def test_fp32_rnn_batch_first_with_initial_state_equals_cpu_bit_for_bit():
    cpu, dev = _rnn_pair(num_layers=2, batch_first=True)
    _assert_same_one_hidden_step(cpu, dev, torch.randn(4, 6, 5), torch.randn(2, 4, 7))


def test_fp32_rnn_without_bias_equals_cpu_bit_for_bit():
    cpu, dev = _rnn_pair(num_layers=2, bias=False)
    _assert_same_one_hidden_step(cpu, dev, torch.randn(6, 3, 5))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_fp32_packed_rnn_equals_cpu_bit_for_bit(bidirectional):
    # Sequences of different lengths: the batch shrinks as they end (and grows again in the
    # reverse direction), the final hidden states gathered from the steps where each ended.
    cpu, dev = _rnn_pair(num_layers=2, bidirectional=bidirectional)
    _assert_same_one_hidden_step(cpu, dev, torch.randn(6, 4, 5), torch.randn(4 if bidirectional else 2, 4, 7),
                                 lengths=torch.tensor([6, 4, 4, 1]))


def _gemm_calls(run):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    names = [e.name for e in prof.events()]
    return names.count("aten::addmm") + names.count("aten::mm"), names


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU])
def test_one_input_projection_per_layer_and_direction(kind):
    # CPU's algorithm: one GEMM for the inputs of all steps, one per step for the hidden state
    # (the per-step route took two per step).
    torch.manual_seed(0)
    steps, layers, directions = 6, 2, 2
    dev = kind(5, 7, num_layers=layers, bidirectional=True).to("neuron")
    x = torch.randn(steps, 3, 5, device="neuron")
    with torch.no_grad():
        gemms, _ = _gemm_calls(lambda: dev(x))
    assert gemms == layers * directions * (1 + steps)


def test_gru_steps_run_the_fused_cell():
    dev = nn.GRU(5, 7).to("neuron")
    x = torch.randn(6, 3, 5, device="neuron", requires_grad=True)
    _, names = _gemm_calls(lambda: _one_hidden_step(dev, x))
    assert names.count("aten::_thnn_fused_gru_cell") == 6
    assert "aten::_thnn_fused_gru_cell_backward" in names


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
def test_dropout_between_layers_is_applied_in_training_only(kind):
    torch.manual_seed(0)
    dev = kind(5, 7, num_layers=2, dropout=0.5).to("neuron")
    x = torch.randn(6, 3, 5, device="neuron")
    torch.manual_seed(1)
    a = dev(x)[0]
    torch.manual_seed(1)
    assert torch.equal(dev(x)[0].cpu(), a.cpu())  # the device generator's stream
    assert bool((a != 0).all())  # between layers, not on the last layer's output
    with torch.no_grad():
        dev.dropout = 0.0
        undropped = dev(x)[0]
        dev.dropout = 0.5
        dev.eval()
        evaluated = dev(x)[0]
    assert not torch.allclose(a.detach().cpu(), undropped.cpu())
    assert torch.equal(evaluated.cpu(), undropped.cpu())


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU])
def test_one_hidden_layer_with_a_wrong_hidden_state_raises_cpus_error(kind):
    dev = kind(5, 7, num_layers=2).to("neuron")
    x = torch.randn(6, 3, 5, device="neuron")
    with pytest.raises(RuntimeError, match="Expected more hidden states"):
        torch._VF.rnn_tanh(x, torch.zeros(1, 3, 7, device="neuron"), dev._flat_weights, True, 2, 0.0, True, False, False) \
            if kind is nn.RNN else \
            torch._VF.gru(x, torch.zeros(1, 3, 7, device="neuron"), dev._flat_weights, True, 2, 0.0, True, False, False)


def test_one_hidden_layer_with_weights_on_another_device_raises_cpus_error():
    dev = nn.GRU(5, 7).to("neuron")
    weights = [w.cpu() for w in dev._flat_weights]
    with pytest.raises(RuntimeError, match="Input and parameter tensors are not at the same device"):
        torch._VF.gru(torch.randn(6, 3, 5, device="neuron"), torch.zeros(1, 3, 7, device="neuron"), weights,
                      True, 1, 0.0, True, False, False)


# ---- the fused cells against ATen's differentiable definitions ----------------------------------

def _cell_args(factor, n=3, h=5, bias=True, dtype=torch.double):
    g = torch.Generator().manual_seed(0)
    t = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    ig, hg, prev = t(n, factor * h), t(n, factor * h), t(n, h)
    b1, b2 = (t(factor * h), t(factor * h)) if bias else (None, None)
    return ig, hg, prev, b1, b2


def _neuron(*ts):
    return [t.to("neuron") if t is not None else None for t in ts]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grads", ["both", "hy", "cy"])
def test_fused_lstm_cell_backward_matches_atens_differentiable_backward(grads, bias):
    ig, hg, cx, b1, b2 = _cell_args(4, bias=bias)
    hy, cy, ws = torch.ops.aten._thnn_fused_lstm_cell(*_neuron(ig, hg, cx, b1, b2))
    g = torch.Generator().manual_seed(1)
    ghy = torch.randn(3, 5, generator=g, dtype=torch.double) if grads != "cy" else None
    gcy = torch.randn(3, 5, generator=g, dtype=torch.double) if grads != "hy" else None
    got = torch.ops.aten._thnn_fused_lstm_cell_backward_impl(*_neuron(ghy, gcy, cx), cy, ws, bias)
    ref = torch.ops.aten._thnn_differentiable_lstm_cell_backward(ghy, gcy, ig, hg, b1, b2, cx, cy.cpu())
    torch.testing.assert_close(got[0].cpu(), ref[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(got[1].cpu(), ref[2], atol=1e-12, rtol=1e-10)
    if bias:
        torch.testing.assert_close(got[2].cpu(), ref[3], atol=1e-12, rtol=1e-10)
    else:
        assert got[2] is None


@pytest.mark.parametrize("bias", [True, False])
def test_fused_gru_cell_backward_matches_atens_differentiable_backward(bias):
    ig, hg, hx, b1, b2 = _cell_args(3, bias=bias)
    _, ws = torch.ops.aten._thnn_fused_gru_cell(*_neuron(ig, hg, hx, b1, b2))
    ghy = torch.randn(3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.double)
    got = torch.ops.aten._thnn_fused_gru_cell_backward(ghy.to("neuron"), ws, bias)
    ref = torch.ops.aten._thnn_differentiable_gru_cell_backward(ghy, ig, hg, hx, b1, b2)
    for i in range(3):
        torch.testing.assert_close(got[i].cpu(), ref[i], atol=1e-12, rtol=1e-10)
    for i in (3, 4):
        if bias:
            torch.testing.assert_close(got[i].cpu(), ref[i], atol=1e-12, rtol=1e-10)
        else:
            assert got[i] is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gru_low_precision_computes_in_fp32_and_rounds_once(dtype):
    ig, hg, hx, b1, b2 = (t.to(dtype) for t in _cell_args(3, dtype=torch.float32))
    hy, ws = torch.ops.aten._thnn_fused_gru_cell(*_neuron(ig, hg, hx, b1, b2))
    gi, gh = (ig.float() + b1.float()).view(3, 3, 5), hg.float().view(3, 3, 5)
    gh[:, :2] += b2.float().view(3, 5)[:2]
    gh[:, 2] += b2.float().view(3, 5)[2]
    rz = (ig.float().view(3, 3, 5)[:, :2] + hg.float().view(3, 3, 5)[:, :2] + b1.float().view(3, 5)[:2]
          + b2.float().view(3, 5)[:2]).sigmoid()
    n_ = (gi[:, 2] + rz[:, 0] * gh[:, 2]).tanh()
    hy_ref = n_ + rz[:, 1] * (hx.float() - n_)
    assert hy.dtype == dtype and ws.dtype == dtype
    torch.testing.assert_close(hy.cpu(), hy_ref.to(dtype), atol=0, rtol=0)


def test_fused_cells_read_strided_gates():
    ig, hg, cx, b1, b2 = _cell_args(4)
    expected = torch.ops.aten._thnn_fused_lstm_cell(*_neuron(ig, hg, cx, b1, b2))
    # the same values through transposed and sliced layouts
    igt = ig.t().contiguous().to("neuron").t()
    hgs = torch.stack([hg, hg], 2).to("neuron")[:, :, 0]
    got = torch.ops.aten._thnn_fused_lstm_cell(igt, hgs, *_neuron(cx, b1, b2))
    assert not igt.is_contiguous() and not hgs.is_contiguous()
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b.cpu())


def test_fused_cell_rejects_a_bias_on_another_device():
    ig, hg, cx, b1, b2 = _cell_args(4, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="same device"):
        torch.ops.aten._thnn_fused_lstm_cell(*_neuron(ig, hg, cx, b1), b2)


def test_fused_cell_rejects_mixed_dtypes():
    ig, hg, cx, b1, b2 = _cell_args(3, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.aten._thnn_fused_gru_cell(*_neuron(ig, hg.double(), cx, b1, b2))


def test_fused_gru_backward_rejects_a_workspace_of_the_wrong_size():
    g = torch.randn(2, 3, device="neuron")
    with pytest.raises(RuntimeError, match="workspace"):
        torch.ops.aten._thnn_fused_gru_cell_backward(g, torch.randn(2, 12, device="neuron"), True)


@pytest.mark.usefixtures("engine_on")
@pytest.mark.parametrize("kind", [nn.GRU, nn.RNN, nn.LSTMCell])
def test_recurrent_training_step_never_waits(kind):
    # The GEMMs and the cells, forward and backward, all queued (tests/conftest.py).
    torch.manual_seed(0)
    model = kind(6, 8).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 3, 6, device="neuron") if kind in (nn.GRU, nn.RNN) else torch.randn(3, 6, device="neuron")

    def loss():
        out = model(x)
        return (out[0] if isinstance(out, tuple) else out).square().sum()

    trains_without_waiting(loss, opt)
