"""Data parallel: the collectives traced into the graph and the process groups, shards and one
plan for every rank."""
