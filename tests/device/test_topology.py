"""Emulated topology from environment variables, one hardware table, `torchneuron info`."""

import pytest
import torch

from support import run_python
from torchneuron import platform

GiB = 1 << 30


def test_default_trn2_has_four_devices_of_24_gib():
    topo = platform.read_topology({})
    assert topo.platform.name == "trn2"
    assert topo.device_count == 4
    assert topo.memory_per_device == 96 * GiB // 4


def test_lnc1_doubles_devices_and_halves_memory():
    topo = platform.read_topology({"NEURON_LOGICAL_NC_CONFIG": "1"})
    assert topo.device_count == 8 and topo.memory_per_device == 12 * GiB


def test_trn3_and_chips():
    topo = platform.read_topology({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn3", "TORCHNEURON_NUM_CHIPS": "2"})
    assert topo.platform.name == "trn3"
    assert topo.device_count == 8
    assert topo.memory_per_device == 144 * GiB // 4


def test_visible_cores_restrict_and_renumber():
    topo = platform.read_topology({"NEURON_RT_VISIBLE_CORES": "1,3"})
    assert topo.visible_cores == (1, 3)
    assert platform.read_topology({"NEURON_RT_VISIBLE_CORES": "0-2"}).device_count == 3


@pytest.mark.parametrize("text,expected", [("2GiB", 2 * GiB), ("512MiB", 512 << 20), ("1048576", 1 << 20),
                                           ("1.5GB", 1_500_000_000)])
def test_device_memory_override_parses_units(text, expected):
    assert platform.read_topology({"TORCHNEURON_DEVICE_MEMORY": text}).memory_per_device == expected


@pytest.mark.parametrize("env,message", [
    ({"NEURON_LOGICAL_NC_CONFIG": "3"}, "must be 1 or 2"),
    ({"NEURON_RT_VISIBLE_CORES": "0,7"}, "names core(s) [7]"),
    ({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn9"}, "unknown Neuron platform"),
    ({"TORCHNEURON_DEVICE_MEMORY": "lots"}, "cannot parse memory size"),
    ({"TORCHNEURON_NUM_CHIPS": "0"}, "must be >= 1"),
])
def test_bad_topology_variables_are_named_in_the_error(env, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        platform.read_topology(env)


def test_process_sees_visible_cores_as_devices():
    r = run_python("import torch; print(torch.neuron.device_count(), torch.neuron.get_device_properties(1).logical_core)",
                   env={"NEURON_RT_VISIBLE_CORES": "1,3", "TORCHNEURON_DEVICE_MEMORY": "1GiB"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "3"]


def test_bad_environment_does_not_break_import_torch_but_errors_on_use():
    r = run_python("import torch\nprint(torch.neuron.is_available())\n"
                   "try:\n    torch.ones(1, device='neuron')\nexcept RuntimeError as e:\n    print('ERR', e)",
                   env={"NEURON_LOGICAL_NC_CONFIG": "5"})
    assert r.returncode == 0, r.stderr
    assert "False" in r.stdout and "ERR" in r.stdout and "NEURON_LOGICAL_NC_CONFIG" in r.stdout


def test_device_properties_come_from_the_platform_table():
    props = torch.neuron.get_device_properties(0)
    p = platform.get_platform("trn2")
    assert props.platform == "trn2"
    assert props.total_memory == 24 * GiB
    assert props.physical_cores == 2
    assert props.peak_tflops["bf16"] == 2 * p.tensor_tflops["bf16"]
    assert props.hbm_bandwidth == pytest.approx(p.hbm_bandwidth_per_chip / 4)
    assert "Trainium2" in torch.neuron.get_device_name(0)
    assert torch.neuron.get_device_capability(0) == (3, 0)


def test_clock_rate_is_the_platforms_tensor_engine_clock_in_mhz():
    r = run_python("import torch; print(torch.neuron.clock_rate(0))", env={"NEURON_PLATFORM_TARGET_OVERRIDE": "trn3"})
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == platform.get_platform("trn3").tensor_clock_hz / 1e6
    assert torch.neuron.clock_rate() == platform.topology().platform.tensor_clock_hz / 1e6


def test_distinct_devices_are_peers_and_a_device_is_not_its_own():
    assert torch.neuron.can_device_access_peer(0, 1) and torch.neuron.can_device_access_peer("neuron:1", 0)
    assert not torch.neuron.can_device_access_peer(1, 1)
    with pytest.raises(RuntimeError, match="Invalid device index neuron:9"):
        torch.neuron.can_device_access_peer(0, 9)


def test_default_generators_are_each_devices_generator():
    gens = torch.neuron.default_generators
    assert len(gens) == torch.neuron.device_count()
    assert [g.device for g in gens] == [torch.device("neuron", i) for i in range(len(gens))]
    gens[1].manual_seed(123)
    assert torch.neuron.initial_seed() != 123 or torch.neuron.current_device() == 1
    with torch.neuron.device(1):
        assert torch.neuron.initial_seed() == 123


@pytest.mark.parametrize("name", ["utilization", "memory_usage", "temperature", "power_draw"])
def test_sensor_readings_raise_naming_what_is_missing(name):
    with pytest.raises(NotImplementedError, match=f"torch.neuron.{name}: the emulated NeuronCore has no"):
        getattr(torch.neuron, name)(0)


def test_info_command_lists_devices_and_memory():
    r = run_python("from torchneuron.cli import main; main(['info'])", env={"NEURON_LOGICAL_NC_CONFIG": "1"})
    assert r.returncode == 0, r.stderr
    assert "platform trn2" in r.stdout
    assert r.stdout.count("neuron:") == 8
    assert "12.0 GiB" in r.stdout
