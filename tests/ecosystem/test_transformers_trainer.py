"""The transformers Trainer picks neuron by itself (``torch_neuronx`` is installed): no device
argument anywhere, ``bf16=True`` accepted, ``torch_compile=True`` compiles with the ``neuron``
backend. Losses are compared with the same Trainer on CPU (``use_cpu=True``)."""

import pytest
import torch
from torch.testing import assert_close

from hf_support import lm_dataset, reset_accelerate_state, tiny_llama

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

STEPS = 4


def _train(tmp_path, tokenizer, **args):
    from transformers import Trainer, TrainingArguments

    reset_accelerate_state()
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                              max_steps=STEPS, learning_rate=1e-3, logging_steps=1,
                              report_to=[], save_strategy="no", seed=0, data_seed=0,
                              dataloader_num_workers=0, **args)
    model = tiny_llama(len(tokenizer))
    trainer = Trainer(model=model, args=targs, train_dataset=lm_dataset(tokenizer))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS
    return targs, trainer, torch.tensor(losses)


@pytest.fixture(scope="module")
def cpu_fp32_losses(tmp_path_factory, word_tokenizer):
    _, _, ref = _train(tmp_path_factory.mktemp("cpu"), word_tokenizer, use_cpu=True)
    return ref


def test_trainer_trains_on_neuron_without_being_told_and_matches_cpu(tmp_path, word_tokenizer,
                                                                     cpu_fp32_losses):
    targs, trainer, losses = _train(tmp_path, word_tokenizer)
    assert targs.device == torch.device("neuron:0")
    assert next(trainer.model.parameters()).device.type == "neuron"
    assert_close(losses, cpu_fp32_losses, atol=1e-4, rtol=1e-4)


def test_trainer_bf16_on_neuron_matches_cpu_bf16(tmp_path, word_tokenizer):
    targs, trainer, losses = _train(tmp_path, word_tokenizer, bf16=True)
    assert targs.device.type == "neuron" and trainer.accelerator.mixed_precision == "bf16"
    _, _, ref = _train(tmp_path, word_tokenizer, bf16=True, use_cpu=True)
    assert_close(losses, ref, atol=3e-2, rtol=1e-2)


def test_trainer_torch_compile_uses_the_neuron_backend_and_matches_cpu(tmp_path, word_tokenizer,
                                                                       cpu_fp32_losses):
    torch.neuron.reset_dynamo_metrics()
    targs, _, losses = _train(tmp_path, word_tokenizer, torch_compile=True)
    assert targs.torch_compile_backend == "neuron"
    assert torch.neuron.get_dynamo_metrics()["compilations"] >= 1
    assert_close(losses, cpu_fp32_losses, atol=1e-4, rtol=1e-4)


def test_generate_with_static_cache_compiles_by_itself_on_neuron_and_matches_cpu(word_tokenizer):
    # transformers compiles the decoding step of a static cache automatically on neuron
    # (generation/utils.py lists it as compile hardware), with the default Inductor backend.
    model = tiny_llama(len(word_tokenizer)).eval()
    prompt = word_tokenizer(["the cat sat on"], return_tensors="pt")
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static",
              pad_token_id=word_tokenizer.pad_token_id)
    ref = model.generate(**prompt, **kw)
    torch.neuron.reset_dynamo_metrics()
    dev = model.to("neuron")
    out = dev.generate(**{k: v.to("neuron") for k, v in prompt.items()}, **kw)
    m = torch.neuron.get_dynamo_metrics()
    assert m["compilations"] >= 1
    assert m["graph_replays"] >= 1  # its mode="reduce-overhead" replays neuron graphs
    assert out.cpu().tolist() == ref.tolist()
