"""The fused RNN cells ATen calls for every non-CPU input, with CUDA's semantics.

``aten/src/ATen/native/RNN.cpp`` computes ``LSTMCell`` / ``GRUCell`` (and so ``nn.LSTM``,
``nn.GRU``, ``nn.LSTMCell``, ``nn.GRUCell``, packed sequences included) for inputs that are
``is_cuda() || is_xpu() || is_privateuseone()`` as two GEMMs followed by one fused pointwise
kernel, ``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``, whose backward
(``_thnn_fused_lstm_cell_backward_impl`` / ``_thnn_fused_gru_cell_backward``) reads the
*workspace* the forward saved. Only CUDA has those kernels (``aten/src/ATen/native/cuda/RNN.cu``);
these are neuron's, with the same workspace layouts so forward and backward pair up (and a
workspace made by one can be consumed by the other, as autograd does):

- LSTM: ``workspace`` is ``[N, 4H]`` (contiguous, the gates' dtype) holding the *activated*
  gates ``sigmoid(i), sigmoid(f), tanh(g), sigmoid(o)`` in that order along dim 1;
- GRU: ``workspace`` is ``[N, 5H]`` holding ``r, z, n, hx, hn + b_hn`` (reset gate, update gate,
  new gate after tanh, previous hidden state, hidden part of the new gate with its bias).

Arithmetic is in the accumulation type (fp32 for fp16/bf16, as CUDA's ``acc_type``), results
and workspace are rounded once to the input dtype. Gate pre-activations are summed in CUDA's
order ``((input + hidden) + input_bias) + hidden_bias``.
"""

from __future__ import annotations

import torch

from . import on_cpu

