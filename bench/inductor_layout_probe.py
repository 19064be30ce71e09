"""Why Inductor's compiled step missed rtol 1e-3 on the test CNN on the H100 (issue 17's GPU tests).

Runs ``mutwo.optimize(..., budget="min", backend="inductor", check=True)`` on the CNN of
``tests/test_backends.py`` with TF32 convolutions on and off and Inductor's layout optimization
on and off, and prints each check's summary (or its failure). On the H100 (2026-11-23) only TF32
with layout optimization failed; mutwo now turns layout optimization off for CUDA compiles, so
the "on" rows here patch Inductor's config back on to reproduce it.

    python bench/inductor_layout_probe.py > $OUT/inductor_layout_probe.log
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mutwo  # noqa: E402
from mutwo.runtime.execution import backends  # noqa: E402
from tests.test_backends import _adam, _cuda_cnn  # noqa: E402


def main() -> None:
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = tf32
        for layout_opt in (True, False):
            workload, _ = _cuda_cnn()
            with mock.patch.dict(backends.CUDA_INDUCTOR_OPTIONS, {"layout_optimization": layout_opt}):
                try:
                    step = mutwo.optimize(workload.model, _adam(workload.model.parameters()), workload.batch,
                                          workload.loss_fn, budget="min", backend="inductor", check=True)  # fmt: skip
                    outcome = f"OK {step.last.report.summary()}"
                except Exception as error:  # the check's NotEquivalentError names the first mismatch
                    outcome = f"FAIL {str(error)[:400]}"
            print(f"tf32 {tf32} layout_opt {layout_opt} {outcome}", flush=True)


if __name__ == "__main__":
    main()
