"""Legacy ``neuronxcc`` import paths (the Neuron compiler package of SDK <= 2.26).

Only ``neuronxcc.nki`` exists here: thin aliases of torchneuron's NKI modules, so kernels
written as ``import neuronxcc.nki.typing as nt`` / ``neuronxcc.nki.language`` still import.
"""
