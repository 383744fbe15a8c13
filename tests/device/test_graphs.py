"""torch.accelerator.Graph on neuron: capture a stream's queued kernels once, replay them.

Semantics are CUDA graphs': a capture runs nothing, a replay recomputes from the inputs'
current contents into the same outputs, memory the graph's kernels write stays the graph's.
What neuron cannot capture (ops whose kernels run synchronously here, host waits, other
streams) raises at the op and fails the capture. Results are compared with CPU PyTorch, or with
the same ops run eagerly on neuron where bits must match.
"""

from __future__ import annotations

import gc

import pytest
import torch

engine = torch.neuron.engine


def capture(fn):
    g = torch.accelerator.Graph()
    with torch.Stream(device="neuron"), g:
        out = fn()
    return g, out


def test_a_capture_runs_nothing_and_each_replay_runs_it_once(engine_mode):
    x = torch.zeros(64, device="neuron")
    g, _ = capture(lambda: x.add_(1))
    assert torch.equal(x.cpu(), torch.zeros(64))
    g.replay()
    g.replay()
    torch.neuron.synchronize()
    assert torch.equal(x.cpu(), torch.full((64,), 2.0))


def test_a_replay_reads_the_inputs_current_contents_into_the_same_output(engine_mode):
    a, b = torch.empty(300, device="neuron"), torch.empty(300, device="neuron")
    g, y = capture(lambda: (a * b + 1).div_(3))
    ptr = y.data_ptr()
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        ac, bc = torch.randn(300, generator=gen), torch.randn(300, generator=gen)
        a.copy_(ac)
        b.copy_(bc)
        g.replay()
        assert y.data_ptr() == ptr
        assert torch.equal(y.cpu(), (ac * bc + 1).div_(3))


def test_a_captured_adamw_step_replays_the_eager_steps_bit_for_bit(engine_mode):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)).to("neuron")

    grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * i + j)) for j, p in
              enumerate(model().parameters())] for i in range(4)]
    eager, graphed = model(), model()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True, capturable=True) for m in (eager, graphed)]
    static = [torch.zeros_like(p) for p in graphed.parameters()]
    for p, s in zip(graphed.parameters(), static):
        p.grad = s

    def eager_step(i):
        for p, g in zip(eager.parameters(), grads[i]):
            p.grad = g.to("neuron")
        opts[0].step()

    eager_step(0)  # the first step creates the optimizer's state, outside the capture (as on CUDA)
    for s, g in zip(static, grads[0]):
        s.copy_(g)
    opts[1].step()
    g, _ = capture(opts[1].step)
    for i in range(1, 4):
        eager_step(i)
        for s, gr in zip(static, grads[i]):
            s.copy_(gr)
        g.replay()
    for a, b in zip(eager.parameters(), graphed.parameters()):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_clamp_and_relu_are_captured_and_keep_the_dtype(engine_mode, dtype):
    # index arithmetic of routing code (e.g. vLLM's MoE under its decode graphs)
    x = torch.zeros(40, dtype=dtype, device="neuron")
    g, (c, r) = capture(lambda: (x.clamp(min=2, max=9), torch.relu(x)))
    src = torch.randint(0 if dtype == torch.uint8 else -20, 20, (40,), dtype=dtype)
    x.copy_(src)
    g.replay()
    assert c.dtype == r.dtype == dtype
    assert torch.equal(c.cpu(), src.clamp(min=2, max=9))
    assert torch.equal(r.cpu(), torch.relu(src))


def test_integer_clamp_with_a_floating_bound_gives_cpus_floating_result():
    x = torch.arange(-3, 4, device="neuron")
    assert torch.equal(x.clamp(min=0.5).cpu(), torch.arange(-3, 4).clamp(min=0.5))


def test_memory_a_captured_kernel_writes_is_not_reused_while_the_graph_lives(engine_mode):
    a = torch.randn(4096, device="neuron")
    def body():
        t = a * 2          # an intermediate the capture frees ...
        y = t + 1
        del t              # ... but the replays write
        return y
    stream = torch.Stream(device="neuron")
    g = torch.accelerator.Graph()
    with stream, g:
        y = body()
    with stream:  # (free blocks are kept per stream: the capture's, so these would take t's)
        others = [torch.full((4096,), 7.0, device="neuron") for _ in range(8)]
    g.replay()
    torch.neuron.synchronize()
    assert torch.equal(y.cpu(), a.cpu() * 2 + 1)
    for o in others:
        assert torch.equal(o.cpu(), torch.full((4096,), 7.0))


