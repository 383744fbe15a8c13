"""What runs while a torch.profiler session records neuron activities.

The kineto plugin (csrc/backend/profiler.cpp) calls three functions registered here:

* :func:`on_start` / :func:`on_stop` when a session starts and stops recording: they install
  and remove global ``nn.Module`` forward hooks that tell the runtime the module path
  (``GPT.blocks.3.attn``) of the work being launched (an interned id per path);
* :func:`annotate` once per trace, with every record: it resolves the launch site of each
  record to the user's ``file:line`` and function (the innermost frame outside torch and
  torchneuron), names the module path, estimates each activity's Trainium cost and builds the
  estimated timeline, and returns the extra trace args and the estimated intervals.

Nothing here runs while no session records device activities.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import torch

from .. import _C

SCHEMA_VERSION = "1.0"

_lock = threading.Lock()
_scope_names: list[str] = [""]  # id -> module path (0: none)
_scope_ids: dict[str, int] = {"": 0}
_stacks: list[tuple] = []  # id -> ((file, line, function), ...) outermost first
_stack_ids: dict[tuple, int] = {}
_hooks: list = []
_tls = threading.local()
_name_cache: dict[tuple, str] = {}
#: NKI instruction streams recorded while profiling: nki run id -> (kernel name, events)
nki_runs: dict[int, tuple] = {}
#: Inductor kernels registered by compiled graphs: name -> info dict
compiled_kernels: dict[str, dict] = {}
#: The last trace's analysis (records with estimates), for exporters in this process.
last: dict = {}

_SKIP_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                   for m in (torch, sys.modules[__name__.split(".")[0]]))
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _is_user_frame(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    f = os.path.abspath(filename)
    if f.startswith(_SKIP_DIRS) or f.startswith(_STDLIB):
        return False
    return "site-packages" not in f or "/examples/" in f


def intern_scope(path: str) -> int:
    with _lock:
        sid = _scope_ids.get(path)
        if sid is None:
            sid = len(_scope_names)
            _scope_names.append(path)
            _scope_ids[path] = sid
        return sid


def scope_name(sid: int) -> str:
    return _scope_names[sid] if 0 <= sid < len(_scope_names) else ""


def intern_stack(frames: tuple) -> int:
    with _lock:
        sid = _stack_ids.get(frames)
        if sid is None:
            sid = len(_stacks)
            _stacks.append(frames)
            _stack_ids[frames] = sid
        return sid


def stack_of(sid: int) -> tuple:
    return _stacks[sid] if 0 <= sid < len(_stacks) else ()


# ---------------------------------------------------------------------------------------------
# module scopes
# ---------------------------------------------------------------------------------------------
def _child_name(parent: torch.nn.Module, child: torch.nn.Module) -> str:
    key = (id(parent), id(child))
    name = _name_cache.get(key)
    if name is None:
        name = type(child).__name__
        # Children called through a container (ModuleList, ModuleDict) are not the caller's
        # direct children: search the caller's submodules ("blocks.3").
        for n, m in parent.named_modules(remove_duplicate=False):
            if m is child and n:
                name = n
                break
        _name_cache[key] = name
    return name


def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    if stack:
        parent, ppath, _ = stack[-1]
        path = ppath + "." + _child_name(parent, module)
    else:
        path = type(module).__name__
    sid = intern_scope(path)
    stack.append((module, path, sid))
    _C._trace_set_scope(sid)


def _post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    stack = getattr(_tls, "stack", None)
    if not stack:
        return
    # Pop to this module (an exception inside a child skips the child's hook).
    while stack:
        m, _, _ = stack.pop()
        if m is module:
            break
    _C._trace_set_scope(stack[-1][2] if stack else 0)


def on_start() -> None:
    """Session started recording: follow module scopes."""
    from torch.nn.modules import module as _m

    from . import trace

    describe_device()
    trace.install()
    if _hooks:
        return
    _hooks.append(_m.register_module_forward_pre_hook(_pre_hook))
    _hooks.append(_m.register_module_forward_hook(_post_hook, always_call=True))


def on_stop() -> None:
    """Session stopped: remove the hooks (zero cost when not profiling)."""
    while _hooks:
        _hooks.pop().remove()
    _tls.stack = []
    _C._trace_set_scope(0)


# ---------------------------------------------------------------------------------------------
# annotation
# ---------------------------------------------------------------------------------------------
def user_frames(frames: Any) -> tuple:
    """((file, line, function), ...) of the user's frames, outermost first."""
    if not frames:
        return ()
    out = []
    for f in frames:  # innermost first
        fn = f.get("filename", "")
        if _is_user_frame(fn):
            # One spelling per file, however it was imported ("a/../b.py" is "b.py").
            out.append((os.path.normpath(fn), int(f.get("line", 0)), f.get("name", "")))
    return tuple(reversed(out))


