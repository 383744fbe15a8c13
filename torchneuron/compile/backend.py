"""The ``neuron`` torch.compile backend.

Pipeline: Dynamo graph -> FlexAttention legalisation (:mod:`.flex_attention`) -> Inductor's
``compile_fx`` (AOTAutograd splits forward/backward, decompositions, fusion) with the ``neuron``
device registered (:mod:`.inductor`): fused C++ kernels over neuron memory plus extern calls
(mm, convolution, ...) through the device's ATen kernels, wrapped by a Python launcher that
allocates on neuron.
"""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from . import cache, metrics

_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_KNOWN_MODES = ("default", "max-autotune-no-cudagraphs") + _CUDAGRAPH_MODES
_warned: set[str] = set()

# Inductor settings for every neuron graph (overridable through ``options``).
_DEFAULT_CONFIG = {
    # Layout optimisation turns conv inputs channels_last for non-CPU devices. FakeTensor
    # predicts a contiguous conv output for neuron (no cuDNN/mkldnn backend is selected for
    # PrivateUse1), but the CPU kernel behind neuron returns channels_last for channels_last
    # inputs, so the compiled graph's stride assertions fail. Keep layouts as the user made them.
    "layout_optimization": False,
}


class NeuronCompileError(RuntimeError):
    """A graph could not be compiled for neuron. ``op`` is the failing operator (if known),
    ``location`` the FX node and user source line it came from."""

    def __init__(self, message: str, op: Optional[str] = None, location: Optional[str] = None):
        super().__init__(message)
        self.op = op
        self.location = location


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _fallback_enabled(options: dict) -> bool:
    if "fallback_execution" in options:
        return bool(options["fallback_execution"])
    return os.environ.get("TORCHNEURON_COMPILE_FALLBACK", "0") == "1"


def graph_replay_config() -> dict:
    """Inductor settings that replay compiled neuron graphs from neuron graphs (graphs.py): what
    CUDA graphs do for ``mode="reduce-overhead"``. No graph partitions (each compiled graph is
    recorded whole, and Inductor screens out graphs with ops a graph cannot hold); not CUDA's
    graph trees (their manager is CUDA's); graphs that mutate their inputs too (an optimizer
    step: the replay writes inputs used in place directly and copies the others back)."""
    from .graphs import NeuronGraphPolicy

    return {"triton.cudagraphs": True, "triton.cudagraph_trees": False, "graph_partition": False,
            "triton.cudagraph_support_input_mutation": True, "cudagraph_policy": NeuronGraphPolicy()}


def _mode_config(mode: Optional[str]) -> dict:
    """Inductor config for a torch.compile ``mode``. Modes that use CUDA graphs replay neuron
    graphs instead (:func:`graph_replay_config`)."""
    if mode in (None, "default"):
        return {}
    if mode not in _KNOWN_MODES:
        raise ValueError(f"torch.compile(backend='neuron'): unknown mode {mode!r}; "
                         f"expected one of {', '.join(_KNOWN_MODES)}")
    from torch._inductor import list_mode_options

    opts = dict(list_mode_options(mode))
    # only the modes that ask for graphs get them (not a user's global triton.cudagraphs)
    opts["triton.cudagraphs"] = mode in _CUDAGRAPH_MODES
    return opts


# ---------------------------------------------------------------------------------------------
# Error reporting


def _op_from_exception(exc: BaseException) -> Optional[str]:
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        m = re.search(r"target: ([\w.:]+)", str(e))
        if m:
            return m.group(1)
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return None


def _node_location(gm: torch.fx.GraphModule, op: Optional[str]) -> Optional[str]:
    """``node name (user source line)`` of the first node calling ``op`` in ``gm``."""
    if op is None:
        return None
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") and (
                str(node.target) == op or str(node.target).endswith(op)
                or getattr(node.target, "__name__", None) == op.rsplit(".", 1)[-1]):
            trace = node.meta.get("stack_trace") or ""
            frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
            where = f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else "unknown source"
            return f"node {node.name!r} ({where})"
    return None


def _is_dynamo_control_flow(exc: BaseException) -> bool:
    """Exceptions Dynamo uses to restart or skip analysis: not compile failures."""
    from torch._dynamo.exc import RestartAnalysis, SkipFrame

    return isinstance(exc, (RestartAnalysis, SkipFrame))


