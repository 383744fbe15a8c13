"""Tensor parallelism: TP=2 over two neuron devices (the ``neuron`` c10d backend) equals TP=1."""

import numpy as np
from serving_support import LOGPROB_ATOL, result_of


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
    for key in ("greedy", "long", "prefix"):
        assert tp2[key] == tp1[key], key
        # sharded matmuls sum in another order: equal up to fp32 rounding
        np.testing.assert_allclose(np.array(tp2[key + "_logprobs"]),
                                   np.array(tp1[key + "_logprobs"]), rtol=0, atol=LOGPROB_ATOL)
    assert tp1["greedy"] == llama_hf["greedy"]
