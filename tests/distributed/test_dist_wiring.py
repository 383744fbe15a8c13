"""The Python wiring of backend "neuron", in this process: core binding from LOCAL_RANK, the
arguments the c10d creator hands to gloo and to the C++ backend, registration, and the
monitored_barrier route. (The multi-process tests run the same code inside spawned ranks, where
neither a failure's line nor mutation testing can see it.)"""

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import torchneuron.distributed as tnd


@pytest.fixture
def binding(monkeypatch):
    """A process not yet bound, restored afterwards (binding changes the current device)."""
    monkeypatch.setattr(tnd, "_bound_device", None)
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    device = torch.neuron.current_device()
    yield monkeypatch
    torch.neuron.set_device(device)


def test_bind_without_local_rank_leaves_placement_to_the_caller(binding):
    assert tnd.bind_local_device() is None
    assert tnd._bound_device is None


def test_bind_maps_local_rank_modulo_device_count(binding):
    assert torch.neuron.device_count() == 4
    binding.setattr(torch.neuron, "memory_allocated", lambda d=None: 0)  # earlier tests' memory
    binding.setenv("LOCAL_RANK", "4")  # 4 mod 4 devices -> neuron:0
    assert tnd.bind_local_device() == 0
    assert torch.neuron.current_device() == 0


def test_bind_sets_the_current_device(binding):
    torch.neuron.set_device(0)
    binding.setattr(torch.neuron, "memory_allocated", lambda d=None: 0)  # no core holds memory
    binding.setenv("LOCAL_RANK", "2")
    binding.setenv("LOCAL_WORLD_SIZE", "4")
    assert tnd.bind_local_device() == 2
    assert torch.neuron.current_device() == 2


def test_binding_is_remembered_for_the_process(binding):
    binding.setattr(torch.neuron, "memory_allocated", lambda d=None: 0)
    binding.setenv("LOCAL_RANK", "3")
    assert tnd.bind_local_device() == 3
    binding.setenv("LOCAL_RANK", "1")  # later groups keep the first binding
    assert tnd.bind_local_device() == 3


def test_bind_with_no_visible_device_names_the_variables(binding):
    binding.setattr(torch.neuron, "device_count", lambda: 0)
    binding.setenv("LOCAL_RANK", "0")
    with pytest.raises(RuntimeError, match=r"^neuron process group: no neuron device is visible \(check "
                                           r"NEURON_RT_VISIBLE_CORES / NEURON_LOGICAL_NC_CONFIG\)$"):
        tnd.bind_local_device()


def test_more_local_processes_than_cores_is_refused(binding):
    binding.setenv("LOCAL_RANK", "0")
    binding.setenv("LOCAL_WORLD_SIZE", "5")
    with pytest.raises(RuntimeError, match=r"5 processes per node but only 4 logical NeuronCore\(s\) are visible; one "
                                           r"process drives one core \(use --nproc-per-node 4 or raise "
                                           r"TORCHNEURON_NUM_CHIPS / change NEURON_LOGICAL_NC_CONFIG\)$"):
        tnd.bind_local_device()


def test_two_visible_cores_for_three_local_processes_is_refused(binding):
    binding.setattr(torch.neuron, "device_count", lambda: 2)
    binding.setenv("LOCAL_RANK", "0")
    binding.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(RuntimeError, match="3 processes per node but only 2"):
        tnd.bind_local_device()


def test_as_many_local_processes_as_cores_is_accepted(binding):
    binding.setattr(torch.neuron, "memory_allocated", lambda d=None: 0)
    binding.setenv("LOCAL_RANK", "1")
    binding.setenv("LOCAL_WORLD_SIZE", "4")
    assert tnd.bind_local_device() == 1


def test_one_visible_core_per_process_is_accepted_for_any_local_world(binding):
    # NEURON_RT_VISIBLE_CORES=<local rank> per process: each sees one device, neuron:0
    binding.setattr(torch.neuron, "device_count", lambda: 1)
    binding.setattr(torch.neuron, "memory_allocated", lambda d=None: 0)
    binding.setenv("LOCAL_RANK", "5")
    binding.setenv("LOCAL_WORLD_SIZE", "8")
    assert tnd.bind_local_device() == 0


def test_memory_held_on_another_core_is_named(binding):
    torch.neuron.init()
    held = {3: 1}  # one byte is enough
    binding.setattr(torch.neuron, "memory_allocated", lambda d=None: held.get(d, 0))
    binding.setenv("LOCAL_RANK", "0")
    with pytest.raises(RuntimeError, match=r"already holds memory on neuron:3 but LOCAL_RANK=0 maps it to neuron:0 "
                                           r"\(one process drives one NeuronCore\)\. Create no neuron tensors "
                                           r"before init_process_group, or create them on neuron:0 "
                                           r"\(torch\.neuron\.set_device\(0\)\)\.$"):
        tnd.bind_local_device()
    assert tnd._bound_device is None


