"""How a compile failure is turned into a NeuronCompileError (torchneuron/compile/backend.py):
which op is named, which FX node and user line it is attributed to, and the message's fields.
Synthetic exceptions and hand-built graphs, so every rule is checked without running Inductor.
"""

import torch
import torch.fx

from torchneuron.compile.backend import NeuronCompileError, _compile_error, _node_location, _op_from_exception

TRACE = ('  File "/src/train.py", line 10, in main\n    loss = model(x)\n'
         '  File "/src/model.py", line 42, in forward\n    return torch.relu(h)\n')


def _graph(traces: dict) -> torch.fx.GraphModule:
    """x -> relu -> neg -> relu, with the given stack traces per node name."""
    def f(x):
        return torch.relu(torch.neg(torch.relu(x)))

    gm = torch.fx.symbolic_trace(f)
    for node in gm.graph.nodes:
        if node.name in traces:
            node.meta["stack_trace"] = traces[node.name]
    return gm


# --- which op ------------------------------------------------------------------------------------
def test_the_op_is_read_from_the_target_in_the_message():
    assert _op_from_exception(RuntimeError("lowering failed, target: aten.mm.default, args")) == "aten.mm.default"


def test_an_op_with_a_namespace_keeps_it():
    assert _op_from_exception(RuntimeError("target: torchneuron::paged_kv_write")) == "torchneuron::paged_kv_write"


def test_the_op_is_found_through_inner_exception_cause_and_context():
    for link in ("inner_exception", "__cause__", "__context__"):
        outer = RuntimeError("wrapper without a target")
        setattr(outer, link, ValueError("target: aten.add.Tensor"))
        assert _op_from_exception(outer) == "aten.add.Tensor", link


def test_the_outermost_target_wins():
    outer = RuntimeError("target: aten.outer.default")
    outer.__cause__ = RuntimeError("target: aten.inner.default")
    assert _op_from_exception(outer) == "aten.outer.default"


def test_no_target_anywhere_names_no_op():
    e = RuntimeError("no op here")
    e.__cause__ = KeyError("still none")
    assert _op_from_exception(e) is None


def test_a_cycle_of_causes_ends():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert _op_from_exception(a) is None


# --- which node and line -------------------------------------------------------------------------
def test_the_node_is_named_with_the_last_user_frame_of_its_stack():
    gm = _graph({"relu": TRACE})
    assert _node_location(gm, "torch.relu") == "node 'relu' (/src/model.py:42 in forward)"


def test_the_first_node_calling_the_op_is_chosen():
    gm = _graph({"relu": TRACE, "relu_1": TRACE.replace("42", "77")})
    assert _node_location(gm, "torch.relu") == "node 'relu' (/src/model.py:42 in forward)"


def test_a_node_without_a_stack_trace_has_unknown_source():
    assert _node_location(_graph({}), "torch.neg") == "node 'neg' (unknown source)"


def test_no_op_or_an_op_not_in_the_graph_has_no_location():
    gm = _graph({"relu": TRACE})
    assert _node_location(gm, None) is None
    assert _node_location(gm, "torch.sigmoid") is None


def test_inputs_and_outputs_are_not_calls():
    gm = _graph({})
    assert _node_location(gm, "x") is None
    assert _node_location(gm, "output") is None


def test_a_target_matches_by_its_full_name_or_suffix():
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    x = gm.graph.placeholder("x")
    node = gm.graph.call_function(torch.ops.aten.relu.default, (x,))
    gm.graph.output(node)
    assert _node_location(gm, "aten.relu.default") == "node 'relu_default' (unknown source)"
    assert _node_location(gm, "relu.default") == "node 'relu_default' (unknown source)"
    assert _node_location(gm, "aten.sigmoid.default") is None


# --- the error -----------------------------------------------------------------------------------
def test_the_error_names_stage_op_location_type_and_first_line():
    gm = _graph({"relu": TRACE})
    exc = RuntimeError("lowering torch.relu failed\nsecond line")
    exc.__cause__ = ValueError("target: torch.relu")
    err = _compile_error(exc, gm, "forward")
    assert isinstance(err, NeuronCompileError)
    assert str(err) == ("neuron backend could not compile the forward graph: op torch.relu at node 'relu' "
                        "(/src/model.py:42 in forward): RuntimeError: lowering torch.relu failed\n"
                        "(set TORCHNEURON_COMPILE_FALLBACK=1 to run such graphs eagerly instead)")
    assert err.op == "torch.relu"
    assert err.location == "node 'relu' (/src/model.py:42 in forward)"


def test_an_unknown_op_and_an_empty_message_are_said_so():
    err = _compile_error(KeyError(), _graph({}), "backward")
    assert str(err).startswith("neuron backend could not compile the backward graph: op <unknown> at "
                               "unknown location: KeyError: KeyError\n")
    assert err.op is None and err.location is None


def test_the_inner_exception_is_reported():
    outer = RuntimeError("wrapper")
    outer.inner_exception = TypeError("target: aten.mm.default bad dtype")
    err = _compile_error(outer, _graph({}), "forward")
    assert ": TypeError: target: aten.mm.default bad dtype\n" in str(err)


def test_a_neuron_compile_error_passes_through_unchanged():
    e = NeuronCompileError("already explained", op="aten.mm.default", location="node 'mm'")
    assert _compile_error(e, _graph({}), "forward") is e
    assert (e.op, e.location) == ("aten.mm.default", "node 'mm'")


def test_a_method_call_node_is_found_by_its_method_name():
    gm = torch.fx.symbolic_trace(lambda x: x.relu() + 1)
    assert _node_location(gm, "relu") == "node 'relu' (unknown source)"


def test_a_submodule_call_node_is_found_by_its_module_path():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x) * 2

    assert _node_location(torch.fx.symbolic_trace(M()), "lin") == "node 'lin' (unknown source)"


def test_a_function_is_matched_by_the_name_after_its_last_dot():
    gm = torch.fx.symbolic_trace(lambda x: torch.nn.functional.gelu(x) + 1)
    assert _node_location(gm, "torch.nn.functional.gelu") == "node 'gelu' (unknown source)"


def test_a_bare_function_name_without_a_dot_is_matched():
    assert _node_location(_graph({}), "neg") == "node 'neg' (unknown source)"


def test_method_and_module_calls_not_naming_the_op_are_skipped():
    gm = torch.fx.symbolic_trace(lambda x: x.relu() + 1)  # a call_method node: its target is a str
    assert _node_location(gm, "torch.sigmoid") is None
