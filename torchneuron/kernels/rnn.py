"""``nn.LSTM`` on neuron through oneDNN, as on CPU.

ATen's ``lstm`` (``aten/src/ATen/native/RNN.cpp``) runs oneDNN's fused LSTM only for CPU
tensors; for every other device it runs two GEMMs and one fused cell per time step
(``_thnn_fused_lstm_cell``, neuron's in ``csrc/backend/rnn_cells.cpp``). On this device the
per-step route cost 2.9x CPU's time for a 2x200 LSTM training step. :func:`lstm`, registered
above autograd, gives neuron CPU's choice: where CPU would run oneDNN it runs the same
``mkldnn_rnn_layer`` kernels (the same bits as CPU, forward and backward); every other call
(projections, float64, packed sequences, oneDNN disabled) takes ATen's composite.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["lstm"]

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


def register(lib: torch.library.Library) -> None:
    lib.impl("lstm.input", lstm, "AutogradPrivateUse1")
