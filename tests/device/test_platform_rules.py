"""The hardware table's derived figures and the parsers of the topology variables, each rule
against a value worked out by hand from the published figures (shared/reference/
trainium-hardware.md), at its boundaries."""

import pytest

from torchneuron import platform

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


# --- derived figures of one physical core --------------------------------------------------
@pytest.mark.parametrize("dtype,tflops", [("bfloat16", 79.0), ("float16", 79.0), ("tfloat32", 79.0),
                                          ("float32", 20.0), ("float8_e4m3", 158.0), ("int8", 158.0),
                                          ("bf16", 79.0), ("fp8", 158.0)])
def test_peak_flops_by_tensor_engine_rate_class_trn2(dtype, tflops):
    assert platform.get_platform("trn2").peak_flops(dtype) == tflops * 1e12


def test_peak_flops_default_is_bf16():
    assert platform.get_platform("trn3").peak_flops() == 79.0e12


def test_fp8_doubles_again_on_trn3():
    assert platform.get_platform("trn3").peak_flops("float8_e5m2") == 315.0e12


def test_unknown_dtype_has_no_peak():
    with pytest.raises(KeyError):
        platform.get_platform("trn2").peak_flops("complex64")


@pytest.mark.parametrize("name,per_core", [("trn1", 820e9 / 2), ("trn2", 2.9e12 / 8), ("trn3", 4.9e12 / 8)])
def test_hbm_bandwidth_share_of_a_physical_core(name, per_core):
    assert platform.get_platform(name).hbm_bytes_per_s_per_physical_core == pytest.approx(per_core, rel=1e-12)


def test_dma_transfer_fixed_cost_is_fixed_plus_issue():
    assert platform.get_platform("trn2").dma_transfer_fixed_s == pytest.approx(1.9e-6, rel=1e-12)


def test_dma_bandwidth_is_all_queues():
    assert platform.get_platform("trn3").dma_bytes_per_s == pytest.approx(16 * 33.0e9)


def test_psum_bank_is_one_eighth_of_psum():
    assert platform.get_platform("trn2").psum_bank_bytes == 2 * KiB


# --- platform selection ------------------------------------------------------------------------
def test_platform_name_is_trimmed_and_case_insensitive():
    assert platform.get_platform("  TRN3 ").name == "trn3"


def test_default_platform_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    assert platform.get_platform().name == "trn3"


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_platform_variable_means_trn2(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    else:
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", value)
    assert platform.get_platform().name == "trn2"


def test_unknown_platform_lists_the_known_ones_and_the_variable():
    with pytest.raises(ValueError, match=r"unknown Neuron platform 'trn9'; expected one of \['trn1', 'trn2', 'trn3'\] "
                                         r"\(set NEURON_PLATFORM_TARGET_OVERRIDE"):
        platform.get_platform("trn9")


def test_trn1_is_simulated_but_not_emulated_as_a_device():
    assert platform.get_platform("trn1").name == "trn1"
    with pytest.raises(ValueError, match=r"emulates \('trn2', 'trn3'\) only, not trn1"):
        platform.read_topology({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn1"})


# --- sizes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("0", 0), ("7", 7), ("7b", 7), ("7B", 7), ("3k", 3000), ("3kb", 3000), ("3KiB", 3 * KiB), ("3ki", 3 * KiB),
    ("2m", 2_000_000), ("2MB", 2_000_000), ("2MiB", 2 * MiB), ("2mi", 2 * MiB), ("1g", 10**9), ("1GB", 10**9),
    ("1GiB", GiB), ("1gi", GiB), ("1t", 10**12), ("1TB", 10**12), ("1TiB", 1 << 40), ("1ti", 1 << 40),
    (" 1.5 GiB ", 3 * GiB // 2), ("0.5KiB", 512),
])
def test_parse_size_units(text, expected):
    assert platform.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "1 PiB", "1.2.3", "12 x"])
def test_parse_size_rejects_with_an_example(text):
    with pytest.raises(ValueError, match=rf"cannot parse memory size {text!r}; use bytes or a unit, e.g. '2GiB'"):
        platform.parse_size(text)


# --- core lists --------------------------------------------------------------------------------
@pytest.mark.parametrize("text,cores", [
    ("0", [0]), ("1,3", [1, 3]), ("0-3", [0, 1, 2, 3]), ("2-2", [2]), ("0-1,4", [0, 1, 4]),
    (" 5 , 1-2 ", [5, 1, 2]), ("3,", [3]), (",3", [3]),
])
def test_parse_core_list(text, cores):
    assert platform.parse_core_list(text) == cores


def test_reversed_core_range_is_rejected():
    with pytest.raises(ValueError, match=r"bad core range '3-1' in NEURON_RT_VISIBLE_CORES='0,3-1'"):
        platform.parse_core_list("0,3-1")


@pytest.mark.parametrize("text", ["1,1", "0-2,2", "1-3,2-4"])
def test_core_listed_twice_is_rejected(text):
    with pytest.raises(ValueError, match=rf"NEURON_RT_VISIBLE_CORES={text!r} lists a core twice"):
        platform.parse_core_list(text)


# --- topology ----------------------------------------------------------------------------------
def test_topology_counts_and_chip_of_each_device():
    topo = platform.read_topology({"TORCHNEURON_NUM_CHIPS": "2", "NEURON_RT_VISIBLE_CORES": "3,4,7"})
    assert topo.logical_cores_per_chip == 4
    assert topo.total_logical_cores == 8
    assert topo.device_count == 3
    assert [topo.chip_of(i) for i in range(3)] == [0, 1, 1]


def test_topology_at_lnc1_has_one_logical_core_per_physical_core():
    topo = platform.read_topology({"NEURON_LOGICAL_NC_CONFIG": "1", "TORCHNEURON_NUM_CHIPS": "3"})
    assert (topo.lnc, topo.logical_cores_per_chip, topo.total_logical_cores) == (1, 8, 24)
    assert topo.visible_cores == tuple(range(24))


def test_describe_names_platform_chips_lnc_devices_and_memory():
    topo = platform.read_topology({"TORCHNEURON_DEVICE_MEMORY": "1536MiB"})
    assert topo.describe() == "trn2 (Trainium2), 1 chip(s), LNC=2, 4 device(s) of 1.5 GiB"


def test_last_core_of_the_machine_is_visible_and_the_next_is_not():
    assert platform.read_topology({"NEURON_RT_VISIBLE_CORES": "3"}).visible_cores == (3,)
    with pytest.raises(ValueError, match=r"names core\(s\) \[4\] but this trn2 machine has logical cores 0-3 "
                                         r"\(1 chip\(s\) x 4 at LNC=2\)"):
        platform.read_topology({"NEURON_RT_VISIBLE_CORES": "4"})


@pytest.mark.parametrize("part", ["-1", "a", "1-", "1-2-3", "1.5"])
def test_malformed_core_is_named_with_an_example(part):
    with pytest.raises(ValueError, match=rf"bad core {part!r} in NEURON_RT_VISIBLE_CORES='0,{part}'; expected "
                                         r"core numbers and ranges such as '1,3' or '0-3'"):
        platform.parse_core_list(f"0,{part}")


@pytest.mark.parametrize("value", ["", "  "])
def test_blank_variables_mean_their_defaults(value):
    topo = platform.read_topology({"TORCHNEURON_NUM_CHIPS": value, "NEURON_LOGICAL_NC_CONFIG": value,
                                   "NEURON_RT_VISIBLE_CORES": value, "TORCHNEURON_DEVICE_MEMORY": value})
    assert (topo.num_chips, topo.lnc, topo.device_count, topo.memory_per_device) == (1, 2, 4, 24 * GiB)
    assert isinstance(topo.memory_per_device, int)  # bytes, handed to the runtime as a count


def test_non_integer_variable_is_named():
    with pytest.raises(ValueError, match=r"^TORCHNEURON_NUM_CHIPS='two' is not an integer$"):
        platform.read_topology({"TORCHNEURON_NUM_CHIPS": "two"})


def test_one_chip_is_the_minimum_and_zero_is_refused():
    assert platform.read_topology({"TORCHNEURON_NUM_CHIPS": "1"}).num_chips == 1
    with pytest.raises(ValueError, match=r"TORCHNEURON_NUM_CHIPS=0 must be >= 1"):
        platform.read_topology({"TORCHNEURON_NUM_CHIPS": "0"})


@pytest.mark.parametrize("lnc", ["0", "3"])
def test_lnc_outside_one_and_two_is_refused(lnc):
    with pytest.raises(ValueError, match=rf"NEURON_LOGICAL_NC_CONFIG={lnc} is invalid; it must be 1 or 2"):
        platform.read_topology({"NEURON_LOGICAL_NC_CONFIG": lnc})


def test_zero_device_memory_is_refused():
    with pytest.raises(ValueError, match=r"TORCHNEURON_DEVICE_MEMORY='0' must be positive"):
        platform.read_topology({"TORCHNEURON_DEVICE_MEMORY": "0"})


def test_one_byte_of_device_memory_is_accepted():
    assert platform.read_topology({"TORCHNEURON_DEVICE_MEMORY": "1"}).memory_per_device == 1


def test_trn3_default_memory_is_its_hbm_over_logical_cores():
    topo = platform.read_topology({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn3"})
    assert topo.memory_per_device == 36 * GiB


def test_process_topology_is_read_once(monkeypatch):
    platform.topology.cache_clear()
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    first = platform.topology()
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert platform.topology() is first and first.lnc == 1
    platform.topology.cache_clear()