__all__ = ["fused_lstm_cell", "fused_lstm_cell_backward_impl", "fused_gru_cell",
           "fused_gru_cell_backward"]

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _c10_name(dtype: torch.dtype) -> str:
    """The ScalarType name ATen's dtype-dispatch errors use ('Long', 'ComplexFloat', ...)."""
    return torch.empty((), dtype=dtype, device="meta").type().rsplit(".", 1)[-1].replace("Tensor", "")


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_sizes(fn: str, input_gates, hidden_gates, input_bias, hidden_bias, factor: int, prev) -> None:
    # The checks of RNN.cu's checkSizes, with its messages' substance.
    if input_gates.dim() != 2:
        raise RuntimeError(f"{fn}: Expected 2-dimensional tensor, but got {input_gates.dim()}-dimensional "
                           "tensor for argument #1 'input_gates'")
    if input_gates.shape != hidden_gates.shape:
        raise RuntimeError(f"{fn}: Expected tensor for argument #1 'input_gates' to have the same size as "
                           f"tensor for argument #2 'hidden_gates'; but {list(input_gates.shape)} does not "
                           f"equal {list(hidden_gates.shape)}")
    gates = input_gates.shape[1]
    if (input_bias is None) != (hidden_bias is None):
        raise RuntimeError(f"{fn}: input_bias and hidden_bias must both be given or both be None")
    if input_bias is not None:
        if input_bias.dim() != 1 or input_bias.numel() != gates:
            raise RuntimeError(f"{fn}: Expected 'input_bias' to be 1-dimensional with {gates} elements, "
                               f"but got shape {list(input_bias.shape)}")
        if input_bias.shape != hidden_bias.shape:
            raise RuntimeError(f"{fn}: 'input_bias' and 'hidden_bias' differ in size: "
                               f"{list(input_bias.shape)} vs {list(hidden_bias.shape)}")
    if prev.dim() != 2 or prev.numel() != input_gates.shape[0] * gates // factor:
        raise RuntimeError(f"{fn}: Expected 'prev_hidden' of shape [{input_gates.shape[0]}, {gates // factor}], "
                           f"but got {list(prev.shape)}")
    tensors = [t for t in (input_gates, hidden_gates, input_bias, hidden_bias, prev) if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise RuntimeError(f"{fn}: Expected all tensors to be on the same device, but found at least two "
                           f"devices, {', '.join(sorted(str(d) for d in devices))}!")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise RuntimeError(f"{fn}: expected all tensors to have the same dtype, got {sorted(map(str, dtypes))}")
    if input_gates.dtype not in _FLOATING:
        raise NotImplementedError(f'"{fn}" not implemented for \'{_c10_name(input_gates.dtype)}\'')


def _gate_sum(ig, hg, b1, b2, acc):
    s = ig.to(acc) + hg.to(acc)
    if b1 is not None:
        s = s + b1.to(acc) + b2.to(acc)
    return s


def _lstm_forward(ig, hg, cx, b1, b2):
    dtype, acc = ig.dtype, _acc(ig.dtype)
    n, h = cx.shape
    gates = _gate_sum(ig, hg, b1, b2, acc).view(n, 4, h)
    act = torch.empty_like(gates)
    torch.sigmoid(gates[:, 0:2], out=act[:, 0:2])
    torch.tanh(gates[:, 2], out=act[:, 2])
    torch.sigmoid(gates[:, 3], out=act[:, 3])
    i, f, g, o = act.unbind(1)
    cy = f * cx.to(acc) + i * g
    hy = o * torch.tanh(cy)
    return hy.to(dtype), cy.to(dtype), act.view(n, 4 * h).to(dtype)


def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """``aten::_thnn_fused_lstm_cell``: ``(hy, cy, workspace)`` for pre-computed gate GEMMs."""
    _check_sizes("_thnn_fused_lstm_cell", input_gates, hidden_gates, input_bias, hidden_bias, 4, cx)
    return on_cpu("_thnn_fused_lstm_cell", _lstm_forward, input_gates, hidden_gates,
                                        cx, input_bias, hidden_bias)


def _lstm_backward(grad_hy, grad_cy, cx, cy, ws, has_bias):
    dtype, acc = ws.dtype, _acc(ws.dtype)
    n, h = cx.shape
    i, f, g, o = ws.reshape(n, 4, h).to(acc).unbind(1)
    tcy = torch.tanh(cy.to(acc))
    go = grad_hy.to(acc) if grad_hy is not None else torch.zeros((), dtype=acc)
    goc = grad_cy.to(acc) if grad_cy is not None else torch.zeros((), dtype=acc)
    gog = go * tcy
    gcx = go * o * (1 - tcy * tcy) + goc
    grad = torch.empty((n, 4, h), dtype=acc)
    grad[:, 0] = gcx * g * (1 - i) * i
    grad[:, 1] = gcx * cx.to(acc) * (1 - f) * f
    grad[:, 2] = gcx * i * (1 - g * g)
    grad[:, 3] = gog * (1 - o) * o
    grad_gates = grad.view(n, 4 * h).to(dtype)
    grad_cx = (gcx * f).expand(n, h).to(dtype)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_cx.contiguous(), grad_bias


def fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """``aten::_thnn_fused_lstm_cell_backward_impl``: ``(grad_gates, grad_cx, grad_bias)`` from
    the forward's workspace (``None`` results when neither gradient is defined, as on CUDA)."""
    if grad_hy is None and grad_cy is None:
        return None, None, None
    defined = grad_hy if grad_hy is not None else grad_cy
    exp = list(defined.shape)
    if defined.dim() != 2:
        raise RuntimeError("fused_lstm_cell_backward: Expected 2-dimensional gradient, "
                           f"but got {defined.dim()}-dimensional")
    for name, t in (("grad_hy", grad_hy), ("grad_cy", grad_cy), ("cx", cx), ("cy", cy)):
        if t is not None and list(t.shape) != exp:
            raise RuntimeError(f"fused_lstm_cell_backward: Expected tensor for '{name}' to have size {exp}, "
                               f"but got {list(t.shape)}")
    if workspace.dim() != 2 or workspace.numel() != exp[0] * exp[1] * 4:
        raise RuntimeError(f"fused_lstm_cell_backward: Expected 'workspace' with {exp[0] * exp[1] * 4} "
                           f"elements, but got shape {list(workspace.shape)}")
    return on_cpu("_thnn_fused_lstm_cell_backward_impl", _lstm_backward, grad_hy,
                                        grad_cy, cx, cy, workspace, has_bias)


def _gru_forward(ig, hg, hx, b1, b2):
    dtype, acc = ig.dtype, _acc(ig.dtype)
    n, h = hx.shape
    ig3, hg3 = ig.to(acc).reshape(n, 3, h), hg.to(acc).reshape(n, 3, h)
    if b1 is not None:
        b13, b23 = b1.to(acc).reshape(3, h), b2.to(acc).reshape(3, h)
        rz = torch.sigmoid(ig3[:, 0:2] + hg3[:, 0:2] + b13[0:2] + b23[0:2])
        hn = hg3[:, 2] + b23[2]
        ng = torch.tanh(ig3[:, 2] + b13[2] + rz[:, 0] * hn)
    else:
        rz = torch.sigmoid(ig3[:, 0:2] + hg3[:, 0:2])
        hn = hg3[:, 2]
        ng = torch.tanh(ig3[:, 2] + rz[:, 0] * hn)
    hxa = hx.to(acc)
    hy = ng + rz[:, 1] * (hxa - ng)
    ws = torch.empty((n, 5, h), dtype=dtype)
    ws[:, 0:2] = rz
    ws[:, 2] = ng
    ws[:, 3] = hx
    ws[:, 4] = hn
    return hy.to(dtype), ws.view(n, 5 * h)


def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """``aten::_thnn_fused_gru_cell``: ``(hy, workspace)`` for pre-computed gate GEMMs."""
    _check_sizes("_thnn_fused_gru_cell", input_gates, hidden_gates, input_bias, hidden_bias, 3, hx)
    return on_cpu("_thnn_fused_gru_cell", _gru_forward, input_gates, hidden_gates, hx,
                                        input_bias, hidden_bias)


def _gru_backward(grad_hy, ws, has_bias):
    dtype, acc = ws.dtype, _acc(ws.dtype)
    n, h5 = ws.shape
    h = h5 // 5
    r, z, ng, hx, hn = ws.reshape(n, 5, h).to(acc).unbind(1)
    go = grad_hy.to(acc)
    gig = go * (hx - ng) * (1 - z) * z
    ghx = go * z
    gin = go * (1 - z) * (1 - ng * ng)
    ghn = gin * r
    grg = gin * hn * (1 - r) * r
    gi = torch.stack((grg, gig, gin), 1).view(n, 3 * h).to(dtype)
    gh = torch.stack((grg, gig, ghn), 1).view(n, 3 * h).to(dtype)
    if has_bias:
        return gi, gh, ghx.to(dtype), gi.sum(0), gh.sum(0)
    return gi, gh, ghx.to(dtype), None, None


def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """``aten::_thnn_fused_gru_cell_backward``: ``(grad_input_gates, grad_hidden_gates, grad_hx,
    grad_input_bias, grad_hidden_bias)`` from the forward's workspace."""
    if grad_hy.dim() != 2:
        raise RuntimeError("fused_gru_cell_backward: Expected 2-dimensional tensor for argument #1 'grad_hy', "
                           f"but got {grad_hy.dim()}-dimensional")
    expected = [grad_hy.shape[0], grad_hy.shape[1] * 5]
    if list(workspace.shape) != expected:
        raise RuntimeError(f"fused_gru_cell_backward: Expected tensor for argument #2 'workspace' to have size "
                           f"{expected}, but got {list(workspace.shape)}")
    return on_cpu("_thnn_fused_gru_cell_backward", _gru_backward, grad_hy, workspace,
                                        has_bias)


def register(lib: torch.library.Library) -> None:
    lib.impl("_thnn_fused_lstm_cell", fused_lstm_cell, "PrivateUse1")
    lib.impl("_thnn_fused_lstm_cell_backward_impl", fused_lstm_cell_backward_impl, "PrivateUse1")
    lib.impl("_thnn_fused_gru_cell", fused_gru_cell, "PrivateUse1")
    lib.impl("_thnn_fused_gru_cell_backward", fused_gru_cell_backward, "PrivateUse1")