def test_memory_on_the_target_core_itself_is_fine(binding):
    torch.neuron.init()
    binding.setattr(torch.neuron, "memory_allocated", lambda d=None: 512 if d == 1 else 0)
    binding.setenv("LOCAL_RANK", "1")
    assert tnd.bind_local_device() == 1


def test_memory_is_not_checked_before_the_runtime_starts(binding):
    binding.setattr(torch.neuron, "is_initialized", lambda: False)
    binding.setattr(torch.neuron, "memory_allocated", lambda d=None: 512)
    binding.setenv("LOCAL_RANK", "2")
    assert tnd.bind_local_device() == 2


# --- the creator c10d calls ------------------------------------------------------------------
def _opts(timeout, group_id="7", ranks=(0,)):
    return SimpleNamespace(store=dist.HashStore(), group_rank=0, group_size=1, timeout=timeout,
                           global_ranks_in_group=list(ranks), group_id=group_id)


@pytest.fixture
def captured(monkeypatch):
    """The C++ backend's constructor replaced by a recorder of its arguments."""
    monkeypatch.setattr(tnd, "_ext", lambda: SimpleNamespace(ProcessGroupNeuron=lambda *a: a))
    monkeypatch.setattr(tnd, "bind_local_device", lambda: None)


def test_creator_passes_gloo_rank_size_timeout_and_name(captured):
    gloo, rank, size, seconds, name = tnd._create_backend(_opts(timedelta(seconds=42), group_id="grp"))
    assert isinstance(gloo, dist.ProcessGroupGloo)
    assert (rank, size, seconds, name) == (0, 1, 42.0, "grp")
    assert gloo.options._timeout == timedelta(seconds=42)


def test_creator_accepts_a_timeout_in_seconds(captured):
    gloo, _, _, seconds, _ = tnd._create_backend(_opts(12.5))
    assert seconds == 12.5
    assert gloo.options._timeout == timedelta(seconds=12.5)


def test_creator_names_the_gloo_transport_like_c10d(captured):
    gloo, *_ = tnd._create_backend(_opts(timedelta(seconds=5), group_id="g3", ranks=(4,)))
    assert gloo.options.group_name == "g3"
    assert list(gloo.options.global_ranks_in_group) == [4]


def test_creator_uses_gloo_options_when_given(captured):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=3)
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    gloo, *_ = tnd._create_backend(_opts(timedelta(seconds=99)), opts)
    assert gloo.options._timeout == timedelta(seconds=3)


def test_creator_ignores_options_of_another_backend(captured):
    gloo, *_ = tnd._create_backend(_opts(timedelta(seconds=8)), object())
    assert gloo.options._timeout == timedelta(seconds=8)


def test_creator_binds_the_process_first(monkeypatch):
    calls = []
    monkeypatch.setattr(tnd, "_ext", lambda: SimpleNamespace(ProcessGroupNeuron=lambda *a: a))
    monkeypatch.setattr(tnd, "bind_local_device", lambda: calls.append("bind"))
    tnd._create_backend(_opts(timedelta(seconds=5)))
    assert calls == ["bind"]


# --- registration and the monitored_barrier route ---------------------------------------------
def test_register_sets_the_flag_and_patches_monitored_barrier(monkeypatch):
    monkeypatch.setattr(tnd, "_registered", False)
    tnd.register()
    assert tnd.is_registered()
    assert getattr(dist.monitored_barrier, "_torchneuron", False)
    assert "neuron" in dist.Backend.backend_list


def test_register_registers_the_creator_for_the_neuron_device(monkeypatch):
    calls = []
    monkeypatch.setattr(tnd, "_registered", False)
    monkeypatch.setattr(dist.Backend, "backend_list", [b for b in dist.Backend.backend_list if b != "neuron"])
    monkeypatch.setattr(dist.Backend, "register_backend", lambda *a, **k: calls.append((a, k)))
    tnd.register()
    assert calls == [(("neuron", tnd._create_backend), {"extended_api": True, "devices": ["neuron"]})]


def test_register_does_not_register_a_name_torch_already_knows(monkeypatch):
    calls = []
    monkeypatch.setattr(tnd, "_registered", False)
    assert "neuron" in dist.Backend.backend_list
    monkeypatch.setattr(dist.Backend, "register_backend", lambda *a, **k: calls.append((a, k)))
    tnd.register()
    assert calls == [] and tnd.is_registered()


def test_register_does_nothing_when_distributed_is_unavailable(monkeypatch):
    monkeypatch.setattr(tnd, "_registered", False)
    monkeypatch.setattr(dist, "is_available", lambda: False)
    tnd.register()
    assert not tnd.is_registered()


def test_register_loads_the_cpp_backend(monkeypatch):
    loaded = []
    monkeypatch.setattr(tnd, "_registered", False)
    monkeypatch.setattr(tnd, "_ext", lambda: loaded.append(True))
    tnd.register()
    assert loaded == [True]


