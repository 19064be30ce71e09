"""The ``memory`` analysis: the simulated memory curve of the whole iteration."""

from __future__ import annotations

from dataclasses import dataclass

from mutwo.ir.graph import Graph
from mutwo.ir.memory import MemorySimulation, simulate
from mutwo.ir.pass_base import Pass, PassContext
from mutwo.passes.liveness import liveness_of


def simulate_with_profile(graph: Graph, ctx: PassContext) -> MemorySimulation:
    """Simulate ``graph`` with the workspace of the profile in the context, if there is one."""
    profile = ctx.artifacts.get("profile")
    workspace = profile.workspace() if profile is not None else None
    return simulate(graph, liveness_of(graph, ctx), workspace)


@dataclass(frozen=True)
class MemoryPass(Pass):
    """Simulate the memory of the whole iteration: the curve, the peak, where it is and what it holds.

    Persistent state (parameters, buffers, optimizer state, the batch) is live throughout; every
    other storage from its creator to its last use; a profile's per-op workspace is added while
    the op runs. Writes memory.json.
    """

    name = "memory"
    provides = ("memory",)

    def run(self, graph: Graph, ctx: PassContext) -> MemorySimulation:
        simulation = simulate_with_profile(graph, ctx)
        ctx.artifacts["memory"] = simulation
        ctx.save_json("memory.json", simulation.to_json())
        peak_node = graph.node(simulation.peak_node)
        persistent = simulation.persistent_bytes / 2**20
        ctx.log(f"memory: simulated peak {simulation.peak_bytes / 2**20:.1f} MiB at %{peak_node.id} "
                f"({peak_node.op_name}, {simulation.peak_phase}); persistent {persistent:.1f} MiB; "
                f"the peak holds {simulation.attribution()}")
        if simulation.peak_phase == "optimizer":
            ctx.log("memory: the peak lies in the optimizer step, where recomputing activations cannot lower it; "
                    "the optimizer passes (optimizer-in-backward, foreach-buckets) can")
        return simulation