def pool_segments(pool):
    return torch.neuron.memory_snapshot(pool)


def test_a_graphs_freed_memory_stays_reserved_for_its_pool_until_reset_or_destroyed():
    a = torch.randn(1 << 16, device="neuron")
    gc.collect()
    torch.neuron.synchronize()
    torch.neuron.empty_cache()
    base, base_reserved = torch.neuron.memory_allocated(), torch.neuron.memory_reserved()

    def body():
        t = a * 2
        return t.add_(1).mul_(a)

    g, y = capture(body)
    del y
    torch.neuron.empty_cache()
    assert torch.neuron.memory_allocated() == base  # freed by its tensor (CUDA's counters) ...
    assert torch.neuron.memory_reserved() > base_reserved  # ... but still the pool's
    assert pool_segments(g.pool()) and all(s["segment_pool_id"] == g.pool() for s in pool_segments(g.pool()))
    g.reset()
    assert torch.neuron.memory_reserved() == base_reserved and not pool_segments(g.pool())
    g2, y2 = capture(body)
    pool = g2.pool()
    del g2
    gc.collect()
    assert torch.neuron.memory_allocated() == base + y2.untyped_storage().nbytes()  # y2 is its own again
    assert not pool_segments(pool)  # (its segment joined the device's own pool)
    del y2
    torch.neuron.empty_cache()
    assert torch.neuron.memory_allocated() == base and torch.neuron.memory_reserved() == base_reserved


@pytest.mark.parametrize("force_gc", [False, True])
def test_a_graph_context_collects_garbage_only_when_asked_and_empties_the_cache(force_gc):
    # torch.cuda.graph's contract since PyTorch 2.9: gc.collect() only under
    # torch.compiler.config.force_cudagraph_gc, the allocator's idle blocks given back always
    import weakref

    x = torch.zeros(64, device="neuron")
    gc.collect()
    gc.disable()  # no automatic collection between the cycle's making and the capture
    try:
        cycle = [torch.empty(16 << 20, dtype=torch.uint8, device="neuron")]
        cycle.append(cycle)  # memory only a collection frees
        held = weakref.ref(cycle[0])
        del cycle
        idle = torch.empty(16 << 20, dtype=torch.uint8, device="neuron")
        del idle  # an idle segment of its own in the cache (past 10 MiB)
        torch.neuron.synchronize()
        reserved = torch.neuron.memory_reserved()
        g = torch.neuron.NeuronGraph()
        with torch.compiler.config.patch(force_cudagraph_gc=force_gc), torch.neuron.graph(g):
            x.add_(1)
        assert (held() is None) == force_gc
        assert torch.neuron.memory_reserved() <= reserved - (16 << 20) * (2 if force_gc else 1)
    finally:
        gc.enable()
    g.replay()
    assert torch.equal(x.cpu(), torch.ones(64))


def test_a_capture_reuses_the_blocks_it_freed_and_replays_in_order(engine_mode):
    a = torch.randn(4096, device="neuron")
    ptrs = {}

    def body():
        t = a * 2
        y = t + 1
        ptrs["t"] = t.data_ptr()
        del t                      # freed: a later allocation of the capture may take it ...
        u = a * 3                  # ... as this one does; a replay writes u after y read t
        ptrs["u"] = u.data_ptr()
        return y + u

    g, out = capture(body)
    assert ptrs["u"] == ptrs["t"]
    for seed in range(2):
        a.copy_(torch.randn(4096, generator=torch.Generator().manual_seed(seed)))
        g.replay()
        ac = a.cpu()
        assert torch.equal(out.cpu(), (ac * 2 + 1) + ac * 3)


def test_an_intermediate_a_replay_reads_after_a_fusion_boundary_is_stored(engine_state):
    # Adaptive Eager leaves unstored a written buffer whose memory is free (nothing queued later
    # can read it); a graph's freed blocks are read by its next replays, so they never are
    from torchneuron.compile import eager_fusion

    was_fusing = engine.is_fusion_enabled()
    engine_state(True)
    engine.set_fusion_enabled(True)
    a, b = torch.randn(64, 64, device="neuron"), torch.randn(64, 64, device="neuron")

    def body():
        t = a.mul(0.375).sub(1.25)  # one region, its output freed when body returns ...
        m = b @ b                   # ... a kernel Adaptive Eager does not fuse ...
        return torch.tanh(t) + m    # ... and a reader after the boundary

    try:
        g, y = capture(body)
        before = engine.stats()["fused"]
        for seed in range(4):  # the fuser compiles the region after seeing it, then runs it
            gen = torch.Generator().manual_seed(seed)
            ac, bc = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)
            a.copy_(ac)
            b.copy_(bc)
            g.replay()
            torch.neuron.synchronize()
            eager_fusion.wait()
            assert torch.equal(y.cpu(), (torch.tanh(a.mul(0.375).sub(1.25)) + b @ b).cpu())
        assert engine.stats()["fused"] > before
    finally:
        engine.set_fusion_enabled(was_fusing)


