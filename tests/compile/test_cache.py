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
