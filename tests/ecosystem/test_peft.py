"""PEFT LoRA on neuron: training updates only the adapters, merging folds them into the base
weights; every step compared with the same PEFT model on CPU."""

import torch
import torch.nn.functional as F
from torch.testing import assert_close

from hf_support import clone, tiny_llama

TOL = dict(atol=1e-5, rtol=1e-4)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                     init_lora_weights="gaussian")  # non-zero B: the adapters change outputs
    torch.manual_seed(1)
    return get_peft_model(model, cfg)


def _train(model, ids, device, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = ids.to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return losses


def test_lora_train_and_merge_on_neuron_match_cpu():
    base = tiny_llama(64)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    ref = _lora(clone(base, "cpu"))
    dev = _lora(clone(base, "cpu")).to("neuron")
    trainable = {n for n, p in dev.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    assert_close(torch.tensor(_train(dev, ids, "neuron")), torch.tensor(_train(ref, ids, "cpu")), **TOL)
    for (n, p), (_, q) in zip(dev.named_parameters(), ref.named_parameters()):
        assert_close(p.detach().cpu(), q.detach(), **TOL, msg=lambda m: f"{n}: {m}")
        if "lora_" not in n:  # frozen base weights are untouched
            assert_close(p.detach().cpu(), dict(base.named_parameters())[n.split("base_model.model.")[-1].replace(".base_layer", "")].detach())

    merged_dev, merged_ref = dev.merge_and_unload(), ref.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged_dev.named_parameters())
    for (n, p), (_, q) in zip(merged_dev.named_parameters(), merged_ref.named_parameters()):
        assert p.device.type == "neuron"
        assert_close(p.detach().cpu(), q.detach(), **TOL, msg=lambda m: f"{n}: {m}")
    with torch.no_grad():
        logits = merged_dev(input_ids=ids.to("neuron")).logits
        assert_close(logits.cpu(), merged_ref(input_ids=ids).logits, **TOL)
        # the merge changed the model: it differs from the base
        assert (logits.cpu() - base(input_ids=ids).logits).abs().max() > 1e-3