def test_captures_sharing_a_pool_reuse_what_earlier_captures_freed(engine_mode):
    # vLLM's decode graphs: one pool, the largest batch first, each graph's output weakly held
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to("neuron")
    sizes = [64, 32, 16, 8]
    inputs = {n: torch.zeros(n, 64, device="neuron") for n in sizes}
    pool = torch.neuron.graph_pool_handle()
    graphs, outputs, reserved = {}, {}, []
    torch.neuron.synchronize()
    with torch.no_grad():
        for n in sizes:
            graphs[n] = torch.neuron.NeuronGraph()
            with torch.neuron.graph(graphs[n], pool=pool):
                out = net(inputs[n])
            outputs[n] = torch.ops.torchneuron.weak_ref_tensor(out)  # (vLLM keeps weak references)
            del out
            reserved.append(sum(s["total_size"] for s in pool_segments(pool)))
        assert reserved[0] > 0 and reserved == [reserved[0]] * len(sizes)  # the first capture's memory serves all
        for n in (8, 64, 16, 32):  # one at a time, in any order
            x = torch.randn(n, 64)
            inputs[n].copy_(x)
            graphs[n].replay()
            torch.neuron.synchronize()
            assert torch.allclose(outputs[n].cpu(), net.cpu()(x), atol=1e-5)
            net.to("neuron")


@pytest.mark.parametrize("op", ["cumprod", "nonzero", "item", "cpu", "synchronize"])
def test_what_neuron_cannot_capture_fails_the_capture_and_leaves_the_device_usable(op):
    a = torch.randn(8, 8, device="neuron")
    run = {"cumprod": lambda: a.cumprod(0), "nonzero": lambda: a.nonzero(), "item": lambda: a[0, 0].item(),
           "cpu": lambda: a.cpu(), "synchronize": torch.neuron.synchronize}[op]
    g = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="graph capture failed") as info:
        with torch.Stream(device="neuron"), g:
            a.mul_(2)
            run()
    assert "cannot run while a graph is being captured" in str(info.value)
    assert torch.equal((a @ a).cpu(), a.cpu() @ a.cpu())  # usable; the failed capture ran nothing
    g2, _ = capture(lambda: a.mul_(3))  # and a new capture works
    before = a.cpu()
    g2.replay()
    assert torch.equal(a.cpu(), before * 3)


def test_a_failed_capture_names_where_the_program_made_the_uncapturable_call():
    # code between capture_begin and capture_end may catch the op's exception (a library's
    # fallback path): capture_end then reports it, with the line that made the call
    a = torch.randn(8, 8, device="neuron")

    def reads_a_value_quietly():
        try:
            return bool((a > 0).all())
        except RuntimeError:
            return False

    g = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="graph capture failed") as info:
        with torch.Stream(device="neuron"), g:
            a.mul_(2)
            reads_a_value_quietly()
    assert "The operation was called at" in str(info.value)
    assert "in reads_a_value_quietly" in str(info.value)


def test_work_on_another_stream_fails_the_capture():
    a = torch.zeros(16, device="neuron")
    other = torch.Stream(device="neuron")
    g = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="another stream"):
        with torch.Stream(device="neuron"), g:
            a.add_(1)
            with other:
                a.add_(1)
    assert torch.equal(a.cpu(), torch.zeros(16))


def test_a_graph_is_captured_once_until_reset():
    a = torch.zeros(16, device="neuron")
    g = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="before a capture"):
        g.replay()
    with torch.Stream(device="neuron"), g:
        a.add_(1)
    with pytest.raises(RuntimeError, match="reset"):
        with torch.Stream(device="neuron"), g:
            a.add_(1)
    g.reset()
    with torch.Stream(device="neuron"), g:
        a.add_(5)
    g.replay()
    assert torch.equal(a.cpu(), torch.full((16,), 5.0))


