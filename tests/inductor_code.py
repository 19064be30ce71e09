"""``generated_anew()``: compile so that Inductor generates the step's code again, for a test that
reads that code or watches Inductor schedule it, without building again the kernels it built
before."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config


@contextmanager
def generated_anew() -> Iterator[None]:
    """Compile with Inductor's FX-graph cache and AOTAutograd's cache off, so that a compile lowers,
    schedules and generates its code (which ``run_and_get_code`` returns and a spy on Inductor's
    scheduler sees) instead of loading an earlier compile's. The kernels themselves are still
    loaded from Inductor's cache where an earlier run built the same source: building them again,
    which ``force_disable_caches`` also does, is most of a CPU test's compile (g++) and tells a
    test about the code nothing more."""
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield
