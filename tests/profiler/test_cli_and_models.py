"""`torchneuron profile run` on an unmodified example, and profiles of a tiny HF Llama."""

import json
import os
import subprocess
import sys

import pytest
import torch
from profiling_helpers import ACTIVITIES, EXAMPLES, device_events
from support import REPO


def test_profile_run_profiles_an_unmodified_example_script(tmp_path):
    out = tmp_path / "prof"
    r = subprocess.run(
        [sys.executable, "-m", "torchneuron.cli", "profile", "run", "--steps", "1:3", "--out", str(out),
         os.path.join(EXAMPLES, "train_gpt.py"), "--steps", "4", "--batch-size", "2"],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "estimated Trainium2 step" in r.stdout and "top findings" in r.stdout
    rank = out / "rank_0"
    for name in ("SystemProfileEvents", "FrameworkNode", "Summary", "Metadata", "trace.json"):
        assert (rank / (name if name.endswith(".json") else name + ".parquet")).exists()
    assert (out / "report.html").exists() and (out / "report.md").exists()
    import pyarrow.parquet as pq

    (summary,) = pq.read_table(rank / "Summary.parquet").to_pylist()
    assert summary["steps"] == 2  # --steps 1:3 records optimizer steps 1 and 2


@pytest.mark.parametrize("argv, message", [
    (["profile", "run", "--steps", "3:1", "x.py"], "need 0 <= A < B"),
    (["profile", "run", "missing_script.py"], "no such script"),
    (["profile", "report", "/nonexistent/dir"], "no profile in"),
])
def test_profile_cli_rejects_bad_input_with_a_clear_message(argv, message, capsys):
    from torchneuron.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_tiny_hf_llama_kernels_are_attributed_to_its_modules(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("neuron")
    ids = torch.randint(0, 64, (1, 16)).to("neuron")
    model(input_ids=ids, labels=ids).loss.backward()  # warm up
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    t = json.loads(path.read_text())
    evs = device_events(t)
    mods = {e["args"].get("module") for e in evs}
    assert "LlamaForCausalLM.model.layers.1.self_attn.q_proj" in mods
    assert "LlamaForCausalLM.model.layers.0.mlp.down_proj" in mods
    attn = [e for e in evs if "attention" in e["name"]]
    assert attn and all(e["args"]["flops"] > 0 and e["args"]["engine"] == "tensor" for e in attn)
    from torchneuron.profiler.analysis import analyze_trace

    a = analyze_trace(t)
    assert a.steps and a.steps[0]["flops"] > 0 and a.steps[0]["est_ns"] > 0
