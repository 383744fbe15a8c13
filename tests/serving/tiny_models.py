"""Tiny random Hugging Face models for the serving tests and bench, built offline.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here with ``tokenizers`` on a
few sentences, the models are random ``LlamaForCausalLM`` / ``Qwen2MoeForCausalLM`` built from
configs (fp32, head_dim 32: vLLM's CPU attention kernels need head_dim >= 32) and saved with
``save_pretrained``. Weights are scaled up from the HF default init so that greedy decoding has
clear winners (no near-ties that rounding could flip).
"""

from __future__ import annotations

import os

CORPUS = [
    "The neuron device runs PyTorch on Trainium.",
    "Serving large language models needs a paged KV cache.",
    "vLLM schedules requests in batches and streams tokens back.",
    "A tiny model is enough to test that every token matches.",
    "Prefix caching reuses the keys and values of a shared prompt.",
    "Chunked prefill splits a long prompt over several steps.",
    "Tensor parallelism shards attention heads over two devices.",
    "hello world, how are you today? I am fine, thank you.",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(path: str, vocab_size: int = 384):
    """Train a byte-level BPE tokenizer and save it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def _scale_(model, factor: float) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(factor)


def build_llama(path: str, seed: int = 0, layers: int = 2, hidden: int = 128) -> str:
    """A random Llama (4 query heads, 2 KV heads of 32) with a trained tokenizer in ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 32,
                      num_key_value_heads=max(1, hidden // 64), head_dim=32,
                      max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(cfg).eval()
    _scale_(model, 4.0)
    model.save_pretrained(path)
    return path


def build_qwen2_moe(path: str, seed: int = 0) -> str:
    """A random Qwen2-MoE (4 experts, top-2, a shared expert; head_dim 32)."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    tok = build_tokenizer(path)
    torch.manual_seed(seed)
    cfg = Qwen2MoeConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                         moe_intermediate_size=64, shared_expert_intermediate_size=128,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, decoder_sparse_step=1,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                         torch_dtype="float32")
    model = Qwen2MoeForCausalLM(cfg).eval()
    _scale_(model, 4.0)
    model.save_pretrained(path)
    return path


def build_lora(base: str, path: str, seed: int = 1, rank: int = 8) -> str:
    """A PEFT LoRA adapter for the model at ``base`` (attention and MLP projections), with
    random B matrices (PEFT starts them at zero: no effect), saved at ``path``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    peft_model.save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[str], max_tokens: int,
              with_logprobs: bool = False, adapter: str | None = None):
    """Greedy continuation token ids from Hugging Face on CPU, fp32 (the oracle); with
    ``with_logprobs`` also the log-probability of each chosen token; with ``adapter`` (a PEFT
    LoRA directory) through the adapter merged into the model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    ids_out, lp_out = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok(p)["input_ids"]])
            gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            new = gen.sequences[0, ids.shape[1]:]
            ids_out.append(new.tolist())
            lp_out.append([torch.log_softmax(lg[0].float(), -1)[t].item()
                           for lg, t in zip(gen.logits, new)])
    return (ids_out, lp_out) if with_logprobs else ids_out


if __name__ == "__main__":  # build into a directory: python tiny_models.py DIR [llama|qwen2_moe]
    import sys

    d, kind = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "llama")
    os.makedirs(d, exist_ok=True)
    (build_llama if kind == "llama" else build_qwen2_moe)(d)
    print(d)
