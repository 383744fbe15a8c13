"""Tiny models, tokenizers and data for the ecosystem tests (importable: tests/ecosystem is put
on sys.path by pytest's rootdir-relative import of conftest)."""

from __future__ import annotations

import copy
from typing import Any

import torch

SENTENCES = [
    "the cat sat on the mat", "a dog ran in the park", "the sun is bright today",
    "we train small models on neuron", "the loss goes down when we train",
    "a tiny model learns a tiny language", "every step moves the weights a little",
    "cats and dogs play in the sun", "the park is green and bright",
    "models read words and predict the next word",
]


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide singletons, so each run picks its device anew."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train_word_tokenizer():
    """Word-level tokenizer over SENTENCES with pad/eos/unk tokens, as a transformers
    ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(
        special_tokens=["<pad>", "<eos>", "<unk>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def tiny_llama(vocab_size: int, seed: int = 0, **overrides: Any):
    """A 2-layer Llama with random weights (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def lm_dataset(tokenizer, n: int = 16, length: int = 12):
    """A ``datasets.Dataset`` of fixed-length causal-LM examples (input_ids, labels)."""
    from datasets import Dataset

    rows = []
    for i in range(n):
        ids = tokenizer(SENTENCES[i % len(SENTENCES)] + " " + SENTENCES[(i + 3) % len(SENTENCES)],
                        padding="max_length", max_length=length, truncation=True)["input_ids"]
        rows.append({"input_ids": ids, "labels": list(ids)})
    return Dataset.from_list(rows)


def clone(model, device):
    return copy.deepcopy(model).to(device)