def test_graphs_sharing_a_pool_keep_its_memory_until_the_last_is_released():
    a = torch.randn(1 << 16, device="neuron")
    gc.collect()
    torch.neuron.synchronize()
    torch.neuron.empty_cache()
    base_reserved = torch.neuron.memory_reserved()
    pool = torch.neuron.graph_pool_handle()
    assert pool != torch.neuron.graph_pool_handle()  # each handle a fresh pool
    first, second = torch.neuron.NeuronGraph(), torch.neuron.NeuronGraph()
    with torch.neuron.graph(first, pool=pool):
        y = a * 2
    with torch.neuron.graph(second, pool=first.pool()):
        z = y + 1
    assert first.pool() == second.pool() == pool
    ptrs = {y.data_ptr(), z.data_ptr()}
    del y, z  # freed by their tensors, kept by the pool
    held = pool_segments(pool)
    assert held and {s["segment_pool_id"] for s in held} == {pool}
    others = [torch.empty_like(a) for _ in range(4)]  # outside the pool: never its blocks
    assert not ptrs & {o.data_ptr() for o in others}
    first.replay()
    second.replay()
    first.reset()
    assert pool_segments(pool) == held  # second's replays write it
    second.reset()
    assert not pool_segments(pool)
    del others
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() == base_reserved


def test_a_pool_that_is_not_a_neuron_graph_pool_is_refused_with_the_fix():
    g = torch.accelerator.Graph(pool=(0, 7))  # (a CUDA MemPool's form)
    with pytest.raises(RuntimeError, match="graph_pool_handle"):
        with torch.Stream(device="neuron"), g:
            pass


def test_debug_dump_lists_the_recorded_kernels(tmp_path):
    a = torch.zeros(64, device="neuron")
    g, _ = capture(lambda: (a.add_(1), a.mul_(2)))
    path = tmp_path / "graph.txt"
    g.debug_dump(str(path))
    lines = path.read_text().splitlines()
    assert lines[0].endswith("2 kernels, device 0")
    assert [line.split(".")[0] for line in lines[1:]] == ["aten::add_", "aten::mul_"]


def test_replays_with_the_engine_on_run_ahead_of_the_host(engine_state):
    engine_state(True)
    x = torch.zeros(1 << 20, device="neuron")
    g, _ = capture(lambda: [x.add_(1) for _ in range(8)])
    before = engine.stats()
    g.replay()
    after = engine.stats()
    assert after["enqueued"] - before["enqueued"] == 8
    assert after["executed"] - before["executed"] < 8  # queued, not yet run
    assert torch.equal(x.cpu(), torch.full((1 << 20,), 8.0))


def test_a_replay_with_the_engine_off_has_run_when_it_returns(engine_state):
    engine_state(False)
    x = torch.zeros(1 << 16, device="neuron")
    g, _ = capture(lambda: [x.add_(1) for _ in range(3)])
    g.replay()
    s = engine.stats()
    assert s["executed"] == s["enqueued"]  # nothing left queued: synchronous, as every op here


def test_torch_neuron_graph_mirrors_torch_cuda_graph():
    a = torch.zeros(32, device="neuron")
    g = torch.neuron.NeuronGraph()
    assert not torch.neuron.is_current_stream_capturing()
    with torch.neuron.graph(g):
        assert torch.neuron.is_current_stream_capturing()
        assert torch.neuron.current_stream() == torch.neuron.graph.default_capture_stream
        a.add_(2)
    assert not torch.neuron.is_current_stream_capturing()
    assert torch.neuron.current_stream() == torch.neuron.default_stream()
    g.replay()
    assert torch.equal(a.cpu(), torch.full((32,), 2.0))


def test_one_capture_at_a_time():
    a = torch.zeros(16, device="neuron")
    outer, inner = torch.accelerator.Graph(), torch.accelerator.Graph()
    with torch.Stream(device="neuron"), outer:
        a.add_(1)
        with pytest.raises(RuntimeError, match="already being captured"):
            inner.capture_begin()
    outer.replay()
    assert torch.equal(a.cpu(), torch.ones(16))


