"""``NEURON_ATTN``: torchneuron's paged-attention backend for vLLM.

The KV cache of a layer is one ``neuron`` tensor, logically ``[num_blocks, kv_heads,
block_size, 2 * head_size]`` as vLLM sizes it, stored token-major (vLLM's ``LBNHC`` layout):
``[num_blocks, block_size, kv_heads, 2 * head_size]`` in memory, each token's key then value
per head. A request's context is then one ``index_select`` of its blocks, and its keys and
values are strided views in SDPA's ``[kv_heads, tokens, head]`` order, without a copy.

* **KV write** (:meth:`NeuronAttentionImpl.do_kv_cache_update`): one
  ``torchneuron::paged_kv_write`` kernel call writes the new tokens' keys and values into
  their slots (row ``slot`` of the ``[blocks * block_size, kv_heads, 2 * head]`` view; slot -1,
  vLLM's padding, is skipped), on the device.
* **Attention** (:meth:`NeuronAttentionImpl.forward`), with vLLM's batch order (decode
  requests first, see ``reorder_batch_threshold``):

  - decode requests (one new token each) in one ``torchneuron::paged_decode_attention``
    kernel call: it walks each request's block table and reads every cached key and value row
    in place, once for all the query heads that share it (GQA), fp32 accumulation (no gather
    of the context, no padding, no mask);
  - every other request (a prefill, a chunk of a chunked prefill, or a prompt whose prefix
    came from the prefix cache) by itself: its query tokens sit at the end of its context, so
    the causal mask is bottom-right aligned (query ``i`` of ``n`` sees the first
    ``context - n + i + 1`` keys). A prefill without cached context attends to its own keys
    directly (``is_causal=True``, no gather).

  With ``TORCHNEURON_NKI_SDPA=1`` every request instead runs the NKI-lib flash-attention
  kernel ``attention_cte`` (simulated, and visible to the performance model and the
  profiler) with the cached context as its prefix KV (``k_prior`` / ``v_prior``) and the new
  tokens as the causal chunk: one kernel shape covers prefill, chunked prefill, prefix-cache
  hits and decode.

Supported: decoder self-attention, MHA and GQA, fp32 / bf16 / fp16, any head size (NKI: at
most 128), the model's dtype or an FP8 KV cache (``kv_cache_dtype="fp8"``/``"fp8_e4m3"``/
``"fp8_e5m2"``: keys and values stored as ``x / scale`` rounded and saturated, read back as
``code * scale`` in fp32 by every request, the layer's ``k_scale``/``v_scale``); no sliding
window, ALiBi, soft-cap or sinks (rejected when the model is loaded, with the reason).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionLayer, AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata, MultipleOf)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

__all__ = ["NeuronAttentionBackend", "NeuronAttentionImpl", "NeuronAttentionMetadata",
           "NeuronAttentionMetadataBuilder", "token_major", "calls"]

# How many attention computations took each path in this process (tests, diagnostics):
# batched decode SDPA calls, plain prefills, continuations (chunked prefill / prefix-cache hit),
# and NKI kernel calls.
_CALLS = {"decode_batch": 0, "prefill": 0, "continuation": 0, "nki": 0}


def calls() -> dict:
    """Counts of the attention paths taken in this process since it started."""
    return dict(_CALLS)


# vLLM's FP8 KV-cache dtypes and the FP8 type each stores ("fp8" is e4m3, as on CUDA)
_KV_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _use_nki() -> bool:
    return os.environ.get("TORCHNEURON_NKI_SDPA", "0") == "1"


class NeuronAttentionBackend(AttentionBackend):
    """Paged attention on ``neuron`` tensors through SDPA or the NKI-lib kernels."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        # fewer block ids per gather than vLLM's default 16 (a multiple of 32, as CPU_ATTN's)
        return 32

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # token-major blocks: one gather brings a request's keys and values in SDPA's order
        return (KVCacheLayout.LBNHC,)

    @staticmethod
    def get_name() -> str:
        return "NEURON_ATTN"

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type["NeuronAttentionImpl"]:
        return NeuronAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["NeuronAttentionMetadataBuilder"]:
        return NeuronAttentionMetadataBuilder


