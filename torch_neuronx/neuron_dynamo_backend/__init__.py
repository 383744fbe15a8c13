"""``torch_neuronx.neuron_dynamo_backend``: the torch.compile backend ``"neuron"`` under AWS's
module path (``torch_neuronx.neuron_dynamo_backend.backend:neuron_backend``); it is
:mod:`torchneuron.compile`."""

from torchneuron.compile import NeuronCompileError, neuron_backend, register

from . import backend

__all__ = ["neuron_backend", "register", "NeuronCompileError", "backend"]
