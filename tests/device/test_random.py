"""Random numbers: per-device generators, seeding, state, explicit generators, threads."""

import threading

import torch


def test_same_seed_same_numbers():
    torch.manual_seed(123)
    a = torch.randn(100, device="neuron").cpu()
    torch.manual_seed(123)
    b = torch.randn(100, device="neuron").cpu()
    assert torch.equal(a, b)


def test_neuron_numbers_match_cpu_for_the_same_seed():
    torch.manual_seed(7)
    cpu = torch.rand(50)
    torch.manual_seed(7)
    dev = torch.rand(50, device="neuron").cpu()
    assert torch.equal(cpu, dev)


def test_torch_manual_seed_seeds_every_device():
    torch.manual_seed(5)
    a = torch.randn(10, device="neuron:2").cpu()
    torch.neuron.manual_seed_all(5)
    b = torch.randn(10, device="neuron:2").cpu()
    assert torch.equal(a, b)


def test_manual_seed_affects_only_current_device_generator():
    torch.neuron.manual_seed_all(1)
    torch.neuron.manual_seed(2)
    assert torch.neuron.initial_seed() == 2
    with torch.neuron.device(1):
        assert torch.neuron.initial_seed() == 1


def test_rng_state_round_trip():
    torch.neuron.manual_seed(0)
    state = torch.neuron.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = torch.rand(10, device="neuron").cpu()
    torch.neuron.set_rng_state(state)
    b = torch.rand(10, device="neuron").cpu()
    assert torch.equal(a, b)
    states = torch.neuron.get_rng_state_all()
    assert len(states) == torch.neuron.device_count()
    torch.neuron.set_rng_state_all(states)


def test_explicit_generator_on_neuron():
    g = torch.Generator(device="neuron")
    assert g.device.type == "neuron"
    g.manual_seed(42)
    a = torch.randn(5, device="neuron", generator=g).cpu()
    g.manual_seed(42)
    b = torch.randn(5, device="neuron", generator=g).cpu()
    assert torch.equal(a, b)
    g2 = torch.Generator(device="neuron").manual_seed(42)
    torch.testing.assert_close(torch.randn(5, device="neuron", generator=g2).cpu(), a)
    assert g.initial_seed() == 42 and g.get_state().numel() > 0


def test_dropout_and_bernoulli_and_randperm_are_reproducible():
    def draw():
        torch.manual_seed(3)
        x = torch.ones(100, device="neuron")
        return (torch.nn.functional.dropout(x, 0.5).cpu(), torch.bernoulli(x * 0.3).cpu(),
                torch.randperm(10, device="neuron").cpu(), torch.randint(0, 9, (5,), device="neuron").cpu())
    for a, b in zip(draw(), draw()):
        assert torch.equal(a, b)


def test_seed_sets_a_new_random_seed():
    torch.neuron.manual_seed_all(0)
    torch.neuron.seed()
    assert torch.neuron.initial_seed() != 0  # a random 64-bit seed is 0 with probability 2**-64
    torch.neuron.seed_all()
    seeds = {torch.neuron.random._generator(i).initial_seed() for i in range(torch.neuron.device_count())}
    assert len(seeds) == 1 and seeds != {0}  # one fresh seed shared by every device
    assert len(torch.neuron.random.default_generators) == torch.neuron.device_count()


def test_fork_rng_on_neuron():
    torch.manual_seed(0)
    with torch.random.fork_rng(device_type="neuron"):
        torch.rand(3, device="neuron")
    a = torch.rand(3, device="neuron").cpu()
    torch.manual_seed(0)
    b = torch.rand(3, device="neuron").cpu()
    assert torch.equal(a, b)


def test_generators_are_thread_safe():
    g = torch.Generator(device="neuron").manual_seed(0)
    out = []

    def worker():
        for _ in range(50):
            out.append(torch.rand(100, device="neuron", generator=g).cpu())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 200 draws from one generator: all distinct, and together exactly the sequential stream.
    g.manual_seed(0)
    seq = {tuple(torch.rand(100, device="neuron", generator=g).cpu().tolist()) for _ in range(200)}
    assert {tuple(t.tolist()) for t in out} == seq