@dataclass
class NeuronAttentionMetadata:
    """Per-step metadata: device tensors for the kernels, host lists for the loop. Built once
    per step and shared by every layer."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor  # (num_tokens,) device; -1 marks padding tokens
    block_table: torch.Tensor  # (num_reqs, max_blocks) device
    query_start: list[int]  # num_reqs + 1 host offsets into the flattened tokens
    seq_lens_host: list[int]  # context length incl. this step's tokens
    num_decodes: int  # leading requests with exactly one query token
    seq_lens: torch.Tensor  # (num_reqs,) device, int32: context lengths for the decode kernel


class NeuronAttentionMetadataBuilder(AttentionMetadataBuilder[NeuronAttentionMetadata]):
    """Builds :class:`NeuronAttentionMetadata`; asks vLLM to put decode requests first."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig,
                              kv_cache_spec: AttentionSpec) -> AttentionCGSupport:
        # decode batches are two queued kernel calls per layer that read vLLM's persistent
        # slot, block-table and length buffers when they run; the NKI path runs the simulator
        # on the host at the call, which a graph cannot record
        if _use_nki():
            return AttentionCGSupport.NEVER
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self._init_reorder_batch_threshold(1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> NeuronAttentionMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        query_start = m.query_start_loc_cpu[: n + 1].tolist()
        # host copy of the context lengths: exact here (no async scheduling, no speculation)
        host = m.seq_lens_cpu_upper_bound
        seq_lens_host = (host[:n] if host is not None else m.seq_lens[:n].cpu()).tolist()
        nd = 0
        while nd < n and query_start[nd + 1] - query_start[nd] == 1:
            nd += 1
        return NeuronAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens, slot_mapping=m.slot_mapping,
            block_table=m.block_table_tensor, query_start=query_start,
            seq_lens_host=seq_lens_host, num_decodes=nd, seq_lens=m.seq_lens)


def token_major(kv_cache: torch.Tensor) -> torch.Tensor:
    """The layer's cache in its memory order, ``[num_blocks, block_size, kv_heads, 2 * head]``
    (each token's keys, then its values, for every head)."""
    tm = kv_cache.permute(0, 2, 1, 3)
    if not tm.is_contiguous():
        raise RuntimeError(
            "NEURON_ATTN expects its KV cache in the LBNHC layout (token-major blocks); got "
            f"strides {tuple(kv_cache.stride())} for shape {tuple(kv_cache.shape)}")
    return tm


