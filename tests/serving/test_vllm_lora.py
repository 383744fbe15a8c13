"""Multi-LoRA serving on neuron (vLLM's PyTorch-native punica ops, as on its CPU platform):
tokens through an adapter against Hugging Face with the adapter merged (PEFT), the base model
for requests without one, both in one batch."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from serving_support import result_of  # noqa: E402


def test_adapter_tokens_match_hugging_face_with_the_adapter_merged(engines, lora_hf):
    assert result_of(engines, "lora")["lora"] == lora_hf


def test_requests_without_an_adapter_get_the_base_models_tokens(engines, llama_hf, lora_hf):
    assert lora_hf != llama_hf["greedy"]  # (the adapter changes the tokens)
    assert result_of(engines, "lora")["base"] == llama_hf["greedy"]


def test_one_batch_mixes_adapter_and_base_requests(engines, llama_hf, lora_hf):
    assert result_of(engines, "lora")["mixed"] == [lora_hf[0], llama_hf["greedy"][1], lora_hf[2]]


def test_lora_engines_run_the_model_eagerly_even_when_compilation_is_asked(engines):
    r = result_of(engines, "lora")
    assert (r["compilation_mode"], r["cudagraph_mode"]) == ("NONE", "NONE")
