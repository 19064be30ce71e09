"""The CPU peak of a swapping CNN's compiled step: with mutwo's rule (the buffers offloads read and
return kept from Inductor's reuse), without it (Inductor left alone, the unsafe control), with
Inductor's buffer reuse off for the whole graph, and the eager executor of the same plan
(docs/swap.md, "Under Inductor"). Run from the repository root:

    PYTHONPATH=. .venv/bin/python bench/results/cpu_dry_runs/swap_inductor/reuse_peak.py
"""

from contextlib import nullcontext

import torch
from torch._inductor import config

from mutwo.runtime import backends

from mutwo.ir.budget import parse_budget
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.api import optimize_graph
from mutwo.runtime.backends import compile_graph
from mutwo.runtime.profiler import cpu_iteration_peak
from tests import models

work = models.cnn(batch_size=64)
planned = optimize_graph(work.model, torch.optim.Adam(work.model.parameters(), lr=1e-3), work.batch, work.loss_fn,
                         passes="profile{runs=1,warmup=0},select-swap{keep_faster=false,bandwidth=5},insert-swap",
                         budget=parse_budget("0.8"))  # fmt: skip
print(f"torch {torch.__version__}; swaps {len(planned.plan.of('swap'))}, recomputes {len(planned.plan.of('recompute'))}, "
      f"planned peak {planned.plan.predicted_peak} B (host buffers are CPU memory too on the CPU)")
rule = backends.offloaded_buffers_kept_from_reuse
for name, options, keep in (("mutwo's rule", {}, rule), ("no rule (unsafe)", {}, nullcontext),
                            ("reuse off for the whole graph", {"allow_buffer_reuse": False}, rule)):
    backends.offloaded_buffers_kept_from_reuse = keep
    with config.patch({"force_disable_caches": True, **options}):
        compiled = compile_graph(planned.graph, planned.inputs, "inductor")
    print(f"{name}: compiled peak {cpu_iteration_peak(compiled.run, planned.inputs)} B")
backends.offloaded_buffers_kept_from_reuse = rule
print(f"eager executor: peak {cpu_iteration_peak(to_fx(planned.graph), planned.inputs)} B")
