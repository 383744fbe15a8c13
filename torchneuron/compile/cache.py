"""On-disk location of compiled neuron artifacts.

The backend reuses Inductor's FX-graph cache and AOTAutograd cache (content-addressed by graph,
input metadata, configuration and torch version), pointed at a neuron-specific directory:
``$TORCHNEURON_COMPILE_CACHE_DIR``, default ``$XDG_CACHE_HOME/torchneuron/compile`` (i.e.
``~/.cache/torchneuron/compile``). A second process compiling the same graph loads the
generated C++/Python instead of regenerating and recompiling it. In memory, loaded modules
stay in Inductor's ``PyCodeCache`` and Dynamo keeps compiled code per frame.

The directory is only in effect while the neuron backend compiles (see :func:`scoped`), so
``backend="inductor"`` compilations in the same process keep their usual cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from typing import Any, Iterator


def cache_dir() -> str:
    """The directory holding neuron compile artifacts (created on demand)."""
    path = os.environ.get("TORCHNEURON_COMPILE_CACHE_DIR")
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "torchneuron", "compile")
    path = os.path.join(os.path.abspath(path), _codegen_tag())
    os.makedirs(path, exist_ok=True)
    return path


def _codegen_tag() -> str:
    """Subdirectory naming the code generator: Inductor's cache key covers the graph, its
    configuration and the torch version, but not this package's code generation (wrapper,
    kernel overrides, patches) or its switches, so artifacts written by another torchneuron
    version, or with the other tanh or erf variant, would otherwise be loaded as hits."""
    from .inductor import fast_erf_enabled, fast_tanh_enabled

    return (f"gen-{_source_hash()}" + ("" if fast_tanh_enabled() else "-precise-tanh") +
            ("" if fast_erf_enabled() else "-precise-erf"))


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, n) for n in sorted(os.listdir(here)) if n.endswith(".py")]
    # The profiler's per-kernel attribution is emitted into the generated code too.
    prof = os.path.join(os.path.dirname(here), "profiler")
    files += [os.path.join(prof, n) for n in ("compiled.py", "estimate_flops.py")]
    # What fake tensors predict for neuron's convolutions (the plans' layouts).
    files.append(os.path.join(os.path.dirname(here), "_conv_layout.py"))
    for path in files:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    # The C++ core decides eager layouts that plans must match (a rebuild may change them);
    # ~5 MB, hashed in ~15 ms once per process that compiles.
    from .. import _C

    with open(_C.__file__, "rb") as f:
        h.update(f.read())
    return h.hexdigest()[:12]


@contextlib.contextmanager
def scoped() -> Iterator[str]:
    """Point Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``, read on every lookup) at
    :func:`cache_dir` for the duration of a neuron compilation."""
    path = cache_dir()
    prev = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield path
    finally:
        if prev is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = prev


def graph_source_key(gm: "torch.fx.GraphModule") -> str:
    """Hash of what the generated code records about the user's program: every node's stack
    trace (source file and line) and module path. Inductor's cache keys leave these out on
    purpose (the same graph from another file is a hit), but the neuron wrapper writes each
    kernel's source attribution into the generated code (torchneuron.profiler.compiled), so a
    hit from another file, or from before an edit that moved the lines, would report stale
    sources in the profiler."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        h.update(str(node.meta.get("stack_trace") or "").encode() + b"\0")
        stack = node.meta.get("nn_module_stack") or {}
        h.update("|".join(str(v[0]) for v in stack.values()).encode() + b"\1")
    return h.hexdigest()[:16]


def source_key_pass(source_key: str) -> Any:
    """A no-op Inductor post-grad pass whose ``uuid()`` is ``source_key``: appended to
    ``post_grad_custom_post_pass`` for a neuron compilation, it puts the graph's source locations
    into the FX-graph and AOTAutograd cache keys. Inductor runs and keys the user's own passes
    beside it by its usual rules (a pass without a uuid still disables the cache)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _SourceKey(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            pass

        def uuid(self) -> Any:
            return f"torchneuron-source-{source_key}"

    return _SourceKey()
