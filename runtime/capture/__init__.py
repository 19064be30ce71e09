"""Capturing one training iteration as a graph of aten ops: tracing, the optimizer's own step,
host scalars and guards, training options (clipping, autocast, accumulation, grad scaling)."""
