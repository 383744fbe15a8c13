"""Random numbers in neuron graphs, as in CUDA graphs.

A captured random op does not fix its numbers at the capture: each replay draws the generator's
next numbers (the graph's range of Philox offsets starts at the generator's offset at the replay,
which then moves past it), and reads the seed current at the replay. So a captured program and
the same program run eagerly from the same generator state give the same numbers, bit for bit:
the oracle of these tests is the eager run on neuron.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

engine = torch.neuron.engine


def capture(fn):
    g = torch.neuron.NeuronGraph()
    with torch.neuron.graph(g):
        out = fn()
    return g, out


def _offset() -> int:
    return torch.neuron.default_generators[0].get_offset()


# Each draws into preallocated memory (x: 1000 float32; d: 40 float64; n: a transposed view) or
# returns a tensor the graph allocates, and touches the generator the way its op does.
OPS = {
    "uniform_": lambda t: t["x"].uniform_(-2, 3),
    "normal_": lambda t: t["x"].normal_(1.0, 0.5),
    "normal_float64": lambda t: t["d"].normal_(),
    "normal_strided": lambda t: t["n"].t().normal_(),
    "bernoulli_": lambda t: t["x"].bernoulli_(0.3),
    "random_": lambda t: t["i"].random_(0, 10),
    "random_64bit": lambda t: t["i"].random_(),
    "exponential_": lambda t: t["x"].exponential_(2.0),
    "log_normal_": lambda t: t["x"].log_normal_(),
    "cauchy_": lambda t: t["x"].cauchy_(),
    "geometric_": lambda t: t["x"].geometric_(0.4),
    "rand": lambda t: torch.rand(333, device="neuron"),
    "randn_like": lambda t: torch.randn_like(t["x"]),
    "randint": lambda t: torch.randint(0, 7, (50,), device="neuron"),
    "dropout": lambda t: F.dropout(t["ones"], 0.4),
    "dropout_bf16": lambda t: F.dropout(t["ones"].bfloat16(), 0.25),
}


def _tensors():
    return {"x": torch.empty(1000, device="neuron"), "d": torch.empty(40, dtype=torch.float64, device="neuron"),
            "n": torch.empty(7, 9, device="neuron"), "i": torch.empty(64, dtype=torch.int64, device="neuron"),
            "ones": torch.ones(257, device="neuron")}


@pytest.mark.parametrize("op", sorted(OPS))
def test_each_replay_draws_the_numbers_the_eager_op_would_draw_next(engine_mode, op):
    torch.neuron.manual_seed(123)
    t = _tensors()
    fn = OPS[op]
    state = torch.neuron.get_rng_state()
    g, out = capture(lambda: fn(t))
    assert torch.equal(torch.neuron.get_rng_state(), state)  # a capture draws nothing
    replayed = []
    for _ in range(3):
        g.replay()
        replayed.append(out.cpu())
    after_replays = torch.neuron.get_rng_state()
    torch.neuron.set_rng_state(state)
    eager = [fn(t).cpu() for _ in range(3)]
    for r, e in zip(replayed, eager):
        assert torch.equal(r, e)
    assert not torch.equal(replayed[0], replayed[1])  # each replay has its own numbers
    assert torch.equal(after_replays, torch.neuron.get_rng_state())  # and moves the generator as eager does


def test_random_ops_mixed_with_other_ops_replay_the_eager_program(engine_mode):
    torch.neuron.manual_seed(7)
    w = torch.randn(64, 64, device="neuron")
    x = torch.randn(32, 64, device="neuron")

    def step():
        h = F.dropout(torch.relu(x @ w), 0.5)
        noise = torch.randn_like(h) * 0.1
        return F.dropout(h + noise, 0.2).sum(1)

    state = torch.neuron.get_rng_state()
    g, out = capture(step)
    replayed = []
    for _ in range(2):
        g.replay()
        replayed.append(out.cpu())
    torch.neuron.set_rng_state(state)
    for r in replayed:
        assert torch.equal(r, step().cpu())


def test_a_replay_reads_the_seed_current_at_the_replay():
    x = torch.empty(100, device="neuron")
    g, _ = capture(lambda: x.normal_())
    torch.neuron.manual_seed(5)
    g.replay()
    got = x.cpu()
    torch.neuron.manual_seed(5)
    assert torch.equal(got, torch.empty(100, device="neuron").normal_().cpu())


def test_a_generator_a_captured_op_draws_from_advances_with_each_replay():
    gen = torch.Generator(device="neuron").manual_seed(3)
    x = torch.empty(30, device="neuron")
    g, _ = capture(lambda: x.uniform_(generator=gen))
    assert gen.get_offset() == 0
    replayed = []
    for _ in range(2):
        g.replay()
        replayed.append(x.cpu())
    assert gen.get_offset() == 2 * 32  # 30 positions rounded up to 4, per replay
    ref = torch.Generator(device="neuron").manual_seed(3)
    for r in replayed:
        assert torch.equal(r, torch.empty(30, device="neuron").uniform_(generator=ref).cpu())
    default_before = _offset()  # the default generator is not that graph's
    g.replay()
    assert _offset() == default_before


def test_register_generator_state_takes_neuron_generators_and_refuses_others():
    g = torch.neuron.NeuronGraph()
    g.register_generator_state(torch.Generator(device="neuron"))
    with pytest.raises(TypeError, match="neuron generator"):
        g.register_generator_state(torch.Generator())


def test_a_failed_capture_leaves_the_generators_drawing_eagerly():
    x = torch.empty(64, device="neuron")
    before = _offset()
    g = torch.neuron.NeuronGraph()
    with pytest.raises(RuntimeError, match="graph capture failed"):
        with torch.neuron.graph(g):
            x.uniform_()
            x.sum().item()
    assert _offset() == before
    x.uniform_()
    assert _offset() == before + 64  # an eager draw moves the generator again
    g2, _ = capture(lambda: x.uniform_())
    g2.replay()
    assert _offset() == before + 128


def test_random_fills_with_the_engine_on_run_ahead_of_the_host_and_draw_the_synchronous_numbers(engine_state):
    engine_state(True)
    x = torch.empty(1 << 20, device="neuron")
    torch.neuron.synchronize()
    state = torch.neuron.get_rng_state()
    before = engine.stats()
    for _ in range(4):
        x.normal_()
    after = engine.stats()
    assert after["enqueued"] - before["enqueued"] == 4
    assert after["executed"] - before["executed"] < 4  # queued, not yet run
    assert after["drains"] == before["drains"]  # no host wait
    queued = x.cpu()
    engine_state(False)
    torch.neuron.set_rng_state(state)
    for _ in range(4):
        x.normal_()
    assert torch.equal(queued, x.cpu())


@pytest.mark.parametrize("call", ["get_rng_state", "set_rng_state", "manual_seed", "get_offset", "checkpoint"])
def test_generator_states_cannot_be_read_or_set_inside_a_capture(call):
    # Inside a capture the ops' offsets are relative to the graph: a state read there (as
    # torch.utils.checkpoint saves one to replay dropout in the recomputation) would not be the
    # replay's, and the recomputation would draw other numbers than the forward. CUDA raises too.
    import torch.utils.checkpoint as cp

    lin = torch.nn.Linear(8, 8).to("neuron")
    x = torch.randn(4, 8, device="neuron", requires_grad=True)
    state = torch.neuron.get_rng_state()
    run = {"get_rng_state": torch.neuron.get_rng_state, "set_rng_state": lambda: torch.neuron.set_rng_state(state),
           "manual_seed": lambda: torch.neuron.manual_seed(3),
           "get_offset": lambda: torch.neuron.default_generators[0].get_offset(),
           "checkpoint": lambda: cp.checkpoint(lambda t: F.dropout(lin(t), 0.5), x, use_reentrant=False)}[call]
    g = torch.neuron.NeuronGraph()
    with pytest.raises(RuntimeError, match="while a graph capture on neuron:0 is open.*before or after the capture"):
        with torch.neuron.graph(g):
            F.dropout(x, 0.5)
            run()
    assert torch.equal(torch.neuron.get_rng_state(), state)  # the failed capture drew nothing
    torch.neuron.manual_seed(3)  # and the generator is usable again


def test_a_graphed_module_with_dropout_trains_as_the_eager_module_bit_for_bit(engine_mode):
    # make_graphed_callables (CUDA's partial-network capture): the forward graph's dropout draws
    # each call's own mask, which its backward graph reads from the forward's saved tensors.
    import copy

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.3), torch.nn.GELU(),
                               torch.nn.Linear(32, 4)).to("neuron")
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=g).to("neuron") for _ in range(4)]
    runs = []
    for graphed in (False, True):
        m = copy.deepcopy(base)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        f = torch.neuron.make_graphed_callables(m, (torch.randn(8, 16, device="neuron"),)) if graphed else m
        torch.neuron.manual_seed(5)
        losses = []
        for x in xs:
            loss = f(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        runs.append((torch.stack(losses).cpu(), [p.detach().cpu() for p in m.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert len(set(runs[0][0].tolist())) == 4
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)
