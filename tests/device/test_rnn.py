"""nn.LSTM / nn.GRU / nn.LSTMCell / nn.GRUCell on neuron: ATen takes the fused-cell kernels
(``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell`` and their backward) for every non-CPU
input; CPU's unfused path is the oracle, forward and backward."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


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