def test_a_graph_captured_without_fusion_replays_fused_once_fusion_is_on(engine_state):
    from torchneuron.compile import eager_fusion

    was_fusing = engine.is_fusion_enabled()
    engine.set_fusion_enabled(False)
    a, b = torch.rand(4096, device="neuron"), torch.rand(4096, device="neuron")
    # (an op sequence of its own: a signature compiled here is compiled for the whole process,
    # and test_fusion.py's failed-compile test needs one nobody compiled)
    g, _ = capture(lambda: a.lerp_(b, 0.3).mul_(b).mul_(b).div_(b))
    expected = a.cpu()
    bc = b.cpu()
    engine_state(True)
    engine.set_fusion_enabled(True)
    try:
        before = engine.stats()["fused"]
        for _ in range(4):
            g.replay()
            torch.neuron.synchronize()
            eager_fusion.wait()
            expected.lerp_(bc, 0.3).mul_(bc).mul_(bc).div_(bc)
        assert engine.stats()["fused"] > before  # the replays ran as one generated kernel
        assert torch.equal(a.cpu(), expected)
    finally:
        engine.set_fusion_enabled(was_fusing)


def test_a_graph_dropped_mid_capture_closes_its_capture():
    a = torch.zeros(16, device="neuron")
    g = torch.accelerator.Graph()
    with torch.Stream(device="neuron"):
        g.capture_begin()
        a.add_(1)
    del g
    gc.collect()
    assert not torch.neuron.is_current_stream_capturing()
    assert torch.equal((a + 1).cpu(), torch.ones(16))  # nothing captured ran; the device works


def test_a_whole_training_step_is_captured_and_replays_the_eager_steps_bit_for_bit(engine_mode):
    # CUDA's "whole-network capture": forward (linear, layer norm, GELU, loss), backward and a
    # capturable AdamW step in one graph; the input is read from a static tensor.
    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 1)).to("neuron")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True, capturable=True)

        def step(x):
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.detach()
        return model, step

    inputs = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    replays_the_eager_steps(setup, inputs)


def replays_the_eager_steps(setup, inputs):
    """Steps of a model set up twice: eagerly on each input, and once eagerly (the optimizer's
    state) then captured and replayed on the others from a static input: the same losses and
    final state, bit for bit."""
    eager, eager_step = setup()
    want = [eager_step(x.to("neuron")).cpu() for x in inputs]
    graphed, graphed_step = setup()
    static_x = inputs[0].to("neuron")
    got = [graphed_step(static_x).cpu()]
    g, static_loss = capture(lambda: graphed_step(static_x))
    for x in inputs[1:]:
        static_x.copy_(x)
        g.replay()
        got.append(static_loss.cpu())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for (name, p), q in zip(eager.state_dict().items(), graphed.state_dict().values()):
        assert torch.equal(p.cpu(), q.cpu()), name


def test_a_cnn_training_step_is_captured_and_replays_the_eager_steps_bit_for_bit(engine_mode):
    # convolutions, batch norm (its running statistics and step counter updated by every replay),
    # relu, max pooling, cross entropy, backward and SGD with momentum, in one graph
    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.BatchNorm2d(6), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(6, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5)).to("neuron")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
        target = torch.tensor([0, 4, 1, 3], device="neuron")

        def step(x):
            loss = torch.nn.functional.cross_entropy(model(x), target)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            return loss.detach()
        return model, step

    inputs = [torch.randn(4, 3, 10, 10, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    replays_the_eager_steps(setup, inputs)


# ---- make_graphed_callables ------------------------------------------------------------------
def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4)).to("neuron")


def batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("zero_grad", ["set_to_none", "zeros", "accumulate_two_batches"])
def test_a_graphed_module_trains_as_the_eager_module_bit_for_bit(engine_mode, zero_grad):
    eager, graphed = mlp(), mlp()
    graphed = torch.neuron.make_graphed_callables(graphed, (torch.randn(8, 16, device="neuron", requires_grad=True),))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, graphed)]
    data = batches(6)
    for step in range(3):
        for model, opt in zip((eager, graphed), opts):
            opt.zero_grad(set_to_none=zero_grad == "set_to_none")
            micro = data[2 * step: 2 * step + 2] if zero_grad == "accumulate_two_batches" else data[step:step + 1]
            for x, t in micro:
                x = x.to("neuron").requires_grad_()
                (model(x) - t.to("neuron")).square().mean().backward()
                model.last_input_grad = x.grad
            opt.step()
        assert torch.equal(graphed.last_input_grad.cpu(), eager.last_input_grad.cpu())
        for p, q in zip(eager.parameters(), graphed.parameters()):
            assert torch.equal(p.grad.cpu(), q.grad.cpu())
            assert torch.equal(p.detach().cpu(), q.detach().cpu())


