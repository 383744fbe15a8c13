"""TRL's SFTTrainer on neuron with no device argument (bf16 on by TRL's default), compared with
the same trainer on CPU. On neuron TRL pads batches to a multiple of 128 (``pad_to_multiple_of=
"auto"``, to bound recompilations); padding is masked, so the losses must still match CPU's."""

import pytest
import torch
from torch.testing import assert_close

from hf_support import SENTENCES, reset_accelerate_state, tiny_llama
from support import vllm_cache_root

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


GRPO_VLLM = """
import json, sys
sys.path.insert(0, {serving!r})
import torch
import tiny_models
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

path = tiny_models.build_llama({model!r})
tok = AutoTokenizer.from_pretrained(path)
tok.pad_token = tok.pad_token or tok.eos_token
prompts = ["Hello, my name is", "The neuron device runs", "A tiny model", "Serving large"] * 2
cfg = GRPOConfig(output_dir={out!r}, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                 max_completion_length=8, learning_rate=1e-4, logging_steps=1, report_to=[],
                 save_strategy="no", use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
                 vllm_gpu_memory_utilization=0.3, vllm_max_model_length=64, bf16=False, seed=0,
                 dataloader_num_workers=0)
trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32),
                      reward_funcs=lambda completions, **kw: [len(c) / 50 for c in completions],
                      args=cfg, train_dataset=Dataset.from_dict({{"prompt": prompts}}), processing_class=tok)
llm = trainer.vllm_generation.llm
trainer.train()
logs = [h for h in trainer.state.log_history if "loss" in h]
runner = llm.llm_engine.model_executor.driver_worker.model_runner
print("RESULT " + json.dumps({{
    "device": str(trainer.args.device), "vllm_device": str(runner.device),
    "losses": [h["loss"] for h in logs],
    "completion_length": [h["completions/mean_length"] for h in logs],
    "sleeping_after": llm.llm_engine.is_sleeping()}}))
"""


def test_grpo_generates_with_colocated_vllm_in_sleep_mode(tmp_path):
    """GRPO with vLLM colocated on the training device, the engine asleep between generations
    (TRL's vllm_enable_sleep_mode: the weights pushed to it before each generation)."""
    pytest.importorskip("vllm")
    import json
    import os
    import subprocess
    import sys

    serving = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serving")
    code = GRPO_VLLM.format(serving=serving, model=str(tmp_path / "llama"), out=str(tmp_path / "out"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHNEURON_DEVICE_MEMORY="1GiB",
               VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false",
               VLLM_CACHE_ROOT=vllm_cache_root(tmp_path))
    env.pop("VLLM_TARGET_DEVICE", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600, cwd=str(tmp_path))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["device"] == "neuron:0" and out["vllm_device"] == "neuron:0"
    assert len(out["losses"]) == 2 and all(abs(x) < 10 for x in out["losses"])
    assert all(n > 0 for n in out["completion_length"])  # vLLM generated the completions
    assert out["sleeping_after"]  # TRL puts it back to sleep after each generation
