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


def build_fp8_block_checkpoint(path: str) -> str:
    """A serialized block-FP8 checkpoint (DeepSeek and Qwen3 FP8 checkpoints' format: vLLM's
    ``fp8`` method, ``weight_block_size`` [128, 128], dynamic activations): a random Llama of
    hidden size 256 (q/k/v shards of 256/128/128 rows, whole blocks), its projections stored as
    e4m3 codes with ``weight_scale_inv`` per block (:func:`fp8_weight`), the rest bf16."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    build_llama(path, hidden=256)
    file = os.path.join(path, "model.safetensors")
    out = {}
    for key, value in load_file(file).items():
        if key.endswith("_proj.weight"):
            codes, scale = fp8_weight([value.to(torch.bfloat16)], "fp8_per_block")
            out[key], out[key.replace(".weight", ".weight_scale_inv")] = codes.contiguous(), scale.contiguous()
        else:
            out[key] = value.to(torch.bfloat16)
    save_file(out, file)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "bfloat16"
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "fmt": "e4m3"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
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


FP8_MAX = 448.0  # float8_e4m3fn
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's smallest dynamic scale


def _to_fp8(x):
    import torch

    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_weight(weights: list, scheme: str):
    """vLLM's online FP8 quantization of one vLLM layer's weight (``weights``: the [out, in]
    matrices it fuses, e.g. q, k and v): the e4m3 codes [sum(out), in] and the fp32 scale
    ([1, 1] per tensor, [out, 1] per channel).

    - ``"fp8_per_tensor"``: one scale ``amax / 448`` over the fused weight, codes
      ``w * (1 / scale)`` rounded;
    - ``"fp8_per_channel"``: a scale per output row, ``max(amax / 448, 1 / (448 * 512))``,
      codes ``w / scale`` rounded;
    - ``"fp8_per_block"``: a scale per 128x128 block (zero-padded at the edges),
      ``max(amax, 1e-4) / 448``, codes ``w * (1 / scale)`` rounded; scale [out / 128, in / 128]."""
    import torch

    w = torch.cat([x.detach().float() for x in weights])
    if scheme == "fp8_per_tensor":
        s = (w.abs().max() / FP8_MAX).reshape(1, 1)
        return _to_fp8(w * s.reciprocal()), s
    if scheme == "fp8_per_block":
        n, k = w.shape
        nb, kb = -(-n // 128), -(-k // 128)
        padded = torch.zeros(nb * 128, kb * 128)
        padded[:n, :k] = w
        blocks = padded.view(nb, 128, kb, 128)
        s = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / FP8_MAX
        codes = _to_fp8(blocks * (1.0 / s)).view(nb * 128, kb * 128)[:n, :k]
        return codes, s.view(nb, kb)
    s = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    return _to_fp8(w / s), s


def _fp8_block_linear(x2, codes, scale):
    """fp8_linear for 128x128 weight blocks: activations in dynamic 1x128 groups (scale
    ``max(amax / 448, 1 / (448 * 512))``, codes ``x / scale`` rounded); per 128-wide K block the
    exact products summed in fp32, times the activation group's and the weight block's scales,
    the blocks added in fp32. ``scale`` is [out / 128, in / 128] or one row per output row."""
    import torch

    n, k = codes.shape
    rows = scale if scale.shape[0] == n else scale.repeat_interleave(128, dim=0)[:n]
    total = torch.zeros(x2.shape[0], n)
    for j, k0 in enumerate(range(0, k, 128)):
        xs = x2[:, k0:k0 + 128]
        sa = (xs.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
        qa = _to_fp8(xs / sa).float()
        total += ((qa @ codes[:, k0:k0 + 128].float().t()) * sa) * rows[:, j].reshape(1, -1)
    return total


def fp8_linear(x, codes, scale, scheme: str):
    """A quantized layer's output as TensorE computes it: the activation ``x`` [tokens, in]
    quantized dynamically (per tensor for ``"fp8_per_tensor"``, per token for
    ``"fp8_per_channel"``; scale ``max(amax / 448, 1 / (448 * 512))``, codes ``x * (1 / scale)``
    rounded), the exact products of the codes summed in fp32, times both scales, rounded once to
    ``x``'s dtype (``"fp8_per_block"``: :func:`_fp8_block_linear`)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if scheme == "fp8_per_block":
        return _fp8_block_linear(x2, codes, scale).to(x.dtype).reshape(*x.shape[:-1], -1)
    amax = x2.abs().amax() if scheme == "fp8_per_tensor" else x2.abs().amax(dim=-1, keepdim=True)
    sa = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    qa = _to_fp8(x2 * sa.reciprocal()).float()
    y = (qa @ codes.float().t()) * (sa * scale.reshape(1, -1))
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def fp8_groups(layer) -> list:
    """The projections of an HF Llama decoder layer as vLLM fuses them into its layers:
    qkv_proj, o_proj, gate_up_proj, down_proj."""
    a, m = layer.self_attn, layer.mlp
    return [[a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]]


