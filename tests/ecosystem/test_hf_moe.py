"""A Hugging Face MoE model (Qwen2-MoE) on its default experts path: ``grouped_mm`` experts
(transformers/integrations/moe.py), which on any device but cpu/mps counts tokens per expert
with an *integer* ``torch.histc`` (CUDA's contract). Forward and backward against CPU."""

import copy

import torch
from torch.testing import assert_close


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=32, shared_expert_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, decoder_sparse_step=1)
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(cfg)


def test_qwen2_moe_default_grouped_mm_experts_train_step_matches_cpu():
    ref = _qwen2_moe()
    dev = copy.deepcopy(ref).to("neuron")
    assert dev.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    out_ref = ref(input_ids=ids, labels=ids, output_router_logits=True)
    out_ref.loss.backward()
    out = dev(input_ids=ids.to("neuron"), labels=ids.to("neuron"), output_router_logits=True)
    out.loss.backward()
    assert_close(out.logits.detach().cpu(), out_ref.logits.detach(), atol=1e-5, rtol=1e-4)
    assert_close(out.loss.detach().cpu(), out_ref.loss.detach(), atol=1e-5, rtol=1e-5)
    for (n, p), (_, q) in zip(dev.named_parameters(), ref.named_parameters()):
        assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
