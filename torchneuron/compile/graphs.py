"""``torch.compile(mode="reduce-overhead")`` on neuron: compiled graphs replayed from neuron graphs.

On CUDA, "reduce-overhead" records each compiled graph into a CUDA graph and replays it, so a
call costs a few copies and one launch instead of the wrapper's Python and every kernel launch.
Neuron has graphs of its own (``torch.neuron.NeuronGraph``, csrc/backend/graph.cpp) and compiled
kernels are queued on the execution engine (kernels.py), so a compiled graph can be recorded
the same way. Inductor hands each compiled forward/backward to a ``CUDAGraphPolicy``
(``torch._inductor.config.cudagraph_policy``); :class:`NeuronGraphPolicy` wraps it in a
:class:`GraphedGraph`:

* The first call with a given input signature (sizes, strides, dtypes, integer arguments, and
  the addresses of inputs that keep theirs) runs the graph as compiled: a warm-up, as on CUDA.
  The second records it into a neuron graph and replays it; later calls replay.
* Inputs that keep their address from call to call (parameters and buffers, Inductor's static
  inputs; outputs of another recording, such as the activations a recorded forward hands its
  backward) are used in place. Other tensor inputs are copied into the recording's own buffers
  (queued copies); a mutated one is copied back after the replay.
* Outputs are fresh tensors over the recording's memory. Unlike CUDA, where an output read after
  the next replay raises ("overwritten by a subsequent run"), an output still referenced when
  the graph replays again is first given private memory holding its values, so results never
  change under the user (the cost: one queued copy of such outputs).
* Random ops are recorded as CUDA graphs record them: each replay draws the generator's next
  numbers (csrc/backend/generator.h, GraphRngUse).
* A graph that cannot be recorded (an op neuron runs synchronously, a host read, another
  stream: csrc/backend/graph.cpp) runs as compiled from then on, with one warning naming
  the reason; so does a call made inside a user's own graph capture (it records it), and calls
  made while torch.profiler records device activity (their kernels then appear in the trace).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch._inductor.cudagraph_utils import CUDAGraphPolicy

from .. import _C
from . import metrics
from .backend import _warn_once

__all__ = ["GraphedGraph", "NeuronGraphPolicy", "MAX_RECORDINGS"]

# Recordings one compiled graph keeps (distinct input signatures, e.g. dynamic shapes); calls
# with further signatures run as compiled.
MAX_RECORDINGS = 16

# Storage data pointer -> the GraphedGraph (its id) whose recording owns that output memory. An
# input found here, owned by another compiled graph, is that graph's output (a recorded forward's
# activations, as its backward's input): its address is stable across replays, so it is used in
# place instead of copied. A graph's own outputs fed back to it (a decoding loop's next input) are
# copied: used in place, each recording would make the next call's input a new address.
_recorded_memory: dict[int, int] = {}


_capture_streams: dict[int, torch.Stream] = {}


def _capture_stream(device: int) -> torch.Stream:
    """The side stream recordings of ``device`` are captured on (one per device, as
    ``torch.cuda.graph``'s default capture stream)."""
    if device not in _capture_streams:
        _capture_streams[device] = torch.neuron.Stream(device=device)
    return _capture_streams[device]


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, without building a storage object (a microsecond per
    input at every call)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


class _Recording:
    """One input signature's neuron graph, with its static inputs and outputs."""

    def __init__(self, graph: Any, inputs: list, copied: list[int], mutated: list[int],
                 outputs: Sequence[Any], in_place: dict[int, int], owner: int) -> None:
        self.graph = graph
        # The recording's own input buffers (the copied inputs'); inputs used in place are not
        # kept: one that is another recording's output must not look referenced to its owner,
        # which would then move it to private memory at every call (_privatize_live).
        self.inputs = [x if i in copied else None for i, x in enumerate(inputs)]
        self.copied = copied  # input indices copied into the recording's buffers at each call
        self.mutated = mutated  # ... of those, the ones the graph writes: copied back
        # How each output is rebuilt at each call: ("value", v) for a non-tensor; ("input", i, t)
        # for a view of input i used in place (an input the graph returns: viewed afresh on the
        # call's input, whose storage may be a new object over the same memory); ("view", t) for
        # an empty tensor; ("alias", group, t) for a tensor over the recording's memory (group:
        # its storage, aliased per call).
        self.plan: list[tuple] = []
        self.groups: list[torch.UntypedStorage] = []
        group_of: dict[int, int] = {}
        for out in outputs:
            if not isinstance(out, torch.Tensor):
                self.plan.append(("value", out))
                continue
            ptr = _storage_ptr(out)
            if ptr in in_place:
                self.plan.append(("input", in_place[ptr], _Geometry(out)))
                continue
            if ptr == 0:
                self.plan.append(("view", out))
                continue
            if ptr not in group_of:
                group_of[ptr] = len(self.groups)
                self.groups.append(out.untyped_storage())
            self.plan.append(("alias", group_of[ptr], out))
        for s in self.groups:
            _recorded_memory[s.data_ptr()] = owner
        weakref.finalize(self, _forget, [s.data_ptr() for s in self.groups])
        self.live: list[torch.UntypedStorage] = []  # the previous call's output storages

    def replay(self, inputs: list) -> list:
        # Outputs still referenced move out first: they may alias an input buffer too (an input
        # the graph returns, e.g. saved for the backward), which the copies below overwrite.
        self._privatize_live()
        for i in self.copied:
            src, dst = inputs[i], self.inputs[i]
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        self.graph.replay()
        for i in self.mutated:
            inputs[i].copy_(self.inputs[i])
        return self._outputs(inputs)

    def _privatize_live(self) -> None:
        """Outputs of the previous call still referenced get private memory with their values
        before the replay overwrites the recording's."""
        for alias in self.live:
            if torch._C._storage_Use_Count(alias._cdata) > 1:
                private = torch.empty(alias.nbytes(), dtype=torch.uint8, device=alias.device)
                private.copy_(torch.empty(0, dtype=torch.uint8, device=alias.device).set_(alias))
                _C._storage_take_data(alias, private.untyped_storage())
        self.live = []

    def _outputs(self, inputs: list) -> list:
        aliases = [torch._C._construct_storage_from_data_pointer(s.data_ptr(), s.device, s.nbytes())
                   for s in self.groups]
        self.live = aliases
        outs: list = []
        for entry in self.plan:
            kind = entry[0]
            if kind == "value":
                outs.append(entry[1])
            elif kind == "input":
                g = entry[2]
                outs.append(inputs[entry[1]].as_strided(g.size, g.stride, g.offset))
            elif kind == "view":
                t = entry[1]
                outs.append(t.as_strided(t.size(), t.stride(), t.storage_offset()))
            else:
                t = entry[2]
                outs.append(torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    aliases[entry[1]], t.storage_offset(), t.size(), t.stride()))
        return outs


