"""Capture of a training iteration, its execution, and equivalence checking."""

# Every graph runs through this package: registering the swap kernels here makes the swap ops of
# mutwo.ir.swap executable wherever a graph can run.
from mutwo.runtime.execution import swap as _swap  # noqa: F401
