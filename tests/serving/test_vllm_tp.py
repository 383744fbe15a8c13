"""Tensor parallelism: TP=2 over two neuron devices (the ``neuron`` c10d backend) equals TP=1."""

from conftest import result_of


def test_tp2_runs_one_worker_per_neuron_device(engines):
    run = result_of(engines, "tp2")
    assert run["rank_devices"] == ["neuron:0", "neuron:1"]
    assert run["rank_param_devices"] == [["neuron:0"], ["neuron:1"]]


def test_tp2_collectives_use_the_neuron_c10d_backend(engines):
    run = result_of(engines, "tp2")
    assert run["rank_tp_backends"] == ["neuron", "neuron"]
    assert run["tp_communicator"] == "NeuronCommunicator"


def test_tp2_equals_tp1(engines, llama_hf):
    tp1, tp2 = result_of(engines, "llama"), result_of(engines, "tp2")
    assert tp2["greedy"] == tp1["greedy"] == llama_hf["greedy"]
    assert tp2["long"] == tp1["long"]
    assert tp2["prefix"] == tp1["prefix"]