def test_a_graphed_call_is_one_autograd_node_whose_outputs_the_next_call_overwrites():
    model = torch.neuron.make_graphed_callables(mlp(), (torch.randn(8, 16, device="neuron"),))
    x1, x2 = torch.randn(8, 16, device="neuron"), torch.randn(8, 16, device="neuron")
    y1 = model(x1)
    assert type(y1.grad_fn).__name__ == "_ReplayBackward"
    want1 = y1.clone()
    y2 = model(x2)
    assert torch.equal(y1.cpu(), y2.cpu()) and not torch.equal(want1.cpu(), y2.cpu())  # CUDA's semantics


def test_graphed_callables_share_one_pool_and_chain_in_order(engine_mode):
    # A function and a module graphed together: forward 1, forward 2, then backward 2, backward 1.
    scale = torch.randn(16, device="neuron", requires_grad=True)

    def prescale(x, s):
        return torch.tanh(x * s), (x * s).detach().sum(-1)  # a second, non-differentiable output

    model = mlp()
    x0 = torch.randn(8, 16, device="neuron", requires_grad=True)
    f, m = torch.neuron.make_graphed_callables((prescale, model), ((x0, scale), (torch.randn(8, 16, device="neuron", requires_grad=True),)))
    ref_model, ref_scale = mlp(), scale.detach().clone().requires_grad_()
    for x, _ in batches(2):
        x = x.to("neuron")
        h, total = f(x.requires_grad_(), scale)
        assert not total.requires_grad
        m(h).sum().backward()
        hr, total_r = prescale(x.detach(), ref_scale)
        ref_model(hr).sum().backward()
        assert torch.equal(total.cpu(), total_r.cpu())
    assert torch.equal(scale.grad.cpu(), ref_scale.grad.cpu())
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.grad.cpu(), q.grad.cpu())


def test_a_graphed_module_runs_its_own_forward_in_the_other_mode():
    model = torch.neuron.make_graphed_callables(mlp(), (torch.randn(8, 16, device="neuron"),))
    model.eval()
    y = model(torch.randn(3, 16, device="neuron"))  # another batch size: the eager forward
    assert y.shape == (3, 4) and y.grad_fn is not None and type(y.grad_fn).__name__ != "_ReplayBackward"


def test_make_graphed_callables_refuses_what_it_cannot_replay():
    x = torch.randn(8, 16, device="neuron")
    hooked = mlp()
    hooked.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="hooks"):
        torch.neuron.make_graphed_callables(hooked, (x,))
    buffered = mlp()
    buffered.register_buffer("b", torch.zeros(2, device="neuron", requires_grad=True))
    with pytest.raises(RuntimeError, match="buffers"):
        torch.neuron.make_graphed_callables(buffered, (x,))
    with pytest.raises(TypeError, match="only tensors"):
        torch.neuron.make_graphed_callables(lambda a, n: a * n, (x, 2))
    with pytest.raises(ValueError, match="2 callables but 1"):
        torch.neuron.make_graphed_callables((mlp(), mlp()), ((x,),))
    with torch.autocast("neuron", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="cache_enabled=False"):
            torch.neuron.make_graphed_callables(mlp(), (x,))
    graphed = torch.neuron.make_graphed_callables(mlp(), (x,))
    with pytest.raises(TypeError, match="captured with 1 tensor arguments, called with 2"):
        graphed(x, x)


def _fp8_layer(x, w8, w_scale):
    """An FP8 W8A8 linear as vLLM's per-token layers run it: dynamic per-row activation scales,
    then torch._scaled_mm with row-wise scales."""
    scale = (x.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1.0 / (448 * 512))
    q = (x * scale.reciprocal()).clamp(-448, 448).to(torch.float8_e4m3fn)
    return torch._scaled_mm(q, w8.t(), scale, w_scale, out_dtype=torch.bfloat16)


def test_an_fp8_layer_is_captured_and_replays_its_eager_results(engine_mode):
    gen = torch.Generator().manual_seed(3)
    w8 = (torch.randn(24, 64, generator=gen) * 8).to(torch.float8_e4m3fn).to("neuron")
    w_scale = (torch.rand(1, 24, generator=gen) + 0.5).to("neuron")
    x = torch.empty(16, 64, device="neuron")
    g, y = capture(lambda: _fp8_layer(x, w8, w_scale))
    for seed in range(3):
        xc = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
        x.copy_(xc)
        g.replay()
        assert torch.equal(y.cpu(), _fp8_layer(xc.to("neuron"), w8, w_scale).cpu())
