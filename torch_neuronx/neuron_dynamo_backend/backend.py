"""AWS's entry-point module for the ``"neuron"`` Dynamo backend; re-exports torchneuron's."""

from torchneuron.compile import neuron_backend

__all__ = ["neuron_backend"]
