"""``attention_cte`` with AWS NKI-lib's signature (``nkilib.core.attention.attention_cte``).

Runs :func:`torchneuron.nkilib.attention_cte` (flash attention; layouts, GQA, causal and
sliding-window masks, sinks, prefix KV, context-parallel slicing as documented there and in
docs/nkilib.md). Not implemented (NotImplementedError): ``cache_softmax=True`` (AWS returns
(out, -max, 1/sum); ours caches the log-sum-exp -- use torchneuron.nkilib.attention_cte),
``softmax_dtype`` / ``mm_out_dtype`` other than float32, ``bound_min`` / ``bound_max``, and a
run-time (tensor) ``cp_offset``.
"""

import numpy as np

import nki
import nki.language as nl
from ..._support import unsupported
from torchneuron.nkilib.attention import attention_cte as _attention_cte

__all__ = ["attention_cte"]


@nki.jit
def attention_cte(q, k, v, scale=1.0, causal_mask=True, k_prior=None, v_prior=None,
                  prior_used_len=None, sink=None, sliding_window=None, tp_q=True, tp_k=False,
                  tp_out=False, cache_softmax=False, softmax_dtype=nl.float32,
                  mm_out_dtype=nl.float32, cp_offset=None, global_cp_deg=None,
                  cp_strided_q_slicing=False, bound_min=None, bound_max=None):
    """Attention for context encoding: ``softmax(scale q k^T [masked]) v`` per batch (heads
    folded into the batch; GQA when k/v have fewer batches). Returns the output."""
    name = "attention_cte"
    if cache_softmax:
        unsupported(name, "cache_softmax=True (AWS's (out, -max, 1/sum) return)",
                    "torchneuron.nkilib.attention_cte(..., cache_softmax=True) returns (out, lse)")
    if np.dtype(softmax_dtype) != np.float32 or np.dtype(mm_out_dtype) != np.float32:
        unsupported(name, "softmax_dtype / mm_out_dtype other than float32",
                    "omit them (fp32 softmax and matmul outputs)")
    if bound_min is not None or bound_max is not None:
        unsupported(name, "bound_min / bound_max", "mask with sliding_window or causal_mask")
    if cp_offset is not None and not isinstance(cp_offset, int):
        unsupported(name, "a run-time (tensor) cp_offset", "pass cp_offset as a Python int")
    return _attention_cte(q, k, v, scale=scale, causal_mask=causal_mask, k_prior=k_prior,
                          v_prior=v_prior, prior_used_len=prior_used_len, sink=sink,
                          sliding_window=sliding_window, tp_q=tp_q, tp_k=tp_k, tp_out=tp_out,
                          cp_offset=cp_offset or 0, global_cp_deg=global_cp_deg or 1,
                          cp_strided_q_slicing=cp_strided_q_slicing)
