"""On-disk compile cache shared across processes."""

import json
import os

from support import run_python

_PROGRAM = r"""
import json, torch
import torchneuron.compile as tnc
tnc.register()
torch.neuron.reset_dynamo_metrics()
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to("neuron")
with torch.no_grad():
    out = torch.compile(m, backend="neuron")(torch.ones(8, 16, device="neuron"))
print(json.dumps(torch.neuron.get_dynamo_metrics()))
"""


def _run(cache_dir):
    r = run_python(_PROGRAM, env={"TORCHNEURON_COMPILE_CACHE_DIR": str(cache_dir)}, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_second_process_hits_the_disk_cache(tmp_path):
    first = _run(tmp_path)
    assert first["cache_hits"] == 0 and first["cache_misses"] >= 1
    assert any(os.scandir(tmp_path)), "nothing written to TORCHNEURON_COMPILE_CACHE_DIR"
    second = _run(tmp_path)
    assert second["compilations"] == 1
    assert second["cache_hits"] >= 1 and second["cache_misses"] == 0


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    from torchneuron.compile import cache

    monkeypatch.setenv("TORCHNEURON_COMPILE_CACHE_DIR", str(tmp_path / "c"))
    assert os.path.dirname(cache.cache_dir()) == str(tmp_path / "c")
    monkeypatch.delenv("TORCHNEURON_COMPILE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert os.path.dirname(cache.cache_dir()) == str(tmp_path / "xdg" / "torchneuron" / "compile")


def test_cache_is_separated_by_code_generator_and_tanh_variant(tmp_path, monkeypatch):
    # Inductor's key does not cover torchneuron's codegen: a stale artifact must not hit.
    from torchneuron.compile import cache

    monkeypatch.setenv("TORCHNEURON_COMPILE_CACHE_DIR", str(tmp_path))
    fast = os.path.basename(cache.cache_dir())
    monkeypatch.setenv("TORCHNEURON_COMPILE_FAST_TANH", "0")
    precise = os.path.basename(cache.cache_dir())
    assert fast.startswith("gen-") and precise == fast + "-precise-tanh"


def test_cache_dir_is_scoped_to_neuron_compilations(tmp_path, monkeypatch):
    from torchneuron.compile import cache

    monkeypatch.setenv("TORCHNEURON_COMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    with cache.scoped() as path:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path
        assert os.path.dirname(path) == str(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"


def test_source_key_changes_with_a_nodes_stack_trace_and_module_path():
    import torch

    from torchneuron.compile.cache import graph_source_key

    gm = torch.fx.symbolic_trace(lambda x: torch.sin(x) + 1)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["stack_trace"] = '  File "a.py", line 3, in f\n'
    key = graph_source_key(gm)
    assert graph_source_key(gm) == key
    node.meta["stack_trace"] = '  File "a.py", line 4, in f\n'
    moved = graph_source_key(gm)
    assert moved != key
    node.meta["nn_module_stack"] = {"L__self__": ("L['self'].proj", torch.nn.Linear)}
    assert graph_source_key(gm) not in (key, moved)


def test_source_key_pass_keys_the_cache_and_leaves_the_graph_alone():
    import torch

    from torchneuron.compile.cache import source_key_pass

    gm = torch.fx.symbolic_trace(lambda x: torch.sin(x) + 1)
    before = str(gm.graph)
    source_key_pass("k1")(gm.graph)
    assert str(gm.graph) == before
    assert source_key_pass("k1").uuid() == source_key_pass("k1").uuid()
    assert source_key_pass("k1").uuid() != source_key_pass("k2").uuid()
