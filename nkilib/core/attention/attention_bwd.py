"""``attention_bwd`` with AWS NKI-lib's signature (``nkilib.core.attention.attention_bwd``).

Runs :func:`torchneuron.nkilib.attention_bwd`: q, o, dy (bs, H, d, Sq); k, v (bs, Hkv, d,
Skv); lse (bs, H, 128, ceil(Sq/128)); returns (dq, dk, dv). ``softmax_scale=None`` means
1/sqrt(d). Not implemented (NotImplementedError): ``sinks_ref``, ``bound_min`` /
``bound_max``, ``mixed_precision=True``.
"""

import math

import nki
from ..._support import unsupported
from torchneuron.nkilib.attention_backward import attention_bwd as _attention_bwd

__all__ = ["attention_bwd"]


@nki.jit
def attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None,
                  bound_max=None, use_causal_mask=False, mixed_precision=False,
                  softmax_scale=None, sliding_window=None):
    """Flash-attention backward: (dq, dk, dv) in the input layouts."""
    name = "attention_bwd"
    if sinks_ref is not None:
        unsupported(name, "sinks_ref", "train without attention sinks")
    if bound_min is not None or bound_max is not None:
        unsupported(name, "bound_min / bound_max", "use use_causal_mask / sliding_window")
    if mixed_precision:
        unsupported(name, "mixed_precision=True", "omit it (bf16 matmuls, fp32 accumulation)")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_ref.shape[2])
    return _attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref,
                          use_causal_mask=use_causal_mask, softmax_scale=scale,
                          sliding_window=sliding_window)