def _compile_error(exc: BaseException, gm: torch.fx.GraphModule, stage: str) -> NeuronCompileError:
    if isinstance(exc, NeuronCompileError):
        return exc
    op = _op_from_exception(exc)
    loc = _node_location(gm, op)
    inner = getattr(exc, "inner_exception", exc)
    first = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
    msg = (f"neuron backend could not compile the {stage} graph: "
           f"op {op or '<unknown>'} at {loc or 'unknown location'}: {type(inner).__name__}: {first}"
           "\n(set TORCHNEURON_COMPILE_FALLBACK=1 to run such graphs eagerly instead)")
    return NeuronCompileError(msg, op=op, location=loc)


# ---------------------------------------------------------------------------------------------
# Compilation


def _cache_counters() -> tuple[int, int, int]:
    """(FX-graph cache hits, FX-graph cache misses, AOTAutograd cache hits) so far."""
    from torch._dynamo.utils import counters

    return (counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"],
            counters["aot_autograd"]["autograd_cache_hit"])


_state = threading.local()


def _make_inner_compile() -> Callable:
    """Wrap Inductor's per-graph compiler (called for the forward, and lazily for the backward):
    counts graphs and time, scopes the cache dir, names the failing op on error."""
    from torch._inductor.compile_fx import compile_fx_inner

    def inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any):
        t0 = time.perf_counter()
        h0, m0, _ = _cache_counters()
        nested = getattr(_state, "in_compile", False)  # else: a lazily compiled backward
        stage = "backward" if kwargs.get("is_backward") else (
            "inference" if kwargs.get("is_inference") else "forward")
        try:
            with cache.scoped():
                out = compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as exc:
            if _is_dynamo_control_flow(exc):
                raise
            raise _compile_error(exc, gm, stage) from exc
        finally:
            if not nested:
                metrics.add_compile_time(time.perf_counter() - t0)
        h1, m1, _ = _cache_counters()
        metrics.incr("graphs_lowered")
        metrics.incr("cache_hits", h1 - h0)
        metrics.incr("cache_misses", m1 - m0)
        return out

    return inner_compile


def _is_recompile() -> bool:
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    return cid is not None and (cid.frame_compile_id or 0) > 0


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                  mode: Optional[str] = None, options: Optional[dict] = None) -> Callable:
    """Compile one Dynamo graph for neuron (the body of :func:`neuron_backend`)."""
    from torch._inductor.compile_fx import compile_fx

    from . import flex_attention, inductor, sdpa

    inductor.register()
    options = dict(options or {})
    fallback = _fallback_enabled(options)
    options.pop("fallback_execution", None)
    config_patches = dict(_DEFAULT_CONFIG)
    config_patches.update(_mode_config(mode))
    config_patches.update(options)
    if config_patches.get("triton.cudagraphs") and config_patches.get("cudagraph_policy") is None:
        config_patches.update(graph_replay_config())  # CUDA graphs asked for: neuron graphs
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    user_passes = get_custom_graph_passes(config_patches.get(
        "post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass))
    config_patches["post_grad_custom_post_pass"] = [
        *user_passes, cache.source_key_pass(cache.graph_source_key(gm))]

    def count_compilation() -> None:  # once per graph Dynamo keeps (not on analysis restarts)
        metrics.incr("compilations")
        if _is_recompile():
            metrics.incr("recompilations")

    # Legalisation rewrites calls in place into equivalent Python functions, so the graph also
    # stays runnable eagerly (the fallback below).
    sdpa.legalize(gm)
    n_flex = flex_attention.legalize(gm)
    if n_flex:
        metrics.incr("flex_attention_decomposed", n_flex)

    from torch._functorch import config as functorch_config

    t0 = time.perf_counter()
    aot0 = _cache_counters()[2]
    _state.in_compile = True
    try:
        # With eager fallback enabled the backward is lowered up front, so that a failure in
        # it is caught here too (it is otherwise lowered lazily at the first backward).
        with cache.scoped(), functorch_config.patch(force_non_lazy_backward_lowering=fallback):
            compiled = compile_fx(gm, example_inputs, inner_compile=_make_inner_compile(),
                                  config_patches=config_patches)
    except Exception as exc:
        if _is_dynamo_control_flow(exc):
            raise
        err = _compile_error(exc, gm, "Dynamo")
        if not fallback:
            raise err from exc
        _warn_once(f"fallback:{err.op}:{err.location}",
                   f"{err}\nRunning this graph eagerly on neuron (TORCHNEURON_COMPILE_FALLBACK=1).")
        metrics.incr("eager_fallbacks")
        count_compilation()
        return gm.forward
    finally:
        _state.in_compile = False
        metrics.add_compile_time(time.perf_counter() - t0)
    # AOTAutograd-cache hits bypass the per-graph compiler: count them here.
    metrics.incr("cache_hits", _cache_counters()[2] - aot0)
    count_compilation()
    return compiled
