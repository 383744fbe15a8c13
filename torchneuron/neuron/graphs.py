"""Graph capture and replay on neuron, mirroring ``torch.cuda``'s ``CUDAGraph`` / ``graph``.

``NeuronGraph`` is ``torch.accelerator.Graph`` on this device (``csrc/backend/graph.cpp``): a
capture records the kernels neuron queues on the capturing stream (elementwise ops, matmuls,
norms, attention, reductions, random ops, compiled kernels, copies and fills, their backward)
without running them; ``replay()`` enqueues them again over the same memory, random ops drawing
each replay's own numbers as on CUDA. An op whose kernel runs synchronously on neuron (fp16
convolutions, selections such as median, data-dependent shapes) or a host wait inside the
capture raises and fails it. ``make_graphed_callables`` captures a module's or function's
forward and backward into two graphs behind one autograd node, as CUDA's. See
docs/architecture.md, *Graphs*.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional, Union

import torch
from torch.utils import _pytree as pytree

from .. import _C

__all__ = ["NeuronGraph", "graph", "is_current_stream_capturing", "graph_pool_handle",
           "make_graphed_callables"]


class NeuronGraph(torch.accelerator.Graph):
    """``torch.cuda.CUDAGraph`` for neuron (``torch.accelerator.Graph`` itself).

    Random ops are captured as on CUDA: each replay draws the next numbers of the generators the
    graph uses (their offsets move past the graph's draws) with the seed current at the replay.
    """

    def register_generator_state(self, generator: torch.Generator) -> None:
        """Accepts a generator for the graph's captures, as ``CUDAGraph.register_generator_state``.

        CUDA raises for a captured op drawing from a generator other than the default unless it
        was registered; neuron registers every neuron generator a captured op draws from at its
        first use, so this only checks the argument (CUDA code calling it runs unchanged)."""
        if not isinstance(generator, torch.Generator) or generator.device.type != "neuron":
            raise TypeError(f"register_generator_state expects a neuron generator, got {generator!r}"
                            f" (create it with torch.Generator(device='neuron'))")


def graph_pool_handle() -> tuple[int, int]:
    """A token naming a fresh graph memory pool, for captures that share it (``pool=`` of
    :class:`graph` or ``torch.accelerator.Graph``), as ``torch.cuda.graph_pool_handle``. The pool's
    memory lives until every graph captured into it is reset or destroyed."""
    return tuple(_C._graph_pool_handle())


def is_current_stream_capturing() -> bool:
    """Whether a graph capture is open (``torch.cuda.is_current_stream_capturing``; neuron
    captures one stream at a time)."""
    return bool(_C._engine_capturing())


class graph:
    """Context manager capturing the work of its body into ``neuron_graph``, as
    ``torch.cuda.graph``: it synchronizes, empties the allocator's cache, then captures on
    ``stream`` (a side stream by default, shared by every ``graph`` context, as CUDA's)."""

    default_capture_stream: Optional[torch.Stream] = None

    def __init__(self, neuron_graph: NeuronGraph, pool: Optional[tuple] = None,
                 stream: Optional[torch.Stream] = None, capture_error_mode: str = "global") -> None:
        if stream is None:
            if graph.default_capture_stream is None:
                graph.default_capture_stream = torch.neuron.Stream()
            stream = graph.default_capture_stream
        self.neuron_graph = neuron_graph
        self.pool = pool
        self.capture_stream = stream
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        torch.neuron.synchronize()
        # As torch.cuda.graph since PyTorch 2.9: a full collection only when asked for
        # (torch.compiler.config.force_cudagraph_gc, TORCH_CUDAGRAPH_GC=1). It frees memory only
        # when a dead reference cycle holds device memory, and costs 0.3-2 s in a large process
        # at every capture; the cache's idle blocks are given back as CUDA's are.
        if torch.compiler.config.force_cudagraph_gc:
            gc.collect()
        torch.neuron.empty_cache()
        self._stream_ctx = torch.neuron.stream(self.capture_stream)
        self._stream_ctx.__enter__()
        try:
            if self.pool is not None:
                self.neuron_graph.graph_pool = self.pool
            self.neuron_graph.capture_begin()
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.neuron_graph.capture_end()
        finally:
            self._stream_ctx.__exit__(*exc)


_Callable = Union[torch.nn.Module, Callable[..., Any]]


class _Captured:
    """One callable's forward and backward graphs and the static tensors they read and write.

    The graphs' inputs are the flattened sample arguments and, for a module, its parameters
    (the "input surface"); a replay reads their current contents, so calls copy new arguments
    in. Outputs and gradients are the graphs' own memory, overwritten by the next replay."""

    def __init__(self, func: _Callable, sample_args: tuple, allow_unused_input: bool) -> None:
        if isinstance(func, torch.nn.Module):
            if func._forward_hooks or func._forward_pre_hooks or func._backward_hooks:
                raise RuntimeError(
                    "make_graphed_callables: the module has hooks registered; register them after "
                    "graphing it (hooks added later run around the graphed forward)")
            if any(b.requires_grad for b in func.buffers()):
                raise RuntimeError(
                    "make_graphed_callables: only a module's parameters may require grad, not its "
                    "buffers (a replay could not produce their gradients)")
        self.func = func
        self.sample_args = sample_args
        self.args = tuple(pytree.arg_tree_leaves(*sample_args))
        if not all(isinstance(a, torch.Tensor) for a in self.args):
            raise TypeError("make_graphed_callables: sample_args must contain only tensors, got "
                            + ", ".join(type(a).__name__ for a in self.args if not isinstance(a, torch.Tensor)))
        self.params = tuple(func.parameters()) if isinstance(func, torch.nn.Module) else ()
        self.surface = self.args + self.params
        self.allow_unused = allow_unused_input
        self.fwd = NeuronGraph()
        self.bwd = NeuronGraph()

    def _grads(self, outputs: tuple, grad_outputs: tuple) -> Optional[tuple]:
        wanted = tuple(o for o in outputs if o.requires_grad)
        if not wanted:
            return None
        return torch.autograd.grad(wanted, tuple(i for i in self.surface if i.requires_grad),
                                   grad_outputs=grad_outputs, only_inputs=True,
                                   allow_unused=self.allow_unused)

    def warm_up(self, iters: int) -> None:
        # Runs once-only work (layout caches, Adaptive Eager's kernel compiles) outside the captures.
        for _ in range(iters):
            outputs = tuple(pytree.tree_leaves(self.func(*self.sample_args)))
            self._grads(outputs, tuple(torch.zeros_like(o) for o in outputs if o.requires_grad))

    def capture_forward(self, pool: tuple[int, int]) -> None:
        with graph(self.fwd, pool=pool):
            result = self.func(*self.sample_args)
        outputs, self.spec = pytree.tree_flatten(result)
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise TypeError("make_graphed_callables: a graphed callable must return only tensors")
        self.outputs = tuple(outputs)
        self.differentiable = tuple(o.requires_grad for o in self.outputs)

    def capture_backward(self, pool: tuple[int, int]) -> None:
        self.grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in self.outputs)
        grads = None
        if any(self.differentiable):
            with graph(self.bwd, pool=pool):
                grads = self._grads(self.outputs, tuple(g for g in self.grad_outputs if g is not None))
        it = iter(grads or ())
        # One entry per surface tensor: None where it does not require grad.
        self.grad_inputs = tuple(next(it) if i.requires_grad and grads is not None else None
                                 for i in self.surface)
        # The captured forward's autograd graph is not needed again: kept, its AccumulateGrad
        # nodes (made on the capture stream) would make every later backward sync with that stream.
        self.outputs = tuple(o.detach() for o in self.outputs)

    def functional(self) -> Callable[..., Any]:
        def run(*user_args: Any) -> Any:
            args = tuple(pytree.arg_tree_leaves(*user_args))
            if len(args) != len(self.args):
                raise TypeError(f"make_graphed_callables: the graphed callable was captured with "
                                f"{len(self.args)} tensor arguments, called with {len(args)}")
            out = _Replay.apply(self, *(args + self.params))
            return pytree.tree_unflatten(list(out), self.spec)
        return run


class _Replay(torch.autograd.Function):
    """One autograd node per graphed call: forward replays the forward graph, backward the
    backward graph (once differentiable, as CUDA's)."""

    @staticmethod
    def forward(ctx: Any, cap: _Captured, *inputs: torch.Tensor) -> tuple:
        for static, new in zip(cap.args, inputs):
            if static.data_ptr() != new.data_ptr():
                static.copy_(new)
        cap.fwd.replay()
        ctx.cap = cap
        outputs = tuple(o.detach() for o in cap.outputs)
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, cap.differentiable) if not d))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        cap = ctx.cap
        for static, new in zip(cap.grad_outputs, grads):
            if static is not None and static.data_ptr() != new.data_ptr():
                static.copy_(new)
        cap.bwd.replay()
        # The static gradients themselves (they do not require grad): _Captured's references
        # keep AccumulateGrad from stealing one as a parameter's .grad, which the next replay
        # would then overwrite (accumulating into it, or a second micro-batch, would be wrong).
        return (None,) + cap.grad_inputs


