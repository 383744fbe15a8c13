"""The shared profile: the demo GPT trained for a few steps under torch.profiler, once per
session (profiling is the expensive part; most tests only read the result)."""

import json
import os

import pytest
import torch
from profiling_helpers import ACTIVITIES, small_gpt, train_step


@pytest.fixture(scope="session")
def gpt_profile(tmp_path_factory):
    """(profiler, trace dict, directory) of 3 recorded GPT training steps (1 warmup)."""
    from torch.profiler import profile, schedule

    model, cfg = small_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, cfg, 0)
    out = tmp_path_factory.mktemp("gpt_profile")
    with profile(activities=ACTIVITIES, schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
                 record_shapes=True, profile_memory=True) as prof:
        for s in range(4):
            train_step(model, opt, cfg, s + 1)
            prof.step()
    path = os.path.join(out, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    return prof, trace, str(out)


