"""``torch.compile(mode="reduce-overhead")`` on neuron: compiled graphs recorded into neuron graphs
and replayed (compile/graphs.py), with results equal to ``mode="default"`` bit for bit."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from compile_models import DEV, MLP
from torchneuron.compile import graphs


@pytest.fixture
def metrics():
    torch._dynamo.reset()
    torch.neuron.reset_dynamo_metrics()
    return torch.neuron.get_dynamo_metrics


def _inputs(n, *shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(DEV) for _ in range(n)]


def _assert_modes_train_alike(base, steps):
    """SGD steps of copies of `base` compiled in default and reduce-overhead modes, from the same
    neuron seed: equal losses and parameters bit for bit. Returns the losses."""
    runs = {}
    for mode in ("default", "reduce-overhead"):
        model = copy.deepcopy(base)
        f = torch.compile(model, backend="neuron", mode=mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.neuron.manual_seed(11)
        losses = []
        for x in _inputs(steps, 8, 16):
            loss = f(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs[mode] = (torch.stack(losses).cpu(), [p.detach().cpu() for p in model.parameters()])
    assert torch.equal(runs["default"][0], runs["reduce-overhead"][0])
    for a, b in zip(runs["default"][1], runs["reduce-overhead"][1]):
        assert torch.equal(a, b)
    return runs["default"][0]


def test_inference_records_at_the_second_call_and_replays_with_defaults_results(metrics):
    torch.manual_seed(0)
    model = MLP().to(DEV).eval()
    default = torch.compile(copy.deepcopy(model), backend="neuron")
    graphed = torch.compile(model, backend="neuron", mode="reduce-overhead")
    with torch.no_grad():
        for x in _inputs(4, 8, 16):
            assert torch.equal(graphed(x).cpu(), default(x).cpu())
    m = metrics()
    assert m["graphs_recorded"] == 1  # call 1 warms up, call 2 records
    assert m["graph_replays"] == 3 and m["graphs_not_recordable"] == 0


def test_training_replays_forward_and_backward_with_defaults_results(metrics):
    torch.manual_seed(0)
    _assert_modes_train_alike(MLP().to(DEV), steps=6)
    m = metrics()
    assert m["graphs_recorded"] == 2  # the forward and the backward
    assert m["graph_replays"] >= 8


def test_training_with_dropout_and_noise_replays_each_steps_own_numbers_as_default_mode(metrics):
    # random ops are recorded: each replay draws the generator's next numbers, so the replayed
    # steps equal default mode's from the same seed (not the recording's numbers again)
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            h = nn.functional.dropout(torch.relu(self.a(x)), 0.3, self.training)
            return self.b(h + 0.01 * torch.randn_like(h))

    torch.manual_seed(0)
    losses = _assert_modes_train_alike(Noisy().to(DEV), steps=5)
    assert len(set(losses.tolist())) == 5
    m = metrics()
    assert m["graphs_recorded"] == 2 and m["graphs_not_recordable"] == 0
    assert m["graph_replays"] >= 6


def test_an_input_a_graph_returns_and_saves_is_the_calls_own_after_another_recording_produced_it(metrics):
    # The second graph gets the first's output in place, returns it (Hugging Face's loss returns
    # logits.float(), a no-op in fp32) and saves it for its backward. Those outputs were rebuilt
    # from the recorded input tensor, which the first recording, seeing it referenced, had moved
    # to private memory holding an earlier call's values: GPT-2's gradients went wrong from the
    # second replay on.
    torch.manual_seed(0)
    lin = nn.Linear(8, 8).to(DEV)

    def f(x):
        y = lin(x)
        torch._dynamo.graph_break()
        y = y.float()
        return y, (y * y).sum()

    default = torch.compile(f, backend="neuron")
    replayed = torch.compile(f, backend="neuron", mode="reduce-overhead")
    for x in _inputs(6, 4, 8):
        results = []
        for run in (default, replayed):
            y, loss = run(x)
            loss.backward()  # reads y as the second graph saved it
            results += [lin.weight.grad.cpu(), y.detach().cpu(), loss.detach().cpu()]
            lin.weight.grad = None
        for want, got in zip(results[:3], results[3:]):
            assert torch.equal(got, want)
    assert metrics()["graph_replays"] >= 3


def test_an_output_held_across_calls_keeps_its_values_and_views():
    f = torch.compile(lambda x: (x * 2).exp(), backend="neuron", mode="reduce-overhead")
    xs = _inputs(5, 32)
    outs = [f(x) for x in xs[:2]]  # warm-up, recording
    held, view = outs[1], outs[1][4:8]
    for x in xs[2:]:
        f(x)  # each replay overwrites the recording's memory
    torch.testing.assert_close(held.cpu(), (xs[1].cpu() * 2).exp())
    torch.testing.assert_close(view.cpu(), (xs[1].cpu() * 2).exp()[4:8])
    view.mul_(0)  # the view still aliases the output it came from
    assert torch.equal(held[4:8].cpu(), torch.zeros(4))


def test_an_output_released_before_the_next_call_is_not_copied():
    f = torch.compile(lambda x: x + 1, backend="neuron", mode="reduce-overhead")
    xs = _inputs(4, 64)
    f(xs[0])
    f(xs[1])
    ptr = f(xs[2]).data_ptr()  # released at once
    assert f(xs[3]).data_ptr() == ptr  # the recording's memory, not a copy
    held = f(xs[3])
    f(xs[0])
    assert held.data_ptr() != ptr  # given its own memory before the replay
    torch.testing.assert_close(held.cpu(), xs[3].cpu() + 1)


def test_parameters_are_read_in_place_and_new_inputs_copied():
    model = nn.Linear(16, 4).to(DEV)
    f = torch.compile(model, backend="neuron", mode="reduce-overhead")
    with torch.no_grad():
        for x in _inputs(2, 3, 16):
            f(x)
        model.weight.add_(1.0)  # in place: the recording reads the parameter's memory
        x = _inputs(1, 3, 16, seed=1)[0]
        torch.testing.assert_close(f(x).cpu(), x.cpu() @ model.weight.cpu().t() + model.bias.cpu())


def test_a_mutated_input_is_written_back():
    def fn(x, y):
        x.add_(y)
        return x * 2

    f = torch.compile(fn, backend="neuron", mode="reduce-overhead")
    for i in range(4):
        x, y = _inputs(2, 16, seed=i)
        want_x = x.cpu() + y.cpu()
        out = f(x, y)
        torch.testing.assert_close(x.cpu(), want_x)
        torch.testing.assert_close(out.cpu(), want_x * 2)


def test_a_graph_that_cannot_be_recorded_runs_as_compiled_with_one_warning(metrics):
    # median runs synchronously on neuron (a selection, not queued): not recordable.
    f = torch.compile(lambda x: x.median() * 2, backend="neuron", mode="reduce-overhead")
    x = _inputs(1, 17)[0]
    f(x)
    with pytest.warns(UserWarning, match="runs without graph replay: it cannot be recorded .*; at .*aten.median"):
        f(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = f(x)
    torch.testing.assert_close(out.cpu(), x.cpu().median() * 2)
    m = metrics()
    assert m["graphs_not_recordable"] == 1 and m["graphs_recorded"] == 0 and m["graph_replays"] == 0


def test_a_graph_inductor_will_not_replay_is_reported(metrics):
    # Inductor skips graphs for its own reasons (here a CPU tensor among the outputs) and logged
    # that only for CUDA; on neuron such a graph ran without replay and without a word.
    f = torch.compile(lambda x: (x * 2, torch.arange(3) + 1), backend="neuron", mode="reduce-overhead")
    x = _inputs(1, 5)[0]
    with pytest.warns(UserWarning, match="without graph replay: Inductor is skipping cudagraphs due to cpu device"):
        out = f(x)
    for _ in range(2):
        out = f(x)
    torch.testing.assert_close(out[0].cpu(), x.cpu() * 2)
    m = metrics()
    assert m["graphs_not_recordable"] == 1 and m["graphs_recorded"] == 0


def test_a_graph_called_with_an_input_it_cannot_key_runs_as_compiled_with_one_warning(metrics):
    # An input that is no tensor or number (a generator) cannot be part of a recording's
    # signature: the graph runs as compiled, said once (it was silent).
    graphed = graphs.GraphedGraph(lambda inputs: [inputs[0] * 2], (), (), "the forward graph")
    x, gen = _inputs(1, 4)[0], torch.Generator()
    with pytest.warns(UserWarning, match="the forward graph runs without graph replay: .*a generator"):
        out = graphed([x, gen])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = graphed([x, gen])
    assert torch.equal(out[0].cpu(), x.cpu() * 2)
    m = metrics()
    assert m["graphs_not_recordable"] == 1 and m["graphs_recorded"] == 0


def test_each_input_shape_gets_its_own_recording(metrics):
    f = torch.compile(lambda x: x.sin() * 3, backend="neuron", mode="reduce-overhead", dynamic=True)
    for n in (8, 16, 8, 16, 8, 16):
        x = _inputs(1, n)[0]
        torch.testing.assert_close(f(x).cpu(), x.cpu().sin() * 3)
    m = metrics()
    assert m["graphs_recorded"] == 2 and m["graph_replays"] == 4


def test_a_call_inside_a_users_capture_is_recorded_by_that_capture():
    f = torch.compile(lambda x: x * 3 + 1, backend="neuron", mode="reduce-overhead")
    x = _inputs(1, 16)[0]
    f(x)
    graph = torch.neuron.NeuronGraph()
    with torch.neuron.graph(graph):
        out = f(x)
    x.copy_(torch.ones(16))
    graph.replay()
    torch.testing.assert_close(out.cpu(), torch.full((16,), 4.0))


def test_a_compiled_capturable_optimizer_step_replays_with_defaults_results(metrics):
    torch.manual_seed(0)
    base = nn.Linear(16, 8).to(DEV)
    params = {}
    for mode in ("default", "reduce-overhead"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True, capturable=True)
        step = torch.compile(opt.step, backend="neuron", mode=mode)
        for x in _inputs(5, 4, 16):
            model(x).square().sum().backward()
            step()
            opt.zero_grad(set_to_none=False)
        params[mode] = [p.detach().cpu() for p in model.parameters()]
    for a, b in zip(params["default"], params["reduce-overhead"]):
        assert torch.equal(a, b)
    assert metrics()["graph_replays"] >= 3


def test_a_parameter_moved_to_new_memory_gets_a_new_recording_up_to_a_bound(monkeypatch, metrics):
    # Parameters are read in place, so their addresses are part of a recording's signature.
    monkeypatch.setattr(graphs, "MAX_RECORDINGS", 2)
    model = nn.Linear(8, 4).to(DEV)
    f = torch.compile(model, backend="neuron", mode="reduce-overhead")
    x = _inputs(1, 2, 8)[0]
    old = []  # (kept, so that each move takes memory no recording was made over)
    with torch.no_grad():
        for moves in range(3):
            if moves:
                old.append(model.weight.data)
                model.weight.data = model.weight.data.clone() * 2  # same parameter, new memory
            f(x)
            if moves == 2:
                with pytest.warns(UserWarning, match="more than 2 input signatures"):
                    out = f(x)
            else:
                out = f(x)
            torch.testing.assert_close(out.cpu(), x.cpu() @ model.weight.cpu().t() + model.bias.cpu())
    assert metrics()["graphs_recorded"] == 2


def test_two_forwards_before_one_backward_give_defaults_gradients():
    # The second forward's replay overwrites the recording's memory while the first one's
    # activations are still saved for the backward: they must be moved first.
    torch.manual_seed(0)
    base = MLP().to(DEV)
    grads = {}
    for mode in ("default", "reduce-overhead"):
        model = copy.deepcopy(base)
        f = torch.compile(model, backend="neuron", mode=mode)
        for step in range(4):
            a, b = _inputs(2, 8, 16, seed=step)
            (f(a).square().mean() + f(b).abs().mean()).backward()
        grads[mode] = [p.grad.cpu() for p in model.parameters()]
    for a, b in zip(grads["default"], grads["reduce-overhead"]):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.neuron.device_count() < 2, reason="needs two neuron devices")
def test_a_graph_on_another_device_than_the_current_one_is_recorded_there(metrics):
    dev = torch.device("neuron:1")
    f = torch.compile(lambda x: (x * 2).exp(), backend="neuron", mode="reduce-overhead")
    xs = [torch.randn(32).to(dev) for _ in range(3)]
    assert torch.neuron.current_device() == 0
    for x in xs:
        out = f(x)
        assert out.device == dev
        torch.testing.assert_close(out.cpu(), (x.cpu() * 2).exp())
    m = metrics()
    assert m["graphs_recorded"] == 1 and m["graph_replays"] == 2 and m["graphs_not_recordable"] == 0
