"""Swap plans under Inductor: what changes in the graph and in Inductor's code generation so that
a step that swaps activations to host memory can be compiled (docs/swap.md, "Under Inductor").

* :func:`compiled_swap_ops`: AOTAutograd refuses a custom op whose output aliases an input,
  which ``mutwo::wait`` does; each becomes the in-place ``mutwo::wait_``. Inductor may write a
  tensor straight into a slice of a larger buffer (a ``cat``'s output), so each ``mutwo::offload``
  becomes ``mutwo::offload_elements``, which copies the tensor's own elements.
* :func:`offloaded_buffers_kept_from_reuse`: Inductor hands a dead buffer to a later kernel's
  output itself, past the caching allocator. A buffer an offload reads is dead on the compute
  stream right after the offload, while the copy-out stream still reads it, and only the
  allocator knows that (``record_stream``). Such buffers are deleted after their last use like
  any other, so the allocator hands their block out again once the copy has read it, but neither
  reused by Inductor for a later buffer nor written in place by a kernel. The host buffers offloads
  return belong to the swap runtime's pool: Inductor does not reuse them either. Every other
  buffer keeps Inductor's reuse. (Whether that keeps a GPU step's peak under what reuse off for
  the whole graph would give is not measured; on the CPU, where host buffers are memory of the
  same device, a swapping CNN peaked at 2.10 MB either way, and at 1.57 MB without the rule only
  because Inductor wrote later outputs into the swap runtime's host buffers:
  bench/results/cpu_dry_runs/swap_inductor/reuse_peak.log.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import fx

from mutwo.ir.swap import OFFLOAD, OFFLOAD_ELEMENTS, WAIT, WAIT_IN_PLACE

#: Names the rules below in Inductor's cache keys (with the fusion rules, through
#: :func:`mutwo.runtime.execution.fusion.phases_arrived`): change it when they change.
SWAP_RULE_VERSION = "mutwo-swap-offloads-not-reused-1"


def compiled_swap_ops(module: fx.GraphModule) -> None:
    """Rewrite the swap ops of ``module`` for Inductor: each ``mutwo::offload`` into
    ``mutwo::offload_elements`` (the same copy, of the tensor's elements wherever Inductor put
    them), and each ``mutwo::wait(x, tag)`` into ``mutwo::wait_(x, tag)``, its uses reading ``x``.
    ``wait_`` is declared as writing ``x``, so functionalization orders every later reader of ``x``
    after it, and Inductor's reinplacing calls it on the prefetched tensor itself (a copy instead
    would read ``x`` before its copy in has finished; the runtime refuses to wait on a tensor no
    prefetch returned, so such a copy fails loudly)."""
    for node in list(module.graph.nodes):
        if node.target is OFFLOAD:
            node.target = OFFLOAD_ELEMENTS
        elif node.target is WAIT:
            prefetched, tag = node.args
            with module.graph.inserting_before(node):
                call = module.graph.call_function(WAIT_IN_PLACE, (prefetched, tag))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(prefetched)
            module.graph.erase_node(node)
    module.recompile()


def _is_offload(scheduler_node: Any) -> bool:
    operation = getattr(scheduler_node, "node", None)
    return getattr(operation, "op_overload", None) is OFFLOAD_ELEMENTS


def offload_buffer(buffer_name: str) -> bool:
    """Whether the buffer, in the graph Inductor is generating, is read by an offload (Inductor
    gives the buffers that alias one another one list of users) or is the host buffer an offload
    returned."""
    from torch._inductor.virtualized import V

    scheduled = V.graph.scheduler.name_to_buf.get(buffer_name)
    if scheduled is None:
        return False
    return _is_offload(scheduled.defining_op) or any(_is_offload(user.node) for user in scheduled.users)


@contextmanager
def offloaded_buffers_kept_from_reuse() -> Iterator[None]:
    """While compiling: a buffer an offload reads, or the host buffer it returns, is freed after
    its last use (``del``), never reused by Inductor: its wrapper's memory planning leaves it out of
    the pool of freed buffers, as it does for buffers other outputs alias, and no kernel writes its
    output in place into it."""
    from torch._inductor.codegen.wrapper import FreeIfNotReusedLine, PythonWrapperCodegen

    planning, reusable = FreeIfNotReusedLine.plan, PythonWrapperCodegen.can_reuse

    def plan(self: Any, state: Any) -> Any:
        if offload_buffer(self.node.get_name()):
            return self  # freed by ``del`` when its line is generated; not in the reuse pool
        return planning(self, state)

    def can_reuse(self: Any, input_buffer: Any, output_buffer: Any = None) -> bool:
        # With an output, Inductor asks whether a kernel may write it in place into the input.
        if output_buffer is not None and offload_buffer(input_buffer.get_name()):
            return False
        return reusable(self, input_buffer, output_buffer)

    FreeIfNotReusedLine.plan = plan  # type: ignore[method-assign]
    PythonWrapperCodegen.can_reuse = can_reuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        FreeIfNotReusedLine.plan = planning  # type: ignore[method-assign]
        PythonWrapperCodegen.can_reuse = reusable  # type: ignore[method-assign]
