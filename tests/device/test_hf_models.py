"""Real Hugging Face transformers models (tiny, random-initialised, no downloads) run forward,
backward and generate on neuron with results matching CPU."""

import copy

import pytest
import torch

import transformers


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(params=[_llama, _gpt2], ids=["llama", "gpt2"])
def models(request):
    torch.manual_seed(0)
    cpu = request.param().eval()
    dev = copy.deepcopy(cpu).to("neuron")
    return cpu, dev


def test_forward_matches_cpu(models):
    cpu, dev = models
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        expected = cpu(ids).logits
        got = dev(ids.to("neuron")).logits
    assert got.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-4)


def test_backward_matches_cpu(models):
    cpu, dev = models
    ids = torch.randint(0, 128, (2, 16))
    cpu(ids, labels=ids).loss.backward()
    dev(ids.to("neuron"), labels=ids.to("neuron")).loss.backward()
    for (name, p_cpu), p_dev in zip(cpu.named_parameters(), dev.parameters()):
        assert p_dev.grad.device.type == "neuron"
        torch.testing.assert_close(p_dev.grad.cpu(), p_cpu.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_generate_matches_cpu(models):
    cpu, dev = models
    ids = torch.randint(0, 128, (1, 5))
    expected = cpu.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = dev.generate(ids.to("neuron"), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got.cpu(), expected)
