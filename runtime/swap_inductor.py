"""Swap plans under Inductor: what changes in the graph and in Inductor's code generation so that
a step that swaps activations to host memory can be compiled (docs/swap.md, "Under Inductor").

* :func:`functionalizable_swap_waits`: AOTAutograd refuses a custom op whose output aliases an
  input, which ``mutwo::wait`` does; each becomes the in-place ``mutwo::wait_``.
* :func:`offloaded_buffers_kept_from_reuse`: Inductor hands a dead buffer to a later kernel's
  output itself, past the caching allocator. A buffer ``mutwo::offload`` reads is dead on the
  compute stream right after the offload, while the copy-out stream still reads it, and only the
  allocator knows that (``record_stream``). Such buffers are deleted after their last use like
  any other, so the allocator hands their block out again once the copy has read it, but never
  reused by Inductor. Every other buffer keeps Inductor's reuse (which keeps the compiled step's
  peak where the plan put it: turning reuse off for the whole graph raised a swapping CNN's peak
  on the CPU from 1.57 to 2.10 MB, the eager executor's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import fx

from mutwo.ir.swap import OFFLOAD, WAIT, WAIT_IN_PLACE


def functionalizable_swap_waits(module: fx.GraphModule) -> None:
    """Rewrite each ``mutwo::wait(x, tag)`` in ``module`` into ``mutwo::wait_(x, tag)``, its uses
    reading ``x``. ``wait_`` is declared as writing ``x``, so functionalization orders every later
    reader of ``x`` after it, and Inductor's reinplacing calls it on the prefetched tensor itself
    (a copy instead would read ``x`` before its copy in has finished; the runtime refuses to wait
    on a tensor no prefetch returned, so such a copy fails loudly)."""
    for node in list(module.graph.nodes):
        if node.target is WAIT:
            prefetched, tag = node.args
            with module.graph.inserting_before(node):
                call = module.graph.call_function(WAIT_IN_PLACE, (prefetched, tag))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(prefetched)
            module.graph.erase_node(node)
    module.recompile()


def read_by_offload(buffer_name: str) -> bool:
    """Whether a ``mutwo::offload`` of the graph Inductor is generating reads the buffer."""
    from torch._inductor.virtualized import V

    scheduled = V.graph.scheduler.name_to_buf.get(buffer_name)
    if scheduled is None:
        return False
    for user in scheduled.users:
        operation = getattr(user.node, "node", None)
        if getattr(operation, "op_overload", None) is OFFLOAD:
            return True
    return False


@contextmanager
def offloaded_buffers_kept_from_reuse() -> Iterator[None]:
    """While compiling: a buffer read by ``mutwo::offload`` is freed after its last use, never
    reused by Inductor for another buffer (its wrapper's memory planning leaves it out of the
    pool of freed buffers, as it does for buffers other outputs alias)."""
    from torch._inductor.codegen.wrapper import FreeIfNotReusedLine

    planning = FreeIfNotReusedLine.plan

    def plan(self: Any, state: Any) -> Any:
        if read_by_offload(self.node.get_name()):
            return self  # freed by ``del`` when its line is generated; not in the reuse pool
        return planning(self, state)

    FreeIfNotReusedLine.plan = plan  # type: ignore[method-assign]
    try:
        yield
    finally:
        FreeIfNotReusedLine.plan = planning  # type: ignore[method-assign]
