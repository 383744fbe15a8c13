"""What compile_graph (torchneuron/compile/backend.py) hands to Inductor and counts in the metrics:
the Inductor config built from the defaults, the mode and the user's options, and the
recompilation counter. Inductor's ``compile_fx`` is replaced by a recorder where only its
arguments matter; the recompilation test compiles for real.
"""

import torch
import torch.fx
import torch._inductor.compile_fx as inductor_compile_fx
from torch._inductor import list_mode_options

from compile_models import DEV
from torchneuron.compile import backend
from torchneuron.compile.cache import graph_source_key


def _gm() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)


def _config_patches(monkeypatch, **kwargs) -> dict:
    """The config_patches compile_graph passes to Inductor's compile_fx."""
    seen = {}

    def recorder(gm, example_inputs, inner_compile=None, config_patches=None):
        seen["config_patches"] = config_patches
        return gm.forward

    monkeypatch.setattr(inductor_compile_fx, "compile_fx", recorder)
    gm = _gm()
    backend.compile_graph(gm, [torch.randn(4)], **kwargs)
    patches = dict(seen["config_patches"])
    # every compilation keys Inductor's caches on the graph's source locations (see cache.py)
    (source_pass,) = patches.pop("post_grad_custom_post_pass")
    assert source_pass.uuid() == f"torchneuron-source-{graph_source_key(gm)}"
    return patches


def test_inductor_keeps_user_layouts_by_default(monkeypatch):
    assert _config_patches(monkeypatch) == {"layout_optimization": False}


def test_a_mode_adds_its_inductor_options_without_cudagraphs(monkeypatch):
    patches = _config_patches(monkeypatch, mode="max-autotune-no-cudagraphs")
    expected = {"layout_optimization": False, **list_mode_options("max-autotune-no-cudagraphs"),
                "triton.cudagraphs": False}
    assert patches == expected


def test_graph_modes_replay_neuron_graphs_through_inductors_policy(monkeypatch):
    from torchneuron.compile.graphs import NeuronGraphPolicy

    for kwargs in ({"mode": "reduce-overhead"}, {"options": {"triton.cudagraphs": True}}):
        patches = _config_patches(monkeypatch, **kwargs)
        assert isinstance(patches.pop("cudagraph_policy"), NeuronGraphPolicy)
        assert patches["triton.cudagraphs"] is True and patches["triton.cudagraph_trees"] is False
        assert patches["graph_partition"] is False and patches["triton.cudagraph_support_input_mutation"]


def test_user_options_override_the_defaults_and_fallback_is_not_passed_on(monkeypatch):
    patches = _config_patches(monkeypatch, options={"layout_optimization": True, "max_fusion_size": 7,
                                                    "fallback_execution": False})
    assert patches == {"layout_optimization": True, "max_fusion_size": 7}


def test_a_users_post_grad_passes_are_kept_before_the_source_key_pass(monkeypatch):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "user-pass-v1"

    first, second = UserPass(), UserPass()
    seen = {}

    def recorder(gm, example_inputs, inner_compile=None, config_patches=None):
        seen["passes"] = config_patches["post_grad_custom_post_pass"]
        return gm.forward

    monkeypatch.setattr(inductor_compile_fx, "compile_fx", recorder)
    for user in (first, [first, second]):
        backend.compile_graph(_gm(), [torch.randn(4)], options={"post_grad_custom_post_pass": user})
        *kept, source_pass = seen["passes"]
        assert kept == (user if isinstance(user, list) else [user])
        assert source_pass.uuid().startswith("torchneuron-source-")


def test_a_users_post_grad_pass_runs_in_a_real_neuron_compilation():
    import uuid

    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Recording(CustomGraphPass):
        def __call__(self, graph):
            seen.append(sum(1 for n in graph.nodes if n.op == "call_function"))

        def uuid(self):
            return f"recording-{run}"  # new per run: a cache hit would skip the pass

    run = uuid.uuid4().hex
    torch._dynamo.reset()

    def f(x):
        return torch.relu(x) * 3

    cf = torch.compile(f, backend="neuron", options={"post_grad_custom_post_pass": Recording()})
    x = torch.randn(8, device=DEV)
    torch.testing.assert_close(cf(x).cpu(), f(x.cpu()))
    assert seen and seen[0] >= 1


def test_a_second_compile_of_the_same_frame_counts_as_one_recompilation(metrics):
    torch._dynamo.reset()

    def f(x):
        return x * 2 + 1

    cf = torch.compile(f, backend="neuron", dynamic=False)
    for dtype in (torch.float32, torch.float64):  # a dtype change fails the guards: recompile
        x = torch.arange(6, dtype=dtype, device=DEV)
        torch.testing.assert_close(cf(x).cpu(), f(x.cpu()))
    m = metrics()
    assert (m["compilations"], m["recompilations"]) == (2, 1)
