"""The neuron platform's graph choices (NeuronPlatform.check_and_update_config, NEURON_ATTN's
graph support) on vLLM's config objects, without an engine."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from types import SimpleNamespace  # noqa: E402

from vllm.config import CompilationConfig, CompilationMode  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402

from torchneuron.vllm.platform import NeuronPlatform  # noqa: E402


def _configured(mode: CUDAGraphMode, world_size: int = 1, lora: bool = False,
                compilation: CompilationMode = CompilationMode.NONE) -> CompilationConfig:
    cc = CompilationConfig(mode=compilation, cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4])
    parallel = SimpleNamespace(worker_cls="auto", enable_dbo=False, world_size=world_size)
    NeuronPlatform.check_and_update_config(SimpleNamespace(
        scheduler_config=None, parallel_config=parallel, compilation_config=cc,
        lora_config=SimpleNamespace(max_lora_rank=8) if lora else None))
    return cc


def test_vllms_default_graph_mode_becomes_full_decode_graphs():
    cc = _configured(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert cc.cudagraph_capture_sizes == [1, 2, 4]


def test_graphs_are_off_with_more_than_one_worker():
    cc = _configured(CUDAGraphMode.FULL_DECODE_ONLY, world_size=2)
    assert cc.cudagraph_mode == CUDAGraphMode.NONE
    assert cc.cudagraph_capture_sizes == []


def test_graphs_switched_off_stay_off():
    assert _configured(CUDAGraphMode.NONE).cudagraph_mode == CUDAGraphMode.NONE


def test_neuron_attention_graphs_hold_single_token_decodes_and_never_the_nki_path(monkeypatch):
    from vllm.v1.attention.backend import AttentionCGSupport

    from torchneuron.vllm.attention import NeuronAttentionMetadataBuilder as Builder

    monkeypatch.delenv("TORCHNEURON_NKI_SDPA", raising=False)
    assert Builder.get_cudagraph_support(None, None) == \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # the NKI kernels run in the simulator on the host at the call: nothing a graph can record
    monkeypatch.setenv("TORCHNEURON_NKI_SDPA", "1")
    assert Builder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER


def test_lora_serving_runs_the_model_eagerly_without_graphs():
    # vLLM's PyTorch-native punica ops branch in Python on each step (prefill or decode, sizes):
    # a model traced once would keep the first step's branch
    cc = _configured(CUDAGraphMode.FULL_AND_PIECEWISE, lora=True, compilation=CompilationMode.VLLM_COMPILE)
    assert cc.mode == CompilationMode.NONE
    assert cc.cudagraph_mode == CUDAGraphMode.NONE and cc.cudagraph_capture_sizes == []


def test_lora_serving_uses_vllms_pytorch_native_punica_ops():
    assert NeuronPlatform.get_punica_wrapper() == "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"
