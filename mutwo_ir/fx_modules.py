"""fx GraphModules whose Python code is generated when it is first needed, not at every change.

A ``torch.fx.GraphModule`` regenerates its Python source (and compiles it) when it is built and at
every ``recompile()``. For a whole training iteration of 5,000-10,000 nodes each regeneration takes
0.1-0.5 s, and on a restart served by the plan cache most were never used: make_fx builds the
captured module and mutwo lifts its constants, which mutwo only reads node by node; ``to_fx``
builds the step's module and the compile-time rewrites regenerate it, before AOTAutograd renames
its placeholders around its cache key (regenerating it twice more, and once for the key itself,
which it still does) and then serves the compiled step from its cache without running it. The
eager backend's restart regenerated the code four times, its Inductor restart seven (cProfile).

torch's ``_LazyGraphModule`` (what Dynamo hands its backends) marks a ``recompile()`` and
generates the code when the module is called or its ``code`` is read. It is private to torch
(``torch.fx._lazy_graph_module``, since torch 2.3); where it is missing, these build ordinary
GraphModules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx

try:
    from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
except ImportError:  # a torch without it: code generated eagerly, as before
    _LazyGraphModule, _use_lazy_graph_module = None, None  # type: ignore[assignment,misc]


def graph_module(root: torch.nn.Module, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name=...)`` whose code is generated when first needed."""
    cls = _LazyGraphModule if _LazyGraphModule is not None else fx.GraphModule
    return cls(root, graph, class_name=class_name)


@contextlib.contextmanager
def lazy_graph_modules() -> Iterator[None]:
    """Inside, torch's tracers (make_fx) build modules whose code is generated when first needed."""
    with _use_lazy_graph_module(True) if _use_lazy_graph_module is not None else contextlib.nullcontext():
        yield
