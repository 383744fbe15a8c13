"""Recurrent layers on neuron computed as CPU computes them.

ATen's recurrent layers (``aten/src/ATen/native/RNN.cpp``) choose their algorithm by device,
and only CPU tensors get the fast ones:

- ``lstm`` runs oneDNN's fused LSTM for CPU tensors; for every other device two GEMMs and one
  fused cell per time step (``_thnn_fused_lstm_cell``, neuron's in
  ``csrc/backend/rnn_cells.cpp``): 2.9x CPU's time for a 2x200 LSTM training step.
- ``gru``, ``rnn_tanh`` and ``rnn_relu`` (and their packed-sequence forms) compute the input
  projection of every time step in one GEMM for CPU tensors ("pre-computed input"); for other
  devices one small GEMM per step (1.7x CPU's time for a 2-layer ``nn.RNN`` language model).

Registered above autograd for neuron, :func:`lstm` and the one-hidden-state layers give neuron
CPU's choice: oneDNN's ``mkldnn_rnn_layer`` for the LSTM, one input GEMM per layer and direction
for the others. The LSTM and the simple RNNs then run CPU's ATen ops in CPU's order, so their
results and gradients are CPU's bit for bit where the GEMMs are (fp32, fp64); the GRU keeps the
fused cell (below). Calls CPU would not take that way, and tensors being traced, take ATen's
composite.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["gru", "gru_packed", "lstm", "rnn_relu", "rnn_relu_packed", "rnn_tanh", "rnn_tanh_packed"]

_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_ONEDNN_LSTM = 2  # ideep::rnn_kind::LSTM, the mode mkldnn_rnn_layer takes


@functools.cache
def _onednn_supports(dtype: torch.dtype) -> bool:
    # CPU's use_mkldnn (aten/src/ATen/native/RNN.cpp): fp32 always, bf16/fp16 where oneDNN runs
    # them natively on this host (fp16 only without autograd, checked by the caller).
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def _onednn_lstm_applies(input, hx, params, has_biases: bool, num_layers: int, bidirectional: bool,
                         batch_first: bool) -> bool:
    """Whether CPU would run this ``lstm`` call through oneDNN were it on CPU: the same rule, for
    neuron tensors of one device; anything else (projections, other dtypes, malformed
    arguments, tensors being traced) takes ATen's composite, which raises CPU's errors."""
    if not torch._C._get_mkldnn_enabled() or len(hx) != 2 or input.dim() != 3 or input.numel() == 0:
        return False
    if input.dtype == torch.float16 and torch.is_grad_enabled():
        return False
    if not _onednn_supports(input.dtype):
        return False
    tensors = [input, *hx, *params]
    # Only plain device tensors: fake, functional or batched ones (torch.compile, torch.func)
    # take the composite, whose decomposition those tools know.
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    if torch._C._are_functorch_transforms_active() or any(t.device != input.device for t in tensors):
        return False
    layers = num_layers * (2 if bidirectional else 1)
    h, c = hx
    if h.dim() != 3 or c.shape != h.shape or h.size(0) != layers or h.size(1) != input.size(0 if batch_first else 1):
        return False  # (projections give h and c different sizes)
    return len(params) == layers * (4 if has_biases else 2)


def lstm(input, hx, params, has_biases: bool, num_layers: int, dropout: float, train: bool,
         bidirectional: bool, batch_first: bool):
    """``aten::lstm.input`` for neuron tensors, above autograd: where CPU runs oneDNN's LSTM
    (``use_mkldnn``), neuron runs the same ``mkldnn_rnn_layer`` kernels layer by layer (as
    ``mkldnn_rnn`` does, with dropout between layers), so results and gradients equal CPU's bit
    for bit; every other call takes ATen's composite (two GEMMs and a fused cell per step)."""
    if not _onednn_lstm_applies(input, hx, params, has_biases, num_layers, bidirectional, batch_first):
        return torch.ops.aten.lstm.input._op_dk(_COMPOSITE, input, hx, params, has_biases, num_layers, dropout,
                                                train, bidirectional, batch_first)
    x = (input.transpose(0, 1) if batch_first else input).contiguous()
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    hidden = h0.size(2)
    directions = 2 if bidirectional else 1
    stride = 4 if has_biases else 2
    hy, cy = [], []
    for layer in range(num_layers):
        outs = []
        for d in range(directions):
            i = layer * directions + d
            w = params[i * stride:(i + 1) * stride]
            # Without biases the kernel still takes two (ignored) tensors, zeros as mkldnn_rnn's.
            b_ih = w[2] if has_biases else torch.zeros(w[0].shape, dtype=w[0].dtype, device=w[0].device)
            b_hh = w[3] if has_biases else torch.zeros(w[1].shape, dtype=w[1].dtype, device=w[1].device)
            y, h, c, _ = torch.ops.aten.mkldnn_rnn_layer(x, w[0], w[1], b_ih, b_hh, h0[i], c0[i], d > 0, [],
                                                         _ONEDNN_LSTM, hidden, num_layers, has_biases,
                                                         bidirectional, batch_first, train)
            outs.append(y)
            hy.append(h)
            cy.append(c)
        x = outs[0] if directions == 1 else torch.cat(outs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    return (x.transpose(0, 1) if batch_first else x), torch.stack(hy, 0), torch.stack(cy, 0)


# ---- gru, rnn_tanh, rnn_relu: the input projection of all steps in one GEMM ---------------------
# The simple cells are CPU's (RNN.cpp SimpleCell with pre_compute_input), op for op: the same
# in-place ops make the same autograd graph, so results and gradients are CPU's bits. The GRU
# cell is the fused one the per-step route used (CUDA's math, rnn_cells.cpp), fed the projections
# with their biases: CPU's unfused GRU cell is ten small ops on strided gate views a step, which
# took a GRU language model from 0.88x CPU's step time to 1.48x.

def _simple_cell(nonlinearity):
    def cell(xw: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor, b_hh) -> torch.Tensor:
        return nonlinearity(torch.nn.functional.linear(h, w_hh, b_hh).add_(xw))
    return cell


def _gru_cell(xw: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor, b_hh) -> torch.Tensor:
    return torch.ops.aten._thnn_fused_gru_cell(xw, torch.nn.functional.linear(h, w_hh, b_hh), h)[0]


_GATES = {"gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
_CELLS = {"gru": _gru_cell, "rnn_tanh": _simple_cell(torch.tanh), "rnn_relu": _simple_cell(torch.relu)}


def _precompute_applies(x, hx, params, has_biases: bool, num_layers: int, bidirectional: bool,
                        gates: int) -> bool:
    """Whether the arguments are well formed for CPU's algorithm on one neuron device; anything
    else (other devices, malformed shapes, tensors being traced) takes ATen's composite, which
    raises CPU's errors."""
    tensors = [x, hx, *params]
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    if any(t.device != x.device or t.dtype != x.dtype for t in tensors):
        return False
    layers = num_layers * (2 if bidirectional else 1)
    stride = 4 if has_biases else 2
    if num_layers < 1 or hx.dim() != 3 or hx.size(0) != layers or len(params) != layers * stride:
        return False
    hidden = hx.size(2)
    for i in range(layers):
        w_ih, w_hh, *biases = params[i * stride:(i + 1) * stride]
        if w_ih.dim() != 2 or w_ih.size(0) != gates * hidden or tuple(w_hh.shape) != (gates * hidden, hidden):
            return False
        if any(tuple(b.shape) != (gates * hidden,) for b in biases):
            return False
    return True


def _weights(params, has_biases: bool, i: int):
    stride = 4 if has_biases else 2
    w = params[i * stride:(i + 1) * stride]
    return (w[0], w[1], w[2], w[3]) if has_biases else (w[0], w[1], None, None)


def _steps(cell, xw_steps, h, w_hh, b_hh):
    outputs = []
    for xw in xw_steps:
        h = cell(xw, h, w_hh, b_hh)
        outputs.append(h)
    return outputs, h


def _full_layer(cell, x, h, weights):
    # RNN.cpp FullLayer for CPU inputs
    w_ih, w_hh, b_ih, b_hh = weights
    outputs, h = _steps(cell, torch.nn.functional.linear(x, w_ih, b_ih).unbind(0), h, w_hh, b_hh)
    return torch.stack(outputs, 0), h


def _full_bidirectional_layer(cell, x, h_fw, h_bw, fw, bw):
    # RNN.cpp FullBidirectionalLayer for CPU inputs
    out_fw, h_fw = _full_layer(cell, x, h_fw, fw)
    w_ih, w_hh, b_ih, b_hh = bw
    outputs, h_bw = _steps(cell, torch.nn.functional.linear(x, w_ih, b_ih).unbind(0)[::-1], h_bw, w_hh, b_hh)
    out_bw = torch.stack(outputs[::-1], 0)
    return torch.cat([out_fw, out_bw], out_fw.dim() - 1), h_fw, h_bw


def _packed_layer(cell, data, sizes, h, weights):
    # RNN.cpp PackedLayer for CPU inputs: finished sequences leave the batch's end
    w_ih, w_hh, b_ih, b_hh = weights
    xw = torch.nn.functional.linear(data, w_ih, b_ih)
    outputs, finished, offset, last = [], [], 0, sizes[0]
    for size in sizes:
        step = xw.narrow(0, offset, size)
        offset += size
        if size < last:
            finished.append(h.narrow(0, size, last - size))
            h = h.narrow(0, 0, size)
        last = size
        h = cell(step, h, w_hh, b_hh)
        outputs.append(h)
    finished.append(h)
    return torch.cat(outputs, 0), torch.cat(finished[::-1], 0)


def _reversed_packed_layer(cell, data, sizes, h0, weights):
    # RNN.cpp ReversedPackedLayer for CPU inputs: sequences join the batch as it grows
    w_ih, w_hh, b_ih, b_hh = weights
    xw = torch.nn.functional.linear(data, w_ih, b_ih)
    offset, last = data.size(0), sizes[-1]
    h = h0.narrow(0, 0, last)
    outputs = []
    for size in reversed(sizes):
        if size > last:
            h = torch.cat([h, h0.narrow(0, last, size - last)], 0)
        step = xw.narrow(0, offset - size, size)
        offset -= size
        last = size
        h = cell(step, h, w_hh, b_hh)
        outputs.append(h)
    return torch.cat(outputs[::-1], 0), h


def _layer_stack(layer, x, hx, params, has_biases: bool, num_layers: int, dropout: float, train: bool,
                 bidirectional: bool):
    # RNN.cpp apply_layer_stack: dropout between layers, final hidden states stacked
    hs = hx.unbind(0)
    finals = []
    for n in range(num_layers):
        if bidirectional:
            x, h_fw, h_bw = layer(x, (hs[2 * n], hs[2 * n + 1]),
                                  (_weights(params, has_biases, 2 * n), _weights(params, has_biases, 2 * n + 1)))
            finals += [h_fw, h_bw]
        else:
            x, h = layer(x, hs[n], _weights(params, has_biases, n))
            finals.append(h)
        if dropout != 0 and train and n < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    return x, torch.stack(finals, 0)


def _one_hidden_input(name: str):
    cell, gates = _CELLS[name], _GATES[name]
    overload = getattr(torch.ops.aten, name).input

    def layer(x, h, weights):
        if isinstance(h, tuple):
            return _full_bidirectional_layer(cell, x, h[0], h[1], weights[0], weights[1])
        return _full_layer(cell, x, h, weights)

    def kernel(input, hx, params, has_biases: bool, num_layers: int, dropout: float, train: bool,
               bidirectional: bool, batch_first: bool):
        if input.dim() != 3 or input.size(0 if not batch_first else 1) == 0 or not _precompute_applies(
                input, hx, params, has_biases, num_layers, bidirectional, gates):
            return overload._op_dk(_COMPOSITE, input, hx, params, has_biases, num_layers, dropout, train,
                                   bidirectional, batch_first)
        x = input.transpose(0, 1) if batch_first else input
        out, hy = _layer_stack(layer, x, hx, params, has_biases, num_layers, dropout, train, bidirectional)
        return (out.transpose(0, 1) if batch_first else out), hy

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = (f"``aten::{name}.input`` for neuron tensors, above autograd: CPU's algorithm (the input "
                      "projection of all steps in one GEMM per layer and direction, then one cell per step).")
    return kernel


def _one_hidden_data(name: str):
    cell, gates = _CELLS[name], _GATES[name]
    overload = getattr(torch.ops.aten, name).data

    def kernel(data, batch_sizes, hx, params, has_biases: bool, num_layers: int, dropout: float, train: bool,
               bidirectional: bool):
        if (data.dim() != 2 or batch_sizes.device.type != "cpu" or batch_sizes.dim() != 1 or batch_sizes.numel() == 0
                or not _precompute_applies(data, hx, params, has_biases, num_layers, bidirectional, gates)):
            return overload._op_dk(_COMPOSITE, data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                                   bidirectional)
        sizes = batch_sizes.tolist()
        if sum(sizes) != data.size(0) or sizes != sorted(sizes, reverse=True) or sizes[-1] < 1 or sizes[0] != hx.size(1):
            return overload._op_dk(_COMPOSITE, data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                                   bidirectional)

        def layer(x, h, weights):
            if isinstance(h, tuple):  # RNN.cpp PackedBidirectionalLayer
                out_fw, h_fw = _packed_layer(cell, x, sizes, h[0], weights[0])
                out_bw, h_bw = _reversed_packed_layer(cell, x, sizes, h[1], weights[1])
                return torch.cat([out_fw, out_bw], -1), h_fw, h_bw
            return _packed_layer(cell, x, sizes, h, weights)

        return _layer_stack(layer, data, hx, params, has_biases, num_layers, dropout, train, bidirectional)

    kernel.__name__ = kernel.__qualname__ = name + "_packed"
    kernel.__doc__ = (f"``aten::{name}.data`` (packed sequences) for neuron tensors, above autograd: CPU's "
                      "algorithm, the input projection of all steps in one GEMM per layer and direction.")
    return kernel


gru, rnn_tanh, rnn_relu = (_one_hidden_input(n) for n in ("gru", "rnn_tanh", "rnn_relu"))
gru_packed, rnn_tanh_packed, rnn_relu_packed = (_one_hidden_data(n) for n in ("gru", "rnn_tanh", "rnn_relu"))


def register(lib: torch.library.Library) -> None:
    lib.impl("lstm.input", lstm, "AutogradPrivateUse1")
    for name, input_kernel, packed_kernel in (("gru", gru, gru_packed), ("rnn_tanh", rnn_tanh, rnn_tanh_packed),
                                              ("rnn_relu", rnn_relu, rnn_relu_packed)):
        lib.impl(f"{name}.input", input_kernel, "AutogradPrivateUse1")
        lib.impl(f"{name}.data", packed_kernel, "AutogradPrivateUse1")
