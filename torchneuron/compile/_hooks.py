"""What ``import torch`` sets up for compiling on neuron, without importing Dynamo or Inductor.

Three hooks, all installed at autoload and all cheap:

* **Import hooks** (a ``sys.meta_path`` finder that runs a function right after a module has
  loaded, or at once if it is already loaded):

  - ``torch.nn.attention.flex_attention``: its ``_validate_device`` rejects neuron tensors
    before any compile backend runs, so eager ``flex_attention`` needs the patch as soon as the
    module exists;
  - ``torch._dynamo.device_interface``: Dynamo registers device interfaces for cuda, xpu, mtia,
    mps and cpu only; neuron's is registered the moment Dynamo loads, so tracing code that
    touches ``torch.neuron`` streams or events works before any backend has run.

* **The default ``torch.compile`` backend** (``"inductor"``, i.e. ``torch.compile(model)`` with no
  ``backend``): a graph whose tensors live on neuron is compiled by the neuron backend
  (:func:`.backend.compile_graph`: FlexAttention/SDPA legalisation, neuron Inductor settings,
  metrics, errors naming the op), which lowers it with the same Inductor. Other graphs go to
  Inductor untouched. See :func:`route_default_backend`.

The Inductor *device* (scheduling, wrapper codegen) needs no hook: Inductor looks PrivateUse1
code generators up by itself, as ``torch.neuron.Scheduling`` etc., the first time it builds its
backend table (``init_backend_registration``); see ``torchneuron.neuron.__getattr__``.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable

_installed = False


def _patch_flex_attention() -> None:
    from .inductor_patches import patch_flex_validate_device

    patch_flex_validate_device()


def _register_device_interface() -> None:
    from . import device_interface

    device_interface.register()


# module name -> what to run once it has loaded
_AFTER_IMPORT: dict[str, Callable[[], None]] = {
    "torch.nn.attention.flex_attention": _patch_flex_attention,
    "torch._dynamo.device_interface": _register_device_interface,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, after: Callable[[], None]):
        self._inner = inner
        self._after = after

    def create_module(self, spec):  # noqa: D102
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: D102
        self._inner.exec_module(module)
        self._after()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # noqa: D102
        after = _AFTER_IMPORT.get(fullname)
        if after is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, after)
                return spec
        return None


def _graph_on_neuron(gm: Any, example_inputs: Any) -> bool:
    """Whether a Dynamo graph computes on neuron: an example input, or a value the graph creates
    (``torch.ones(..., device="neuron")`` in a graph without tensor inputs), lives there."""
    import torch

    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            return True
    for node in getattr(getattr(gm, "graph", None), "nodes", ()):
        val = node.meta.get("example_value")
        if isinstance(val, torch.Tensor) and val.device.type == "neuron":
            return True
    return False


def route_default_backend() -> None:
    """Make the default Inductor backend hand neuron graphs to the neuron backend (idempotent).

    ``torch.compile(model)`` and ``backend="inductor"`` build a
    ``torch._TorchCompileInductorWrapper`` whose ``__call__`` runs ``compile_fx`` on each Dynamo
    graph. Inductor itself can generate neuron kernels once the device is registered, but a
    neuron graph also needs the neuron backend's graph legalisation before AOTAutograd
    (FlexAttention training, which Inductor's C++ template cannot do, and SDPA kernels whose
    meta functions match the device) and its Inductor settings (no layout optimisation). The
    wrapper keeps its mode/options (an Inductor config dict) and passes them on."""
    import torch

    cls = torch._TorchCompileInductorWrapper
    original = cls.__call__
    if getattr(original, "_torchneuron_orig", None) is not None:
        return

    def __call__(self, model_, inputs_, *, config_patches=None):
        if not _graph_on_neuron(model_, inputs_):
            return original(self, model_, inputs_, config_patches=config_patches)
        from .backend import compile_graph

        # mode="reduce-overhead" / "max-autotune" set triton.cudagraphs: compile_graph replays
        # neuron graphs instead
        return compile_graph(model_, inputs_, options={**self.config, **(config_patches or {})})

    __call__._torchneuron_orig = original  # type: ignore[attr-defined]
    cls.__call__ = __call__


def install_import_hooks() -> None:
    """Install the hooks above (idempotent, cheap: imports neither Dynamo nor Inductor)."""
    global _installed
    if _installed:
        return
    _installed = True
    pending = False
    for name, after in _AFTER_IMPORT.items():
        if name in sys.modules:
            after()
        else:
            pending = True
    if pending:
        sys.meta_path.insert(0, _Finder())
    route_default_backend()