def make_graphed_callables(callables: Union[_Callable, tuple[_Callable, ...]], sample_args: tuple,
                           num_warmup_iters: int = 3, allow_unused_input: bool = False,
                           pool: Optional[tuple[int, int]] = None) -> Union[_Callable, tuple[_Callable, ...]]:
    """Graphed versions of modules or functions, as ``torch.cuda.make_graphed_callables``.

    Each callable's forward work is captured into one :class:`NeuronGraph` and its backward
    (gradients of its outputs with respect to its tensor arguments and, for a module, its
    parameters) into another; the graphed callable replays them inside one autograd node, so it
    drops into an autograd training loop. A module keeps its original forward for the
    training/eval mode it was not captured in.

    ``sample_args`` is a tuple of tensors (a tuple of such tuples for a tuple of callables), with
    the ``requires_grad`` of the real inputs. Several callables share one memory pool (``pool``,
    or a fresh one) and must run in the order given. Each replay overwrites the previous call's
    outputs and gradients (the graphs' static memory); double backward is not supported; buffers
    must not require grad; autocast caching must be off (``cache_enabled=False``). Everything a
    capture contains must be capturable on neuron (:class:`NeuronGraph`)."""
    if torch.is_autocast_enabled("neuron") and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables does not support autocast's weight cache: use "
                           "torch.autocast('neuron', ..., cache_enabled=False)")
    single = not isinstance(callables, tuple)
    funcs = (callables,) if single else callables
    samples = (sample_args,) if single else sample_args
    if len(funcs) != len(samples):
        raise ValueError(f"make_graphed_callables: {len(funcs)} callables but {len(samples)} sample_args tuples")
    caps = [_Captured(f, tuple(a), allow_unused_input) for f, a in zip(funcs, samples)]
    pool = graph_pool_handle() if pool is None else pool

    torch.neuron.synchronize()
    with torch.neuron.stream(torch.neuron.Stream()):
        for cap in caps:
            cap.warm_up(num_warmup_iters)
    torch.neuron.synchronize()
    # In the order the replays will run: every forward, then the backwards in reverse.
    for cap in caps:
        cap.capture_forward(pool)
    for cap in reversed(caps):
        cap.capture_backward(pool)

    graphed = []
    for func, cap in zip(funcs, caps):
        run = cap.functional()
        if isinstance(func, torch.nn.Module):
            func.forward = _mode_dispatch(func, func.training, run, func.forward)
            graphed.append(func)
        else:
            graphed.append(run)
    return graphed[0] if single else tuple(graphed)


def _mode_dispatch(module: torch.nn.Module, training: bool, graphed: Callable[..., Any],
                   eager: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return graphed(*args, **kwargs) if module.training == training else eager(*args, **kwargs)
    return forward
