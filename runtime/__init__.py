"""Capture of a training iteration, its execution, and equivalence checking."""