def _split(rows: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., tokens, kv_heads, 2 * head]`` -> key and value views ``[..., kv_heads, tokens,
    head]`` (no copy)."""
    return rows[..., :head].transpose(-3, -2), rows[..., head:].transpose(-3, -2)


class NeuronAttentionImpl(AttentionImpl[NeuronAttentionMetadata]):
    """Decoder self-attention over the paged KV cache on ``neuron``."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        unsupported = [name for name, bad in (
            ("ALiBi", alibi_slopes is not None), ("sliding window", sliding_window is not None),
            ("logits soft-cap", bool(logits_soft_cap)), ("attention sinks", sinks is not None),
            (f"KV cache dtype {kv_cache_dtype!r}", kv_cache_dtype not in _KV_FP8 and kv_cache_dtype != "auto"),
            (f"attention type {attn_type!r}", attn_type != AttentionType.DECODER)) if bad]
        if unsupported:
            raise NotImplementedError(
                f"NEURON_ATTN does not implement {', '.join(unsupported)}; "
                "serve this model with attention_backend='CPU_ATTN'")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.gqa = num_heads != num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        # FP8 cache: vLLM allocates it as uint8; the kernels see it as the FP8 type it holds
        self.fp8_dtype = _KV_FP8.get(kv_cache_dtype)
        self.use_nki = _use_nki()
        if self.use_nki and self.fp8_dtype is not None:
            raise NotImplementedError("TORCHNEURON_NKI_SDPA=1 with an FP8 KV cache is not implemented: "
                                      "the NKI attention kernel reads the model's dtype")
        if self.use_nki and head_size > 128:
            raise NotImplementedError(f"TORCHNEURON_NKI_SDPA=1: the NKI attention kernel "
                                      f"needs head_size <= 128, got {head_size}")

    # ---- KV cache write -------------------------------------------------------------------
    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor,
                           value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        # one kernel call: no host sync on the padding test, no masked copies of key/value
        tm = self._cache(kv_cache)
        if self.fp8_dtype is not None:  # codes of key / k_scale, saturated (vLLM's CUDA rounding)
            key, value = self._quantize(key, layer._k_scale_float), self._quantize(value, layer._v_scale_float)
        torch.ops.torchneuron.paged_kv_write(key, value, tm, slot_mapping)

    def _cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer's cache, token-major, as the FP8 type it holds when it is an FP8 cache."""
        tm = token_major(kv_cache)
        return tm if self.fp8_dtype is None else tm.view(self.fp8_dtype)

    def _quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        limit = torch.finfo(self.fp8_dtype).max
        return (x.float() / scale).clamp(-limit, limit).to(self.fp8_dtype)

    # ---- attention ------------------------------------------------------------------------
    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: NeuronAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``query`` [tokens, heads, head], ``key``/``value`` [tokens, kv_heads, head] (already
        written to ``kv_cache``); writes ``output`` [tokens, heads, head] and returns it."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("NEURON_ATTN: fused output quantization is not supported")
        if attn_metadata is None:  # profiling run without a KV cache
            return output
        md = attn_metadata
        tm = self._cache(kv_cache)
        self._scales = (layer._k_scale_float, layer._v_scale_float)
        block_size = tm.shape[1]
        qs, lens = md.query_start, md.seq_lens_host
        first = 0
        if md.num_decodes and not self.use_nki:
            first = md.num_decodes
            self._decodes(query, tm, md, output)
        for i in range(first, len(lens)):
            q0, q1, ctx = qs[i], qs[i + 1], lens[i]
            if q1 == q0:
                continue
            blocks = md.block_table[i, :-(-ctx // block_size)]
            out = (self._nki_request if self.use_nki else self._sdpa_request)(
                query[q0:q1], key[q0:q1], value[q0:q1], tm, blocks, ctx)
            output[q0:q1].copy_(out.view(q1 - q0, self.num_heads, -1))
        return output

    def _gather(self, tm: torch.Tensor, blocks: torch.Tensor, length: int, dtype: torch.dtype):
        """Cached keys and values of one request, ``[kv_heads, length, head]`` (views; an FP8
        cache's dequantized to ``dtype``)."""
        rows = tm.index_select(0, blocks)  # [blocks, block_size, kv_heads, 2 * head]
        rows = rows.view(-1, rows.shape[2], rows.shape[3])[:length]
        k, v = _split(rows, self.head_size)
        if self.fp8_dtype is not None:  # dequantized in fp32, then the model's dtype
            k = (k.float() * self._scales[0]).to(dtype)
            v = (v.float() * self._scales[1]).to(dtype)
        return k, v

    def _decodes(self, query, tm, md, output) -> None:
        """All decode requests in one paged-attention kernel call, written into ``output``."""
        _CALLS["decode_batch"] += 1
        nd = md.num_decodes
        torch.ops.torchneuron.paged_decode_attention(
            query[:nd], tm, md.block_table, md.seq_lens, self.scale,
            output[:nd].view(nd, self.num_heads, self.head_size), *self._scales)

    def _sdpa_request(self, q, k_new, v_new, tm, blocks, ctx):
        n = q.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, head]
        # (an FP8 cache: every request reads the cached, quantized keys and values, as the
        # decode kernel does and as vLLM's CUDA backends read their paged caches)
        if n == ctx and self.fp8_dtype is None:  # plain prefill: its own keys, top-left = bottom-right causal
            _CALLS["prefill"] += 1
            out = F.scaled_dot_product_attention(
                qh, k_new.transpose(0, 1).unsqueeze(0), v_new.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=self.scale, enable_gqa=self.gqa)
        else:  # continuation: cached context + this step's tokens (already in the cache)
            _CALLS["continuation"] += 1
            k, v = self._gather(tm, blocks, ctx, q.dtype)
            pos_q = torch.arange(ctx - n, ctx, device=q.device)
            keep = torch.arange(ctx, device=q.device)[None, :] <= pos_q[:, None]
            out = F.scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0),
                                                 attn_mask=keep, scale=self.scale,
                                                 enable_gqa=self.gqa)
        return out[0].transpose(0, 1)  # [n, heads, head]

    def _nki_request(self, q, k_new, v_new, tm, blocks, ctx):
        from torchneuron.nkilib.attention import attention_cte

        _CALLS["nki"] += 1
        n = q.shape[0]
        prior = ctx - n
        kwargs = {}
        if prior > 0:
            k, v = self._gather(tm, blocks, prior, q.dtype)
            kwargs = dict(k_prior=k.contiguous(), v_prior=v.contiguous(), prior_used_len=prior)
        out = attention_cte(q.transpose(0, 1).contiguous(), k_new.transpose(0, 1).contiguous(),
                            v_new.transpose(0, 1).contiguous(), scale=self.scale,
                            causal_mask=True, tp_q=True, tp_k=True, tp_out=False, **kwargs)
        return out.transpose(0, 1)  # [n, heads, head]
