"""torch.compile kernels as device activities, attributed to their FX nodes' source.

The neuron Inductor wrapper (torchneuron.compile.inductor) calls every generated C++ kernel
through :func:`call` while a profiler session records or a graph is captured: between
:func:`launch` and ``.end()`` when recording, and with its attribution for the replays'
activities when captured (``_kernel_call_captured``). Per kernel it also emits, when the graph is compiled,
an info dict built by :func:`kernel_info` from the kernel's origin FX nodes: their ATen ops,
FLOPs, the user source line of each node (``node.meta["stack_trace"]``) and the module path
(``node.meta["nn_module_stack"]``). The dict is a literal in the generated code, so a graph
loaded from Inductor's cache keeps its attribution.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from .. import _C

__all__ = ["call", "launch", "kernel_info"]

_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


class _Running:
    __slots__ = ("act", "info")

    def __init__(self, act: Any, info: dict):
        self.act = act
        self.info = info

    def end(self) -> None:
        self.act.end(_meta(self.info), 0)


def _meta(info: dict) -> list:
    """A kernel's attribution as activity arguments: (key, JSON value) pairs."""
    return [(k, json.dumps(info[k])) for k in ("source", "function", "module", "flops",
                                              "tensor_flops", "origins", "sources") if info.get(k)]


def call(kernel: Any, info: dict, out_positions: tuple, *args: Any) -> None:
    """Call compiled kernel ``kernel`` (a ``NeuronCppKernel``) while a graph is captured (queued
    and recorded with its attribution, so each replay under torch.profiler is this kernel's
    activity) or while a profiler session records (after the queue, as an attributed device
    activity)."""
    if _C._engine_capturing():
        _C._kernel_call_captured(_meta(info), kernel.handle, *args)
        return
    _C._engine_drain()
    act = launch(kernel.name, info, out_positions, *args)
    kernel(*args)
    if act is not None:
        act.end()


def launch(name: str, info: dict, out_positions: tuple, *args: Any) -> Any:
    """Start the device activity of compiled kernel ``name`` (None when nothing records)."""
    if not _C._trace_active():
        return None
    act = _C._Activity(5, name, -1)
    ins, outs = [], []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            (outs if i in out_positions else ins).append(a)
    act.tensors(ins, False)
    act.tensors(outs, True)
    act.begin()
    return _Running(act, info)


def _module_path(nn_module_stack: Any) -> str:
    if not nn_module_stack:
        return ""
    path = list(nn_module_stack.values())[-1][0]
    # Dynamo's names: L['self'].blocks[0].attn / L__self___blocks_0_attn
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("['", ".").replace("']", "")
    return path.strip(".")


def _innermost(stack_trace: str) -> tuple | None:
    frames = _FRAME_RE.findall(stack_trace or "")
    if not frames:
        return None
    f, line, func = frames[-1]
    return f, int(line), func


def kernel_info(nodes: list, outputs: list) -> dict:
    """Attribution and FLOPs of a fused kernel from its scheduler nodes (codegen time)."""
    from .estimate_flops import flops_of

    origins = []
    for n in nodes:
        for sn in (n.get_nodes() if hasattr(n, "get_nodes") else [n]):
            irn = getattr(sn, "node", None)
            origins.extend(getattr(irn, "origins", ()) or ())
    seen = set()
    ops, sources = [], []
    flops = tensor_flops = 0
    module = ""
    for o in sorted(origins, key=lambda x: getattr(x, "name", "")):
        if id(o) in seen or getattr(o, "op", "") != "call_function":
            continue
        seen.add(id(o))
        target = o.target
        opname = getattr(target, "__name__", str(target))
        if isinstance(target, torch._ops.OpOverload):
            opname = target._schema.name.split("::")[-1] + (
                "." + target._overloadname if target._overloadname != "default" else "")
            ins = [a.meta["val"].shape for a in o.all_input_nodes
                   if isinstance(a.meta.get("val"), torch.Tensor)]
            val = o.meta.get("val")
            outs = [val.shape] if isinstance(val, torch.Tensor) else [
                v.shape for v in (val or ()) if isinstance(v, torch.Tensor)]
            # Symbolic shapes (dynamic=True): no FLOP count at codegen; evaluating one would
            # specialize the graph (a guard per size, a recompilation per shape).
            static = all(isinstance(d, int) for s_ in ins + outs for d in s_)
            try:
                f = flops_of(opname, ins, outs) if static else 0
            except Exception:
                f = 0
            flops += f
            if opname.split(".")[0] in ("mm", "addmm", "bmm", "baddbmm", "convolution"):
                tensor_flops += f
        ops.append(opname)
        src = _innermost(o.meta.get("stack_trace", ""))
        if src and src not in sources:
            sources.append(src)
        module = module or _module_path(o.meta.get("nn_module_stack"))
    # The fused computation starts at its earliest source line.
    sources.sort(key=lambda x: (x[0], x[1]))
    info: dict = {"origins": ops[:16], "flops": int(flops), "outputs": sorted(outputs)}
    if tensor_flops:
        info["tensor_flops"] = int(tensor_flops)
    if sources:
        f, line, func = sources[0]
        info["source"] = f"{f}:{line}"
        info["function"] = func
        info["sources"] = [f"{f}:{l}" for f, l, _ in sources[:8]]
    if module:
        info["module"] = module
    return info