def _j(v: Any) -> str:
    return json.dumps(v)


def annotate(items: list) -> tuple:
    """Called by the plugin with every record of a trace (see the module docstring)."""
    from .estimate import hardware
    from .estimate_timeline import build_timeline
    from .records import DeviceRecord

    records = [DeviceRecord.from_tuple(t) for t in items]
    hw = hardware()
    tl = build_timeline(records, hw)
    by_id = {e.record.id: e for e in tl.items}
    notes = []
    for r in records:
        meta: list = []
        frames = user_frames(r.stack)
        if frames:
            fn, line, func = frames[-1]
            meta += [("source", _j(f"{fn}:{line}")), ("function", _j(func)),
                     ("stack_id", _j(intern_stack(frames)))]
        elif r.kind == "compiled" and r.meta.get("source"):
            pass  # compiled kernels carry their FX nodes' source already
        module = scope_name(r.scope)
        if module:
            meta.append(("module", _j(module)))
        e = by_id.get(r.id)
        if e is not None and e.cost is not None:
            c = e.cost
            meta += [("flops", _j(c.flops)), ("bytes_read", _j(c.bytes_read)),
                     ("bytes_written", _j(c.bytes_written)), ("engine", _j(c.engine)),
                     ("bound", _j(c.bound)), ("est_ns", _j(round(c.est_ns, 1))),
                     ("est_start_ns", _j(tl.origin + int(round(e.est_start)))),
                     ("est_launch_ns", _j(tl.origin + int(round(e.host_launch)))),
                     ("est_mfu", _j(round(c.mfu(hw), 5))), ("est_mbu", _j(round(c.mbu(hw), 5))),
                     ("dtype", _j(c.dtype))]
            if c.notes:
                meta.append(("portability", _j(c.notes)))
        elif e is not None and r.kind == "sync":
            meta += [("est_stall_ns", _j(int(e.stall_ns))),
                     ("est_launch_ns", _j(tl.origin + int(round(e.host_launch))))]
        notes.append(meta)
    trace_meta = {"neuron_profiler": json.dumps({
        "schema_version": SCHEMA_VERSION,
        "hardware": hw.as_dict(),
        "label": hw.label,
        "stacks": {str(i): [list(f) for f in st] for i, st in enumerate(_stacks)},
        "modules": {str(i): n for i, n in enumerate(_scope_names) if i},
        "nki_runs": sorted(nki_runs),
    })}
    last.clear()
    last.update({"records": records, "timeline": tl, "hardware": hw})
    return notes, trace_meta


def describe_device() -> None:
    """Name the device and its estimated track in traces (``deviceProperties``)."""
    from .estimate import hardware

    hw = hardware()
    props = json.dumps({"name": f"{hw.platform.chip} NeuronCore", "platform": hw.name,
                        "lnc": hw.lnc, "peak_bf16_tflops": hw.peak_flops("bfloat16") / 1e12,
                        "hbm_bandwidth_gbps": hw.hbm_bw / 1e9})
    _C._profiler_set_device_info("neuron", props)