def fp8_quantize_(model, scheme: str) -> None:
    """Make an HF Llama's projections compute as vLLM's online FP8 W8A8 method ``scheme``
    (``"fp8_per_tensor"``, ``"fp8_per_channel"``, ``"fp8_per_block"``) on TensorE: :func:`fp8_weight` per fused
    group, :func:`fp8_linear` per call."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            for group in fp8_groups(layer):
                codes, scale = fp8_weight([lin.weight for lin in group], scheme)
                if scheme == "fp8_per_block":  # one scale row per output row, sliced per shard
                    scale = scale.repeat_interleave(128, dim=0)[:codes.shape[0]]
                row = 0
                for lin in group:
                    n = lin.weight.shape[0]
                    c, sc = codes[row:row + n], scale if scale.numel() == 1 else scale[row:row + n]
                    lin.forward = lambda x, c=c, sc=sc: fp8_linear(x, c, sc, scheme)
                    row += n


def hf_greedy(path: str, prompts: list[str], max_tokens: int,
              with_logprobs: bool = False, adapter: str | None = None, fp8: str | None = None,
              dtype: str = "float32", kv_fp8: bool = False):
    """Greedy continuation token ids from Hugging Face on CPU, fp32 (the oracle); with
    ``with_logprobs`` also the log-probability of each chosen token; with ``adapter`` (a PEFT
    LoRA directory) through the adapter merged into the model; with ``fp8`` (a vLLM online
    FP8 scheme) through :func:`fp8_quantize_`'s projections; ``dtype`` the model's (vLLM's FP8
    methods take bf16 and fp16 models); with ``kv_fp8`` through an FP8 KV cache of scale 1 (vLLM's
    ``kv_cache_dtype="fp8"`` without scales: keys after the rotary embedding and values rounded
    to e4m3, saturated, before attention reads them)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    if fp8 is not None:
        fp8_quantize_(model, fp8)
    with _kv_fp8(model, kv_fp8):
        return _generate(tok, model, prompts, max_tokens, with_logprobs)


def _kv_fp8(model, enabled: bool):
    """Context: the Llama's cached keys (after rotary) and values rounded to e4m3."""
    import contextlib

    import torch
    from transformers.models.llama import modeling_llama

    @contextlib.contextmanager
    def rounded():
        if not enabled:
            yield
            return
        rope = modeling_llama.apply_rotary_pos_emb

        def fp8(x):
            return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)

        def rounded_rope(q, k, *args, **kwargs):
            q, k = rope(q, k, *args, **kwargs)
            return q, fp8(k)

        projections = [layer.self_attn.v_proj for layer in model.model.layers]
        for v_proj in projections:
            v_proj.register_forward_hook(lambda mod, inputs, out: fp8(out))
        modeling_llama.apply_rotary_pos_emb = rounded_rope
        try:
            yield
        finally:
            modeling_llama.apply_rotary_pos_emb = rope
            for v_proj in projections:
                v_proj._forward_hooks.clear()
    return rounded()


def _generate(tok, model, prompts, max_tokens, with_logprobs):
    import torch

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