@pytest.fixture
def neuron_group():
    """A one-rank default group with backend "neuron" in this process."""
    tnd.register()
    assert not dist.is_initialized()
    dist.init_process_group("neuron", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_standard_monitored_barrier_runs_on_a_neuron_group(neuron_group):
    dist.monitored_barrier(timeout=timedelta(seconds=10), wait_all_ranks=True)  # upstream: gloo only
    tnd.monitored_barrier()
    tnd.monitored_barrier(neuron_group, timeout=timedelta(seconds=10))


def test_patched_monitored_barrier_keeps_torchs_error_for_other_backends():
    store = dist.HashStore()
    dist.init_process_group("cpu:gloo", store=store, rank=0, world_size=1)
    try:
        sub = dist.new_group([0], backend="gloo")
        dist.monitored_barrier(sub, timeout=timedelta(seconds=5))  # gloo: the original runs it
    finally:
        dist.destroy_process_group()


def test_flight_recorder_lists_the_collectives_of_this_process(neuron_group):
    import json

    t = torch.ones(3, device="neuron")
    dist.all_reduce(t)
    records = [json.loads(line) for line in tnd.dump_flight_recorder().splitlines()]
    assert records and "allreduce" in records[-1]["op"].lower().replace("_", "")


# --- monitored_barrier: the forwarding function and the patch of torch's, with recording fakes ---
class _Backend:
    def __init__(self):
        self.calls = []

    def monitored_barrier(self, timeout, wait_all_ranks):
        self.calls.append((timeout, wait_all_ranks))


class _Group:
    def __init__(self, name, has_neuron=True):
        self.name, self.has_neuron, self.backend, self.asked = name, has_neuron, _Backend(), []

    def _get_backend(self, device):
        self.asked.append(device)
        if not self.has_neuron:
            raise RuntimeError("no backend for device neuron")
        return self.backend


def test_monitored_barrier_forwards_timeout_and_wait_all_ranks_to_the_neuron_backend():
    g = _Group("neuron")
    tnd.monitored_barrier(g, timeout=timedelta(seconds=5), wait_all_ranks=True)
    assert g.backend.calls == [(timedelta(seconds=5), True)]
    assert g.asked == [torch.device("neuron")]


def test_monitored_barrier_defaults_are_the_process_group_timeout_and_first_failure():
    g = _Group("neuron")
    tnd.monitored_barrier(g)
    assert g.backend.calls == [(timedelta(seconds=dist.default_pg_timeout.total_seconds()), False)]


@pytest.fixture
def unpatched(monkeypatch):
    """torch's monitored_barrier replaced by a recorder, as before register() patched it."""
    import torch.distributed.distributed_c10d as c10d

    calls = []

    def original(group=None, timeout=None, wait_all_ranks=False):
        """upstream docstring"""
        calls.append((group, timeout, wait_all_ranks))

    monkeypatch.setattr(c10d, "monitored_barrier", original)
    monkeypatch.setattr(dist, "monitored_barrier", original)
    monkeypatch.setattr(dist, "get_backend", lambda pg: pg.name)
    routed = []
    monkeypatch.setattr(tnd, "monitored_barrier", lambda pg, t, w: routed.append((pg, t, w)))
    tnd._patch_monitored_barrier()
    return SimpleNamespace(c10d=c10d, original=original, calls=calls, routed=routed)


def test_patch_installs_one_marked_function_in_both_namespaces(unpatched):
    patched = dist.monitored_barrier
    assert patched is not unpatched.original and unpatched.c10d.monitored_barrier is patched
    assert patched._torchneuron is True and patched.__doc__ == "upstream docstring"
    tnd._patch_monitored_barrier()  # again: already patched, not wrapped twice
    assert dist.monitored_barrier is patched


def test_patched_barrier_routes_a_neuron_group_to_its_backend(unpatched):
    g = _Group("neuron")
    dist.monitored_barrier(g, timeout=timedelta(seconds=4), wait_all_ranks=True)
    assert unpatched.routed == [(g, timedelta(seconds=4), True)] and unpatched.calls == []
    assert g.asked == [torch.device("neuron")]


def test_patched_barrier_leaves_gloo_groups_to_torch(unpatched):
    g = _Group("gloo")
    dist.monitored_barrier(g, timeout=timedelta(seconds=4), wait_all_ranks=True)
    assert unpatched.calls == [(g, timedelta(seconds=4), True)] and unpatched.routed == []
    assert g.asked == []


def test_patched_barrier_leaves_groups_without_a_neuron_backend_to_torch(unpatched):
    g = _Group("nccl", has_neuron=False)
    dist.monitored_barrier(g, timeout=timedelta(seconds=2))
    assert unpatched.calls == [(g, timedelta(seconds=2), False)] and unpatched.routed == []


def test_patched_barrier_without_a_group_uses_the_default_group(unpatched, monkeypatch):
    g = _Group("neuron")
    monkeypatch.setattr(unpatched.c10d, "_get_default_group", lambda: g)
    dist.monitored_barrier()
    assert unpatched.routed == [(g, None, False)]
