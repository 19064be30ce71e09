"""mutwo: fit a PyTorch training step in less accelerator memory, with the same numbers.

The public API is these few names; everything else is reachable under the sub-packages but not
promised to stay put:

- :func:`optimize` turns a model, its optimizer, an example batch and a loss function into a
  training step that runs the whole iteration as one rewritten graph.
- :func:`fit_batch` finds the largest batch size whose optimized iteration fits a memory limit.
- :class:`Pass`, :func:`option`, :class:`PassContext`, :class:`PassFailure` and
  :func:`register_pass` are what a pass author subclasses, declares, reads and raises.
- :class:`Graph`, :class:`Node`, :class:`NodeKind`, :class:`Phase`, :class:`TensorMeta` and
  :class:`StorageKey` are the IR a pass walks.

The sub-packages are the design's rooms, one folder each in the source tree:
``mutwo.ir`` (folder ``mutwo_ir/``), ``mutwo.passes`` (``passes/``), ``mutwo.runtime``
(``runtime/``) and ``mutwo.tools`` (``tools/``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from mutwo.ir.graph import Graph
from mutwo.ir.node import Node, NodeKind, Phase, StorageKey, TensorMeta
from mutwo.ir.pass_base import Pass, PassContext, PassFailure, option
from mutwo.ir.registry import register_pass
from mutwo.runtime.api import optimize
from mutwo.runtime.planning.fit import fit_batch

try:
    __version__ = version("mutwo")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Graph", "Node", "NodeKind", "Pass", "PassContext", "PassFailure", "Phase", "StorageKey", "TensorMeta",
    "__version__", "fit_batch", "optimize", "option", "register_pass",
]  # fmt: skip
