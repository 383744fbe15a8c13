"""TRL's SFTTrainer on neuron with no device argument (bf16 on by TRL's default), compared with
the same trainer on CPU. On neuron TRL pads batches to a multiple of 128 (``pad_to_multiple_of=
"auto"``, to bound recompilations); padding is masked, so the losses must still match CPU's."""

import pytest
import torch
from torch.testing import assert_close

from hf_support import SENTENCES, reset_accelerate_state, tiny_llama

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

STEPS = 3


def _sft(tmp_path, tokenizer, **args):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    reset_accelerate_state()
    cfg = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=STEPS, per_device_train_batch_size=4,
                    learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                    max_length=24, seed=0, data_seed=0, dataloader_num_workers=0, **args)
    trainer = SFTTrainer(model=tiny_llama(len(tokenizer)), args=cfg, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"text": SENTENCES * 2}))
    trainer.train()
    return cfg, trainer, torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])


def test_sft_trainer_picks_neuron_and_matches_cpu(tmp_path, word_tokenizer):
    cfg, trainer, losses = _sft(tmp_path, word_tokenizer)
    assert cfg.device.type == "neuron" and cfg.bf16
    assert cfg.pad_to_multiple_of == 128
    assert next(trainer.model.parameters()).device.type == "neuron"
    ref_cfg, _, ref = _sft(tmp_path, word_tokenizer, use_cpu=True)
    assert ref_cfg.pad_to_multiple_of is None and ref_cfg.bf16
    assert len(losses) == STEPS
    assert_close(losses, ref, atol=3e-2, rtol=1e-2)