class _Geometry:
    """An output's view of an input: sizes, strides and storage offset."""

    __slots__ = ("size", "stride", "offset")

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.stride, self.offset = tuple(t.size()), t.stride(), t.storage_offset()


def _forget(ptrs: list[int]) -> None:
    for p in ptrs:
        _recorded_memory.pop(p, None)


def _breaking_call(report: list[str]) -> Optional[str]:
    """The generated code's line that broke a capture (``buf3 = torch.ops.aten.median.default(
    arg0_1)``), from the capture's report, which ends with the stack of that call: its innermost
    frame outside torch itself."""
    import linecache
    import re

    torch_dir = os.path.dirname(torch.__file__)
    for line in reversed(report):
        m = re.search(r'File "([^"]+)", line (\d+)', line)
        if m and not m.group(1).startswith(torch_dir):
            code = linecache.getline(m.group(1), int(m.group(2))).strip()
            return code[:160] if code else f"{m.group(1)}:{m.group(2)}"
    return None


class GraphedGraph:
    """A compiled graph (Inductor's boxed callable: a list of inputs in, a list of outputs
    out) replayed from neuron graphs, one per input signature (module docstring)."""

    def __init__(self, model: Callable[[list], Any], static_input_idxs: Sequence[int],
                 mutated_input_idxs: Sequence[int], name: str) -> None:
        self.model = model
        self.static_input_idxs = frozenset(static_input_idxs)
        self.mutated_input_idxs = frozenset(mutated_input_idxs)
        self.name = name
        self.warmed: set = set()
        self.recordings: dict[Any, _Recording] = {}
        self.failed: Optional[str] = None  # why recording failed: not tried again

    def _in_place(self, i: int, x: torch.Tensor) -> bool:
        if i in self.static_input_idxs:
            return True
        if not _recorded_memory:
            return False
        owner = _recorded_memory.get(_storage_ptr(x))
        return owner is not None and owner != id(self)

    def _key(self, inputs: list) -> Optional[tuple]:
        """The input signature a recording is made for (None: not recordable). Runs at every
        call: kept to a few attribute reads per input."""
        key = []
        try:
            for i, x in enumerate(inputs):
                if isinstance(x, torch.Tensor):
                    key.append((x.shape, x.stride(), x.storage_offset(), x.dtype, x.device,
                                x.data_ptr() if self._in_place(i, x) else None))
                elif x is None or isinstance(x, (int, float, bool)):
                    key.append((type(x), x))
                else:  # generators and the like: not part of a recording
                    return None
        except RuntimeError:  # a layout without strides (sparse, nested)
            return None
        return tuple(key)

    def __call__(self, inputs: list) -> Any:
        # As compiled inside the user's own capture (it records the call). While torch.profiler
        # records device activity, recordings made before replay (each replayed kernel is an
        # activity with its launch's attribution, csrc/backend/compiled_kernels.cpp), but none
        # is made: a signature not recorded yet runs as compiled.
        if self.failed is not None or torch.neuron.is_current_stream_capturing():
            return self.model(inputs)
        key = self._key(inputs)
        rec = self.recordings.get(key)  # (None for key None: never a recording's key)
        if rec is None:
            if _C._trace_active():
                return self.model(inputs)
            if key is None:  # seen at every call: said once, then as compiled from now on
                self._not_recordable("an input is neither a tensor, a number nor None (a generator?), or a "
                                     "tensor without strides (sparse, nested)")
                return self.model(inputs)
            if key not in self.warmed:
                self.warmed.add(key)
                return self.model(inputs)
            if len(self.recordings) >= MAX_RECORDINGS:
                _warn_once(f"max:{id(self)}", f"neuron: mode='reduce-overhead': {self.name} was called with "
                           f"more than {MAX_RECORDINGS} input signatures; further ones run without graph "
                           "replay")
                return self.model(inputs)
            rec = self._record(inputs)
            if rec is None:  # not recordable (self.failed says why): as compiled from now on
                return self.model(inputs)
            self.recordings[key] = rec
        outs = rec.replay(inputs)
        inputs.clear()
        metrics.incr("graph_replays")
        return outs

    def _not_recordable(self, reason: str) -> None:
        """This graph runs as compiled from now on, with one warning naming ``reason``."""
        self.failed = reason
        metrics.incr("graphs_not_recordable")
        _warn_once(f"fail:{self.name}:{reason}", f"neuron: mode='reduce-overhead': {self.name} runs "
                   f"without graph replay: it cannot be recorded ({reason})")

    def _record(self, inputs: list) -> Optional[_Recording]:
        static: list = []
        copied: list[int] = []
        in_place: dict[int, int] = {}  # storage address -> the input used in place over it
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                if self._in_place(i, x):
                    static.append(x)
                    in_place.setdefault(_storage_ptr(x), i)
                else:
                    buf = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
                    buf.copy_(x)
                    static.append(buf)
                    copied.append(i)
            else:
                static.append(x)
        device = next((x.device.index for x in inputs if isinstance(x, torch.Tensor)), None)
        if device is None:
            device = torch.neuron.current_device()
        graph = torch.neuron.NeuronGraph()
        try:
            # Captured on the graph's device (a neuron:1 graph called with neuron:0 current
            # queues its kernels on neuron:1's stream), on a side stream of that device.
            with torch.neuron.device(device), torch.neuron.graph(graph, stream=_capture_stream(device)):
                outputs = self.model(list(static))
        except Exception as exc:  # what cannot be captured runs as compiled from now on
            lines = str(exc).strip().splitlines()
            reason = lines[0] if lines else type(exc).__name__
            where = _breaking_call(lines)
            if where:
                reason += f"; at {where}"
            self._not_recordable(reason)
            return None
        mutated = [i for i in copied if i in self.mutated_input_idxs]
        metrics.incr("graphs_recorded")
        return _Recording(graph, static, copied, mutated, list(outputs), in_place, id(self))


class NeuronGraphPolicy(CUDAGraphPolicy):
    """Inductor's graph-wrapping hook for neuron graphs (``mode="reduce-overhead"``)."""

    def should_wrap(self, compiled_graph: Any) -> bool:
        # Inductor gives up graphs for its own reasons (a CPU tensor among the outputs, an input's
        # storage resized, ...) and says so only for CUDA graphs; on neuron it was silent.
        reason = getattr(compiled_graph, "disabled_cudagraphs_reason", None)
        if reason:
            metrics.incr("graphs_not_recordable")
            _warn_once(f"inductor:{reason}", f"neuron: mode='reduce-overhead': a compiled graph runs without graph "
                       f"replay: Inductor is {reason}")
        return True

    def cudagraphify(self, model: Callable[..., Any], example_inputs: Sequence[Any],
                     static_input_idxs: Sequence[int], *, device_index: int, is_backward: bool,
                     is_inference: bool, **kwargs: Any) -> Callable[..., Any]:
        name = "the backward graph" if is_backward else ("the inference graph" if is_inference
                                                          else "the forward graph")
        return GraphedGraph(model, static_input_idxs, kwargs.get("mutated_input_idxs", ()), name)
