"""Measuring what a graph does on the machine: per-node profiles, host-device copies and their
contention, and the equivalence check of two graphs."""
