"""Helpers of the profiler tests (a small demo GPT, its training step, trace queries)."""

import json
import os
import sys

import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.PrivateUse1]


def small_gpt():
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return GPT(cfg).to("neuron"), cfg


def train_step(model, opt, cfg, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g)
    x, y = x.to("neuron"), y.to("neuron")
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def device_events(trace, kind=None):
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"
            and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in e.get("args", {})
            and (kind is None or e["args"].get("kind") == kind)]
