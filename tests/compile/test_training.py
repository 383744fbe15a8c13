"""Training under compile: forward, backward and optimizer steps, vs eager CPU."""

import pytest
import torch

from compile_models import DEV, MLP, assert_close, clone_to


def _train(model, opt, step_fn, batches):
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        step_fn()
        losses.append(loss.item())
    return losses


def test_mlp_training_with_compiled_optimizer_step_matches_eager(metrics):
    torch.manual_seed(0)
    ref = MLP()
    dev_model = clone_to(ref, DEV)
    batches = [(torch.randn(16, 16), torch.randint(0, 8, (16,))) for _ in range(3)]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt_dev = torch.optim.AdamW(dev_model.parameters(), lr=1e-2, foreach=False)

    compiled_model = torch.compile(dev_model, backend="neuron")

    @torch.compile(backend="neuron")
    def compiled_step():
        opt_dev.step()

    ref_losses = _train(ref, opt_ref, opt_ref.step, batches)
    dev_losses = _train(compiled_model, opt_dev, compiled_step,
                        [(x.to(DEV), y.to(DEV)) for x, y in batches])
    assert dev_losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)
    for p_ref, p in zip(ref.parameters(), dev_model.parameters()):
        assert p.device == DEV
        assert_close(p, p_ref, atol=1e-4, rtol=1e-4)
    m = metrics()
    assert m["compilations"] >= 2 and m["graphs_lowered"] >= 3  # model fwd+bwd, optimizer


def test_tiny_llama_trains_like_eager():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    dev_model = clone_to(ref, DEV)
    compiled = torch.compile(dev_model, backend="neuron")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_dev = torch.optim.SGD(dev_model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    ref_losses, dev_losses = [], []
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        for model, opt, losses, dev in ((ref, opt_ref, ref_losses, "cpu"),
                                         (compiled, opt_dev, dev_losses, DEV)):
            opt.zero_grad(set_to_none=True)
            out = model(input_ids=ids.to(dev), labels=ids.to(dev))
            out.loss.backward()
            opt.step()
            losses.append(out.loss.item())
    assert dev_losses == pytest.approx(ref_losses, rel=1e-3)
    assert dev_losses[-1] < dev_losses[0]


def test_dropout_in_compiled_training_masks_output_and_gradient_consistently():
    torch.manual_seed(0)
    x = torch.randn(64, 64, device=DEV, requires_grad=True)
    f = torch.compile(lambda x: torch.nn.functional.dropout(x * 1.0, p=0.5, training=True),
                      backend="neuron")
    out = f(x)
    out.sum().backward()
    kept = out.detach() != 0
    assert 0.4 < kept.float().mean().item() < 0.6
    assert_close(out, torch.where(kept, x.detach() * 2, torch.zeros_like(out)))
    assert_close(x.grad, kept.float() * 2)
